"""Breaks the fuzzer (tests/faults/test_fuzz.py) found, each pinned by a test of its own against
a real worker and Redis (docs/guarantees.md, "Redis inputs")."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import redis

import queueserve as qs
from queueserve.broker.consumer import Consumer
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.timing import DEAD_AFTER_S
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import wait_until

StartWorker = Callable[..., qs.Worker]
WAIT_S = 60.0


def echo(name: str) -> qs.Serving:
    return qs.Serving(lambda xs: list(xs), name=name, batch_size=8, batch_timeout=0)


def test_junk_ready_marks_and_a_stream_of_another_type_do_not_stop_a_servings_reads(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving, and marks in its ready set that enqueue.lua never writes (no priority
    # digit, no stream, a stream name holding a string), ranked before every real one
    serving = echo("rdy")
    start_worker(serving)
    assert client.dispatch(serving, "before", timeout=WAIT_S) == "before"
    keys = Keys(prefix, "rdy")
    redis_client.set(keys.stream("wt", 3), "a string where a stream belongs")
    junk = [b"x", b"", b"0nosuch", b"3wt", b"\xff\xfe"]
    redis_client.zadd(keys.ready, dict.fromkeys(junk, -1e18))

    # When requests come, then they are read and answered (read.lua failed on the first junk
    # mark, for ever: the serving stopped), and the junk marks are gone
    assert [client.dispatch(serving, i, timeout=WAIT_S) for i in range(5)] == list(range(5))
    wait_until(
        lambda: not set(redis_client.zrange(keys.ready, 0, -1)) & set(junk),
        "the junk marks dropped",
    )
    assert redis_client.get(keys.stream("wt", 3)) == b"a string where a stream belongs"


def _held_by_a_dead_consumer(r: redis.Redis, stream: bytes | str, fields: dict[str, Any]) -> None:
    """An entry that consumer "gone" read and never acked (it died), in a stream the worker
    watches for such entries (the active set)."""
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xadd(stream, fields)
    r.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)


def test_names_that_are_not_utf8_in_the_active_and_workers_sets_are_skipped(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker, a request held by a consumer that died, and members of the active and
    # workers sets that are not UTF-8 (names queueserve never writes; anyone may ZADD them)
    worker = start_worker(echo("utf"))
    keys = Keys(prefix, "utf")
    inbox = RawInbox(redis_client, prefix)
    stream = keys.stream("held")
    _held_by_a_dead_consumer(
        redis_client, stream, {"h": header(7, 1, inbox.key), "p": bytes(msgpack.packb(["x"]))}
    )
    junk_stream = keys.stream("held").encode() + b"\xff"
    _held_by_a_dead_consumer(redis_client, junk_stream, {"h": b"junk"})
    now_ms = int(time.time() * 1000)
    redis_client.zadd(keys.workers, {b"\xfe-ghost": now_ms + 10**9})
    redis_client.zadd(keys.active, {stream: now_ms, junk_stream: now_ms})

    # When reclaim looks at them, then the dead consumer's request is reclaimed and answered
    # (the reader thread died decoding the names: nothing was reclaimed any more)
    wait_until(lambda: inbox.answered([7]), "the reclaimed request's answer")
    assert inbox.error_kind(7) is None
    assert worker._host is not None and worker._host.alive()


def test_requests_in_a_stream_whose_name_is_not_utf8_are_dead_lettered_and_the_rest_served(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving, and a request in the stream of a batch key that is not UTF-8 (no
    # client sends one; anyone may XADD it), marked ready as enqueue.lua would mark it
    serving = echo("nonutf")
    worker = start_worker(serving)
    keys = Keys(prefix, "nonutf")
    inbox = RawInbox(redis_client, prefix)
    stream = keys.stream("").encode() + b"\xff\xfe"
    redis_client.xadd(stream, {"h": header(5, 1, inbox.key), "p": bytes(msgpack.packb(["x"]))})
    redis_client.zadd(keys.ready, {b"0\xff\xfe": -1e18})

    # When requests come, then they are answered (the reader thread died decoding the
    # stream's name, for ever: every restart read it again), and the entry is dead-lettered
    assert [client.dispatch(serving, i, timeout=WAIT_S) for i in range(5)] == list(range(5))
    ((_, record),) = wait_until(lambda: redis_client.xrange(keys.dead), "the dead letter")
    assert record[b"stream"] == stream and b"not UTF-8" in record[b"reason"]
    assert redis_client.xlen(stream) == 0
    assert worker._host is not None and worker._host.alive()


def test_a_read_taken_in_slowly_is_not_claimed_back_by_its_own_worker_and_run_twice(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given an idle worker (its executor holds the blocking read), and a request whose intake
    # takes longer than DEAD_AFTER_S: its cost function is slow once (a tokenizer on a long
    # document; under the fuzzer, a starved CPU)
    runs: Counter[Any] = Counter()
    slow_once = threading.Event()

    def cost(item: Any) -> float:
        if item == "slow" and not slow_once.is_set():
            slow_once.set()
            time.sleep(3 * DEAD_AFTER_S)  # the work of the cost function, not a wait
        return 1.0

    def run(items: list[Any]) -> list[Any]:
        runs.update(items)
        return items

    serving = qs.Serving(run, name="slowin", batch_size=4, batch_timeout=0, cost=cost)
    start_worker(serving)
    assert client.dispatch(serving, "warm", timeout=WAIT_S) == "warm"

    # When it is read and answered
    assert client.dispatch(serving, "slow", timeout=WAIT_S) == "slow"

    # Then it ran once: the worker's reclaim did not take it back as "pending without its
    # knowing" while the read that brought it was still being taken in (it ran twice)
    stream = Keys(prefix, "slowin").stream("default")
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")
    assert runs["slow"] == 1, runs


def test_a_request_read_by_a_consumer_named_in_junk_is_reclaimed_and_answered(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker, and a request that a consumer of the group whose name is not UTF-8 read
    # and never acked (anyone may XREADGROUP), in a stream the worker watches
    worker = start_worker(echo("thief"))
    keys = Keys(prefix, "thief")
    inbox = RawInbox(redis_client, prefix)
    stream = keys.stream("held")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    redis_client.xadd(stream, {"h": header(9, 1, inbox.key), "p": bytes(msgpack.packb(["x"]))})
    redis_client.xreadgroup(GROUP, b"\xff\xfe-thief", {stream: ">"}, count=1)
    redis_client.zadd(keys.active, {stream: int(time.time() * 1000)})

    # When reclaim looks at it, then the request is taken from that dead consumer and answered
    # (the reader thread died decoding its name)
    wait_until(lambda: inbox.answered([9]), "the reclaimed request's answer")
    assert inbox.error_kind(9) is None
    assert worker._host is not None and worker._host.alive()


def test_consumers_of_a_missing_stream_or_a_key_of_another_type_are_none(
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given what a junk member of the active set names: no key, a hash, a stream whose group
    # has a consumer named in bytes that are not UTF-8
    keys = Keys(prefix, "gone")
    redis_client.hset(keys.meta, "codec", "msgpack")
    stream = keys.stream("held")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    redis_client.xadd(stream, {"h": b"junk"})
    redis_client.xreadgroup(GROUP, b"\xff-junk", {stream: ">"}, count=1)
    broker = Consumer(redis_url)
    try:
        # Then the worker's forget_dead_consumers finds no consumers where there is no
        # stream (it raised "no such key", WRONGTYPE: the reader's housekeeping failed and
        # retried until a sweep dropped the member), and can name and forget the junk one
        assert broker.consumers(keys.stream("missing")) == []
        assert broker.consumers(keys.meta) == []
        ((name, pending, _),) = broker.consumers(stream)
        assert pending == 1 and name.encode("utf-8", "surrogateescape") == b"\xff-junk"
        held = redis_client.xpending_range(stream, GROUP, "-", "+", 10)
        redis_client.xack(stream, GROUP, *[p["message_id"] for p in held])
        broker.forget_consumer(stream, name)
        assert redis_client.xinfo_consumers(stream, GROUP) == []
    finally:
        broker.close()


def test_junk_in_the_admission_counters_is_reset_by_the_ack_and_the_reply_goes_once(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker, and an admitted request whose key's depth field someone overwrote with
    # what is not a count
    start_worker(echo("counts"))
    keys = Keys(prefix, "counts")
    inbox = RawInbox(redis_client, prefix)
    redis_client.set(keys.queued, 1)
    redis_client.hset(keys.depth, "default", "junk")
    redis_client.xadd(
        keys.stream("default"),
        {"h": header(3, 1, inbox.key), "p": bytes(msgpack.packb(["x"])), "a": "1"},
    )

    # When it is answered and acked, then the counters are back at zero, the junk reset (the
    # ack script failed on it: the replier retried and sent the reply again, and the field
    # stayed), and the caller got one reply
    wait_until(lambda: inbox.answered([3]), "the answer")
    wait_until(
        lambda: (
            int(redis_client.get(keys.queued) or 0) == 0
            and not redis_client.hexists(keys.depth, "default")
        ),
        "the counters at zero",
    )
    inbox.drain()
    assert inbox.error_kind(3) is None


def test_a_depth_field_holding_no_count_is_reset_by_the_enqueue_and_the_request_runs_once(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving whose key's depth field someone overwrote with what is not a count
    runs: Counter[Any] = Counter()

    def run(items: list[Any]) -> list[Any]:
        runs.update(items)
        return items

    serving = qs.Serving(run, name="depthjunk", batch_size=8, batch_timeout=0)
    start_worker(serving)
    keys = Keys(prefix, "depthjunk")
    redis_client.hset(keys.depth, "default", "junk")

    # When a caller dispatches, then it is answered, the request ran once and the counters end
    # at zero (enqueue.lua failed after writing the entry: the client sent it again and again,
    # and the admission counter kept what each copy added)
    assert client.dispatch(serving, "x", timeout=WAIT_S) == "x"
    wait_until(
        lambda: (
            int(redis_client.get(keys.queued) or 0) == 0
            and not redis_client.hexists(keys.depth, "default")
        ),
        "the counters at zero",
    )
    assert runs["x"] == 1, runs
