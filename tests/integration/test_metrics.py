"""Worker metrics and middleware (docs/design.md §7): what a scrape shows, and that hooks never stop
a worker."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest

import queueserve as qs
from queueserve.worker.middleware import Middleware


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found = line[len(name) + 1 : line.index("}")]
            if ",".join(sorted(found.split(","))) == want:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{want}}} in:\n{text}")


def triple(xs: list[Any]) -> list[Any]:
    return [x * 3 for x in xs]


def test_a_scrape_shows_batches_items_errors_and_queue_depth(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    serving = qs.Serving(triple, name="triple", batch_size=8, batch_timeout=0)
    worker = qs.Worker(
        serving, redis_url=redis_url, prefix=prefix, metrics_port=0, handle_signals=False
    ).start()
    try:
        assert worker.metrics_port
        assert client.dispatch_many("triple", list(range(20))) == [x * 3 for x in range(20)]
        assert client.dispatch_many("triple", [1, None], return_exceptions=True)[0] == 3

        status, text = _get(worker.metrics_port, "/metrics")
        assert status == 200
        assert _sample(text, "queueserve_items_total", serving="triple") == 22
        # 20 items go as requests of at most a batch (8, 8, 4), then one more
        assert _sample(text, "queueserve_requests_total", serving="triple") == 4
        assert _sample(text, "queueserve_errors_total", serving="triple", kind="remote") == 1
        assert _sample(text, "queueserve_batch_size_sum", serving="triple", key="default") == 22
        assert _sample(text, "queueserve_batch_size_count", serving="triple", key="default") >= 3
        assert _sample(text, "queueserve_queue_depth", serving="triple", key="default") == 0
        assert _sample(text, "queueserve_pending", serving="triple", key="default") == 0
        assert (
            _sample(
                text, "queueserve_partition_busy_seconds_total", serving="triple", partition="0"
            )
            > 0
        )
        assert _get(worker.metrics_port, "/healthz")[0] == 200
        assert _get(worker.metrics_port, "/readyz")[0] == 200
        assert _get(worker.metrics_port, "/nothing")[0] == 404
    finally:
        worker.stop()


class Broken(Middleware):
    def batch_started(self, *args: Any) -> None:
        raise RuntimeError("a metrics bug")

    def replied(self, *args: Any) -> None:
        raise RuntimeError("another metrics bug")


def test_a_failing_middleware_hook_is_logged_and_the_worker_goes_on(
    redis_url: str, prefix: str, client: qs.Client, caplog: pytest.LogCaptureFixture
) -> None:
    serving = qs.Serving(triple, name="triple", batch_size=8, batch_timeout=0)
    with qs.Worker(
        serving, redis_url=redis_url, prefix=prefix, middleware=[Broken()], handle_signals=False
    ):
        assert client.dispatch_many("triple", [1, 2, 3]) == [3, 6, 9]
        assert client.dispatch("triple", 4) == 12
    assert "middleware Broken.batch_started failed" in caplog.text
