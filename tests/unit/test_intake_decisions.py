"""Intake decides, the reader writes: turning a read's entries into slices, error rows, dead
letters and pack splits touches no broker (worker/pipeline/intake.py), whatever the entries
hold."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

import queueserve as qs
from queueserve.broker.consumer import Consumer
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.kinds import ERR_DEAD_LETTER, ERR_TIMEOUT, ERROR
from queueserve.wire.request import encode_request, parse_header
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline import decode
from queueserve.worker.pipeline.intake import Entry, Intake

MSGPACK = get_codec("msgpack")
KEYS = Keys("qs", "echo")
STREAM = KEYS.stream("default")
INBOX = inbox_key("qs", "abc")


class NoBroker:
    """Fails the test on any use: deciding must not reach Redis."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"intake used the broker ({name}) while deciding")


def entry(
    entry_id: bytes, fields: dict[bytes, bytes], deliveries: int = 1, reclaimed: bool = False
) -> Entry:
    return Entry(STREAM, entry_id, fields, deliveries, reclaimed)


def request(rid: int, items: list[Any]) -> dict[bytes, bytes]:
    header, payload = encode_request(MSGPACK, rid, items, INBOX, None)
    return {b"h": header, b"p": payload, b"a": str(len(items)).encode()}


def pack(*members: dict[bytes, bytes]) -> dict[bytes, bytes]:
    return {b"a": b"2", b"k": msgpack.packb([[m[b"h"], m[b"p"], m[b"a"]] for m in members])}


def test_every_decision_is_returned_and_nothing_is_written() -> None:
    serving = qs.Serving(lambda xs: xs, name="echo", batch_size=8, max_deliveries=3)
    broker: Consumer = NoBroker()  # type: ignore[assignment]
    intake = Intake(serving, MSGPACK, KEYS, broker, "c1", Middleware())

    decided = intake.ingest(
        [
            entry(b"1-0", request(1, ["a"])),  # runs
            entry(b"2-0", {b"p": b"\x90"}),  # no header: nobody to tell, dead-lettered and acked
            entry(b"3-0", {b"a": b"1", b"k": b"not a pack"}),  # a forged pack: the same
            entry(b"4-0", pack(request(2, ["b"]), request(3, ["c"])), 2, True),  # reclaimed: split
            entry(b"5-0", request(4, ["d"]), 3, True),  # delivered max_deliveries times
            entry(b"6-0", request(5, ["e"]), 2, True),  # reclaimed once more: runs again
        ]
    )

    assert [(key, piece.request.rid) for key, piece in decided.slices] == [
        ("default", 1),
        ("default", 5),
    ]
    assert [e.entry_id for e in decided.splits] == [b"4-0"]
    assert [(d.entry_id, d.ack_now) for d in decided.dead] == [
        (b"2-0", True),
        (b"3-0", True),
        (b"5-0", False),
    ]
    assert "malformed pack" in decided.dead[1].records[0]["reason"]
    # the caller of the dead-lettered request is told (the replier acks it after)
    [(dead_request, _, _, kind, body)] = decided.rows
    assert (dead_request.rid, kind, body[3]) == (4, ERROR, ERR_DEAD_LETTER)


def test_an_entry_split_from_a_reclaimed_pack_is_a_replay_on_every_path() -> None:
    # Given the entries split.lua writes ('r': each request ran once already, in its pack),
    # read for the first time, by a serving whose plain entries take the fast decode and by
    # one whose entries do not (a request model: the full decode)
    split = request(1, ["a"]) | {b"r": b"1"}
    for serving in (
        qs.Serving(lambda xs: xs, name="echo", batch_size=8),
        qs.Serving(lambda xs: xs, name="echo", batch_size=8, cost=len),
    ):
        broker: Consumer = NoBroker()  # type: ignore[assignment]
        intake = Intake(serving, MSGPACK, KEYS, broker, "c1", Middleware())
        # (after an entry of the same caller: its reply address is one the fast decode knows)
        decided = intake.ingest([entry(b"1-0", request(2, ["b"])), entry(b"2-0", split)])
        # Then it runs as a replay (its events restart, its job's record is not taken for a
        # first run's), and a plain entry beside it does not
        assert [(p.request.rid, p.request.replay) for _, p in decided.slices] == [
            (2, False),
            (1, True),
        ]


def test_a_pack_that_split_lua_refuses_becomes_a_dead_letter_of_the_whole_pack() -> None:
    serving = qs.Serving(lambda xs: xs, name="echo", batch_size=8)
    intake = Intake(serving, MSGPACK, KEYS, NoBroker(), "c1", Middleware())  # type: ignore[arg-type]
    refused = intake.split_refused(entry(b"7-0", {b"a": b"1", b"k": b"x"}, 2, True))
    assert (refused.stream, refused.entry_id, refused.ack_now) == (STREAM, b"7-0", True)
    assert "split.lua" in refused.records[0]["reason"]
    assert refused.records[0]["field:k"] == b"x"


def test_an_entry_the_fast_decode_does_not_take_has_its_header_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a plain serving's intake that knows one caller's reply address, and a count of
    # the headers decode.py reads
    serving = qs.Serving(lambda xs: xs, name="echo", batch_size=8)
    intake = Intake(serving, MSGPACK, KEYS, NoBroker(), "c1", Middleware())  # type: ignore[arg-type]
    intake.ingest([entry(b"1-0", request(1, ["a"]))])
    reads: list[bytes] = []

    def counted(raw: bytes) -> list[Any]:
        reads.append(raw)
        return parse_header(raw)

    monkeypatch.setattr(decode, "parse_header", counted)
    other = inbox_key("qs", "other")
    header, payload = encode_request(MSGPACK, 2, ["b"], other, None)
    unknown = {b"h": header, b"p": payload, b"a": b"1"}  # a caller not seen before
    header, payload = encode_request(MSGPACK, 3, ["c"], INBOX, time.time() - 60)
    expired = {b"h": header, b"p": payload, b"a": b"1"}
    for fields, how in ((unknown, "runs"), (expired, "times out")):
        for e in (entry(b"2-0", fields), entry(b"3-0", pack(fields))):
            reads.clear()
            # When intake takes it, alone or as a pack's request
            decided = intake.ingest([e])
            intake.inboxes.discard(other)  # (a caller not seen before, again for the next)
            # Then the fast checks' header goes on to the full checks, not read again
            assert reads == [fields[b"h"]], (how, e.entry_id)
            if how == "runs":
                assert [p.request.rid for _, p in decided.slices] == [2]
            else:
                [(_, _, _, kind, body)] = decided.rows
                assert (kind, body[3]) == (ERROR, ERR_TIMEOUT)
