"""queueserve on a real local Redis Cluster (3 masters, 3 replicas): the core cases on a
serving spread over 3 shards, the shards' spread over the masters, and a master SIGKILLed
under load with ``durable=True``.

One cluster serves the whole module (it forms in about 2 s); each test has its own prefix.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.broker.connect import parse_url
from queueserve.broker.job_store import Jobs
from queueserve.wire.job_record import group_key, job_place
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.once import shard_of_key
from queueserve.wire.shards import key_slot, shard_tags
from tests.support.broker import RedisBroker
from tests.support.callers import Caller
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer
from tests.support.redis_topologies import Cluster, redis_cluster
from tests.support.step_app import Count, expected


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    return f"qsc{uuid4().hex[:8]}"


def square(xs: list[int]) -> list[int]:
    for x in xs:
        if x == -1:
            raise ValueError("no squares of -1 here")
    return [x * x for x in xs]


class Recorder:
    """A batch function that records each batch's items (to check batches never mix keys)."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.lock = threading.Lock()

    def __call__(self, xs: list[Any]) -> list[Any]:
        with self.lock:
            self.batches.append(list(xs))
        return [x if isinstance(x, str) else x * 10 for x in xs]


def test_cluster_urls_are_parsed_and_checked() -> None:
    t = parse_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2")
    assert (t.kind, t.hosts, t.password) == (
        "cluster",
        (("10.0.0.1", 7000), ("10.0.0.2", 6379)),
        "pw",
    )
    assert parse_url("redis://localhost:6379/0").kind == "single"
    with pytest.raises(ValueError, match="only database 0"):
        parse_url("redis+cluster://h:7000/3")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sentinel_password'\]"):
        parse_url("redis+cluster://h:7000?sentinel_password=x")
    with pytest.raises(ValueError, match="unknown scheme 'redis\\+mesh'"):
        parse_url("redis+mesh://h:1")


def test_shard_tags_sit_evenly_around_the_slot_ring() -> None:
    tags = shard_tags("square", 4)
    slots = [key_slot(t) for t in tags]
    assert tags[0] == "square"
    assert [(s - slots[0]) % 16384 for s in slots] == [0, 4096, 8192, 12288]
    keys = Keys("qs", "square")
    shards = keys.sharded(4)
    stream = shards[3].stream("k", 2)
    assert keys.shard_of(stream) is shards[3] and keys.batch_key_of(stream) == "k"
    with pytest.raises(ValueError, match="not a key of serving 'square'"):
        keys.shard_of("qs:{other#1}:in:k")


def test_three_shards_land_on_three_masters_and_share_the_enqueues(
    cluster: Cluster, prefix: str
) -> None:
    # Given a serving with 3 shards on a cluster of 3 masters
    serving = qs.Serving(square, name="spread", batch_size=8, batch_timeout=0.001, shards=3)
    masters = {cluster.node_of_slot(key_slot(t)).port for t in shard_tags("spread", 3)}
    assert len(masters) == 3, "each shard's slot is served by another master"
    before = {m.port: _request_calls(m.port) for m in cluster.masters}
    worker = qs.Worker(
        [serving], redis_url=cluster.url, prefix=prefix, handle_signals=False
    ).start()
    try:
        with qs.Client(cluster.url, prefix=prefix) as client:
            # When 300 requests are sent by name (the shard count comes from the workers)
            wait_until(
                lambda: client._broker.meta(Keys(prefix, "spread")).get("shards") == "3",
                "the worker to declare the serving",
            )
            for i in range(300):
                assert client.dispatch("spread", i) == i * i
    finally:
        worker.stop(timeout=10)
    # Then every master took about a third of the requests and acked them
    ran = [_request_calls(m.port) - before[m.port] for m in cluster.masters]
    assert min(ran) >= 0.8 * max(ran), ran


def _request_calls(port: int) -> int:
    """XADDs (a request, and its stream's wake-up) and XACKs (its ack) a master ran, inside
    scripts too. Not the script calls themselves: an idle shard's reader runs read.lua each
    time its blocking wait times out, which says nothing of the requests' spread."""
    with redis.Redis(port=port) as r:
        stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_xadd", "cmdstat_xack"))


def test_no_command_asks_a_master_for_its_keys_first(cluster: Cluster, prefix: str) -> None:
    # Given a worker and a client of a 3-shard serving
    serving = qs.Serving(square, name="routed", batch_size=16, batch_timeout=0.001, shards=3)
    worker = qs.Worker(
        [serving], redis_url=cluster.url, prefix=prefix, handle_signals=False
    ).start()
    try:
        with qs.Client(cluster.url, prefix=prefix) as client:
            client.dispatch(serving, 1, timeout=30)
            before = _getkeys(cluster)
            # When requests go one at a time and packed (inbox reads, wake-ups, reads, acks)
            for i in range(30):
                assert client.dispatch(serving, i) == i * i
            assert len(list(client.map(serving, range(500), chunk_size=16))) == 500
        asyncio.run(_async_dispatches(cluster.url, prefix, serving))
    finally:
        worker.stop(timeout=10)
    # Then no master was asked COMMAND GETKEYS: redis-py asks its default node (always the
    # same master) before each BLMPOP, XREAD, or EVALSHA in a cluster pipeline, unless the
    # command is sent to its key's node; that master then did more than the others
    assert _getkeys(cluster) == before


async def _async_dispatches(url: str, prefix: str, serving: qs.Serving) -> None:
    async with qs.AsyncClient(url, prefix=prefix) as client:
        for i in range(10):
            assert await client.dispatch(serving, i) == i * i


def _getkeys(cluster: Cluster) -> int:
    calls = 0
    for m in cluster.masters:
        with redis.Redis(port=m.port) as r:
            calls += int(r.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0))
    return calls


def test_core_cases_run_on_a_sharded_serving(cluster: Cluster, prefix: str) -> None:
    recorder = Recorder()
    keyed = qs.Serving(recorder, name="keyed", batch_size=16, batch_timeout=0.02, shards=3)
    squares = qs.Serving(square, name="squares", batch_size=32, batch_timeout=0.001, shards=3)
    events = qs.Serving(
        _progress, name="events", batch_size=8, batch_timeout=0.001, shards=2
    ).streaming(hooks=["progress"])
    worker = qs.Worker(
        [keyed, squares, events], redis_url=cluster.url, prefix=prefix, handle_signals=False
    ).start()
    try:
        with qs.Client(cluster.url, prefix=prefix) as client:
            # dispatch, dispatch_many and a remote error
            assert client.dispatch(squares, 7) == 49
            assert client.dispatch_many(squares, [1, 2, 3]) == [1, 4, 9]
            with pytest.raises(qs.RemoteError, match="no squares of -1"):
                client.dispatch(squares, -1)
            assert client.dispatch_many(squares, [2, -1], return_exceptions=True)[0] == 4
            # map: ordered over many chunks, so over every shard
            assert list(client.map(squares, range(2000), chunk_size=64)) == [
                x * x for x in range(2000)
            ]
            # batch keys: requests of two keys on three shards still never share a batch
            tickets = [
                client.submit(keyed, [f"{k}{i}" for i in range(5)], batch_key=k)
                for _ in range(6)
                for k in ("a", "b")
            ]
            for t in tickets:
                t.result(timeout=30)
            assert all(len({x[0] for x in b}) == 1 for b in recorder.batches), recorder.batches
            # streaming: hook events reach the caller from a shard of another slot
            got = list(client.stream(events, [1, 2, 3]))
            assert [e.payload for e in got if isinstance(e, qs.Hook)] == ["done"]
            assert [r for e in got if isinstance(e, qs.Output) for r in e.results] == [2, 4, 6]
            # jobs: their records live in other slots than their streams, so the client
            # writes them around the enqueue (on one Redis, enqueue.lua writes them)
            job = client.submit(squares, [3, 4], keep=60)
            assert job.result(timeout=30) == [9, 16]
            record = cluster.client().hget(*job_place(prefix, job.id))
            assert record is not None and record.split(b":")[:1] + record.split(b":")[2:3] == [
                b"done",
                b"2",
            ]
            # where a job waits is written around its enqueue too (for cancel): as a client
            # does for a job of request 7 that waits in entry 1-1
            keys = Keys(prefix, "squares")
            at = [(0, group_key(prefix, "clusterjobs", 7), "7", 60_000)]
            requests = [("default", 1, b"h", b"p", 0)]
            jobs = Jobs(cluster.client(), cluster.url)
            made = jobs.created(keys, requests, at, False)
            assert made == {"7"}
            jobs.placed(keys, requests, at, (0, 1, [b"1-1"]), made)
            waiting = cluster.client().hget(group_key(prefix, "clusterjobs", 7), "7")
            assert waiting == f"1:60000:squares:1-1:{keys.stream('default')}".encode()
            with qs.Client(cluster.url, prefix=prefix) as other:
                assert other.job(job.id).status() == "done"
                assert other.job(job.id).result(timeout=5) == [9, 16]
        asyncio.run(_async_cases(cluster.url, prefix))
    finally:
        worker.stop(timeout=10)


def _progress(xs: list[int]) -> list[int]:
    qs.emit("progress", "done")
    return [x * 2 for x in xs]


async def _async_cases(url: str, prefix: str) -> None:
    async with qs.AsyncClient(url, prefix=prefix) as client:
        assert await client.dispatch("squares", 12) == 144
        assert await client.dispatch_many("squares", list(range(50))) == [x * x for x in range(50)]
        job = client.job(await (await client.submit("squares", [6], keep=60)).id)
        assert await job.result(timeout=30) == [36]
        assert await job.status() == "done"


def test_idempotency_keys_on_a_sharded_serving_run_once_in_their_shards_slot(
    cluster: Cluster, prefix: str
) -> None:
    recorder = Recorder()
    serving = qs.Serving(recorder, name="once", batch_size=16, batch_timeout=0.001, shards=3)
    worker = qs.Worker([serving], redis_url=cluster.url, prefix=prefix, handle_signals=False)
    worker.start()
    try:
        with qs.Client(cluster.url, prefix=prefix) as a, qs.Client(cluster.url, prefix=prefix) as b:
            # each key sent by two clients: one run, one job
            for i in range(9):
                first = a.submit(serving, [i], idempotency_key=f"k{i}")
                again = b.submit(serving, [i], idempotency_key=f"k{i}")
                assert first.result(30) == again.result(30) == [i * 10]
                assert again.id == first.id
            with pytest.raises(qs.IdempotencyConflict):
                b.dispatch(serving, 99, idempotency_key="k0")
            clients = (a.client_id, b.client_id)
        assert sorted(x for batch in recorder.batches for x in batch) == list(range(9))
        r = cluster.client()
        # each key's record is in the slot of the shard its key maps to, over several shards
        tags = {shard_tags("once", 3)[shard_of_key(f"k{i}", 3)] for i in range(9)}
        assert len(tags) > 1
        for i in range(9):
            tag = shard_tags("once", 3)[shard_of_key(f"k{i}", 3)]
            assert r.exists(f"{prefix}:{{{tag}}}:once:k{i}")
        # the job fields written before each enqueue (other slots) stayed only for the request
        # each key enqueued: 9 jobs done, none of a follower (or a conflict) left waiting
        jobs = [
            v for c in clients for k, v in r.hgetall(group_key(prefix, c, 1)).items() if k.isdigit()
        ]
        assert len(jobs) == 9 and all(v.startswith(b"done:") for v in jobs), jobs
    finally:
        worker.stop(timeout=10)


def test_cached_results_on_a_sharded_serving_live_in_their_items_shards_slots(
    cluster: Cluster, prefix: str
) -> None:
    recorder = Recorder()
    serving = qs.Serving(
        recorder, name="cached", batch_size=16, batch_timeout=0.001, shards=3, cache_ttl="10m"
    )
    worker = qs.Worker([serving], redis_url=cluster.url, prefix=prefix, handle_signals=False)
    worker.start()
    items = [f"t{i}" for i in range(12)]
    r = cluster.client()
    try:
        with qs.Client(cluster.url, prefix=prefix) as client:
            assert client.dispatch_many(serving, items) == items
            tags = shard_tags("cached", 3)
            entries = [entry_in_its_shard(prefix, item, tags) for item in items]
            wait_until(
                lambda: all(r.exists(e) for e in entries), "every result cached in its shard"
            )
            assert {e.split("}")[0] for e in entries} == {f"{prefix}:{{{t}" for t in tags}
            # a call of repeats and new items over the masters: only the new ones run
            assert client.dispatch_many(serving, ["new", *items[::-1]]) == ["new", *items[::-1]]
        assert sorted(x for batch in recorder.batches for x in batch) == sorted([*items, "new"])
        hits = sum(int(r.hget(f"{prefix}:{{{t}}}:cachestats", "hits") or 0) for t in tags)
        assert hits == 12
    finally:
        worker.stop(timeout=10)


def entry_in_its_shard(prefix: str, item: str, tags: tuple[str, ...]) -> str:
    """The documented name of an item's cache entry (wire/cache.py), in the shard its digest
    names: BLAKE2b-128 of version "", batch key and payload, its first 4 bytes mod shards."""
    digest = hashlib.blake2b(b"\0default\0" + msgpack.packb([item]), digest_size=16).digest()
    tag = tags[int.from_bytes(digest[:4], "big") % len(tags)]
    return f"{prefix}:{{{tag}}}:cached:{digest.hex()}"


def test_a_step_serving_tells_a_listening_caller_from_a_gone_one_across_the_masters(
    cluster: Cluster, prefix: str
) -> None:
    # Given one slot on a cluster, held by a request streamed through a client of its own
    # (its event channel, and so its subscription, in whatever slot its name hashes to)
    serving = Count(max_slots=1, caller_gone_after=0.5)
    worker = qs.Worker(
        [serving], redis_url=cluster.url, prefix=prefix, handle_signals=False
    ).start()
    try:
        with qs.Client(cluster.url, prefix=prefix) as client:
            leaving = qs.Client(cluster.url, prefix=prefix)
            caller = Caller(leaving, "count", [{"n": 1, "hold": True}])
            caller.next_event()
            waiting = client.submit("count", [{"n": 2, "base": 4}])
            # While that caller listens, it is not taken for gone, however many graces pass:
            # its subscribers are counted on every master, not only on the serving's
            time.sleep(6 * 0.5)
            assert not caller.finished.is_set() and not waiting.done()
            # When its client closes, Then its slot is freed for the request that waited
            leaving.close()
            assert waiting.result(timeout=30) == [expected({"n": 2, "base": 4})]
            assert caller.finished.wait(30)
    finally:
        serving.gate.set()
        worker.stop(timeout=10)


@pytest.mark.parametrize("failure", ["kill", "takeover"])
def test_a_failed_master_loses_no_durable_request(
    cluster: Cluster, prefix: str, failure: str
) -> None:
    # Given a durable serving on 3 shards, and 4 threads sending under load
    executed: Counter[int] = Counter()
    lock = threading.Lock()

    def record(xs: list[int]) -> list[int]:
        with lock:
            executed.update(xs)
        return [x + 1 for x in xs]

    serving = qs.Serving(
        record, name="durable", batch_size=32, batch_timeout=0.002, shards=3, durable=True
    )
    worker = qs.Worker(
        [serving], redis_url=cluster.url, prefix=prefix, handle_signals=False
    ).start()
    outcomes: dict[int, str] = {}
    stop = threading.Event()

    inboxes: list[str] = []
    errors: list[BaseException] = []

    def send(first: int) -> None:
        try:
            with qs.Client(cluster.url, prefix=prefix) as client:
                # one call at a time: each answer comes to this thread's own inbox
                inboxes.append(client._core.own_inbox(threading.get_ident()))
                n = first
                while not stop.is_set():
                    try:
                        answer = client.dispatch(serving, n, timeout=40)
                        outcomes[n] = "answered" if answer == n + 1 else "wrong"
                    except qs.Timeout:
                        outcomes[n] = "lost"  # accepted (a replica acknowledged), unanswered
                    except (qs.NotReplicated, qs.RedisUnavailable):
                        outcomes[n] = "refused"  # the caller was told: nothing silent
                    n += 4
        except BaseException as e:  # a thread that dies fails the test
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(outcomes) > 200 and inboxes, "answers before the kill")
        # When the master holding a sender's inbox (and, 3 shards on 3 masters, a shard) is
        # SIGKILLed, or its replica takes over while it runs on (CLUSTER FAILOVER TAKEOVER:
        # it takes writes until it learns of the new epoch): requests and replies on the line
        killed_at = len(outcomes)
        _fail_master(cluster, key_slot(inboxes[0]), failure)
        wait_until(
            lambda: sum(v == "answered" for v in list(outcomes.values())[killed_at:]) > 300,
            "answers after the failover",
            timeout=60,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        worker.stop(timeout=10)
    counts = Counter(outcomes.values())
    duplicated = sum(1 for n in outcomes if executed[n] > 1)
    print(
        f"\nmaster failed ({failure}) under durable load: {dict(counts)}, executed twice: "
        f"{duplicated}"
    )
    # Then every request a caller was told was accepted got its one right answer
    assert not errors, errors
    assert counts["lost"] == 0 and counts["wrong"] == 0, counts


def _fail_master(cluster: Cluster, slot: int, failure: str) -> None:
    """Fail the master of ``slot`` and wait until a replica serves it, and has a replica."""
    victim = cluster.node_of_slot(slot)
    if failure == "kill":
        victim.kill()
    else:
        with redis.Redis(port=_replica_of(cluster, victim).port) as replica:
            replica.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
    wait_until(
        lambda: cluster.node_of_slot(slot).port != victim.port, "a replica promoted", timeout=30
    )
    if failure == "kill":
        victim.restart()  # it comes back as the new master's replica: durable again
    wait_until(
        lambda: _online_replicas(cluster.node_of_slot(slot).port) == 1,
        "the old master to replicate the new one",
        timeout=30,
    )


def test_durable_replies_reach_a_replica_of_the_inbox_master_before_the_ack(
    cluster: Cluster, prefix: str
) -> None:
    # Given a request read by a worker on one master, its caller's inbox on another master
    keys = Keys(prefix, "held")
    stream = keys.stream("default")
    broker = RedisBroker(cluster.url)
    rc = cluster.client()
    broker.ensure_group(stream)
    entry_id = rc.xadd(stream, {"h": b"", "p": b""})
    rc.xreadgroup(GROUP, "worker", {stream: ">"})
    stream_master = cluster.node_of_slot(key_slot(stream)).port
    inbox = next(
        f"{prefix}:inbox:c{i}"
        for i in range(100)
        if cluster.node_of_slot(key_slot(f"{prefix}:inbox:c{i}")).port != stream_master
    )
    inbox_master = cluster.node_of_slot(key_slot(inbox))
    replica = _replica_of(cluster, inbox_master)
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        # When the worker answers a durable serving's request while that master's replica
        # cannot acknowledge anything
        with pytest.raises(qs.RedisUnavailable, match="no replica of the master holding"):
            broker.reply_and_ack(
                keys, {inbox: [b"answer"]}, {stream: {0: [entry_id]}}, 60_000, durable=True
            )
        # Then the reply is in the inbox, but the request is not acked: a failover of the
        # inbox's master now would lose the reply, and the request would be served again
        assert rc.lrange(inbox, 0, -1) == [b"answer"]
        assert rc.xpending(stream, GROUP)["pending"] == 1
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    # And once the replica acknowledges, the retried call acks it (the caller keeps the
    # first copy of the reply)
    wait_until(lambda: _online_replicas(inbox_master.port) == 1, "the replica to catch up")
    broker.reply_and_ack(
        keys, {inbox: [b"answer"]}, {stream: {0: [entry_id]}}, 60_000, durable=True
    )
    assert rc.xpending(stream, GROUP)["pending"] == 0
    assert rc.lrange(inbox, 0, -1) == [b"answer", b"answer"]
    broker.close()
    rc.close()


def _replica_of(cluster: Cluster, master: RedisServer) -> RedisServer:
    with redis.Redis(port=master.port) as r:
        port = int(r.info("replication")["slave0"]["port"])
    return next(n for n in cluster.nodes if n.port == port)


def _online_replicas(port: int) -> int:
    with redis.Redis(port=port) as r:
        info = r.info("replication")
    return sum(
        1
        for k, v in info.items()
        if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
    )
