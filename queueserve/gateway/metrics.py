"""Prometheus metrics of the gateway's HTTP requests, in a registry of each app's own (two
apps in one process never clash), served at ``GET /metrics``.

Routes are labelled by their template (``/v1/servings/{name}/dispatch``), never by the raw
path: a client sending random paths would otherwise create a series per path.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
MAX_CACHED = 4096  # series kept looked up (serving names are the client's to choose)
SERVING_ACTIONS = frozenset({"dispatch", "dispatch_many", "stream", "jobs"})
JOB_ACTIONS = frozenset({"result", "cancel"})
# Up to 2 s in fine steps (an HTTP round trip is a millisecond or two), then long generations.
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


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


class HttpMetrics:
    """The counters, and the ASGI middleware that fills them."""

    def __init__(self, known_paths: frozenset[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.known = known_paths
        self.requests = Counter(
            "queueserve_http_requests",
            "HTTP requests answered, by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "queueserve_http_request_seconds",
            "time from the request's arrival to the end of its response (streams included)",
            ["route", "method"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._cache: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        # Counted in a plain int, read at scrape time: a Gauge's inc and dec take a lock each,
        # twice per request on the gateway's hot path.
        self.active = 0
        Gauge(
            "queueserve_http_requests_in_flight",
            "HTTP requests being answered",
            registry=self.registry,
        ).set_function(lambda: self.active)

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
                count, seconds = self._series(scope["path"], scope["method"], status)
                count.inc()
                seconds.observe(time.perf_counter() - start)

        return measured

    def _series(self, path: str, method: str, status: int) -> tuple[Counter, Histogram]:
        """The two series of one request; looked up once per (path, method, status): the
        labels() calls cost more than the counting (bounded: unknown paths are one key)."""
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
            series = (
                self.requests.labels(route, method, str(status)),
                self.seconds.labels(route, method),
            )
            if len(self._cache) < MAX_CACHED:
                self._cache[key] = series
        return series

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
