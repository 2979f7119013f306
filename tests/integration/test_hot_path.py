"""The single-item path's shortcuts (docs/benchmarks.md, issue 16) keep every answer exact:
a lone dispatch reads its answer from an inbox of its own, concurrent calls share the client's
inbox, an idle worker's executor reads its own work and sends its own replies, and a reader
that drained everything blocks for new work and reads it in the same round trip."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.broker.reads import PendingRead, ReadOutcome, Reads
from queueserve.broker.replies import Replies
from queueserve.errors import RedisUnavailable
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import GROUP, Keys, inbox_key
from queueserve.wire.request import encode_request
from queueserve.worker.pipeline import lease as lease_module
from queueserve.worker.pipeline.reader import Reader
from tests.support.broker import RedisBroker
from tests.support.helpers import items_waiting, wait_until
from tests.support.servings import Recording, tag_items

RESULT_WAIT_S = 30.0

StartWorker = Callable[..., qs.Worker]


def record_inbox_reads(client: qs.Client) -> list[tuple[str, str]]:
    """(thread name, inbox) of every inbox read the client makes from now on."""
    reads: list[tuple[str, str]] = []
    read_inbox = client._broker.read_inbox

    def recording(inbox: str, timeout: float) -> list[bytes]:
        reads.append((threading.current_thread().name, inbox))
        return read_inbox(inbox, timeout)

    client._broker.read_inbox = recording  # type: ignore[method-assign]
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
    own = client._core.own_inbox(threading.get_ident())
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
        results[n] = [client.dispatch("many", f"{n}-{i}", timeout=RESULT_WAIT_S) for i in range(10)]

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
    shared = client._core.inbox
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


def record_take_ins(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread that takes in each read that brought entries, from now on (any in-process
    worker's)."""
    threads: list[str] = []
    take_in = Reader.take_in

    def recording(self: Reader, entries: Any, yield_gil: bool = True, *leads: Any) -> None:
        if entries:
            threads.append(threading.current_thread().name)
        take_in(self, entries, yield_gil, *leads)

    monkeypatch.setattr(Reader, "take_in", recording)
    return threads


def read_lent(worker: qs.Worker) -> bool:
    """Whether an in-process worker's executor holds its blocking read (it would read the next
    request itself)."""
    host = worker._host
    return host is not None and host.runners[0].lease.borrowed


def dispatch_when_idle(client: qs.Client, worker: qs.Worker, serving: str, n: int) -> list[Any]:
    """Dispatch 0..n-1 one at a time, each once the worker's executor holds its blocking read
    again (idle); returns the answers."""
    answers = []
    for i in range(n):
        answers.append(client.dispatch(serving, i, timeout=RESULT_WAIT_S))
        wait_until(lambda: read_lent(worker), "the idle executor to take the blocking read")
    return answers


def slow_reader_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that lent its read out looks again by itself only after 30 s (RECLAIM_EVERY_S
    otherwise): what it does sooner, it does because it was woken for it."""
    monkeypatch.setattr(lease_module, "RECLAIM_EVERY_S", 30.0)


def test_an_idle_workers_executor_reads_the_work_it_runs(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an idle worker
    read_by = record_take_ins(monkeypatch)
    ran_on: list[str] = []

    def tag_and_note(items: list[Any]) -> list[str]:
        ran_on.append(threading.current_thread().name)
        return tag_items(items)

    worker = start_worker(Recording(tag_and_note, name="lend", batch_size=4, batch_timeout=0))
    # When requests come one at a time, each after the last one's answer, once idle again
    answers = dispatch_when_idle(client, worker, "lend", 20)
    # Then each is answered, and (after the first, which the reader read) the thread that ran
    # each batch had read it itself: no hand-off between threads on an idle worker's answer
    assert answers == [f"r:{i}" for i in range(20)]
    later = list(zip(read_by, ran_on, strict=True))[2:]
    assert sum(reader == runner for reader, runner in later) >= len(later) - 2, later


def test_an_idle_worker_sends_its_next_read_behind_each_reply(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an idle worker, whose replies are recorded with whether a read went with them
    fused: list[bool] = []
    reply_and_ack = Replies.reply_and_ack

    def recording(self: Replies, *args: Any, **kwargs: Any) -> PendingRead | None:
        pending = reply_and_ack(self, *args, **kwargs)
        fused.append(pending is not None)
        return pending

    monkeypatch.setattr(Replies, "reply_and_ack", recording)
    worker = start_worker(Recording(tag_items, name="fused", batch_size=4, batch_timeout=0))
    # When requests come one at a time, each after the last one's answer, once idle again
    answers = dispatch_when_idle(client, worker, "fused", 20)
    # Then each is answered, and (after the first few) each reply carried the executor's next
    # blocking read in the same write: Redis started it when the next request came
    assert answers == [f"r:{i}" for i in range(20)]
    later = fused[2:]
    assert sum(later) >= len(later) - 2, fused


def test_what_a_read_sent_behind_a_reply_brought_is_served_when_its_reply_is_lost(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an idle worker whose next read (sent behind its last reply; on a busy machine
    # perhaps the reader's) will deliver a request and then lose its connection before the
    # worker sees what it read. The reads are wrapped before the worker starts, since a thread
    # already blocked in one holds the method it bound, and armed once the worker is warm.
    armed = threading.Event()
    lost: list[ReadOutcome] = []
    results = {
        "pending": PendingRead.result,
        "wait": Reads.wait_then_read,
        "ready": Reads.read_ready,
    }

    def losing(outcome: ReadOutcome) -> ReadOutcome:
        if armed.is_set() and not lost and outcome.entries:
            lost.append(outcome)
            raise RedisUnavailable("the connection broke after the read (test)")
        return outcome

    monkeypatch.setattr(PendingRead, "result", lambda self: losing(results["pending"](self)))
    monkeypatch.setattr(Reads, "wait_then_read", lambda self, *a: losing(results["wait"](self, *a)))
    monkeypatch.setattr(Reads, "read_ready", lambda self, *a: losing(results["ready"](self, *a)))
    worker = start_worker(Recording(tag_items, name="lost", batch_size=4, batch_timeout=0))
    assert client.dispatch("lost", "warm", timeout=RESULT_WAIT_S) == "r:warm"
    armed.set()
    wait_until(lambda: read_lent(worker), "the idle executor to take the blocking read")

    # When a request comes, and the read that delivered it never reaches the worker
    answer = client.dispatch("lost", "x", timeout=RESULT_WAIT_S)

    # Then the worker finds the entry pending for it without its knowing, and serves it
    assert lost and answer == "r:x"


def test_work_arriving_during_a_long_batch_is_read_while_it_runs(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker whose batches take a while (20 ms each, so far)
    slow_reader_fallback(monkeypatch)
    serving = Recording(tag_items, name="long", batch_size=4, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    for i in range(5):
        ticket = client.submit("long", [f"w{i}"])
        wait_until(lambda i=i: len(serving.batches) == i + 1, "the batch runs")
        time.sleep(0.02)
        serving.gate.set()
        assert ticket.result(RESULT_WAIT_S) == [f"r:w{i}"]
        serving.gate.clear()
    wait_until(lambda: read_lent(worker), "the idle executor to take the blocking read")
    # When a request arrives while the executor runs another one's batch
    first = client.submit("long", ["a"])
    wait_until(lambda: len(serving.batches) == 6, "the first batch runs")
    second = client.submit("long", ["b"])
    # Then the reader reads it meanwhile, and it is waiting when the executor is free
    # (well before the 30 s after which the reader would have looked by itself)
    wait_until(
        lambda: items_waiting(worker) == 1, "the second request read during the first", timeout=10.0
    )
    serving.gate.set()
    assert first.result(RESULT_WAIT_S) == ["r:a"]
    assert second.result(RESULT_WAIT_S) == ["r:b"]


def test_a_batch_waiting_for_its_timeout_takes_in_what_arrives_meanwhile(
    start_worker: StartWorker, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an idle worker whose batches wait up to 20 s to fill
    slow_reader_fallback(monkeypatch)
    serving = Recording(tag_items, name="fill", batch_size=4, batch_timeout=20.0)
    worker = start_worker(serving)
    wait_until(lambda: read_lent(worker), "the idle executor to take the blocking read")
    # When four requests come one after another (the executor reads the first itself)
    tickets = []
    for i in range(4):
        tickets.append(client.submit("fill", [i]))
        time.sleep(0.02)
    # Then the others are read while its batch waits, and the four run as one full batch
    assert [t.result(RESULT_WAIT_S) for t in tickets] == [[f"r:{i}"] for i in range(4)]
    assert serving.batches == [("default", [0, 1, 2, 3])]


def test_acks_in_runs_release_each_entrys_items_once(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    # Given requests of 1, 1 and 3 items, read by one consumer
    broker = RedisBroker(redis_url)
    keys = Keys(prefix, "acks")
    stream = keys.stream("default")
    broker.ensure_group(stream)
    inbox = inbox_key(prefix, "c1")
    codec = get_codec("msgpack")
    requests = [
        ("default", n, *encode_request(codec, rid, ["x"] * n, inbox, None), 0)
        for rid, n in ((1, 1), (2, 1), (3, 3))
    ]
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


def accepted(tickets: list[qs.Ticket]) -> bool:
    """Whether the client has read the entry id of every request of ``tickets``."""
    return all(call.entry_id for t in tickets for call in t._each)


@pytest.mark.parametrize("by", ["name", "serving object"])
def test_a_request_in_flight_keeps_few_objects_for_the_garbage_collector(
    client: qs.Client, redis_client: redis.Redis, prefix: str, by: str
) -> None:
    # Every object a call in flight keeps reaches the collector's oldest generation (a window
    # of submits lives longer than its young collections) and is walked by each full pass:
    # in the submit-window benchmark those passes were 40% of the client's CPU.
    serving = qs.Serving(lambda xs: xs, name="nobody-serves")
    target: qs.Serving | str = serving if by == "serving object" else serving.name
    # The serving's options are declared, as a worker declares them (a name is then cached)
    first = [client.submit(serving, [0])]
    redis_client.hset(f"{prefix}:{{nobody-serves}}:meta", "codec", "msgpack")
    first.append(client.submit(target, [0]))
    wait_until(lambda: accepted(first), "the client to hear its first requests accepted")
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        tickets = [client.submit(target, [x]) for x in range(500)]
        wait_until(lambda: accepted(tickets), "the client to hear all 500 accepted")
        kept = [o for o in gc.get_objects() if id(o) not in before]
    finally:
        gc.enable()
    # Then each keeps its call, its ticket and (for a serving object, whose options may
    # change between calls) its target, and nothing else
    most = 3 if by == "serving object" else 2
    assert len(tickets) == 500 and len(kept) <= most * 500 + 50
