"""The single-item path's shortcuts (docs/benchmarks.md, issue 16) keep every answer exact:
a lone dispatch reads its answer from an inbox of its own, concurrent calls share the client's
inbox, an idle worker's executor sends its own replies, and a reader that drained everything
blocks for new work and reads it in the same round trip."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

import queueserve as qs
from queueserve.broker.sync import RedisBroker
from queueserve.wire.codec import get_codec
from queueserve.wire.messages import encode_request
from queueserve.wire.protocol import GROUP, Keys, inbox_key
from tests.support.helpers import wait_until
from tests.support.servings import Recording, tag_items

RESULT_WAIT_S = 30.0

StartWorker = Callable[..., qs.Worker]


def record_inbox_reads(client: qs.Client) -> list[tuple[str, str]]:
    """(thread name, inbox) of every inbox read the client makes from now on."""
    reads: list[tuple[str, str]] = []
    read_inbox = client.broker.read_inbox

    def recording(inbox: str, timeout: float) -> list[bytes]:
        reads.append((threading.current_thread().name, inbox))
        return read_inbox(inbox, timeout)

    client.broker.read_inbox = recording  # type: ignore[method-assign]
    return reads


def test_a_lone_dispatch_reads_its_answer_from_its_own_inbox(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an idle worker and a client with no call in flight
    serving = Recording(tag_items, name="lone", batch_size=8, batch_timeout=0)
    start_worker(serving)
    assert client.dispatch("lone", "warm", timeout=RESULT_WAIT_S) == "r:warm"
    reads = record_inbox_reads(client)

    # When one thread dispatches items one after another
    results = [client.dispatch("lone", f"x{i}", timeout=RESULT_WAIT_S) for i in range(20)]

    # Then each answer is exact, and this thread read it from its own inbox (not the client's
    # shared one, which would need the inbox reader to wake it)
    assert results == [f"r:x{i}" for i in range(20)]
    own = client._base.own_inbox(threading.get_ident())
    mine = [inbox for name, inbox in reads if name == threading.current_thread().name]
    assert mine and set(mine) == {own}
    # and what the worker wrote there expires (nothing without a TTL)
    assert redis_client.pttl(own) > 0 or not redis_client.exists(own)


def test_concurrent_dispatches_share_the_clients_inbox_and_get_their_own_results(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a worker whose batches wait until the test lets them run
    serving = Recording(tag_items, name="many", batch_size=64, batch_timeout=0, gated=True)
    start_worker(serving)
    held = client.submit("many", ["first"])  # a call in flight: later dispatches are not alone
    reads = record_inbox_reads(client)
    results: dict[int, list[str]] = {}

    def caller(n: int) -> None:
        results[n] = [client.dispatch("many", f"{n}-{i}", timeout=RESULT_WAIT_S)
                      for i in range(10)]

    # When 8 threads dispatch while that call is in flight
    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    serving.release()
    for t in threads:
        t.join(RESULT_WAIT_S)

    # Then every thread got exactly its own results, through the shared inbox's reader
    assert held.result(RESULT_WAIT_S) == ["r:first"]
    assert results == {n: [f"r:{n}-{i}" for i in range(10)] for n in range(8)}
    callers = {t.name for t in threads}
    own_reads = [inbox for name, inbox in reads if name in callers]
    shared = client._base.inbox
    assert all(inbox != shared for inbox in own_reads)  # a caller never reads the shared one
    assert any(inbox == shared for _, inbox in reads)


def test_an_idle_worker_answers_each_request_and_blocks_between_them(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an idle worker (its reader drained everything, so it waits on the wake stream)
    serving = Recording(tag_items, name="idle", batch_size=4, batch_timeout=0)
    start_worker(serving)
    assert client.dispatch("idle", "a", timeout=RESULT_WAIT_S) == "r:a"
    keys = Keys(prefix, "idle")
    wait_until(lambda: not redis_client.zcard(keys.ready), "the reader drained the ready set")

    # When requests come one at a time, and then several at once
    singles = [client.dispatch("idle", f"s{i}", timeout=RESULT_WAIT_S) for i in range(10)]
    tickets = [client.submit("idle", [f"m{i}"]) for i in range(10)]

    # Then each is answered, once, and nothing is left unacked or marked ready
    assert singles == [f"r:s{i}" for i in range(10)]
    assert [t.result(RESULT_WAIT_S) for t in tickets] == [[f"r:m{i}"] for i in range(10)]
    wait_until(lambda: redis_client.xlen(keys.stream("default")) == 0, "every entry acked")
    assert not redis_client.zcard(keys.ready)


def test_acks_in_runs_release_each_entrys_items_once(redis_url: str, prefix: str,
                                                      redis_client: redis.Redis) -> None:
    # Given requests of 1, 1 and 3 items, read by one consumer
    broker = RedisBroker(redis_url)
    keys = Keys(prefix, "acks")
    stream = keys.stream("default")
    broker.ensure_group(stream)
    inbox = inbox_key(prefix, "c1")
    codec = get_codec("msgpack")
    requests = [("default", n, *encode_request(codec, rid, ["x"] * n, inbox, None), 0)
                for rid, n in ((1, 1), (2, 1), (3, 3))]
    _, queued, ids = broker.enqueue(keys, requests, 0)
    assert queued == 5
    read = broker.read_ready(keys, "c", 100, 100, [])
    assert [entry_id for _, entries in read.entries for entry_id, _ in entries] == ids
    # and the second one acked meanwhile by a worker that reclaimed it (it deleted it too)
    redis_client.xack(stream, GROUP, ids[1])
    redis_client.xdel(stream, ids[1])
    redis_client.decrby(keys.queued, 1)
    redis_client.hincrby(keys.depth, "default", -1)

    # When the first worker acks all three, in runs of one item count
    broker.reply_and_ack(keys, {}, {stream: {1: [ids[0], ids[1]], 3: [ids[2]]}}, 1000)

    # Then each entry's items were released exactly once, and the stream is empty
    assert int(redis_client.get(keys.queued) or 0) == 0
    assert redis_client.xlen(stream) == 0
    assert not redis_client.hget(keys.depth, "default")
    broker.close()
