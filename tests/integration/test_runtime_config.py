"""Options changed at run time reach running workers without restart (docs/design.md §3.7), and the
operator commands `queueserve config` and `queueserve stats` work against a real Redis."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.options.stored import parse_assignments
from tests.support.helpers import REPO, child_env, wait_until


class Sizes(qs.Serving):
    """Records batch sizes; the first batch waits until the test releases it."""

    name = "sizes"
    batch_size = 4
    batch_timeout = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.gate = threading.Event()

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.gate.wait(30)
        self.sizes.append(len(batch))
        return list(batch)


def _cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queueserve", *args, "--redis-url", redis_url, "--prefix", prefix],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_set_changes_batch_size_of_a_running_worker(
    redis_url: str, prefix: str, client: qs.Client, redis_client: redis.Redis
) -> None:
    serving = Sizes()
    with qs.Worker(serving, redis_url=redis_url, prefix=prefix, handle_signals=False):
        serving.gate.set()
        assert client.dispatch_many("sizes", list(range(8))) == list(range(8))
        assert max(serving.sizes) == 4

        # When an operator raises batch_size cluster-wide
        done = _cli(redis_url, prefix, "config", "set", "sizes", "batch_size=16")
        assert done.returncode == 0, done.stderr
        assert "batch_size = 16  (set at run time)" in done.stdout
        # Then the running worker picks it up (it logs and applies within a second)
        serving.gate.clear()
        deadline = time.monotonic() + 30
        while True:
            serving.sizes.clear()
            ticket = client.submit("sizes", list(range(16)))
            serving.gate.set()
            assert ticket.result(timeout=30) == list(range(16))
            serving.gate.clear()
            if max(serving.sizes) == 16:
                break
            assert time.monotonic() < deadline, f"batch_size never changed: {serving.sizes}"
        serving.gate.set()
        # and clients now pack up to the new batch size (docs/guarantees.md, Packs)
        meta = f"{prefix}:{{sizes}}:meta"
        wait_until(lambda: redis_client.hget(meta, "pack_items") == b"16", "pack_items = 16")
    # and the caller's Serving object was not modified
    assert serving.batch_size == 4


def test_config_set_rejects_unknown_and_invalid_options(redis_url: str, prefix: str) -> None:
    for bad, message in (
        ("colour=blue", "cannot be changed at run time"),
        ("batch_size=0", "batch_size must be an int from 1 to"),
        ("batch_timeout=10000000000", "batch_timeout must be a duration from 0 to 3600s"),
        ("batch_size=abc", "batch_size must be an integer"),
        ("batch_timeout=-1", "is not a duration"),
        ("batch_size", "is not option=value"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_assignments([bad])
        done = _cli(redis_url, prefix, "config", "set", "sizes", bad)
        assert done.returncode != 0 and message in done.stderr, (bad, done.stderr)


def test_config_set_max_queue_applies_to_clients_at_once(
    redis_url: str, prefix: str, client: qs.Client, redis_client: redis.Redis
) -> None:
    # --force: no worker has declared "sizes" yet (an unknown serving is otherwise refused)
    done = _cli(redis_url, prefix, "config", "set", "sizes", "max_queue=3", "--force")
    assert done.returncode == 0, done.stderr
    with pytest.raises(qs.QueueFull, match="max_queue=3"):
        client.dispatch_many("sizes", list(range(5)), timeout=5)


def test_stats_shows_queues_workers_and_dead_letters(
    redis_url: str, prefix: str, client: qs.Client, redis_client: redis.Redis
) -> None:
    serving = Sizes()
    serving.gate.set()
    with qs.Worker(serving, redis_url=redis_url, prefix=prefix, handle_signals=False):
        assert client.dispatch_many("sizes", [1, 2, 3]) == [1, 2, 3]
        done = _cli(redis_url, prefix, "stats", "--interval", "10ms")
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[:2]
    assert header.split() == [
        "serving",
        "key",
        "items",
        "waiting",
        "pending",
        "oldest",
        "seen",
        "req/s",
        "workers",
        "dead",
    ]
    # nothing queued, so no oldest item; the key saw a request a moment ago
    assert row.split()[:6] == ["sizes", "default", "0", "0", "0", "-"]
    assert row.split()[6].endswith(("ms", "s"))
    assert row.split()[8:] == ["1", "0"]
