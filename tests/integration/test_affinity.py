"""Reads that follow what is loaded, through a real worker (worker/pipeline/affinity.py): a
partition says in its heartbeat record which keys' states it holds, learns which keys its
serving's other partitions hold, and reads with those marks; a cold key is still served
within the fairness bound under a flood of a key it holds."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

import queueserve as qs
from queueserve.wire.keys import Keys, worker_key
from queueserve.worker.pipeline.batching import Assembler
from tests.support.helpers import WAIT_S, wait_until
from tests.support.key_app import Keyed

StartWorker = Callable[..., qs.Worker]


def marks_of(worker: qs.Worker) -> list[str]:
    host = worker._host
    assert host is not None
    assembler = host.runners[0].assembler
    assert isinstance(assembler, Assembler)
    return list(assembler.affinity_marks)


def test_a_partition_says_which_keys_it_holds_and_reads_with_what_others_hold(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker of a serving whose loads take 20 ms
    serving = Keyed(batch_size=4, load_s=0.02)
    worker = start_worker(serving)
    keys = Keys(prefix, "keyed")
    # And another partition of it (a record of its own, alive) that holds z and a
    redis_client.hset(worker_key(prefix, "other-p0"), "held:keyed", "z\na")
    redis_client.zadd(keys.workers, {"other-p0": 2**52})
    # (and one whose last heartbeat is 10 s old: dead, it holds nothing)
    seconds, _ = redis_client.time()
    redis_client.hset(worker_key(prefix, "dead-p0"), "held:keyed", "q")
    redis_client.zadd(keys.workers, {"dead-p0": (seconds - 10) * 1000})
    # When the worker loads a and b
    for key in ("a", "b"):
        assert client.dispatch("keyed", "x", batch_key=key, timeout=WAIT_S) == f"{key}:x"
    # Then its record says it holds them, one per line
    consumer = wait_until(
        lambda: next((c.decode() for c in redis_client.zrange(keys.workers, 0, -1)
                      if c not in (b"other-p0", b"dead-p0")), None),
        "the worker's heartbeat",
    )  # fmt: skip
    wait_until(
        lambda: (
            set((redis_client.hget(worker_key(prefix, consumer), "held:keyed") or b"").split())
            == {b"a", b"b"}
        ),
        "held keys in the heartbeat record",
    )
    # And it reads with its keys first ('@'), z (held by the other alone) two leans later
    # ('^'), the lean being its loads' time per item of a batch (80 ms and more)
    wait_until(lambda: "^z" in marks_of(worker), "the other partition's keys learnt")
    marks = marks_of(worker)
    lean = int(marks[0][1:])
    assert marks[0].startswith("!") and 80 <= lean <= 500, marks
    # (and '*' last: idle, it may load a key)
    assert sorted(marks[1:-1]) == ["@a", "@b", "^z"] and marks[-1] == "*", marks  # no '^a', q


def test_a_cold_key_is_served_within_the_fairness_bound_under_a_flood_of_a_held_key(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a worker holding hot, flooded with 60 batches of it (each 20 ms of device time)
    serving = Keyed(batch_size=4, load_s=0.05, work_s=0.02, max_loaded_keys=1)
    start_worker(serving)
    flood = [client.submit("keyed", [f"h{i}"] * 4, batch_key="hot") for i in range(60)]
    wait_until(lambda: len(serving.order) >= 5, "the flood running")
    # When a cold key's request comes (its state loaded by none)
    before = len(serving.order)
    assert client.dispatch("keyed", "c", batch_key="cold", timeout=WAIT_S) == "cold:c"
    # Then it ran within a few batches of hot (those read and prepared ahead of it), long
    # before the flood ended
    ran_before = serving.order.index("cold") - before
    assert ran_before <= 3, serving.order
    for ticket in flood:
        ticket.result(WAIT_S)
    assert serving.order.count("hot") == 60


def test_a_key_nobody_holds_gathers_its_items_for_a_lean_then_loads_once(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a worker with room for one state, flooded with batches of hot (20 ms each), after
    # a request of cold (so cold is no quiet key: its next requests get no lead), its loads
    # 50 ms (a lean of 200 ms: 50 ms for each item of a batch of 4)
    serving = Keyed(batch_size=4, load_s=0.05, work_s=0.02, max_loaded_keys=1)
    start_worker(serving)
    assert client.dispatch("keyed", "c0", batch_key="cold", timeout=WAIT_S) == "cold:c0"
    flood = [client.submit("keyed", [f"h{i}"] * 4, batch_key="hot") for i in range(60)]
    wait_until(lambda: serving.order.count("hot") >= 3, "the flood running, hot loaded")
    # When cold's next four requests come 30 ms apart (within its lean)
    colds = []
    for i in range(4):
        colds.append(client.submit("keyed", [f"c{i + 1}"], batch_key="cold"))
        time.sleep(0.03)  # (the arrivals' spacing, not a wait for a condition)
    # Then they waited in Redis and ran in one batch, cold loaded once more, before the
    # flood ended (a load per request, were cold read as soon as it came)
    assert [t.result(WAIT_S) for t in colds] == [[f"cold:c{i + 1}"] for i in range(4)]
    assert serving.order.count("cold") == 2 and serving.loads.count("cold") == 2, serving.order
    for ticket in flood:
        ticket.result(WAIT_S)
    assert serving.order.index("cold", 1) < len(serving.order) - 10, serving.order
