"""docs/design.md §5 guarantees, one scenario each, against a real Redis: a long batch is never
stolen from a live worker, poison isolation and CUDA out-of-memory halving, dead letters (with the
`queueserve dead-letter` CLI), deadlines and cancellation.

The no-loss fault suite is tests/faults/test_faults.py; bad input is
tests/faults/test_bad_input.py; reconnects are tests/faults/test_reconnect.py. docs/guarantees.md
maps each guarantee to its test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch

import queueserve as qs
from queueserve.wire.codec import codec_for_tag
from queueserve.wire.timing import DEAD_AFTER_S, RECLAIM_EVERY_S
from tests.support.fault_app import RawInbox, Workers, header, serving_consumer, worker_env
from tests.support.helpers import REPO, WAIT_S, stream_key, wait_until
from tests.support.servings import Recording, fail_on_negative

StartWorker = Callable[..., qs.Worker]


def queued(r: redis.Redis, prefix: str, serving: str) -> int:
    """The serving's admission counter: items admitted and not acked yet."""
    return int(r.get(f"{prefix}:{{{serving}}}:queued") or 0)


def executions(r: redis.Redis, prefix: str) -> list[str]:
    """Items the fault_app servings ran, one entry per execution."""
    return [x.decode() for x in r.lrange(f"{prefix}:fault:exec", 0, -1)]


# --- no loss: a live worker's long batch is never reclaimed ----------------------------------


@pytest.mark.timeout(180)
def test_a_batch_running_longer_than_the_dead_consumer_timeout_is_never_stolen(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given two workers, each reclaiming from dead consumers once a second
    pair = [workers.start("slow") for _ in range(2)]
    consumers = {serving_consumer(redis_client, prefix, "slow", w) for w in pair}
    stream = stream_key(prefix, "slow")

    def held() -> list[tuple[str, int, int]]:
        """(owner, deliveries, idle ms) of every entry read and not acked."""
        return [
            (p["consumer"].decode(), p["times_delivered"], p["time_since_delivered"])
            for p in redis_client.xpending_range(stream, "qs", "-", "+", 10)
        ]

    # and one of them running a batch that lasts until the test opens its gate
    ticket = client.submit("slow", ["long"])
    wait_until(lambda: "long" in executions(redis_client, prefix), "the long batch to start")
    ((owner, _, _),) = held()
    assert owner in consumers

    # When the batch runs past DEAD_AFTER_S plus several reclaim periods (or the entry moves)
    past = (DEAD_AFTER_S + 3 * RECLAIM_EVERY_S) * 1000

    def moved_or_idle_long() -> bool:
        h = held()
        if len(h) != 1 or h[0][:2] != (owner, 1):
            return True  # it moved: the assertion below says where
        return h[0][2] > past

    wait_until(moved_or_idle_long, "the entry to be idle past the dead-consumer timeout")

    # Then the entry is still its first owner's, delivered once
    assert [(o, d) for o, d, _ in held()] == [(owner, 1)]
    redis_client.set(f"{prefix}:fault:go", 1)
    # and it runs to its end and is answered, having been executed exactly once
    assert ticket.result(WAIT_S) == ["done:long"]
    assert executions(redis_client, prefix).count("long") == 1
    assert all(w.alive for w in pair)


# --- poison isolation -------------------------------------------------------------------------


def send_concurrently(
    client: qs.Client, serving: qs.Serving, requests: list[list[int]], threads: int = 8
) -> list[list[Any]]:
    """Send every request from ``threads`` caller threads at once; results by request."""
    results: list[list[Any]] = [[] for _ in requests]

    def call(k: int) -> None:
        for i in range(k, len(requests), threads):
            results[i] = client.dispatch_many(
                serving, requests[i], timeout=WAIT_S, return_exceptions=True
            )

    pool = [threading.Thread(target=call, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(WAIT_S * 2)
    return results


def poisoned_requests() -> tuple[list[list[int]], set[int]]:
    """2,000 items in 200 requests of 10; 1% of them (20) are poison (negative)."""
    items = [-i if i % 100 == 37 else i for i in range(1, 2001)]
    return [items[i : i + 10] for i in range(0, 2000, 10)], {x for x in items if x < 0}


def test_poison_items_fail_alone_and_every_healthy_item_gets_its_result(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a busy stream where 1% of the items make the batch function raise
    serving = Recording(fail_on_negative, name="poisoned", batch_size=32, batch_timeout=0.005)
    start_worker(serving)
    requests, poison = poisoned_requests()

    # When 8 callers send them all at once
    results = send_concurrently(client, serving, requests)

    # Then exactly the poison items get the error, every other item its own result
    for items, got in zip(requests, results, strict=True):
        for x, r in zip(items, got, strict=True):
            if x in poison:
                assert isinstance(r, qs.RemoteError) and r.remote_type == "ValueError", r
                assert f"negative item {x}" in r.remote_message
            else:
                assert r == x * 10
    # and the worker did bisect (a batch with poison ran again in parts)
    assert len(serving.items_run) > 2000


def test_on_error_fail_fails_whole_batches_and_only_those(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given the same busy, poisoned stream and on_error="fail"
    serving = Recording(
        fail_on_negative, name="failing", batch_size=32, batch_timeout=0.005, on_error="fail"
    )
    start_worker(serving)
    requests, poison = poisoned_requests()

    results = send_concurrently(client, serving, requests)

    # Then every item of a batch holding poison gets the error, and no other item does
    batch_of = {x: b for b, items in enumerate(serving.item_batches) for x in items}
    assert len(batch_of) == len(serving.items_run) == 2000  # no batch ran twice
    poisoned_batches = {batch_of[x] for x in poison}
    for items, got in zip(requests, results, strict=True):
        for x, r in zip(items, got, strict=True):
            if batch_of[x] in poisoned_batches:
                assert isinstance(r, qs.RemoteError) and r.remote_type == "ValueError", (x, r)
            else:
                assert r == x * 10
    assert sum(len(serving.item_batches[b]) for b in poisoned_batches) > len(poison)


def oom_over_two(items: list[int]) -> list[int]:
    """Out of device memory on batches of more than two items, and always on the item -1."""
    if len(items) > 2 or -1 in items:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return [x * 10 for x in items]


@pytest.mark.parametrize("on_error", ["isolate", "fail"])
def test_cuda_out_of_memory_halves_the_batch_until_it_fits(
    start_worker: StartWorker,
    client: qs.Client,
    on_error: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a serving that runs out of device memory on batches of more than two items
    serving = Recording(
        oom_over_two, name="oom", batch_size=8, batch_timeout=0.5, on_error=on_error
    )
    start_worker(serving)

    # When one full batch of 8 arrives
    assert client.dispatch_many(serving, list(range(8)), timeout=WAIT_S) == [
        x * 10 for x in range(8)
    ]

    # Then it was halved and retried until it fitted: 8 -> 4 -> 2, 2 -> 4 -> 2, 2 (also with
    # on_error="fail", which never bisects other errors), and the worker said why
    assert [len(b) for b in serving.item_batches] == [8, 4, 2, 2, 4, 2, 2]
    assert "out of memory on a batch of 8; halving" in caplog.text


def test_an_item_that_always_runs_out_of_memory_gets_the_error_alone(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(oom_over_two, name="oom1", batch_size=4, batch_timeout=0.5)
    start_worker(serving)

    results = client.dispatch_many(serving, [1, 2, -1, 4], timeout=WAIT_S, return_exceptions=True)

    assert results[:2] == [10, 20] and results[3] == 40
    assert isinstance(results[2], qs.RemoteError)
    assert results[2].remote_type == "OutOfMemoryError"
    # halved down to the one item before it was reported
    assert [len(b) for b in serving.item_batches] == [4, 2, 2, 1, 1]


# --- dead letters -----------------------------------------------------------------------------


def cli(*args: str, url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "dead-letter",
            *args,
            "--redis-url",
            url,
            "--prefix",
            prefix,
        ],
        cwd=REPO,
        env=worker_env(url, prefix),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def record_replies(client: qs.Client) -> list[tuple[int, int, Any]]:
    """Every reply slice the client receives, as (request id, kind, body), kept even when the
    client drops it (its caller was answered already)."""
    seen: list[tuple[int, int, Any]] = []
    deliver = client._table.deliver

    def recording(message: bytes) -> None:
        if message:
            for row in codec_for_tag(message[0]).loads(memoryview(message)[1:]):
                seen.append((row[0], row[3], row[4]))
        deliver(message)

    client._table.deliver = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.timeout(180)
def test_a_request_that_keeps_killing_workers_is_dead_lettered_and_can_be_replayed_or_dropped(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker whose partition dies (os._exit) on the item "boom"; max_deliveries=2
    worker = workers.start("crasher", "--max-restarts", "50")
    serving_consumer(redis_client, prefix, "crasher", worker)
    replies = record_replies(client)
    before = [client.submit("crasher", [f"b{i}"]) for i in range(10)]
    assert [t.result(WAIT_S) for t in before] == [[f"ok:b{i}"] for i in range(10)]

    # When "boom" is sent, with other callers' requests around it
    poison = client.submit("crasher", ["boom"])
    during = [client.submit("crasher", [f"d{i}"]) for i in range(10)]

    # Then after it killed the partition max_deliveries times, its caller gets DeadLettered
    with pytest.raises(qs.DeadLettered, match=r"delivered 2 times \(max_deliveries=2\)"):
        poison.result(90)
    assert redis_client.llen(f"{prefix}:fault:crashes") == 2
    assert worker.output().count("died while running a batch (exit code 9)") == 2
    # and every other request was answered
    assert [t.result(WAIT_S) for t in during] == [[f"ok:d{i}"] for i in range(10)]
    assert "boom" not in executions(redis_client, prefix)

    # and `queueserve dead-letter list` shows it with the reason
    listed = cli("list", "crasher", url=redis_url, prefix=prefix)
    assert listed.returncode == 0, listed.stderr
    (line,) = listed.stdout.splitlines()
    dead_id = line.split()[0]
    assert "deliveries=2" in line and "max_deliveries=2" in line, line
    assert stream_key(prefix, "crasher") in line

    # When the serving is fixed and the dead letter replayed
    redis_client.set(f"{prefix}:fault:fixed", 1)
    replayed = cli("replay", "crasher", dead_id, url=redis_url, prefix=prefix)
    assert replayed.returncode == 0, replayed.stderr
    assert f"{dead_id} replayed as" in replayed.stdout

    # Then it runs and is answered (to its client, which drops it: its caller was told)
    rid = int(poison.id.rsplit("-", 1)[1])
    wait_until(lambda: (rid, 0, ["ok:boom"]) in replies, "the replayed request's answer")
    assert executions(redis_client, prefix).count("boom") == 1
    assert cli("list", "crasher", url=redis_url, prefix=prefix).stdout == ""
    wait_until(lambda: queued(redis_client, prefix, "crasher") == 0, "admitted items released")

    # When an unanswerable entry is dead-lettered, replay refuses it and drop removes it
    redis_client.xadd(stream_key(prefix, "crasher"), {"junk": b"\x00"})
    wait_until(lambda: redis_client.xlen(f"{prefix}:{{crasher}}:dead") == 1, "a dead letter")
    (junk_line,) = cli("list", "crasher", url=redis_url, prefix=prefix).stdout.splitlines()
    junk_id = junk_line.split()[0]
    assert "malformed entry" in junk_line
    refused = cli("replay", "crasher", junk_id, url=redis_url, prefix=prefix)
    assert refused.returncode == 1 and "can only be dropped" in refused.stderr
    dropped = cli("drop", "crasher", junk_id, url=redis_url, prefix=prefix)
    assert (dropped.returncode, dropped.stdout.strip()) == (0, f"{junk_id} dropped")
    assert redis_client.xlen(f"{prefix}:{{crasher}}:dead") == 0
    assert worker.alive


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "spec",
    ["crasher_batched", "crasher_batched_3"],
    ids=["every-retry-alone", "first-retry-batched"],
)
def test_a_request_that_shared_a_batch_with_a_crasher_is_still_answered(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    spec: str,
    redis_url: str,
) -> None:
    # Given batches of up to 4 requests, and a worker that dies on "boom" (max_deliveries 2:
    # every redelivery runs alone; 3: the first redelivery is batched, and dies again)
    name = spec.replace("_", "-")
    worker = workers.start(spec, "--max-restarts", "50")
    serving_consumer(redis_client, prefix, name, worker)

    # When a healthy request arrives together with "boom", each an entry of its own (two
    # clients: one client's requests sent together would travel as one pack, whose
    # redeliveries tests/faults/test_packs.py proves)
    poison = client.submit(name, ["boom"])
    with qs.Client(redis_url, prefix=prefix) as other:
        healthy = other.submit(name, ["fine"])
        healthy_result = healthy.result(90)

    # Then the crasher is dead-lettered, and the healthy request still gets its result
    with pytest.raises(qs.DeadLettered):
        poison.result(90)
    assert healthy_result == ["ok:fine"]
    # having died with it: they shared the first batch, and with max_deliveries 3 its first
    # redelivery too (docs/guarantees.md, "Dead letters"); every later run was alone
    batches = [b.decode() for b in redis_client.lrange(f"{prefix}:fault:batches", 0, -1)]
    shared = 2 if spec == "crasher_batched_3" else 1
    assert batches[:shared] == ["boom,fine"] * shared, batches
    assert "boom,fine" not in batches[shared:] and "fine" in batches[shared:], batches


def test_the_requests_of_a_killed_batch_run_again_together_not_one_by_one(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a batch of six requests running when its partition is SIGKILLed
    worker = workers.start("gathering", "--max-restarts", "10")
    serving_consumer(redis_client, prefix, "gathering", worker)
    items = ["wait", "a", "b", "c", "d", "e"]
    tickets = [client.submit("gathering", [x]) for x in items]
    sizes = f"{prefix}:fault:sizes"
    wait_until(lambda: redis_client.lrange(sizes, 0, -1) == [b"6"], "the batch of six to start")
    worker.kill_partition(worker.partition_pids()[0])
    redis_client.set(f"{prefix}:fault:go", 1)

    # Then each is answered once, and their first redelivery ran as one batch again (one
    # batch per request would hold a killed worker's recovery for seconds)
    assert [t.result(60) for t in tickets] == [[f"r:{x}"] for x in items]
    assert redis_client.lrange(sizes, 0, -1) == [b"6", b"6"]


# --- deadlines and cancellation ---------------------------------------------------------------


def test_expired_requests_are_answered_with_timeout_and_never_run(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    pending: Callable[..., int],
) -> None:
    # Given an executor busy with a first batch (gated), and a reply address read by the test
    serving = Recording(name="deadline", batch_size=4, batch_timeout=0, gated=True)
    start_worker(serving)
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "deadline")
    blocker = client.submit(serving, ["blocker"])
    wait_until(lambda: serving.batches, "the blocker batch to start")

    # When requests whose deadlines are near are read by the worker and their deadlines pass
    soon = int((time.time() + 2) * 1000)
    redis_client.xadd(stream, {"h": header(1, 1, inbox.key, soon), "p": b"\x91\xa4late"})
    doomed = client.submit(serving, ["doomed"], timeout=2)
    wait_until(lambda: pending("deadline") == 3, "the worker to read both")
    with pytest.raises(qs.Timeout):
        doomed.result()  # the caller's own deadline
    # and one whose deadline passed before any worker read it
    past = int((time.time() - 1) * 1000)
    redis_client.xadd(stream, {"h": header(2, 1, inbox.key, past), "p": b"\x91\xa4past"})
    wait_until(lambda: inbox.answered([2]), "the answer to the already expired request")
    serving.release()

    # Then the worker answers them with Timeout (to whoever listens) and never runs them
    assert blocker.result(WAIT_S) == ["blocker"]
    wait_until(lambda: inbox.answered([1, 2]), "answers to the raw requests")
    assert (inbox.error_kind(1), inbox.error_kind(2)) == ("timeout", "timeout")
    assert client.dispatch(serving, "after", timeout=WAIT_S) == "after"
    assert serving.items_run == ["blocker", "after"]
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")


def test_cancel_withdraws_unread_and_prefetched_requests_and_drops_a_running_ones_result(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    pending: Callable[..., int],
) -> None:
    # Given a worker running one gated batch, one request prefetched, and one not read yet
    serving = Recording(name="cancel", batch_size=1, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    stream = stream_key(prefix, "cancel")
    running = client.submit(serving, ["running"])
    wait_until(lambda: serving.batches, "the first batch to start")
    prefetched = client.submit(serving, ["prefetched"])
    wait_until(lambda: pending("cancel") == 2, "the worker to prefetch the second")
    unread = client.submit(serving, ["unread"])
    wait_until(lambda: redis_client.xlen(stream) == 3, "the client's sender to send it")
    assert pending("cancel") == 2

    # When the unread one is cancelled, cancel() says it will never run, and it leaves the queue
    assert unread.cancel() is True
    assert redis_client.xlen(stream) == 2
    assert queued(redis_client, prefix, "cancel") == 2
    # When the prefetched and the running ones are cancelled, cancel() cannot promise that
    assert prefetched.cancel() is False
    assert running.cancel() is False
    # (the worker hears of cancels on pub/sub; wait until it did before the executor moves on)
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    wait_until(lambda: len(runner.ledger.cancelled) == 2, "the worker to learn of both cancels")
    serving.release()

    # Then the prefetched request never runs, the running one finishes uninterrupted, and
    # every caller gets Cancelled
    assert client.dispatch(serving, "after", timeout=WAIT_S) == "after"
    assert serving.items_run == ["running", "after"]
    for ticket in (unread, prefetched, running):
        assert ticket.done()
        with pytest.raises(qs.Cancelled):
            ticket.result(WAIT_S)
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")
    wait_until(lambda: queued(redis_client, prefix, "cancel") == 0, "admitted items released")
