"""`queueserve worker` as operators run it: real processes, real signals, real Redis.

Workers are started in their own session (process group), so teardown can kill whatever a test
left behind, partition processes included. Nothing here waits on a sleep: every wait is for a
condition (a Redis key, a heartbeat, a process exit) with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import GROUP, Keys
from tests.support.helpers import REPO, child_env, wait_until
from tests.support.redis_server import free_port

PYTHON = sys.executable
CONSOLE_SCRIPT = Path(sys.executable).parent / "queueserve"
EXIT_TIMEOUT_S = 30.0
QUICK_TIMEOUT_S = 60.0


def poll_until(condition: Callable[[], object], limit: float) -> bool:
    """Poll for an event that may legitimately never happen; False when ``limit`` passed."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: signal.Signals) -> None:
        """What systemd (KillMode=control-group) or `kill -TERM -PGID` does."""
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within {timeout:g}s; its output:\n{self.output()}")


Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start `python -m queueserve worker ...`; every process it started is killed afterwards."""
    started: list[WorkerProcess] = []
    logs: list[Any] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        log = tmp_path / f"worker-{len(started)}.log"
        out = log.open("wb")
        logs.append(out)
        proc = subprocess.Popen(
            [PYTHON, "-m", "queueserve", "worker", *args],
            cwd=REPO,
            env=env or child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        worker = WorkerProcess(proc, log)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        # The worker and any partition process it left: its session's process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
    for out in logs:
        out.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., qs.Client]]:
    made: list[qs.Client] = []

    def make(url: str, prefix: str) -> qs.Client:
        client = qs.Client(url, prefix=prefix)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def run_cli(
    *args: str,
    program: tuple[str, ...] = (PYTHON, "-m", "queueserve"),
    timeout: float = QUICK_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*program, *args],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_many(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run CLI commands concurrently (each imports the library, which takes a moment)."""
    procs = [
        subprocess.Popen(
            [PYTHON, "-m", "queueserve", *cmd],
            cwd=REPO,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd in commands
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=QUICK_TIMEOUT_S)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def worker_alive(client: redis.Redis, prefix: str, serving: str) -> Callable[[], bool]:
    key = Keys(prefix, serving).workers
    return lambda: client.zcard(key) > 0


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


# -- serving and stopping ----------------------------------------------------------------------
def test_worker_serves_until_sigterm(
    spawn: Spawn,
    clients: Callable[..., qs.Client],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker started from the command line
    worker = spawn(
        "tests.support.cli_app:square",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--batch-timeout",
        "0",
    )
    wait_until(
        worker_alive(redis_client, prefix, "square"), "the worker's heartbeat", process=worker
    )

    # When a client dispatches, the worker answers
    client = clients(redis_url, prefix)
    assert client.dispatch("square", 3, timeout=10) == 9
    assert client.dispatch_many("square", [1, 2, 4], timeout=10) == [1, 4, 16]

    # and --check sees it (and names only the serving nobody serves)
    check = run_cli(
        "worker",
        "tests.support.cli_app:square",
        "--check",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
    )
    assert check.returncode == 0, check.stderr
    assert "ok" in check.stdout
    partial = run_cli(
        "worker",
        "tests.support.cli_app:square",
        "tests.support.cli_app:cube",
        "--check",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
    )
    assert partial.returncode == 1
    assert "cube" in partial.stderr
    assert "square" not in partial.stderr

    # When it gets SIGTERM, it exits 0 and leaves the worker registry
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
    assert "SIGTERM" in worker.output()
    after = run_cli(
        "worker",
        "tests.support.cli_app:square",
        "--check",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
    )
    assert after.returncode == 1
    assert "no live worker for: square" in after.stderr


def test_worker_from_environment_serves_several_specs_and_stops_on_sigint(
    spawn: Spawn,
    clients: Callable[..., qs.Client],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker configured by QUEUESERVE_* variables, serving a list and a subclass
    worker = spawn(
        "tests.support.cli_app:both",
        "tests.support.cli_app:Doubler",
        "--batch-timeout",
        "1ms",
        env=child_env(QUEUESERVE_REDIS_URL=redis_url, QUEUESERVE_PREFIX=prefix),
    )
    for name in ("square", "cube", "doubler"):
        wait_until(
            worker_alive(redis_client, prefix, name), f"a heartbeat for {name}", process=worker
        )
    client = clients(redis_url, prefix)
    assert client.dispatch("square", 5, timeout=10) == 25
    assert client.dispatch("cube", 2, timeout=10) == 8
    assert client.dispatch_many("doubler", list(range(6)), timeout=10) == [0, 2, 4, 6, 8, 10]

    # When it gets SIGINT (Ctrl-C), it stops just as gracefully
    worker.signal(signal.SIGINT)
    assert worker.wait() == 0, worker.output()


def test_check_without_a_worker_exits_1(redis_url: str, prefix: str) -> None:
    result = run_cli(
        "worker",
        "tests.support.cli_app:cube",
        "--check",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
    )
    assert result.returncode == 1
    assert "no live worker for: cube" in result.stderr
    assert result.stdout == ""


def test_check_with_redis_unreachable_exits_1() -> None:
    url = dead_url()
    result = run_cli("worker", "tests.support.cli_app:square", "--check", "--redis-url", url)
    assert result.returncode == 1
    assert "unavailable" in result.stderr.lower()
    assert "Traceback" not in result.stderr


# -- SIGTERM while a batch runs ----------------------------------------------------------------
def _start_gated(
    spawn: Spawn,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
    clients: Callable[..., qs.Client],
) -> tuple[WorkerProcess, qs.Ticket]:
    worker = spawn(
        "tests.support.cli_app:Gated",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--batch-timeout",
        "0",
        env=child_env(CLI_APP_REDIS_URL=redis_url, CLI_APP_PREFIX=prefix),
    )
    wait_until(
        worker_alive(redis_client, prefix, "gated"), "the worker's heartbeat", process=worker
    )
    ticket = clients(redis_url, prefix).submit("gated", [20, 21], timeout=60)
    wait_until(lambda: redis_client.get(f"{prefix}:started"), "the batch to start", process=worker)
    return worker, ticket


def _pending(redis_client: redis.Redis, prefix: str) -> tuple[int, int]:
    """(stream length, pending entries) of the gated serving's default stream."""
    stream = Keys(prefix, "gated").stream("default")
    return redis_client.xlen(stream), redis_client.xpending(stream, GROUP)["pending"]


def test_sigterm_during_a_batch_finishes_and_answers_it(
    spawn: Spawn,
    clients: Callable[..., qs.Client],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a batch that is executing
    worker, ticket = _start_gated(spawn, redis_url, prefix, redis_client, clients)
    assert not ticket.done()

    # When the worker gets SIGTERM, and only once its partition is draining is the batch let go
    worker.signal(signal.SIGTERM)
    wait_until(
        lambda: redis_client.llen(f"{prefix}:signals"),
        "the partition to get SIGTERM",
        process=worker,
    )
    redis_client.rpush(f"{prefix}:go", 1)

    # Then the caller still gets its results, the entry is acked, and the exit code is 0
    assert ticket.result(timeout=30) == [40, 42]
    assert worker.wait() == 0, worker.output()
    assert _pending(redis_client, prefix) == (0, 0)
    assert redis_client.llen(f"{prefix}:signals") == 1


def test_second_sigterm_exits_at_once_with_3_and_leaves_work_pending(
    spawn: Spawn,
    clients: Callable[..., qs.Client],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a batch that is executing and a worker already draining
    worker, ticket = _start_gated(spawn, redis_url, prefix, redis_client, clients)
    worker.signal(signal.SIGTERM)
    wait_until(
        lambda: redis_client.llen(f"{prefix}:signals"),
        "the partition to get SIGTERM",
        process=worker,
    )

    # When a second SIGTERM comes, it exits at once with code 3, batch unfinished
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 3, worker.output()

    # Then the request is neither answered nor lost: it stays pending for another worker
    assert not ticket.done()
    assert _pending(redis_client, prefix) == (1, 1)


def test_sigterm_to_the_process_group_still_drains(
    spawn: Spawn,
    clients: Callable[..., qs.Client],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a batch that is executing
    worker, ticket = _start_gated(spawn, redis_url, prefix, redis_client, clients)
    signals = f"{prefix}:signals"

    # When the service manager sends SIGTERM to every process of the worker at once
    worker.signal_group(signal.SIGTERM)
    wait_until(lambda: redis_client.llen(signals), "the partition to get SIGTERM", process=worker)
    wait_until(
        lambda: worker.proc.poll() is not None or "SIGTERM" in worker.output(),
        "the supervisor to get SIGTERM",
    )
    # The supervisor may forward the signal to the partition too; let that happen before the
    # batch is let go (a fixed worker may also never send it: then this waits out its limit).
    poll_until(lambda: redis_client.llen(signals) >= 2, limit=5.0)
    redis_client.rpush(f"{prefix}:go", 1)

    # Then the held batch is still finished, answered and acked, like after a single SIGTERM
    assert worker.wait() == 0, worker.output()
    assert _pending(redis_client, prefix) == (0, 0), redis_client.lrange(signals, 0, -1)
    assert ticket.result(timeout=10) == [40, 42]


# -- usage errors ------------------------------------------------------------------------------
def test_specs_that_do_not_name_servings_exit_2() -> None:
    url = dead_url()  # a spec that loaded would fail on Redis with 1, not 2
    serve = [  # as `worker` runs them
        ("nosuchmodule:x", "cannot import module 'nosuchmodule'"),
        ("tests.support.cli_app:not_a_serving", "not_a_serving is int, not a qs.Serving"),
    ]
    check = [  # the same loader, through --check, which starts faster
        ("nosuchmodule:x", "cannot import module 'nosuchmodule'"),
        ("tests.support.no_such_module:x", "tests.support.no_such_module"),
        ("tests.support.cli_app:not_a_serving", "not_a_serving is int, not a qs.Serving"),
        ("tests.support.cli_app:no_such_attr", "no attribute 'no_such_attr'"),
        ("tests.support.cli_app", "not module:attr"),
        (":square", "not module:attr"),
        ("tests.support.cli_app:", "not module:attr"),
        ("tests.support.cli_app:empty_list", "not a qs.Serving"),
        ("tests.support.cli_app:mixed_list", "not a qs.Serving"),
    ]
    commands = [["worker", spec, "--redis-url", url] for spec, _ in serve]
    commands += [
        ["worker", "tests.support.cli_app:square", spec, "--check", "--redis-url", url]
        for spec, _ in check
    ]
    results = run_many(commands)
    for (spec, message), (code, out, err) in zip([*serve, *check], results, strict=True):
        assert code == 2, f"{spec}: exit {code}\n{out}{err}"
        assert message in err, f"{spec}: {err}"
        assert "Traceback" not in err, f"{spec}: {err}"


def test_argument_errors_are_usage_errors() -> None:
    cases = [
        (["worker", "tests.support.cli_app:square", "--batch-size", "0"], "--batch-size"),
        (["worker", "tests.support.cli_app:square", "--batch-size", "-3"], "--batch-size"),
        (["worker", "tests.support.cli_app:square", "--batch-size", "1.5"], "--batch-size"),
        (["worker", "tests.support.cli_app:square", "--batch-timeout", "abc"], "--batch-timeout"),
        (["worker", "tests.support.cli_app:square", "--batch-timeout", "-1s"], "--batch-timeout"),
        (
            ["worker", "tests.support.cli_app:square", "--max-concurrent-batches", "0"],
            "--max-concurrent-batches",
        ),
        (["worker", "tests.support.cli_app:square", "--no-such-flag"], "unrecognized arguments"),
        (["worker"], "module:attr"),
        ([], "usage:"),
        (["frobnicate"], "invalid choice"),
    ]
    results = run_many([args for args, _ in cases])
    for (args, message), (code, _out, err) in zip(cases, results, strict=True):
        assert code == 2, f"{args}: exit {code}\n{err}"
        assert "usage:" in err, f"{args}: {err}"
        assert message in err, f"{args}: {err}"


def test_console_script_is_installed_and_helps() -> None:
    assert CONSOLE_SCRIPT.exists(), f"{CONSOLE_SCRIPT} is missing: reinstall the package"
    top = run_cli("--help", program=(str(CONSOLE_SCRIPT),))
    assert top.returncode == 0, top.stderr
    assert "worker" in top.stdout
    sub = run_cli("worker", "--help", program=(str(CONSOLE_SCRIPT),))
    assert sub.returncode == 0, sub.stderr
    for flag in (
        "--redis-url",
        "--prefix",
        "--batch-size",
        "--batch-timeout",
        "--check",
        "--shutdown-timeout",
        "module:attr",
    ):
        assert flag in sub.stdout, flag


def test_python_dash_m_matches_the_console_script() -> None:
    assert run_cli("--help").stdout == run_cli("--help", program=(str(CONSOLE_SCRIPT),)).stdout
