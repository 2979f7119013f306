"""Packs: the requests of one enqueue to one stream travel as one entry (enqueue.lua), once the
workers have declared that they read them. Each request is still answered, failed, cancelled
and dead-lettered on its own (docs/guarantees.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.ops.deadletter import DeadLetters
from queueserve.wire.keys import Keys
from queueserve.wire.kinds import ERROR
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox, Workers, header, serving_consumer
from tests.support.helpers import stream_key, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]
BACKLOG = 40  # admitted items waiting elsewhere: ack.lua clamps the counter at 0, hiding
# a release of too much from a test that starts at 0


def requests(inbox: RawInbox, items: list[str], first_rid: int = 1) -> list[tuple]:
    """One single-item request per item, answered to ``inbox``: enqueue.lua's arguments."""
    return [
        ("default", 1, header(first_rid + i, 1, inbox.key), msgpack.packb([item]), 0)
        for i, item in enumerate(items)
    ]


def unread_pack(
    r: redis.Redis, redis_url: str, prefix: str, serving: str
) -> tuple[Keys, RedisBroker, RawInbox, list[bytes | int]]:
    """A pack of three requests ("a", "b", "c"; ids 1-3) for ``serving``, which no worker runs
    yet (its declaration made by hand): keys, the broker that sent it, the inbox its answers
    go to, and the entry id of each request."""
    keys = Keys(prefix, serving)
    r.hset(keys.meta, "pack_items", 8)
    broker = RedisBroker(redis_url)
    inbox = RawInbox(r, prefix)
    _, _, ids = broker.enqueue(keys, requests(inbox, ["a", "b", "c"]), 0)
    return keys, broker, inbox, ids


def results(inbox: RawInbox, rids: range) -> list[object]:
    """Each request's result, or its error kind. The first answer of each: a worker sends a
    reply again when Redis lacked its ack script (clients keep the first)."""
    wait_until(lambda: inbox.answered(rids), "every request answered")
    first = [inbox.slices[rid][0] for rid in rids]
    return [body if kind != ERROR else body[3] for _, _, kind, body in first]


def test_the_requests_of_one_enqueue_share_an_entry_and_each_gets_its_own_answer(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker, which declares that it reads packs
    serving = qs.Serving(
        lambda xs: [f"r:{x}" for x in xs], name="packed", batch_size=8, batch_timeout=0
    )
    worker = start_worker(serving)
    keys = Keys(prefix, "packed")
    assert redis_client.hget(keys.meta, "pack_items") == b"8"
    broker = RedisBroker(redis_url)
    inbox = RawInbox(redis_client, prefix)
    redis_client.set(keys.queued, BACKLOG)

    # When 10 one-item requests are enqueued at once
    _, _, ids = broker.enqueue(keys, requests(inbox, [f"x{i}" for i in range(10)]), 0)

    # Then they travel as packs of at most 8 items: 2 entries
    assert len(set(ids)) == 2 and ids[:8] == [ids[0]] * 8, ids
    # and each request gets its own result, and the admitted items are released, each once
    assert results(inbox, range(1, 11)) == [[f"r:x{i}"] for i in range(10)]
    wait_until(lambda: redis_client.xlen(stream_key(prefix, "packed")) == 0, "packs acked")
    assert int(redis_client.get(keys.queued) or 0) == BACKLOG

    # When the declaration says the workers do not read packs (theirs, with none running: a
    # running worker writes back what it declared, worker/pipeline/declaration.py), each
    # request is an entry, which the next worker answers
    worker.stop()
    redis_client.hset(keys.meta, "pack_items", 0)
    _, _, ids = broker.enqueue(keys, requests(inbox, ["y0", "y1"], 11), 0)
    assert len(set(ids)) == 2
    start_worker(serving)
    assert results(inbox, range(11, 13)) == [["r:y0"], ["r:y1"]]
    broker.close()


def test_admission_takes_the_part_of_a_pack_that_fits(
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a serving whose workers declared packs and max_queue=3 (none running)
    keys = Keys(prefix, "tight")
    redis_client.hset(keys.meta, mapping={"pack_items": 8, "max_queue": 3})
    broker = RedisBroker(redis_url)
    inbox = RawInbox(redis_client, prefix)

    # When 5 one-item requests are enqueued at once
    limit, queued, ids = broker.enqueue(keys, requests(inbox, list("abcde")), 0)

    # Then the first 3 are admitted, in one pack, and the other 2 refused
    assert (limit, queued) == (3, 3)
    assert ids[3:] == [0, 0] and ids[0] and ids[:3] == [ids[0]] * 3
    ((_, fields),) = redis_client.xrange(stream_key(prefix, "tight"))
    assert fields[b"a"] == b"3"
    assert [m[2] for m in msgpack.unpackb(fields[b"k"], raw=True)] == [b"1"] * 3
    broker.close()


def test_a_cancel_withdraws_its_request_from_a_queued_pack_and_its_pack_mates_run(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a pack of three requests no worker has read yet, and items admitted elsewhere
    keys, broker, inbox, ids = unread_pack(redis_client, redis_url, prefix, "cancels")
    redis_client.incrby(keys.queued, BACKLOG)
    stream = stream_key(prefix, "cancels")

    # When one of its callers cancels (issue 38, finding 3: before, it ran and its answer was
    # dropped by its client, and the cancel said so)
    assert broker.cancel(keys, stream, ids[1], 1, 2, inbox.key) is True
    assert broker.cancel(keys, stream, ids[1], 1, 2, inbox.key) is True  # (again: the same)

    # Then the pack stays, its items counted until its ack, the cancel recorded beside it
    assert redis_client.xlen(stream) == 1
    assert int(redis_client.get(keys.queued) or 0) == BACKLOG + 3
    assert redis_client.hgetall(keys.withdrawn) == {f"{stream}\n{ids[1].decode()}".encode(): b"2"}
    # and once a worker comes (a forged cancel on the channel, naming the pack, changes
    # nothing), its other requests run and are answered, and the cancelled one never runs
    serving = Recording(name="cancels", batch_size=8, batch_timeout=0)
    start_worker(serving)
    redis_client.publish(keys.cancel, f"{stream}\n{ids[0].decode()}")
    assert results(inbox, range(1, 4, 2)) == [["a"], ["c"]]
    wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
    inbox.drain()
    assert 2 not in inbox.slices
    assert sorted(serving.items_run) == ["a", "c"]
    # and its items are released with the pack's, each once; the record went with the read
    assert int(redis_client.get(keys.queued) or 0) == BACKLOG
    assert redis_client.hget(keys.depth, "default") is None
    assert not redis_client.exists(keys.withdrawn)
    broker.close()


def test_bad_requests_in_a_pack_fail_alone_and_a_malformed_pack_is_dead_lettered_whole(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker
    serving = qs.Serving(
        lambda xs: [f"r:{x}" for x in xs], name="mixed", batch_size=8, batch_timeout=0
    )
    start_worker(serving)
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "mixed")
    dead = f"{prefix}:{{mixed}}:dead"

    # When a pack holds a good request, one whose payload is not msgpack, and one whose reply
    # address is forged
    good = [header(1, 1, inbox.key), msgpack.packb(["fine"]), b"1"]
    bad_payload = [header(2, 1, inbox.key), b"\xc1", b"1"]
    forged = [header(3, 1, "elsewhere"), msgpack.packb(["x"]), b"1"]
    redis_client.xadd(stream, {"a": 3, "k": msgpack.packb([good, bad_payload, forged])})

    # Then the good one gets its result, the bad one a BadRequest, the forged one a dead letter
    assert results(inbox, range(1, 3)) == [["r:fine"], "bad_request"]
    wait_until(lambda: redis_client.xlen(dead) == 1, "a dead letter")
    ((_, record),) = redis_client.xrange(dead)
    assert b"reply address 'elsewhere'" in record[b"reason"]
    assert record[b"field:h"] == forged[0] and record[b"field:p"] == forged[1]
    wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked once all were done")

    # When a pack's 'k' field is not a pack
    redis_client.xadd(stream, {"a": 2, "k": b"\x93junk"})

    # Then the whole entry is dead-lettered, its fields kept, and nothing else is answered
    wait_until(lambda: redis_client.xlen(dead) == 2, "the malformed pack dead-lettered")
    record = redis_client.xrange(dead)[-1][1]
    assert b"malformed pack" in record[b"reason"] and record[b"field:k"] == b"\x93junk"
    wait_until(lambda: redis_client.xlen(stream) == 0, "the malformed pack acked")
    assert set(inbox.slices) == {1, 2}


def test_a_pack_reclaimed_from_a_killed_worker_is_split_so_its_crasher_dies_alone(
    workers: Workers,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker whose partition dies on "boom" (max_deliveries=2, batches of 4)
    worker = workers.start("crasher_batched", "--max-restarts", "50")
    serving_consumer(redis_client, prefix, "crasher-batched", worker)
    keys = Keys(prefix, "crasher-batched")
    wait_until(lambda: redis_client.hget(keys.meta, "pack_items"), "the declaration")
    broker = RedisBroker(redis_url)
    inbox = RawInbox(redis_client, prefix)

    # When "boom" arrives in one pack with three healthy requests
    redis_client.set(keys.queued, BACKLOG)
    _, _, ids = broker.enqueue(keys, requests(inbox, ["fine1", "boom", "fine2", "fine3"]), 0)
    assert len(set(ids)) == 1

    # Then the pack is split after the first death; the healthy requests are answered, and
    # only the crasher is dead-lettered, after killing workers on its own
    assert results(inbox, range(1, 5)) == [["ok:fine1"], "dead_letter", ["ok:fine2"], ["ok:fine3"]]
    assert "split into 4 entries" in worker.output()
    # and the pack's items were released once, by the entries it was split into
    wait_until(
        lambda: redis_client.xlen(stream_key(prefix, "crasher-batched")) == 0, "every entry acked"
    )
    assert int(redis_client.get(keys.queued) or 0) == BACKLOG
    broker.close()


def test_a_pack_dead_lettered_whole_is_replayed_request_by_request(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a pack of three requests that a worker older than packs dead-lettered whole (to it,
    # an entry with no 'h' field), as running both versions during an upgrade leaves it
    keys, broker, inbox, _ = unread_pack(redis_client, redis_url, prefix, "upgraded")
    stream = stream_key(prefix, "upgraded")
    ((entry_id, fields),) = redis_client.xrange(stream)
    redis_client.xdel(stream, entry_id)
    redis_client.decrby(keys.queued, 3)
    record = {"stream": stream, "entry_id": entry_id, "deliveries": 1, "at_ms": 0}
    dead_id = redis_client.xadd(
        keys.dead,
        {
            **record,
            "reason": "malformed entry: no 'h' field",
            **{f"field:{name.decode()}": value for name, value in fields.items()},
        },
    ).decode()
    # and one whose pack is not a pack
    junk_id = redis_client.xadd(
        keys.dead,
        {
            **record,
            "reason": "malformed pack",
            "field:k": b"\x93junk",
            "field:a": 2,
        },
    ).decode()

    # When a worker of this version runs and the first is replayed
    start_worker(
        qs.Serving(
            lambda xs: [f"r:{x}" for x in xs], name="upgraded", batch_size=8, batch_timeout=0
        )
    )
    letters = DeadLetters(broker, prefix, "upgraded")
    new_ids = letters.replay(dead_id)

    # Then each of its requests goes back as an entry of its own, and each is answered
    assert len(set(new_ids)) == 3
    assert results(inbox, range(1, 4)) == [["r:a"], ["r:b"], ["r:c"]]
    wait_until(lambda: redis_client.get(keys.queued) == b"0", "admitted items released")
    # and the junk one is refused, saying why, and kept to be dropped
    with pytest.raises(ValueError, match=r"not msgpack.*can only be dropped"):
        letters.replay(junk_id)
    assert [i.decode() for i, _ in redis_client.xrange(keys.dead)] == [junk_id]
    broker.close()


@pytest.mark.parametrize(
    "members",
    [
        ["bad"],  # one entry whose header nobody can read: no one to answer
        ["bad", "bad", "bad"],  # a pack of such requests: none left to answer
        ["bad", "a", "b"],  # a pack with answerable requests: acked after their answers
    ],
)
def test_requests_nobody_can_answer_give_their_admitted_items_back(
    members: list[str],
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker reading packs, and a backlog counted elsewhere (ack.lua clamps at 0)
    serving = qs.Serving(lambda xs: [f"r:{x}" for x in xs], name="owed", batch_size=8)
    start_worker(serving)
    keys = Keys(prefix, "owed")
    redis_client.set(keys.queued, BACKLOG)
    inbox = RawInbox(redis_client, prefix)

    # When requests of two items each are enqueued, some with a header that is no msgpack
    sent = [
        (
            "default",
            2,
            b"\xc1" if m == "bad" else header(i + 1, 2, inbox.key),
            msgpack.packb([m, m]),
            0,
        )
        for i, m in enumerate(members)
    ]
    # (the count enqueue.lua answered: the worker may give the items back before a GET)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        _, queued, _ = broker.enqueue(keys, sent, 0)
    assert queued == BACKLOG + 2 * len(members)

    # Then the unreadable ones are dead-lettered, the others answered, the entry acked, and
    # every admitted item is given back: a producer's bad entry holds no max_queue room
    good = [i + 1 for i, m in enumerate(members) if m != "bad"]
    if good:
        wait_until(lambda: inbox.answered(good), "the readable requests answered")
    wait_until(lambda: redis_client.xlen(stream_key(prefix, "owed")) == 0, "the entry acked")
    wait_until(lambda: int(redis_client.get(keys.queued)) == BACKLOG, "the items given back")
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        letters = DeadLetters(broker, prefix, "owed").records()
    assert len(letters) == members.count("bad")
