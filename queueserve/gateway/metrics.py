"""Prometheus metrics of the gateway's HTTP requests, in a registry of each app's own (two
apps in one process never clash), served at ``GET /metrics``.

Routes are labelled by their template (``/v1/servings/{name}/dispatch``), never by the raw
path: a client sending random paths would otherwise create a series per path.

Requests are counted in plain numbers and turned into Prometheus families when scraped: the
client library's counters and histograms take a lock per update, several per request, a
tenth of the gateway's own CPU per request on its hottest route (bench/gateway.py).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queueserve.gateway.paths import route_path

METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
MAX_CACHED = 4096  # series kept looked up (serving names are the client's to choose)
SERVING_ACTIONS = frozenset({"dispatch", "dispatch_many", "stream", "jobs"})
JOB_ACTIONS = frozenset({"result", "cancel"})
# Up to 2 s in fine steps (an HTTP round trip is a millisecond or two), then long generations.
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
BOUNDS = (*(repr(float(b)) for b in BUCKETS), "+Inf")  # the le labels, as Prometheus writes them


def route_of(path: str, known: frozenset[str]) -> str:
    """The route template of ``path``; ``other`` for paths no route serves."""
    if path in known:
        return path
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "v1", "servings"] and parts[4] in SERVING_ACTIONS:
        return f"/v1/servings/{{name}}/{parts[4]}"
    if parts[:3] == ["", "v1", "jobs"] and parts[3]:
        if len(parts) == 4:
            return "/v1/jobs/{id}"
        if len(parts) == 5 and parts[4] in JOB_ACTIONS:
            return f"/v1/jobs/{{id}}/{parts[4]}"
    return "other"


class Timings:
    """One (route, method)'s histogram: seconds summed, and counts per bucket (not cumulative;
    the last is past the largest bound)."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)


class Count:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class HttpMetrics(Collector):
    """The counts, the ASGI middleware that fills them, and their families at scrape time."""

    def __init__(self, known_paths: frozenset[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.known = known_paths
        self.active = 0
        self.counts: dict[tuple[str, str, str], Count] = {}
        self.timings: dict[tuple[str, str], Timings] = {}
        self._cache: dict[tuple[str, str, int], tuple[Count, Timings]] = {}
        self.registry.register(self)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def measured(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            status = 500  # what the client saw if the app raised before answering

            async def send_noting(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            start = time.perf_counter()
            self.active += 1
            try:
                await app(scope, receive, send_noting)
            finally:
                self.active -= 1
                self.record(route_path(scope), scope["method"], status, start)

        return measured

    def record(self, path: str, method: str, status: int, start: float) -> None:
        """One request to ``path`` (below the mount point: ``route_path``) answered with
        ``status``, begun at ``start`` (``time.perf_counter``)."""
        count, timings = self._series(path, method, status)
        count.n += 1
        seconds = time.perf_counter() - start
        timings.total += seconds
        timings.buckets[bisect_left(BUCKETS, seconds)] += 1

    def _series(self, path: str, method: str, status: int) -> tuple[Count, Timings]:
        """The two series of one request; looked up once per (path, method, status): finding
        the route costs more than the counting (bounded: unknown paths are one key)."""
        if path.startswith("/v1/jobs/"):  # an id per job: cached by its template
            path = route_of(path, self.known)
        key = (
            path if path in self.known or path.startswith(("/v1/servings/", "/v1/jobs/")) else "",
            method,
            status,
        )
        series = self._cache.get(key)
        if series is None:
            route = route_of(path, self.known)
            method = method if method in METHODS else "other"
            count = self.counts.setdefault((route, method, str(status)), Count())
            series = count, self.timings.setdefault((route, method), Timings())
            if len(self._cache) < MAX_CACHED:
                self._cache[key] = series
        return series

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        requests = CounterMetricFamily(
            "queueserve_http_requests",
            "HTTP requests answered, by route, method and status",
            labels=["route", "method", "status"],
        )
        for labels, count in self.counts.items():
            requests.add_metric(list(labels), count.n)
        seconds = HistogramMetricFamily(
            "queueserve_http_request_seconds",
            "time from the request's arrival to the end of its response (streams included)",
            labels=["route", "method"],
        )
        for route_method, timings in self.timings.items():
            seen, buckets = 0, []
            for bound, n in zip(BOUNDS, timings.buckets, strict=True):
                seen += n
                buckets.append((bound, seen))
            seconds.add_metric(list(route_method), buckets, timings.total)
        yield requests
        yield seconds
        yield GaugeMetricFamily(
            "queueserve_http_requests_in_flight", "HTTP requests being answered", self.active
        )

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
