"""The metric table of docs/operations.md is what ``/metrics`` serves: every family a worker
exports is listed with its type, and every listed one is exported. (Here, not in tests/unit:
it scrapes a real worker, which needs a real Redis.)"""

from __future__ import annotations

import platform
import re
import threading
import urllib.request
from pathlib import Path

import queueserve as qs
from queueserve.worker.queue_metrics import version
from tests.integration.test_cli import Spawn, spawn  # noqa: F401
from tests.support.helpers import metric_sample, wait_until
from tests.support.redis_server import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented() -> dict[str, str]:
    """name -> type from the table under "## Metrics" (a row may name several metrics)."""
    section = DOCS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`queueserve_"):
            continue
        for name in re.findall(r"`(queueserve_\w+)`", cells[0]):
            out[name] = cells[1]
    return out


def served(text: str) -> dict[str, str]:
    """name -> type of each family (prometheus-client's ``*_created`` gauges left out: they
    are the time each series began, served by a worker in one process only)."""
    found = re.findall(r"^# TYPE (queueserve_\w+) (\w+)$", text, re.MULTILINE)
    return {n: t for n, t in found if not n.endswith("_created")}


def echo(xs: list[int]) -> list[int]:
    return xs


def test_the_docs_table_names_every_metric_a_worker_serves(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    worker = qs.Worker(
        qs.Serving(echo, name="echo", batch_timeout=0),
        redis_url=redis_url,
        prefix=prefix,
        metrics_port=0,
        handle_signals=False,
    ).start()
    try:
        assert client.dispatch("echo", 1) == 1
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        worker.stop()
    docs, exported = documented(), served(text)
    assert sorted(set(exported) - set(docs)) == [], "served, missing from docs/operations.md"
    assert sorted(set(docs) - set(exported)) == [], "in docs/operations.md, not served"
    assert {n: docs[n] for n in exported} == exported


def test_queue_time_end_to_end_and_the_backlog_by_priority(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    gate = threading.Event()

    def gated(xs: list[int]) -> list[int]:
        gate.wait(30)
        return xs

    worker = qs.Worker(
        qs.Serving(gated, name="gated", batch_size=1, batch_timeout=0),
        redis_url=redis_url,
        prefix=prefix,
        metrics_port=0,
        handle_signals=False,
    ).start()
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    try:
        first = client.submit("gated", [0])
        wait_until(
            lambda: (
                metric_sample(scrape(), "queueserve_queue_time_seconds_count", serving="gated") == 1
            ),
            "the first batch started",
        )
        # each goes as three requests of one item (a batch each: the client cuts them)
        later = [client.submit("gated", [1, 2, 3], priority=5) for _ in range(2)]
        wait_until(
            lambda: metric_sample(scrape(), "queueserve_queued_items", serving="gated") == 7,
            "seven items admitted",
        )
        text = scrape()  # of the two at priority 5, one may be read ahead already
        assert (
            metric_sample(text, "queueserve_priority_queue_depth", serving="gated", priority="5")
            >= 1
        )
        assert (
            metric_sample(
                text, "queueserve_oldest_request_age_seconds", serving="gated", priority="5"
            )
            >= 0
        )
        assert (
            metric_sample(
                text, "queueserve_oldest_request_age_seconds", serving="gated", priority="0"
            )
            > 0
        )
        gate.set()
        assert first.result(30) == [0]
        assert [t.result(30) for t in later] == [[1, 2, 3]] * 2
        wait_until(
            lambda: (
                metric_sample(scrape(), "queueserve_end_to_end_seconds_count", serving="gated") == 7
            ),
            "seven requests answered",
        )
        text = scrape()
        assert metric_sample(text, "queueserve_queue_time_seconds_count", serving="gated") == 7
        assert metric_sample(text, "queueserve_queued_items", serving="gated") == 0
        assert (
            metric_sample(
                text, "queueserve_build_info", version=version(), python=platform.python_version()
            )
            == 1
        )
    finally:
        gate.set()
        worker.stop()


def test_a_recycled_partition_counts_as_a_restart(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    port = free_port()
    worker = spawn(
        "tests.support.log_app:flaky",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--partitions",
        "1",
        "--max-batches-per-partition",
        "1",
        "--metrics-port",
        str(port),
    )
    url = f"http://127.0.0.1:{port}/metrics"

    def restarts() -> float:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        return metric_sample(
            text, "queueserve_partition_restarts_total", partition="0", reason="recycled"
        )

    assert client.dispatch("flaky", 1, timeout=60) == 2  # its one batch: then it is recycled
    wait_until(lambda: restarts() >= 1, "a restart counted", process=worker)
    assert client.dispatch("flaky", 2, timeout=60) == 3  # served by the fresh partition
