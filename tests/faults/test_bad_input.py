"""docs/design.md §5 "Bad input": whatever anyone writes to a serving's stream, the worker keeps
running, answers what it can answer with a per-request error, dead-letters the rest with the reason,
and every other request is served. Client-side limits refuse oversize requests before sending."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis
from pydantic import BaseModel, PositiveInt

import queueserve as qs
from tests.support.fault_app import RawInbox, Workers, header, serving_consumer
from tests.support.helpers import stream_key, wait_until

StartWorker = Callable[..., qs.Worker]
RESULT_WAIT_S = 60.0
MALFORMED = 10_000
GOOD_EVERY = 20  # one good request after every 20 malformed entries


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value))


# Malformed entries: (kind, fields for request id ``rid`` replying to ``inbox``, and the text the
# dead-letter reason must hold, or None when the entry is answered with BadRequest).
Malformed = tuple[str, Callable[[int, str], dict[str, bytes]], str | None]
KINDS: list[Malformed] = [
    ("missing header", lambda rid, inbox: {"p": pack(["x"])}, "no 'h' (header) field"),
    (
        "garbage header",
        lambda rid, inbox: {"h": b"\xc1\xff\x00", "p": pack(["x"])},
        "malformed entry",
    ),
    (
        "truncated header",
        lambda rid, inbox: {"h": header(rid, 1, inbox)[:5], "p": pack(["x"])},
        "malformed entry",
    ),
    (
        "header not a list",
        lambda rid, inbox: {"h": pack({"id": rid}), "p": pack(["x"])},
        "header must be a list",
    ),
    (
        "short header",
        lambda rid, inbox: {"h": pack([1, rid, 1, inbox]), "p": pack(["x"])},
        "header must be a list",
    ),
    (
        "wrong types",
        lambda rid, inbox: {"h": pack([1, str(rid), 1, inbox, 0, "msgpack"]), "p": pack(["x"])},
        "wrong types",
    ),
    (
        "zero items",
        lambda rid, inbox: {"h": pack([1, rid, 0, inbox, 0, "msgpack"]), "p": pack([])},
        "wrong types",
    ),
    (
        "wrong version",
        lambda rid, inbox: {"h": pack([99, rid, 1, inbox, 0, "msgpack"]), "p": pack(["x"])},
        "wire version 99",
    ),
    (
        "unknown codec",
        lambda rid, inbox: {"h": header(rid, 1, inbox, codec="zstd"), "p": pack(["x"])},
        None,
    ),
    (
        "undecodable payload",
        lambda rid, inbox: {"h": header(rid, 1, inbox), "p": b"\xc1\x00"},
        None,
    ),
    (
        "count mismatch",
        lambda rid, inbox: {"h": header(rid, 3, inbox), "p": pack(["x", "y"])},
        None,
    ),
    ("payload not a list", lambda rid, inbox: {"h": header(rid, 1, inbox), "p": pack(5)}, None),
    ("missing payload", lambda rid, inbox: {"h": header(rid, 1, inbox)}, None),
]
ANSWER_TEXT = {
    "unknown codec": "accepts codec 'msgpack', the request used 'zstd'",
    "undecodable payload": "could not be decoded",
    "count mismatch": "payload must be a list of 3 items",
    "payload not a list": "payload must be a list of 1 items",
    "missing payload": "no 'p' (payload) field",
}


def flood(
    r: redis.Redis, client: qs.Client, stream: str, inbox: RawInbox
) -> tuple[dict[bytes, str], dict[int, str], list[tuple[qs.Ticket, str]]]:
    """XADD MALFORMED malformed entries, with a good request (sent by a client) after every
    GOOD_EVERY; returns entry id -> kind, answerable rid -> kind, and the good tickets."""
    by_entry: dict[bytes, str] = {}
    by_rid: dict[int, str] = {}
    good: list[tuple[qs.Ticket, str]] = []
    for start in range(0, MALFORMED, GOOD_EVERY):
        pipe = r.pipeline(transaction=False)
        rids = range(start + 1, min(start + GOOD_EVERY, MALFORMED) + 1)
        for rid in rids:
            kind, fields, _ = KINDS[rid % len(KINDS)]
            pipe.xadd(stream, fields(rid, inbox.key))  # type: ignore[arg-type]
            by_rid[rid] = kind
        for rid, entry_id in zip(rids, pipe.execute(), strict=True):
            by_entry[entry_id] = by_rid[rid]
        value = f"g{start}"
        good.append((client.submit("sturdy", [value]), f"r:{value}"))
    answerable = {rid: kind for rid, kind in by_rid.items() if kind in ANSWER_TEXT}
    return by_entry, answerable, good


@pytest.mark.timeout(240)
def test_a_flood_of_malformed_entries_is_answered_or_dead_lettered_and_nothing_else_is_lost(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker, and a reply address the test reads itself
    worker = workers.start("sturdy")
    serving_consumer(redis_client, prefix, "sturdy", worker)
    assert client.dispatch("sturdy", "first", timeout=RESULT_WAIT_S) == "r:first"
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "sturdy")

    # When 10,000 malformed entries of 13 kinds are written, interleaved with good requests
    by_entry, answerable, good = flood(redis_client, client, stream, inbox)

    # Then every good request is answered with its own result
    assert [t.result(RESULT_WAIT_S) for t, _ in good] == [[want] for _, want in good]
    # and every malformed entry with a readable reply address gets exactly one BadRequest
    wait_until(lambda: inbox.answered(answerable), "answers to the answerable entries")
    for rid, kind in answerable.items():
        assert inbox.error_kind(rid) == "bad_request", (kind, inbox.slices[rid])
        assert ANSWER_TEXT[kind] in inbox.slices[rid][0][3][1], (kind, inbox.slices[rid])
    assert set(inbox.slices) == set(answerable)  # nothing else got an answer
    # (one each: the answer to "first" loaded the ack script, so no reply is sent again)
    assert all(len(inbox.slices[rid]) == 1 for rid in answerable)
    # and every other one is in the dead-letter stream, with its reason
    dead_key = f"{stream.rsplit(':in:', 1)[0]}:dead"
    unanswerable = {e: k for e, k in by_entry.items() if k not in ANSWER_TEXT}
    wait_until(lambda: redis_client.xlen(dead_key) == len(unanswerable), "the dead letters")
    reasons = {kind: text for kind, _, text in KINDS}
    for _, fields in redis_client.xrange(dead_key, "-", "+"):
        kind = unanswerable.pop(fields[b"entry_id"])
        assert reasons[kind] in fields[b"reason"].decode(), (kind, fields)
        assert fields[b"stream"].decode() == stream
    assert not unanswerable
    # and the worker kept running: nothing is left in the stream, no partition died
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")
    assert client.dispatch("sturdy", "last", timeout=RESULT_WAIT_S) == "r:last"
    assert worker.alive and "restarting" not in worker.output()


def test_malformed_entries_release_nothing_from_the_admission_counter(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker whose counter holds a backlog (as if 40 admitted items waited elsewhere:
    # ack.lua clamps the counter at zero, so from zero a wrong release could not show), and
    # requests written by hand (not through admission) that get answered
    serving = qs.Serving(lambda xs: list(xs), name="counted", batch_size=8, batch_timeout=0)
    start_worker(serving)
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "counted")
    queued = f"{prefix}:{{counted}}:queued"
    assert client.dispatch(serving, "good", timeout=RESULT_WAIT_S) == "good"
    wait_until(lambda: redis_client.xlen(stream) == 0, "the good request acked")
    redis_client.set(queued, 40)
    for rid in range(1, 11):
        redis_client.xadd(stream, {"h": header(rid, 3, inbox.key), "p": pack(["a", "b"])})

    # When the worker has answered them all
    wait_until(lambda: inbox.answered(range(1, 11)), "the BadRequest answers")
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")

    # Then they released nothing: the counter holds exactly the backlog
    assert int(redis_client.get(queued) or 0) == 40


@pytest.mark.timeout(120)
def test_a_50_mb_payload_over_max_payload_bytes_gets_a_per_request_error(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker for a serving with the default max_payload_bytes (16 MiB)
    serving = qs.Serving(lambda xs: [len(x) for x in xs], name="big", batch_size=8, batch_timeout=0)
    start_worker(serving)
    inbox = RawInbox(redis_client, prefix)

    # When a 50 MB payload is written to its stream by hand, between two good requests
    before = client.submit(serving, [b"ok"])
    redis_client.xadd(
        stream_key(prefix, "big"),
        {"h": header(7, 1, inbox.key), "p": pack([b"\x00" * (50 * 1024 * 1024)])},
    )
    after = client.submit(serving, [b"fine"])

    # Then its sender gets a BadRequest naming the limit, and the others their results
    wait_until(lambda: inbox.answered([7]), "the answer to the oversize request")
    assert inbox.error_kind(7) == "bad_request"
    assert "over max_payload_bytes=16777216" in inbox.slices[7][0][3][1]
    assert before.result(RESULT_WAIT_S) == [2] and after.result(RESULT_WAIT_S) == [4]
    wait_until(lambda: redis_client.xlen(stream_key(prefix, "big")) == 0, "every entry acked")


def test_the_client_refuses_an_oversize_request_before_sending_it(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker that declared max_payload_bytes=1 MiB for its serving
    serving = qs.Serving(
        lambda xs: list(xs),
        name="small",
        batch_size=8,
        batch_timeout=0,
        max_payload_bytes=1024 * 1024,
    )
    start_worker(serving)
    assert client.dispatch("small", "x", timeout=RESULT_WAIT_S) == "x"
    stream = stream_key(prefix, "small")
    length = redis_client.xlen(stream)

    # When a caller sends 2 MB, by name (limit known from the workers) or with the object
    for target in ("small", serving):
        with pytest.raises(qs.BadRequest, match="over max_payload_bytes=1048576"):
            client.dispatch(target, b"\x00" * (2 * 1024 * 1024), timeout=RESULT_WAIT_S)

    # Then nothing was written to the stream or admitted
    assert redis_client.xlen(stream) == length
    assert int(redis_client.get(f"{prefix}:{{small}}:queued") or 0) == 0
    assert client.dispatch("small", "y", timeout=RESULT_WAIT_S) == "y"


class Point(BaseModel):
    x: PositiveInt
    y: int


def test_items_failing_the_input_model_get_bad_request_and_the_rest_of_the_request_runs(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving that validates its items with a pydantic model
    seen: list[Any] = []

    def add(points: list[Point]) -> list[int]:
        seen.extend(points)
        return [p.x + p.y for p in points]

    start_worker(qs.Serving(add, name="points", batch_size=8, batch_timeout=0, input_model=Point))

    # When one request mixes valid and invalid items
    items = [{"x": 1, "y": 2}, {"x": -1, "y": 0}, {"y": 3}, "not a point", {"x": 4, "y": 5}]
    results = client.dispatch_many("points", items, timeout=RESULT_WAIT_S, return_exceptions=True)

    # Then the valid items get results, each invalid one a BadRequest saying what is wrong
    assert results[0] == 3 and results[4] == 9
    for bad, field in zip(results[1:4], ("x", "x", "Point"), strict=True):
        assert isinstance(bad, qs.BadRequest), bad
        assert "does not match Point" in str(bad) and field in str(bad)
    # and the batch function only ever saw validated model instances
    assert seen == [Point(x=1, y=2), Point(x=4, y=5)]


def test_items_whose_cost_cannot_be_computed_fail_alone(
    start_worker: StartWorker, client: qs.Client
) -> None:
    start_worker(
        qs.Serving(
            lambda xs: [len(x) for x in xs], name="costly", batch_size=10, batch_timeout=0, cost=len
        )
    )

    results = client.dispatch_many(
        "costly", ["ab", 5, "x" * 11, "abc"], timeout=RESULT_WAIT_S, return_exceptions=True
    )

    assert results[0] == 2 and results[3] == 3
    assert isinstance(results[1], qs.BadRequest) and "cost function failed" in str(results[1])
    assert isinstance(results[2], qs.BadRequest) and "more than the capacity" in str(results[2])
