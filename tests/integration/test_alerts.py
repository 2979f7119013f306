"""deploy/prometheus/alerts.yml: checked by ``promtool check rules``, and loaded into a real
Prometheus (test_grafana.py's fixture) scraping a real worker process and the dashboard's
/metrics: each alert is active (pending or firing) for the serving whose condition holds and
for no other. And the backlog of a serving with no worker reaches Prometheus through the
dashboard, as the KEDA manifest's query reads it (docs/operations.md, "Alerts" and "Scaling
from zero")."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis
import yaml

import queueserve as qs
from queueserve.wire.keys import Keys
from tests.integration.test_grafana import _get, prometheus, query  # noqa: F401
from tests.support.dashboard_proc import DashboardProc
from tests.support.fault_app import WorkerProc, header
from tests.support.helpers import REPO, wait_until
from tests.support.listing_cost import declare
from tests.support.redis_server import RedisServer, free_port

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
KEDA = REPO / "deploy" / "k8s" / "keda-scaledobject.yaml"
RULES = (
    "NoWorker",
    "Failing",
    "WaitingLong",
    "DeadLettersGrowing",
    "RedisErrors",
    "PartitionRestarts",
)


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("no promtool: scripts/test installs Debian's prometheus package")
    return binary


def test_promtool_checks_the_rules_and_refuses_a_broken_copy(tmp_path: Path) -> None:
    checked = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in checked.stdout, checked.stdout
    rules = yaml.safe_load(ALERTS.read_text())
    assert [r["alert"] for r in rules["groups"][0]["rules"]] == [f"Queueserve{n}" for n in RULES]
    broken = tmp_path / "alerts.yml"
    broken.write_text(
        ALERTS.read_text().replace("(queueserve_queued_items)", "(queueserve_queued_items")
    )
    refused = subprocess.run(
        [promtool(), "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0


def active(url: str) -> dict[str, set[str]]:
    """Alert name (without its Queueserve prefix) -> the servings (or, without a serving
    label, reasons or instances) it is active for, pending or firing."""
    answer = _get(f"{url}/api/v1/alerts")
    assert answer is not None and answer["status"] == "success", answer
    out: dict[str, set[str]] = {name: set() for name in RULES}
    for alert in answer["data"]["alerts"]:
        labels = alert["labels"]
        name = labels["alertname"].removeprefix("Queueserve")
        out[name].add(labels.get("serving") or labels.get("reason") or labels.get("instance", "?"))
    return out


def started(url: str, prefix: str, log: Path, spec: str, serving: str) -> tuple[WorkerProc, int]:
    """A worker of ``spec`` with /metrics on a free port, once it answers ``serving``."""
    port = free_port()
    proc = WorkerProc.one_partition([spec, "--metrics-port", str(port)], url, prefix, log)
    try:
        with qs.Client(url, prefix=prefix) as client:
            wait_until(lambda: client.dispatch(serving, 2, timeout=30) == 4, "the worker")
    except BaseException:
        proc.kill_group()
        raise
    return proc, port


@pytest.fixture
def worker(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[tuple[WorkerProc, int]]:
    proc, port = started(
        redis_url, prefix, tmp_path / "worker.log", "tests.support.health_app:alerting", "busy"
    )
    try:
        yield proc, port
    finally:
        proc.kill_group()


@pytest.fixture
def lone_worker(
    redis_tmp_server: RedisServer, prefix: str, tmp_path: Path
) -> Iterator[tuple[WorkerProc, int, RedisServer]]:
    """A worker on a Redis of its own, which the test may stop."""
    proc, port = started(
        redis_tmp_server.url, prefix, tmp_path / "lone.log", "tests.support.health_app:idle", "idle"
    )
    try:
        yield proc, port, redis_tmp_server
    finally:
        proc.kill_group()


def forge_old_request(r: redis.Redis, prefix: str, serving: str, age_s: float) -> None:
    """A well-formed request of one item, enqueued ``age_s`` ago (its entry id's time), under
    a batch key of its own, marked ready as enqueue.lua marks a stream."""
    keys = Keys(prefix, serving)
    stream = f"{prefix}:{{{serving}}}:in:old"
    r.xgroup_create(stream, "qs", id="0", mkstream=True)
    at_ms = int((time.time() - age_s) * 1000)
    entry = {"h": header(1, 1, f"{prefix}:inbox:raw"), "p": msgpack.packb([1]), "a": 1}
    r.xadd(stream, entry, id=f"{at_ms}-0")
    r.zadd(keys.ready, {"0old": at_ms})


def test_each_alert_fires_under_its_condition_and_not_without(
    worker: tuple[WorkerProc, int],
    lone_worker: tuple[WorkerProc, int, RedisServer],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    prometheus: tuple[str, Path],  # noqa: F811
) -> None:
    url, config = prometheus
    proc, metrics_port = worker
    lone, lone_port, lone_redis = lone_worker
    # Given a serving declared whose worker is gone, with work waiting (3 items)
    declare(redis_client, prefix, "orphan")
    with qs.Client(redis_url, prefix=prefix) as client:
        orphaned = client.submit("orphan", [1, 2, 3])
        # and a request of the stuck serving enqueued 2 minutes ago, whose batch hangs
        forge_old_request(redis_client, prefix, "stuck", 120)
        dashboard = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log")
        try:
            # When Prometheus scrapes the worker and the dashboard, with the rules loaded
            dash = dashboard.url.removeprefix("http://")
            config.write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                f"rule_files: ['{ALERTS}']\n"
                "scrape_configs:\n"
                "  - job_name: queueserve-worker\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}', "
                f"'127.0.0.1:{lone_port}']}}]\n"
                "  - job_name: queueserve-dashboard\n"
                f"    static_configs: [{{targets: ['{dash}']}}]\n"
            )
            reload = urllib.request.Request(f"{url}/-/reload", method="POST")
            urllib.request.urlopen(reload, timeout=10)
            wait_until(
                lambda: len([r for r in query(url, "up") if r["value"][1] == "1"]) == 3,
                "the three targets scraped",
                process=proc,
            )
            loaded = _get(f"{url}/api/v1/rules")["data"]["groups"]
            assert [len(g["rules"]) for g in loaded] == [len(RULES)], loaded
            # and callers load the busy serving and the one that always raises
            with Load(redis_url, prefix):
                # Then the backlog with no worker reaches Prometheus, through the dashboard
                keda = yaml.safe_load(KEDA.read_text())["spec"]["triggers"][0]["metadata"]
                backlog = keda["query"].replace('"embed"', '"orphan"')
                wait_until(
                    lambda: [r["value"][1] for r in query(url, backlog)] == ["3"],
                    f"the orphan's backlog from {backlog}",
                )
                # and each alert is active for its serving alone
                wanted = {
                    "NoWorker": {"orphan"},
                    "Failing": {"broken"},
                    "WaitingLong": {"stuck"},
                    "DeadLettersGrowing": set(),
                    "RedisErrors": set(),
                    "PartitionRestarts": set(),
                }
                wait_until(lambda: active(url) == wanted, f"alerts {wanted}", process=proc)

                # When a dead letter is added to the busy serving's, once Prometheus saw none
                wait_until(
                    lambda: query(url, 'queueserve_dead_letter_depth{serving="busy"}'),
                    "the busy serving's dead letters scraped",
                )
                busy = Keys(prefix, "busy")
                redis_client.xadd(busy.dead, {"reason": "forged", "stream": "x", "entry_id": "1-0"})
                # Then dead letters growing is active for it alone
                wanted["DeadLettersGrowing"] = {"busy"}
                wait_until(lambda: active(url) == wanted, f"alerts {wanted}", process=proc)

                # When the partition is killed (its stuck batch running), and restarted
                [pid] = proc.partition_pids()
                proc.kill_partition(pid)
                # Then partition restarts is active, for a partition that died in its batch
                wanted["PartitionRestarts"] = {"died_in_batch"}
                wait_until(lambda: active(url) == wanted, f"alerts {wanted}", process=proc)

                # When the lone worker's Redis stops (its heartbeats fail, and are counted)
                lone_redis.stop()
                # Then Redis errors is active for that worker alone
                wanted["RedisErrors"] = {f"127.0.0.1:{lone_port}"}
                wait_until(lambda: active(url) == wanted, f"alerts {wanted}", process=lone)
        finally:
            dashboard.stop()
        orphaned.cancel()


class Load:
    """Callers of the busy serving and of the one that always raises, until the block ends."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.url, self.prefix = redis_url, prefix
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._send, args=(s,)) for s in ("busy", "broken")]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _send(self, serving: str) -> None:
        # The busy serving fails 2% of its items, under the alert's 5%: failing has a series
        # for it, and must not fire for it
        items = [*range(1, 50), -1] if serving == "busy" else [1, 2, 3]
        with qs.Client(self.url, prefix=self.prefix) as client:
            while not self.stop.is_set():
                client.dispatch_many(serving, items, return_exceptions=True, timeout=30)
