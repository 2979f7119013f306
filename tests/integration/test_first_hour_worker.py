"""A new user's first hour with the worker (issue 36), each surprise they met as a test:

1. the operator's own `config set batch_size` draws no warning, and `config get` is current;

Workers and the CLI run as real processes against the session's Redis; every wait is for a
condition (a log line, a heartbeat, an exit) with a deadline, never a sleep.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest
import redis

import queueserve as qs
from queueserve.wire.protocol import Keys
from tests.integration.test_cli import Spawn, WorkerProcess, run_cli, spawn  # noqa: F401
from tests.support.helpers import wait_until

APP = "tests.support.first_hour_worker_app"
STRANGER = "not what this worker declared"


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[qs.Client]:
    with qs.Client(redis_url, prefix=prefix) as c:
        yield c


def worker(start: Spawn, redis_url: str, prefix: str, spec: str, *flags: str) -> WorkerProcess:
    return start(spec, "--redis-url", redis_url, "--prefix", prefix, "--partitions", "1", *flags)


def cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--redis-url", redis_url, "--prefix", prefix)


def lines_with(text: str, output: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


# -- 1. `config set batch_size` is the operator's own change, not a stranger's ------------------
def test_config_set_batch_size_draws_no_stranger_warning_and_config_get_shows_pack_items(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker serving square (batch_size 10, so pack_items 10)
    meta = Keys(prefix, "square").meta
    running = worker(spawn, redis_url, prefix, f"{APP}:square")
    wait_until(
        lambda: redis_client.zcard(Keys(prefix, "square").workers) > 0,
        "the worker's heartbeat",
        process=running,
    )

    # When the operator changes batch_size with the CLI
    done = cli(redis_url, prefix, "config", "set", "square", "batch_size=7")
    assert done.returncode == 0, done.stderr
    wait_until(
        lambda: lines_with("batch_size changed from 10 to 7", running.output()),
        "the worker to apply the change",
        process=running,
    )
    # and then a stranger writes a field of the declaration: once the worker says so, its
    # declaration passes since the change have all run
    redis_client.hset(meta, "max_queue", "16")
    wait_until(
        lambda: lines_with(f"held max_queue='16', {STRANGER}", running.output()),
        "the worker to write back the stranger's field",
        process=running,
    )

    # Then the only field the worker wrote back is the stranger's: not pack_items
    out = running.output()
    assert lines_with(STRANGER, out) == lines_with("max_queue='16'", out), out
    shown = cli(redis_url, prefix, "config", "get", "square")
    assert "batch_size = 7  (set at run time)" in shown.stdout
    assert "pack_items = 7\n" in shown.stdout, shown.stdout

    # When no worker runs (nothing writes the declaration back), a change shows at once
    running.signal(signal.SIGTERM)
    assert running.wait() == 0, running.output()
    changed = cli(redis_url, prefix, "config", "set", "square", "batch_size=5")
    assert changed.returncode == 0, changed.stderr
    assert "pack_items = 5\n" in changed.stdout, changed.stdout
    assert "pack_items = 5\n" in cli(redis_url, prefix, "config", "get", "square").stdout
    # and a pack_items withdrawn by the operator (docs/operations.md, "Upgrading workers")
    # stays withdrawn
    redis_client.hdel(meta, "pack_items")
    assert cli(redis_url, prefix, "config", "set", "square", "batch_size=4").returncode == 0
    assert not redis_client.hexists(meta, "pack_items")
    assert redis_client.hget(meta, "batch_size") == b"4"
