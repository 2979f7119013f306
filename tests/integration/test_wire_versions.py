"""Mixed wire versions during a rolling upgrade (docs/architecture.md, "Wire versions"): a
worker of this version answers entries written as clients of the version before the header's
map of optional fields wrote them, and entries that carry the map; a client of this version is
answered by a worker that reads headers as the old version did. Nothing is lost, nothing is
dead-lettered."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

import queueserve as qs
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, events_channel, inbox_key
from queueserve.wire.kinds import RESULTS
from queueserve.wire.reply import parse_reply
from queueserve.wire.request import encode_request
from queueserve.worker.pipeline import decode
from tests.support.helpers import wait_until
from tests.support.old_wire import old_encode_request, old_parse_header
from tests.support.servings import Recording, tag_items

MSGPACK = get_codec("msgpack")
StartWorker = Callable[..., qs.Worker]


def answers(redis_client: redis.Redis, inbox: str, count: int) -> dict[int, list[object]]:
    """rid -> results of ``count`` requests, read from ``inbox`` as they come."""
    got: dict[int, list[object]] = {}

    def read() -> bool:
        popped = redis_client.blpop([inbox], timeout=1)
        if popped is not None:
            for rid, _offset, _count, kind, body, *_ in parse_reply(popped[1], {MSGPACK.tag}):
                assert kind == RESULTS, body
                got[rid] = body
        return len(got) == count

    wait_until(read, f"answers to all {count} requests")
    return got


def no_dead_letters(redis_client: redis.Redis, keys: Keys) -> None:
    assert redis_client.xlen(keys.dead) == 0, redis_client.xrange(keys.dead)


def test_entries_of_old_clients_and_entries_with_optional_fields_are_answered(
    start_worker: StartWorker, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker of this version
    start_worker(Recording(tag_items, name="mixed", batch_size=8, batch_timeout=0))
    keys = Keys(prefix, "mixed")
    inbox = inbox_key(prefix, "oldclient")
    events = events_channel(prefix, "oldclient")
    wait_until(lambda: redis_client.exists(keys.meta), "the worker's declaration")

    # When clients of the old version write entries of each header shape they wrote, and a
    # client of this one writes entries with optional fields
    sent = {
        1: old_encode_request(MSGPACK, 1, ["a"], inbox, None),
        2: old_encode_request(MSGPACK, 2, ["b", "c"], inbox, None, events),
        3: encode_request(MSGPACK, 3, ["d"], inbox, None, fields={"trace": "00-ab-cd-01"}),
        4: encode_request(
            MSGPACK,
            4,
            ["e"],
            inbox,
            None,
            events,
            fields={"tenant": "acme", "a-field-of-a-later-version": {"x": 1}},
        ),
    }
    for header, payload in sent.values():
        n = len(MSGPACK.loads(payload))
        redis_client.xadd(keys.stream("default"), {"h": header, "p": payload, "a": n})
        redis_client.incrby(keys.queued, n)

    # Then each is answered, and nothing was dead-lettered
    assert answers(redis_client, inbox, 4) == {
        1: ["r:a"],
        2: ["r:b", "r:c"],
        3: ["r:d"],
        4: ["r:e"],
    }
    no_dead_letters(redis_client, keys)


@pytest.mark.parametrize("priority", [0, 4])
def test_a_client_of_this_version_is_answered_by_a_worker_reading_headers_the_old_way(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    priority: int,
) -> None:
    # Given a worker that reads request headers as the version before the optional fields did
    monkeypatch.setattr(decode, "parse_header", old_parse_header)
    start_worker(Recording(tag_items, name="old", batch_size=8, batch_timeout=0))

    # When a client of this version sends requests, one by one and several at once
    one = client.dispatch("old", "x", timeout=30, priority=priority)
    many = client.submit("old", ["y", "z"], priority=priority).result(timeout=30)

    # Then all are answered, and nothing was dead-lettered
    assert (one, many) == ("r:x", ["r:y", "r:z"])
    no_dead_letters(redis_client, Keys(prefix, "old"))
