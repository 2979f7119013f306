"""A sharded serving's readers share the partition's look-ahead (docs/scaling.md, "Shards"):
a reader that blocks on its drained shard's wake stream must leave room for the others."""

from __future__ import annotations

from typing import Any

import pytest

import queueserve as qs
from queueserve.broker.reads import ReadOutcome, WakeRead
from queueserve.broker.retry import Outage
from queueserve.serving import Partition
from queueserve.worker.pipeline.runner import ServingRunner


def noop(xs: list[Any]) -> list[Any]:
    return xs


class ShardsBroker:
    """Just the reads of a broker: nothing is ready on any shard. While a read blocks (on
    the wake stream), it notes how much room the other shards' readers still have."""

    def __init__(self) -> None:
        self.outage = Outage("test")
        self.runner: ServingRunner | None = None
        self.blocked_with: list[tuple[int, int]] = []  # (its budget, room left to the others)

    def read_ready(
        self, keys: Any, consumer: str, budget: int, per_key: int, full: Any, age_ms: int = 0
    ) -> ReadOutcome:
        return ReadOutcome(b"0-0", 0, False, 0, [])

    def wait_then_read(self, keys: Any, read: WakeRead) -> ReadOutcome:
        assert self.runner is not None
        with self.runner.ledger.cond:
            self.blocked_with.append((read.budget, self.runner.reader.budget()))
        return ReadOutcome(b"0-0", 0, False, 0, [])


def test_a_reader_blocked_on_an_idle_shard_leaves_room_for_the_others() -> None:
    # Given a 3-shard serving whose shards are all idle
    serving = qs.Serving(noop, name="idle", batch_size=64, shards=3)
    broker = ShardsBroker()
    runner = ServingRunner(serving, broker, "qsu", "c1", Partition())  # type: ignore[arg-type]
    broker.runner = runner
    with runner.ledger.cond:
        room = runner.reader.budget()
    # When each shard's reader reads, finds nothing, and then blocks on its wake stream
    for _ in range(2):
        for keys in runner.shards:
            runner.reader._read_once(keys)
    # Then every blocked read reserved a share of the room, and the others kept the rest:
    # reserving it all left the busy shards' readers waiting on the idle ones (3 shards read
    # 15k packed items/s against 150k with 1, bench/cluster.py)
    assert len(broker.blocked_with) == 3
    assert all(
        budget <= room // 3 and left >= room - room // 3 for budget, left in broker.blocked_with
    ), (room, broker.blocked_with)


class RefusingBroker(ShardsBroker):
    """Housekeeping's reads answer nothing to do; the declaration pass is refused (NOPERM)."""

    def sweep(self, keys: Any, ttl_ms: int, declared: Any, start: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def active_streams(self, keys: Any) -> list[str]:
        return []

    def alive_consumers(self, keys: Any, dead_after_s: float) -> set[str]:
        return set()

    def pending_by_stream(self, streams: list[str]) -> dict[str, Any]:
        return {}

    def config(self, keys: Any) -> dict[str, str]:
        return {}

    def run_time_config(self, keys: Any) -> tuple[dict[str, str], dict[str, float]]:
        return {}, {}

    def declarations(self, keys: Any, last: Any) -> Any:
        raise qs.RedisCommandError("NOPERM this user has no permissions to run 'hgetall'")


def test_a_housekeeping_job_redis_refuses_waits_its_period_and_never_blocks_the_reads() -> None:
    # Given a reader whose every housekeeping job is due, and whose declaration pass fails
    runner = ServingRunner(
        qs.Serving(noop, name="refused"),
        RefusingBroker(),
        "qsu",
        "c1",
        Partition(),  # type: ignore[arg-type]
    )
    keys = runner.shards[0]
    due = {"sweep": 0.0, "reclaim": 0.0, "config": 0.0, "forget": 0.0}
    with pytest.raises(qs.RedisCommandError):
        runner.reader._housekeeping(due, keys)

    # When the read loop comes round again (it rides the error out), then the failed pass
    # waits its period like a done one: the loop gets on to its read
    runner.reader._housekeeping(due, keys)
    assert all(when > 0 for when in due.values()), due
