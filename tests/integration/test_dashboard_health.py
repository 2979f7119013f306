"""The dashboard's health figures against a real worker process (docs/operations.md,
"Dashboard", "Status"): each serving is credited its own items when servings share a
partition, a serving whose batch function always raises is shown failing within 10 s of
load, and the queue time and end to end the page shows are the worker's own histograms
(its /metrics) over the same requests; and the page's summary in a real Chromium."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.remote.webdriver import WebDriver

import queueserve as qs
from queueserve.dashboard.health import WINDOW_S
from queueserve.wire.figures import LATENCY_BOUNDS, quantile
from tests.support.dashboard_proc import DashboardProc, chromium
from tests.support.fault_app import WorkerProc
from tests.support.helpers import wait_until
from tests.support.redis_server import free_port

# Sent to the busy serving, 4 items each. The page counts what was done over its last minute
# (health.WINDOW_S), so the exact count below holds only while all of it fits in the minute
# from the page's first sample: few enough to send in seconds on a loaded 2-core machine.
REQUESTS = 100


@pytest.fixture
def served(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[tuple[DashboardProc, int]]:
    """A worker of busy, idle and broken on one partition, with /metrics, and a dashboard."""
    port = free_port()
    worker = WorkerProc.one_partition(
        ["tests.support.health_app:together", "--metrics-port", str(port)],
        redis_url,
        prefix,
        tmp_path / "worker.log",
    )
    proc = None
    try:
        with qs.Client(redis_url, prefix=prefix) as client:
            wait_until(lambda: client.dispatch("busy", 2, timeout=30) == 4, "the worker")
        proc = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log")
        yield proc, port
    finally:
        if proc is not None:
            proc.stop()
        worker.kill_group()


def overview(http: httpx.Client) -> dict[str, dict[str, Any]]:
    response = http.get("/api/overview")
    assert response.status_code == 200, response.text[:500]
    return {s["name"]: s for s in response.json()["servings"]}


def worker_histogram(port: int, name: str, serving: str) -> list[int]:
    """The worker's histogram ``name`` of ``serving`` from its /metrics, per bucket (not
    cumulative), over LATENCY_BOUNDS and past the last."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    cumulative: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket" and s.labels.get("serving") == serving:
                cumulative[float(s.labels["le"])] = s.value
    bounds = [*map(float, LATENCY_BOUNDS), float("inf")]
    assert sorted(cumulative) == bounds, sorted(cumulative)
    totals = [int(cumulative[b]) for b in bounds]
    return [n - (totals[i - 1] if i else 0) for i, n in enumerate(totals)]


def bucket(seconds: float) -> int:
    return next((i for i, b in enumerate(LATENCY_BOUNDS) if seconds <= b), len(LATENCY_BOUNDS))


def test_each_serving_has_its_own_figures_and_the_failing_one_says_so(
    served: tuple[DashboardProc, int], redis_url: str, prefix: str
) -> None:
    dashboard, port = served
    with httpx.Client(base_url=dashboard.url, timeout=60) as http:
        # Given the page read once before any load (its first sample)
        before = worker_histogram(port, "queueserve_queue_time_seconds", "busy")
        first_sample = time.monotonic()
        first = overview(http)
        assert first["idle"]["health"]["status"]["status"] == "idle", first["idle"]["health"]

        # When callers load the busy serving and the broken one
        stop = threading.Event()

        def load(serving: str, rounds: int | None) -> None:
            with qs.Client(redis_url, prefix=prefix) as client:
                n = 0
                while not stop.is_set() and (rounds is None or n < rounds):
                    client.dispatch_many(serving, [1, 2, 3, 4], return_exceptions=True, timeout=60)
                    n += 1

        callers = [
            threading.Thread(target=load, args=("busy", REQUESTS // 2)),
            threading.Thread(target=load, args=("busy", REQUESTS // 2)),
            threading.Thread(target=load, args=("broken", None)),
        ]
        for caller in callers:
            caller.start()
        try:
            # Then the broken serving is shown failing within 10 s
            failing = wait_until(
                lambda: (
                    (s := overview(http)["broken"])["health"]["status"]["status"] == "failing" and s
                ),
                "the broken serving shown failing",
                timeout=10,
                process=dashboard,
            )
            assert failing["health"]["error_rate"] == 1.0, failing["health"]
            assert "failed" in failing["health"]["status"]["reasons"][0]
            # and the busy one busy, with items per second of its own
            rows = wait_until(
                lambda: (o := overview(http))["busy"]["health"]["items_per_s"] and o,
                "the busy serving's throughput",
            )
        finally:
            stop.set()
            for caller in callers:
                caller.join(120)
            loaded = time.monotonic()
        assert rows["busy"]["health"]["status"]["status"] == "busy", rows["busy"]["health"]

        # and the idle serving, on the same partition, ran nothing at any point
        idle = overview(http)["idle"]
        assert idle["health"]["items"] == 0 and idle["health"]["items_per_s"] == 0.0, idle
        assert all(p["items_per_s"] == 0.0 for p in idle["history"]), idle["history"]
        assert [w["items"] for w in idle["workers"]] == [0], idle["workers"]
        assert idle["health"]["status"]["status"] == "idle", idle["health"]

        # When every request to the busy serving has been counted by the page
        sent = REQUESTS * 4
        try:
            busy = wait_until(
                lambda: (s := overview(http)["busy"])["health"]["items"] == sent and s,
                "the page to count every item sent to busy",
            )
        except AssertionError as e:
            # (once seen in a full run on 2 loaded cores: more, as from a request run twice
            # after its lease lapsed, or fewer, as from a count the page lost, tell apart)
            counted = overview(http)["busy"]["health"]["items"]
            ran = sum(worker_histogram(port, "queueserve_queue_time_seconds", "busy")) - sum(before)
            raise AssertionError(
                f"{e}; the page counted {counted} items of {sent}, and the worker's queue-time "
                f"histogram {ran} requests of {REQUESTS}; the load ended "
                f"{loaded - first_sample:.0f} s after the page's first sample (it counts over "
                f"{WINDOW_S:g} s)"
            ) from None

        # Then its queue time is the worker's histogram's over the same requests: p50 and
        # p99 in the same bucket (they count the same observations in the same buckets)
        after = worker_histogram(port, "queueserve_queue_time_seconds", "busy")
        worker = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(worker) == REQUESTS
        for q, shown in (
            (0.5, busy["health"]["queue_p50_ms"]),
            (0.99, busy["health"]["queue_p99_ms"]),
        ):
            expected = quantile(q, worker)
            assert expected is not None and shown is not None
            assert abs(bucket(shown / 1000) - bucket(expected)) <= 1, (q, shown, expected, worker)
        ends = worker_histogram(port, "queueserve_end_to_end_seconds", "busy")
        assert busy["health"]["end_to_end_p99_ms"] is not None
        assert (
            bucket(busy["health"]["end_to_end_p99_ms"] / 1000)
            <= bucket(quantile(0.99, ends) or 0.0) + 1
        )


def cells(browser: WebDriver) -> dict[str, dict[str, str]]:
    """The summary table as shown: serving -> column class -> text."""
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#summary tr[data-serving]')].map((tr) =>"
        " [tr.dataset.serving, Object.fromEntries([...tr.cells].map((td) =>"
        " [td.className, td.textContent]))]);"
    )
    return {name: row for name, row in rows}


def order(browser: WebDriver) -> list[str]:
    return list(cells(browser))


def test_the_page_shows_a_failing_a_busy_and_an_idle_serving_in_its_summary(
    served: tuple[DashboardProc, int], redis_url: str, prefix: str
) -> None:
    """In a real Chromium: the summary's status in words and colour, sorting by a column, and
    the options table with the differences from the defaults first. QS_DASHBOARD_SCREENSHOT
    =path saves the page (docs/img/dashboard.png was taken so)."""
    dashboard, _ = served
    browser = chromium()
    stop = threading.Event()

    def load(serving: str) -> None:
        with qs.Client(redis_url, prefix=prefix) as client:
            while not stop.is_set():
                client.dispatch_many(serving, [1, 2, 3, 4], return_exceptions=True, timeout=60)

    callers = [threading.Thread(target=load, args=(s,)) for s in ("busy", "busy", "broken")]
    try:
        # Given the page open before any load
        browser.get(dashboard.url)
        wait_until(lambda: len(cells(browser)) == 3, "the summary's rows", process=dashboard)
        # When callers load the busy serving and the broken one
        for caller in callers:
            caller.start()
        # Then within 10 s the summary says which fails, which is busy and which idle
        statuses = {"broken": "failing", "busy": "busy", "idle": "idle"}
        wait_until(
            lambda: {n: r["status"] for n, r in cells(browser).items()} == statuses,
            f"the statuses {statuses}",
            timeout=10,
            process=dashboard,
        )
        rows = wait_until(
            lambda: (c := cells(browser))["busy"]["items-per-s"] not in ("\u2013", "0.0") and c,
            "the busy serving's items/s",
        )
        assert rows["idle"]["items-per-s"] == "0.0" and rows["broken"]["error-rate"] == "100%"
        colours = browser.execute_script(
            "return Object.fromEntries([...document.querySelectorAll('#summary tr[data-serving]')]"
            ".map((tr) => [tr.dataset.serving,"
            " getComputedStyle(tr.querySelector('.badge')).backgroundColor]));"
        )
        assert colours["broken"] == "rgb(198, 40, 40)" and colours["busy"] == "rgb(46, 125, 50)"
        assert len(set(colours.values())) == 3, colours
        # and it opens worst first; a click on a column sorts by it, again the other way
        assert order(browser)[0] == "broken", order(browser)
        click = "document.querySelector(`#summary th[data-column='${arguments[0]}']`).click();"
        browser.execute_script(click, 0)
        assert order(browser) == ["broken", "busy", "idle"]
        browser.execute_script(click, 0)
        assert order(browser) == ["idle", "busy", "broken"]
        browser.execute_script(click, 2)  # items/s: the most first
        assert order(browser)[0] == "busy", order(browser)
        # and the options of each serving differ from the defaults first (batch_size 16)
        first = browser.execute_script(
            "const row = document.querySelector("
            "'section[data-serving=\"busy\"] table.options tr.differs');"
            "return row ? [...row.cells].map((c) => c.textContent) : null;"
        )
        assert first is not None and first[:3] == ["batch_size", "16", "32"], first
        browser.execute_script(click, 1)  # back to the worst first for the picture
        shot = os.environ.get("QS_DASHBOARD_SCREENSHOT")
        if shot:  # once the charts hold a dozen points (some 24 s of load)
            wait_until(lambda: chart_points(browser) >= 12, "the charts", timeout=120)
            browser.save_screenshot(shot)
    finally:
        stop.set()
        for caller in callers:
            if caller.is_alive():
                caller.join(120)
        browser.quit()


def chart_points(browser: WebDriver) -> int:
    points = browser.execute_script(
        "const p = document.querySelector('section[data-serving=\"busy\"] polyline');"
        "return p ? p.getAttribute('points') : '';"
    )
    return len(str(points).split())
