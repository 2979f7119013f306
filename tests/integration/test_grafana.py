"""deploy/grafana/queueserve.json against a real Prometheus (Debian's ``prometheus`` package,
which scripts/test installs) scraping a real supervised worker under load: every query of
every panel returns data. Grafana's own variables are what Grafana would put there (every
serving, a rate window of a few scrapes)."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
from tests.integration.test_cli import Spawn, spawn  # noqa: F401
from tests.support.helpers import REPO, wait_until
from tests.support.log_app import BAD
from tests.support.redis_server import free_port

DASHBOARD = REPO / "deploy" / "grafana" / "queueserve.json"
RATE_WINDOW = "10s"  # Grafana's $__rate_interval for a 1s scrape interval, with room


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (p["title"], t["expr"].replace("$serving", ".*").replace("$__rate_interval", RATE_WINDOW))
        for p in panels
        for t in p["targets"]
    ]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on a free port: (its URL, its config file, written by the test)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "no prometheus binary: scripts/test installs Debian's prometheus package "
            "(apt-get install prometheus)"
        )
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs: []\n")
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(f"{url}/-/ready") is not None, "Prometheus ready")
        yield url, config
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _get(url: str) -> Any:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
        body = r.read()
        return json.loads(body) if body.startswith(b"{") else body
    return None


def query(url: str, promql: str) -> list[dict[str, Any]]:
    answer = _get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    assert answer is not None and answer["status"] == "success", (promql, answer)
    return list(answer["data"]["result"])


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


class Load:
    """Callers of both servings until stopped: items, some failing, and step requests."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client = qs.Client(redis_url, prefix=prefix)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._plain, daemon=True),
            threading.Thread(target=self._steps, daemon=True),
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        self.client.close()

    def _plain(self) -> None:
        while not self.stop.is_set():
            self.client.dispatch_many("flaky", [1, 2, BAD, 4], return_exceptions=True, timeout=30)
            self.client.dispatch_many("flaky", list(range(5)), priority=3, timeout=30)

    def _steps(self) -> None:
        while not self.stop.is_set():
            self.client.dispatch_many("count", [{"n": 3}, {"n": 5}], timeout=30)


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
    prometheus: tuple[str, Path],
) -> None:
    url, config = prometheus
    port = free_port()
    worker = spawn(
        "tests.support.log_app:flaky",
        "tests.support.step_app:Count",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--partitions",
        "1",
        "--metrics-port",
        str(port),
    )
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: queueserve-worker\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    urllib.request.urlopen(urllib.request.Request(f"{url}/-/reload", method="POST"), timeout=10)
    # An entry that names nobody to answer is dead-lettered (docs/operations.md).
    redis_client.xadd(f"{prefix}:{{flaky}}:in:default", {"junk": "1"})
    redis_client.zadd(f"{prefix}:{{flaky}}:ready", {"0default": 0})
    queries = panel_queries()
    assert len(queries) >= 12
    with Load(redis_url, prefix):
        for title, promql in queries:
            wait_until(
                lambda promql=promql: has_data(query(url, promql)),
                f"data for panel {title!r}: {promql}",
                process=worker,
            )
