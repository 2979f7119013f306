"""What one pack may cost a worker (docs/guarantees.md, "Packs"): at most MAX_PACK_REQUESTS
requests, enqueue.lua closes a pack there and a worker dead-letters a bigger one whole, unread;
the requests of a pack that nobody can be told of are dead-lettered in one round trip, not one
each, so a forged pack holds up the reader (and every other caller of the serving) for one."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.broker.dead_letters import DeadLetter, DeadLetterWriter
from queueserve.wire.keys import Keys
from queueserve.wire.protocol import MAX_PACK_REQUESTS
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import REPO, stream_key, wait_until

StartWorker = Callable[..., qs.Worker]


def forged_pack(inbox: RawInbox, orphans: int, answerable: int = 0) -> dict[str, bytes]:
    """A pack entry written by hand: ``orphans`` requests whose reply address is no inbox,
    then ``answerable`` requests (ids 1...) to ``inbox``."""
    members = [[header(i, 1, "elsewhere"), msgpack.packb([i]), b"0"] for i in range(orphans)]
    members += [
        [header(1 + i, 1, inbox.key), msgpack.packb([f"ok{i}"]), b"0"] for i in range(answerable)
    ]
    return {"a": b"0", "k": msgpack.packb(members)}


@pytest.fixture
def dead_letter_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many records each call of the worker's ``write_dead_letters`` (its consumer's
    ``DeadLetterWriter``) wrote: one call is one round trip."""
    calls: list[int] = []
    write = DeadLetterWriter.write_dead_letters

    def counted(self: DeadLetterWriter, keys: Keys, letters: Sequence[DeadLetter]) -> None:
        calls.append(sum(len(letter.records) for letter in letters))
        write(self, keys, letters)

    monkeypatch.setattr(DeadLetterWriter, "write_dead_letters", counted)
    yield calls


def test_enqueue_closes_a_pack_at_the_bound_workers_hold_it_to(
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given workers that declared packs of 4096 items (none running)
    keys = Keys(prefix, "wide")
    redis_client.hset(keys.meta, "pack_items", 4096)
    broker = RedisBroker(redis_url)
    inbox = RawInbox(redis_client, prefix)

    # When more one-item requests than a pack may hold are enqueued at once
    n = MAX_PACK_REQUESTS + 10
    _, _, ids = broker.enqueue(
        keys, [("default", 1, header(i, 1, inbox.key), msgpack.packb([i]), 0) for i in range(n)], 0
    )

    # Then they travel as two packs: the first holds MAX_PACK_REQUESTS, as enqueue.lua says
    assert ids[:MAX_PACK_REQUESTS] == [ids[0]] * MAX_PACK_REQUESTS and ids[-1] != ids[0]
    packs = redis_client.xrange(stream_key(prefix, "wide"))
    assert [len(msgpack.unpackb(f[b"k"], raw=True)) for _, f in packs] == [MAX_PACK_REQUESTS, 10]
    lua = (REPO / "queueserve/broker/lua/enqueue.lua").read_text()
    assert f"local MAX_PACK_REQUESTS = {MAX_PACK_REQUESTS} " in lua
    broker.close()


def test_a_pack_over_the_bound_is_dead_lettered_whole_unread(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    dead_letter_calls: list[int],
) -> None:
    # Given a running serving
    start_worker(
        qs.Serving(lambda xs: [f"r:{x}" for x in xs], name="bounded", batch_size=8, batch_timeout=0)
    )
    keys = Keys(prefix, "bounded")
    wait_until(lambda: redis_client.hget(keys.meta, "pack_items"), "the declaration")
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "bounded")

    # When a pack of more requests than any client sends is written, one of them answerable
    forged = forged_pack(inbox, orphans=MAX_PACK_REQUESTS + 500, answerable=1)
    redis_client.xadd(stream, forged)

    # Then it is dead-lettered whole, in one record that says why and keeps it
    wait_until(lambda: redis_client.xlen(keys.dead) > 0, "the pack dead-lettered")
    wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
    ((_, record),) = redis_client.xrange(keys.dead)
    assert record[b"reason"].decode() == (
        f"malformed pack: it holds {MAX_PACK_REQUESTS + 501} requests, more than the "
        f"{MAX_PACK_REQUESTS} of any pack a client sends"
    )
    assert record[b"field:k"] == forged["k"] and dead_letter_calls == [1]
    # and the serving goes on: a client's request is answered
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("bounded", "x") == "r:x"
    assert not inbox.answered([1])


def test_the_orphans_of_a_pack_are_dead_lettered_in_one_round_trip(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    dead_letter_calls: list[int],
) -> None:
    # Given a running serving
    start_worker(
        qs.Serving(lambda xs: [f"r:{x}" for x in xs], name="orphans", batch_size=8, batch_timeout=0)
    )
    keys = Keys(prefix, "orphans")
    wait_until(lambda: redis_client.hget(keys.meta, "pack_items"), "the declaration")
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "orphans")

    # When a pack as big as a pack may be holds requests nobody can be told of, and two
    # that can
    redis_client.xadd(stream, forged_pack(inbox, orphans=MAX_PACK_REQUESTS - 2, answerable=2))

    # Then the answerable ones are answered
    wait_until(lambda: inbox.answered([1, 2]), "the answerable requests answered")
    assert [inbox.slices[rid][0][3] for rid in (1, 2)] == [["r:ok0"], ["r:ok1"]]
    # and every orphan is dead-lettered, with its reason and fields, by one call
    wait_until(lambda: redis_client.xlen(stream) == 0, "the pack acked")
    records = redis_client.xrange(keys.dead)
    assert len(records) == MAX_PACK_REQUESTS - 2
    assert dead_letter_calls == [MAX_PACK_REQUESTS - 2]
    first = records[0][1]
    assert b"reply address 'elsewhere' is not an inbox" in first[b"reason"]
    assert first[b"field:h"] == header(0, 1, "elsewhere")
