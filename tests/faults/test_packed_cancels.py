"""A cancel withdraws its own request whatever else shares its entry (issue 38, finding 3).

Requests of one enqueue to one stream travel as one pack entry (enqueue.lua); a client that
serves many callers (the gateway's) packs different callers' requests together. Before, a
request in a pack could not be withdrawn: cancel.lua returned 0 for a pack and the worker's
ledger ignored cancels of packs, so a closed stream's generation ran to its end (200 SSE
streams closed after 3 s left 199 generations running). Now the cancel names the request:
a running step or generator request stops at its next step, while its pack-mates run on; and
what names another caller's request in a pack (a forged job record, another client's inbox)
withdraws nothing. tests/faults/test_packs.py has the queued pack's withdrawal.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import redis

import queueserve as qs
from queueserve.wire import job_record as J
from queueserve.wire.codec import get_codec
from queueserve.wire.event import parse_events
from queueserve.wire.keys import Keys, events_channel, inbox_key
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox
from tests.support.helpers import stream_key, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]
LONG = 10**6  # steps: a request that runs until it is cancelled
AHEAD = 100  # steps its pack-mate makes after a cancelled request stopped


class Stepper(qs.StepServing):
    """A step serving: an item ``{"tag": T, "n": N}`` makes N steps, counted in ``steps``."""

    name = "stepper"
    max_slots = 4
    max_batch_tokens = 10**9
    max_prefill_tokens = 10**9

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps: dict[str, int] = defaultdict(int)  # shared with the worker's copy

    def tokens(self, item: Any) -> tuple[int, int]:
        return 0, int(item["n"])

    def prefill(self, items: list[Any]) -> list[dict[str, Any]]:
        return [{"tag": item["tag"], "left": int(item["n"])} for item in items]

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        time.sleep(0.002)  # (a step is not free: the test's threads get the GIL too)
        out: list[Any] = []
        for s in states:
            if s["left"] <= 0:
                out.append(qs.END)
                continue
            self.steps[s["tag"]] += 1
            s["left"] -= 1
            out.append(s["tag"])
        return out


def request(rid: int, item: Any, inbox: str, events: str = "") -> tuple[Any, ...]:
    """enqueue.lua's arguments for a request of one item answered to ``inbox``."""
    fields = [1, rid, 1, inbox, 0, "msgpack", *([events] if events else [])]
    return ("default", 1, msgpack.packb(fields), msgpack.packb([item]), 0)


def one_pack(broker: RedisBroker, keys: Keys, requests: list[tuple[Any, ...]]) -> bytes:
    """Enqueue ``requests`` at once, and the entry id they share (a pack: checked)."""
    _, _, ids = broker.enqueue(keys, requests, 0)
    assert len(set(ids)) == 1 and ids[0], ids
    return bytes(ids[0])


def test_a_running_packs_step_request_stops_at_its_next_step_and_its_pack_mate_runs_on(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given two callers' requests of a step serving in one pack, sent by one client (as the
    # gateway's client sends its HTTP callers'), both generating
    serving = Stepper()
    start_worker(serving)
    keys, stream = Keys(prefix, "stepper"), stream_key(prefix, "stepper")
    inbox = RawInbox(redis_client, prefix)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        a, b = {"tag": "a", "n": LONG}, {"tag": "b", "n": LONG}
        entry = one_pack(broker, keys, [request(1, a, inbox.key), request(2, b, inbox.key)])
        wait_until(lambda: serving.steps["a"] > 2 and serving.steps["b"] > 2, "both to step")

        # When b's caller cancels (a worker holds it: it may have run, the cancel says)
        assert broker.cancel(keys, stream, entry, 1, 2, inbox.key) is False

        # Then b makes no more steps while a goes on
        wait_until(
            lambda: serving.steps["a"] - serving.steps["b"] >= AHEAD,
            "the cancelled request to stop while its pack-mate steps on",
        )
        stopped = serving.steps["b"]
        wait_until(lambda: serving.steps["a"] - stopped >= 2 * AHEAD, "a to step on")
        assert serving.steps["b"] == stopped
        # and b is answered nothing; the pack stays until a, its last request, ends
        inbox.drain()
        assert inbox.slices == {}
        assert redis_client.xlen(stream) == 1

        # When a's caller cancels too, Then the pack is acked and its items released
        assert broker.cancel(keys, stream, entry, 1, 1, inbox.key) is False
        wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
        assert int(redis_client.get(keys.queued) or 0) == 0
        inbox.drain()
        assert inbox.slices == {}


def test_a_running_packs_generator_request_gets_no_step_after_its_cancel(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a generator serving whose batch steps until the test ends it, and two callers'
    # streamed requests in one pack (one client's), both in its running batch
    done = threading.Event()

    def endless(batch: qs.Batch) -> Iterator[list[Any]]:
        while not done.is_set():
            time.sleep(0.002)
            yield list(batch)

    serving = qs.Serving(endless, name="endless", batch_size=4, batch_timeout=0.05)
    start_worker(serving)
    keys, stream = Keys(prefix, "endless"), stream_key(prefix, "endless")
    inbox, channel = RawInbox(redis_client, prefix), events_channel(prefix, "raw")
    steps: dict[int, int] = defaultdict(int)  # request id -> its steps published
    tap = redis_client.pubsub()
    tap.subscribe(channel)

    def listened() -> dict[int, int]:
        for _ in range(100):  # (at most: the generator publishes faster than this reads)
            message = tap.get_message(timeout=0.01)
            if message is None:
                break
            if message["type"] == "message":
                for event in parse_events(message["data"], {get_codec("msgpack").tag}):
                    steps[event[0]] += 1
        return steps

    try:
        with contextlib.closing(RedisBroker(redis_url)) as broker:
            entry = one_pack(
                broker,
                keys,
                [request(1, "a", inbox.key, channel), request(2, "b", inbox.key, channel)],
            )
            wait_until(lambda: listened()[1] > 2 and steps[2] > 2, "both to step")

            # When b's caller cancels
            assert broker.cancel(keys, stream, entry, 1, 2, inbox.key) is False

            # Then no step of b is published after a few more of a's
            wait_until(lambda: listened()[1] - steps[2] >= AHEAD, "b's steps to stop")
            stopped = steps[2]
            wait_until(lambda: listened()[1] - stopped >= 2 * AHEAD, "a to step on")
            assert steps[2] == stopped
            # and once the batch ends, a is answered, b is not, and the pack is acked
            done.set()
            wait_until(lambda: inbox.answered([1]), "a's answer")
            wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
            inbox.drain()
            assert sorted(inbox.slices) == [1]
            assert int(redis_client.get(keys.queued) or 0) == 0
    finally:
        done.set()
        tap.close()


def test_a_cancel_naming_another_callers_packed_request_withdraws_nothing(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a victim's three requests in one pack, queued (no worker yet)
    keys, stream = Keys(prefix, "victims"), stream_key(prefix, "victims")
    withdrawn = f"{prefix}:{{victims}}:withdrawn"
    redis_client.hset(keys.meta, "pack_items", 8)
    victim = RawInbox(redis_client, prefix, "victim")
    cancels = redis_client.pubsub()
    cancels.subscribe(keys.cancel)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        entry = one_pack(
            broker,
            keys,
            [request(rid, x, victim.key) for rid, x in ((7, "x"), (8, "y"), (9, "z"))],
        )

        # When others name its request 7: another client's inbox, an id it does not hold, a
        # forged count, an inbox that only starts as its does
        def forged() -> list[bool]:
            return [
                broker.cancel(keys, stream, entry, n, rid, inbox)
                for rid, n, inbox in (
                    (7, 1, inbox_key(prefix, "attacker")),
                    (10, 1, victim.key),
                    (7, 67_108_864, victim.key),
                    (7, 1, f"{victim.key}x"),
                )
            ]

        assert forged() == [False] * 4
        # Then nothing is recorded against it, and its own client's cancel of 9 withdraws 9
        assert not redis_client.exists(withdrawn)
        assert broker.cancel(keys, stream, entry, 1, 9, victim.key) is True
        assert redis_client.hvals(withdrawn) == [b"9"]
        # When a worker holds the pack, the same names announce nothing to the workers, and
        # its own client's cancel of 8 names 8 alone
        serving = Recording(name="victims", batch_size=8, batch_timeout=0, gated=True)
        start_worker(serving)
        wait_until(lambda: serving.batches, "the pack's batch to start")
        assert forged() == [False] * 4
        assert broker.cancel(keys, stream, entry, 1, 8, victim.key) is False
        serving.release()
        # and what was not withdrawn before it ran (a batch that runs is not stopped) runs
        # and is answered
        wait_until(lambda: victim.answered([7, 8]), "the victim's answers")
        wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
        assert sorted(serving.items_run) == ["x", "y"]
        assert 9 not in victim.slices
    published = []
    while (message := cancels.get_message(timeout=0.05)) is not None:
        if message["type"] == "message":
            published.append(message["data"])
    cancels.close()
    assert published == [f"{stream}\n{entry.decode()}/8".encode()]


def test_a_forged_job_record_naming_a_victims_packed_request_cancels_nothing(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a victim's pack, and one of an attacker's client (raw requests answered to its
    # inbox), both queued (no worker yet)
    keys, stream = Keys(prefix, "victims"), stream_key(prefix, "victims")
    redis_client.hset(keys.meta, "pack_items", 8)
    victim = RawInbox(redis_client, prefix, "victim")
    with (
        contextlib.closing(RedisBroker(redis_url)) as broker,
        qs.Client(redis_url, prefix=prefix) as attacker,
    ):
        own = RawInbox(redis_client, prefix, attacker.client_id)
        theirs = one_pack(broker, keys, [request(7, "x", victim.key), request(8, "y", victim.key)])
        mine = one_pack(broker, keys, [request(7, "a", own.key), request(8, "b", own.key)])

        # When the attacker writes job records of its client that name request 7 of the
        # victim's pack and request 8 of its own, and cancels both jobs
        def record(rid: int, entry: bytes) -> str:
            job = f"{attacker.client_id}-{rid}"
            group, field = J.job_place(prefix, job)
            where = f"1:60000:victims:{entry.decode()}:{stream}"
            redis_client.hset(group, mapping={field: where, "live": 1})
            return job

        assert attacker.job(record(7, theirs)).cancel() is True  # (its own record ends)
        assert attacker.job(record(8, mine)).cancel() is True
        # Then only its own request is withdrawn
        assert redis_client.hgetall(f"{prefix}:{{victims}}:withdrawn") == {
            f"{stream}\n{mine.decode()}".encode(): b"8"
        }
        # and once a worker comes, both of the victim's requests run, and the attacker's 7
        serving = Recording(name="victims", batch_size=8, batch_timeout=0)
        start_worker(serving)
        wait_until(lambda: victim.answered([7, 8]) and own.answered([7]), "the answers")
        wait_until(lambda: redis_client.xlen(stream) == 0, "both packs acked")
        assert sorted(serving.items_run) == ["a", "x", "y"]
