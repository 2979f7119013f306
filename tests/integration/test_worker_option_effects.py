"""The worker's option-effect table (tests/integration/test_option_effects.py's twin): every
field of WorkerOptions, set each way the docs allow, acts through a real worker.

A worker option is set as a ``qs.Worker`` keyword, as a ``queueserve worker`` flag, or as a
``QUEUESERVE_<NAME>`` variable, which ``qs.Worker`` and the command read alike. All meet in
WorkerOptions.of, then in the worker's ``options``, which everything downstream reads (the CLI
builds ``Worker(**dict(options))``). So each row of ``ROWS`` is proven in two parts:

- **every way**: the real entry point, given the row's value that way (``qs.Worker(...)``;
  ``queueserve.ops.cli.main`` with ``Worker.run`` replaced by a capture, with the flag or with
  the variable set), makes a worker whose ``options`` hold that value
  (``test_each_way_of_setting_a_worker_option_reaches_the_worker``);
- **its effect**: a test (``Row.effect``, ``path::name``) runs a real worker with the option set
  one way (``Row.way``) and sees what a user would: two partitions serving, batches cut at the
  worker's size, /metrics on 127.0.0.2, JSON lines, deaths spread wider than the window
  forgiven... Most are the two scenarios below, each one worker process with the options that
  do not interfere; the recycling limits and the crash loop name tests/faults' tests, which
  kill and starve real partitions already.

An option without a row fails ``test_every_worker_option_has_a_row_that_names_its_effect``
(and its ``every way`` cases), as a serving option without one fails test_option_effects.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.ops import cli
from queueserve.wire.keys import Keys
from queueserve.worker.options import ENV_PREFIX, WorkerOptions
from tests.integration.test_cli import Spawn, spawn  # noqa: F401
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import REPO, WAIT_S, child_env, metric_sample, pending_requests
from tests.support.helpers import wait_until as wait
from tests.support.redis_server import free_port
from tests.support.worker_option_app import gate_key, holding_key

APP = "tests.support.worker_option_app"
THIS = "tests/integration/test_worker_option_effects.py"
LIMITS = "tests/faults/test_limits.py"
BATCHES = "queueserve_batch_size_count"
WAYS = ("keyword", "flag", "variable")
# The variable is read by both entry points: each is a way to check
ENTRIES = ("keyword", "flag", "variable (qs.Worker)", "variable (queueserve worker)")
ONE_WORKER = f"{THIS}::test_one_worker_shows_partitions_batching_keys_metrics_logs_and_shutdown"
SUPERVISED = (
    f"{THIS}::test_two_batches_run_at_once_and_deaths_wider_apart_than_the_window_are_forgiven"
)


@dataclass(frozen=True)
class Row:
    """``value``: what ``Worker.options.<name>`` holds once the option is set; ``text``: it as
    a flag's argument and as the variable (``keyword``: as the keyword, when not ``value``);
    ``effect``: the test that sees it act through a real worker, set ``way``."""

    value: Any
    text: str
    effect: str
    way: str
    keyword: Any = None

    def flag(self, option: str) -> list[str]:
        if option == "batch_keys":  # repeatable, where the variable is comma-separated
            return [a for key in self.text.split(",") for a in ("--batch-key", key)]
        return [f"--{option.replace('_', '-')}", self.text]


ROWS: dict[str, Row] = {
    "partitions": Row(2, "2", ONE_WORKER, "flag"),
    "batch_size": Row(3, "3", ONE_WORKER, "flag"),
    "batch_timeout": Row(0.0, "0", ONE_WORKER, "flag"),
    "batch_keys": Row(("early", "late"), "early,late", ONE_WORKER, "variable", ["early", "late"]),
    "max_concurrent_batches": Row(2, "2", SUPERVISED, "flag"),
    "shutdown_timeout": Row(1.0, "1s", ONE_WORKER, "flag", "1s"),
    "max_restarts": Row(
        1,
        "1",
        "tests/faults/test_partitions.py::"
        "test_a_dead_partition_is_restarted_and_a_crash_loop_stops_the_worker",
        "flag",
    ),
    "restart_window": Row(0.2, "200ms", SUPERVISED, "variable", "200ms"),
    "max_batch_seconds": Row(
        1.0,
        "1s",
        f"{LIMITS}::test_a_batch_past_max_batch_seconds_is_abandoned_and_its_request_dead_lettered",
        "flag",
        "1s",
    ),
    "max_batches_per_partition": Row(
        3,
        "3",
        f"{LIMITS}::test_a_partition_is_recycled_after_max_batches_and_nothing_is_lost",
        "flag",
    ),
    "max_partition_memory": Row(
        400 * 2**20,
        "400MiB",
        f"{LIMITS}::test_a_partition_past_max_partition_memory_is_recycled",
        "flag",
        "400MiB",
    ),
    "torch_threads": Row(
        3, "3", f"{THIS}::test_torch_threads_sets_each_partitions_threads", "flag"
    ),
    "metrics_port": Row(9137, "9137", ONE_WORKER, "flag"),
    "metrics_host": Row("127.0.0.2", "127.0.0.2", ONE_WORKER, "variable"),
    "metrics_keys": Row(0, "0", ONE_WORKER, "variable"),
    "log_format": Row("json", "json", ONE_WORKER, "variable"),
    "log_level": Row("DEBUG", "DEBUG", ONE_WORKER, "variable"),
}


def spelling(option: str, way: str) -> str:
    """How a test sets ``option`` ``way``: the keyword's name, the flag, the variable."""
    if way == "keyword":
        return option
    if way == "variable":
        return f"{ENV_PREFIX}{option.upper()}"
    return "--batch-key" if option == "batch_keys" else f"--{option.replace('_', '-')}"


def written_in(reference: str) -> tuple[set[str], set[str]] | None:
    """The strings and the names of keyword arguments in the code (not the comments) of test
    ``path::name``; None when there is no such test."""
    path, _, name = reference.partition("::")
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            inside = list(ast.walk(node))
            strings = {n.value for n in inside if isinstance(n, ast.Constant)}
            keywords = {n.arg for n in inside if isinstance(n, ast.keyword) and n.arg}
            return {s for s in strings if isinstance(s, str)}, keywords
    return None


def test_every_worker_option_has_a_row_that_names_its_effect() -> None:
    assert set(ROWS) == set(WorkerOptions.model_fields), (
        "a worker option without a row in the option-effect table (or a row for none): add one "
        f"to ROWS: {set(WorkerOptions.model_fields) ^ set(ROWS)}"
    )
    for option, row in ROWS.items():
        # a row that sets the default would pass whether or not the option acts
        assert row.value != WorkerOptions.model_fields[option].default, option
        assert row.way in WAYS, (option, row.way)
        written = written_in(row.effect)
        assert written is not None, f"{option}: no test {row.effect}"
        strings, keywords = written
        # the test sets the option the way the row says: a keyword argument, a flag's string,
        # the variable as a string or as child_env's keyword
        names = keywords if row.way == "keyword" else strings | keywords
        assert spelling(option, row.way) in names, (option, row.way, row.effect)
    assert ROWS["partitions"].value != 1  # qs.Worker's own default


# --- every way: the value reaches the worker ---------------------------------------------------


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[qs.Worker]:
    """Workers the command made and would have run (``Worker.run`` replaced); no variable of
    the caller's sets a worker option meanwhile."""
    for name in WorkerOptions.model_fields:
        monkeypatch.delenv(f"{ENV_PREFIX}{name.upper()}", raising=False)
    runs: list[qs.Worker] = []

    def run(self: qs.Worker) -> int:
        runs.append(self)
        return 0

    monkeypatch.setattr(qs.Worker, "run", run)
    return runs


@pytest.mark.parametrize(
    ("option", "entry"),
    [
        pytest.param(o, e, id=f"{o}-{e.replace(' ', '_')}")
        for o in WorkerOptions.model_fields
        for e in ENTRIES
    ],
)
def test_each_way_of_setting_a_worker_option_reaches_the_worker(
    option: str,
    entry: str,
    redis_url: str,
    captured: list[qs.Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = ROWS[option]
    spec = f"{APP}:sizes"
    if entry.startswith("variable"):
        monkeypatch.setenv(f"{ENV_PREFIX}{option.upper()}", row.text)
    if entry == "keyword":
        keyword = row.value if row.keyword is None else row.keyword
        worker = qs.Worker(spec, redis_url=redis_url, **{option: keyword})
    elif entry == "variable (qs.Worker)":
        worker = qs.Worker(spec, redis_url=redis_url)
    else:
        flags = row.flag(option) if entry == "flag" else []
        assert cli.main(["worker", spec, "--redis-url", redis_url, *flags]) == 0
        (worker,) = captured
    assert getattr(worker.options, option) == row.value


def test_qs_worker_serves_one_partition_unless_told(
    captured: list[qs.Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    # qs.Worker's default is 1 (queueserve worker's: auto); QUEUESERVE_PARTITIONS wins over
    # it (it did not: the keyword's default of 1 was taken as given), and a keyword over that
    spec = f"{APP}:sizes"
    assert qs.Worker(spec).options.partitions == 1
    for text, value in (("2", 2), ("auto", "auto")):
        monkeypatch.setenv("QUEUESERVE_PARTITIONS", text)
        assert qs.Worker(spec).options.partitions == value
    assert qs.Worker(spec, partitions=3).options.partitions == 3


# --- effects: real worker processes ------------------------------------------------------------


def consumers(r: redis.Redis, prefix: str, serving: str) -> dict[int, int]:
    """Partition pid -> partition index of the consumers serving ``serving`` (host-PID-pN-x)."""
    found = {}
    for name in r.zrange(Keys(prefix, serving).workers, 0, -1):
        m = re.search(r"-(\d+)-p(\d+)-[0-9a-f]+$", name.decode())
        if m:
            found[int(m.group(1))] = int(m.group(2))
    return found


def scrape(port: int, host: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())
    except OSError:
        return None


def not_json(lines: list[str]) -> list[str]:
    bad = []
    for line in lines:
        try:
            if not isinstance(json.loads(line), dict):
                bad.append(line)
        except ValueError:
            bad.append(line)
    return bad


@pytest.mark.timeout(240)
def test_one_worker_shows_partitions_batching_keys_metrics_logs_and_shutdown(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker set by flags and QUEUESERVE_* variables, serving Sizes (batch_size 32,
    # batch_timeout 1h: the worker's --batch-size and --batch-timeout override both)
    port = free_port()
    worker = spawn(
        f"{APP}:sizes",
        "--redis-url", redis_url,
        "--prefix", prefix,
        "--partitions", "2",
        "--batch-size", "3",
        "--batch-timeout", "0",
        "--metrics-port", str(port),
        "--shutdown-timeout", "1s",
        env=child_env(
            QS_TEST_URL=redis_url,
            QS_TEST_PREFIX=prefix,
            QUEUESERVE_BATCH_KEYS="early",
            QUEUESERVE_METRICS_HOST="127.0.0.2",
            QUEUESERVE_METRICS_KEYS="0",
            QUEUESERVE_LOG_FORMAT="json",
            QUEUESERVE_LOG_LEVEL="DEBUG",
        ),
    )  # fmt: skip
    keys = Keys(prefix, "sizes")

    # partitions=2: two partition processes serve, each its own consumer (auto by default:
    # one on a machine without CUDA)
    wait(
        lambda: len(consumers(redis_client, prefix, "sizes")) == 2,
        "two partitions serving",
        process=worker,
    )
    assert sorted(consumers(redis_client, prefix, "sizes").values()) == [0, 1]

    # batch_size=3 cuts a request of 7 items into batches of at most 3 (the serving's 32: one
    # of 7); batch_timeout=0 runs the last item and a lone one at once (the serving's: 1 h)
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.submit("sizes", list(range(7))).result(WAIT_S) == [3] * 6 + [1]
        assert client.dispatch("sizes", "alone", timeout=WAIT_S) == 1

        # batch_keys=early: its stream is read from the start, before any request to it, so a
        # request any Redis user XADDs there (no enqueue script marking it) is answered
        early = keys.stream("early")
        wait(
            lambda: redis_client.exists(early),
            "the declared key's stream, before any request",
            process=worker,
        )
        inbox = RawInbox(redis_client, prefix)
        redis_client.xadd(early, {"h": header(1, 1, inbox.key), "p": msgpack.packb(["plain"])})
        wait(
            lambda: inbox.answered([1]),
            "the XADDed request to the declared key answered",
            process=worker,
        )
        assert inbox.error_kind(1) is None

        # metrics_port and metrics_host: /metrics is served on 127.0.0.2:port, not on
        # 127.0.0.1:port; metrics_keys=0: key k1 is summed under "other", the declared early
        # keeps its name
        assert client.submit("sizes", ["k"], batch_key="k1").result(WAIT_S) == [1]

        def counted() -> str | None:
            text = scrape(port, "127.0.0.2") or ""
            k1 = [metric_sample(text, BATCHES, serving="sizes", key=k) for k in ("k1", "other")]
            return text if any(k1) else None

        text = wait(counted, "k1's batch counted, on 127.0.0.2", process=worker)
        assert 'key="k1"' not in text, text
        assert metric_sample(text, BATCHES, serving="sizes", key="other") == 1
        assert metric_sample(text, BATCHES, serving="sizes", key="early") == 1
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

        # log_format=json: every line is a JSON object, the supervisor's and each partition's
        lines = [line for line in worker.output().splitlines() if line.strip()]
        assert not not_json(lines), not_json(lines)[:5]
        assert {json.loads(line)["partition"] for line in lines} == {"-", "0", "1"}
        # log_level=DEBUG: a line per batch, from the partitions (INFO by default: none)
        records = [json.loads(line) for line in lines]
        assert any(r["level"] == "DEBUG" and "batch of" in r["message"] for r in records)

        # shutdown_timeout=1s: SIGTERM while a batch is held; the worker stops after 1 s of
        # draining (30 s by default), leaving the request pending for another worker
        held = client.submit("sizes", ["hold"])
        wait(
            lambda: redis_client.exists(holding_key(prefix)),
            "the held batch running",
            process=worker,
        )
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.output()
        assert "draining: stopped reading, finishing what it holds (up to 1s)" in worker.output()
        assert "shutdown timeout passed with work unfinished" in worker.output()
        assert pending_requests(redis_client, keys.stream("default")) == 1 and not held.done()
        redis_client.set(gate_key(prefix), 1)


def child_of(parent: int, pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent


@pytest.mark.timeout(240)
def test_two_batches_run_at_once_and_deaths_wider_apart_than_the_window_are_forgiven(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker of one partition that runs 2 batches at once and tolerates 1 death
    # within a window of 200 ms
    worker = spawn(
        f"{APP}:pair",
        f"{APP}:whoami",
        "--redis-url", redis_url,
        "--prefix", prefix,
        "--partitions", "1",
        "--max-concurrent-batches", "2",
        "--max-restarts", "1",
        env=child_env(QUEUESERVE_RESTART_WINDOW="200ms"),
    )  # fmt: skip
    wait(lambda: consumers(redis_client, prefix, "pair"), "the partition serving", process=worker)

    with qs.Client(redis_url, prefix=prefix) as client:
        # max_concurrent_batches=2: a batch of Pair returns only once another runs beside it
        # in its process (one at a time: the first waits alone, and both fail)
        a = client.submit("pair", ["a"], batch_key="a")
        b = client.submit("pair", ["b"], batch_key="b")
        assert a.result(WAIT_S) == b.result(WAIT_S)  # one pid: the one partition

        # restart_window=200ms: the partition is killed 3 times, each time once its successor
        # serves (a restart takes 0.5 s, past the window): no two deaths fall in one window,
        # so the worker serves on (60 s by default: the second death is a crash loop, exit 4)
        pid = client.dispatch("whoami", 0, timeout=WAIT_S)
        killed: list[int] = []
        for death in (1, 2, 3):
            assert child_of(worker.proc.pid, pid), (pid, worker.output())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            pid = wait(
                lambda: next(
                    (p for p in consumers(redis_client, prefix, "whoami") if p not in killed), None
                ),
                f"a fresh partition after death {death}",
                process=worker,
            )
            assert client.dispatch("whoami", 0, timeout=WAIT_S) == pid
        assert worker.proc.poll() is None
        assert worker.output().count("killed by SIGKILL; restarting in 0.5s") == 3


@pytest.mark.timeout(120)
def test_torch_threads_sets_each_partitions_threads(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker of one partition told to run 3 torch threads (by default the cores
    # divided among the partitions: 2 on the development machine, one per core)
    default = max(1, (os.cpu_count() or 1) // 1)
    assert default != 3, "pick another value on a machine of 3 cores"
    worker = spawn(
        "tests.support.torch_threads_app:threads",
        "--redis-url", redis_url,
        "--prefix", prefix,
        "--partitions", "1",
        "--torch-threads", "3",
        env=child_env(),
    )  # fmt: skip
    # Then its batches run with 3
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("threads", "x", timeout=WAIT_S) == 3
    worker.proc.send_signal(signal.SIGTERM)
