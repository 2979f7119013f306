"""A cancel names a request, not only its entry (issue 38, finding 3): the ledger drops one
request of a pack from the batch that would run it, and only that one, and the parsers of the
cancel message and of a pack's withdrawals (wire/cancel.py) read nothing else as one."""

from __future__ import annotations

import pytest

from queueserve.wire.cancel import parse_cancel, parse_withdrawn
from queueserve.wire.protocol import MAX_PACK_REQUESTS
from queueserve.worker.pipeline.batching import Pack, Request, Slice, TakenBatch
from queueserve.worker.pipeline.ledger import Ledger, cancel_key

STREAM = "qs:{s}:in:default"


def pack_of(*rids: int, entry: bytes = b"5-0") -> list[Request]:
    """The requests of one pack entry, one item each."""
    pack = Pack(len(rids), len(rids))
    requests = []
    for rid in rids:
        request = Request(entry, STREAM, rid, "qs:inbox:c", 0.0, 1)
        request.pack = pack
        requests.append(request)
    return requests


def held(ledger: Ledger, requests: list[Request]) -> TakenBatch:
    """``requests`` read and held, and the batch that would run them all."""
    slices = [Slice(r, 0, [r.rid]) for r in requests]
    with ledger.cond:
        ledger.hold([("default", s) for s in slices], [])
    return TakenBatch("default", slices)


def rids(slices: list[Slice]) -> list[int]:
    return [s.request.rid for s in slices]


def test_a_cancel_naming_one_request_of_a_pack_drops_it_alone() -> None:
    ledger = Ledger()
    batch = held(ledger, pack_of(1, 2, 3))
    ledger.cancel((STREAM, b"5-0", 2))
    with ledger.cond:
        assert rids(ledger.withdraw_cancelled(batch)) == [2]
    assert rids(batch.slices) == [1, 3]


def test_a_cancel_naming_a_pack_entry_alone_drops_none_of_its_requests() -> None:
    ledger = Ledger()
    batch = held(ledger, pack_of(1, 2))
    ledger.cancel((STREAM, b"5-0"))  # the shape of a cancel of an entry of one request
    ledger.cancel((STREAM, b"5-0", 9))  # a request id the pack does not hold
    ledger.cancel((STREAM, b"6-0", 1))  # another entry's
    with ledger.cond:
        assert ledger.withdraw_cancelled(batch) == []
    assert rids(batch.slices) == [1, 2]


def test_a_cancel_heard_before_its_pack_was_held_drops_it_once_held() -> None:
    ledger = Ledger()
    ledger.cancel((STREAM, b"5-0", 3))  # read already, not yet held
    batch = held(ledger, pack_of(3, 4))
    with ledger.cond:
        assert rids(ledger.withdraw_cancelled(batch)) == [3]


def test_an_entry_of_one_request_is_still_cancelled_by_its_entry() -> None:
    ledger = Ledger()
    alone = Request(b"7-0", STREAM, 1, "qs:inbox:c", 0.0, 1)
    batch = held(ledger, [alone])
    assert cancel_key(alone) == (STREAM, b"7-0")
    ledger.cancel((STREAM, b"7-0"))
    with ledger.cond:
        assert rids(ledger.withdraw_cancelled(batch)) == [1]


def test_settling_a_pack_forgets_its_cancels_and_keeps_the_set_running_batches_hold() -> None:
    ledger = Ledger()
    held(ledger, pack_of(1, 2))
    held(ledger, pack_of(1, entry=b"6-0"))
    cancelled = ledger.cancelled  # what a running batch was given (batch_context.py)
    ledger.cancel((STREAM, b"5-0", 1))
    ledger.cancel((STREAM, b"6-0", 1))
    ledger.settle([(STREAM, b"5-0")])
    assert ledger.cancelled is cancelled and cancelled == {(STREAM, b"6-0", 1)}


@pytest.mark.parametrize(
    ("message", "key"),
    [
        (b"qs:{s}:in:a\nkey\n17-3/42", ("qs:{s}:in:a\nkey", b"17-3", 42)),
        (b"s\n1-0/0", ("s", b"1-0", 0)),
        (b"s\n1-0/", None),
        (b"s\n1-0/x", None),
        (b"s\n1-0/-1", None),
        (b"s\n1-0/1/2", None),
        (b"s\n1-0/" + b"9" * 21, None),
    ],
)
def test_a_cancel_of_a_packed_request_names_its_entry_and_its_id(
    message: bytes, key: tuple[object, ...] | None
) -> None:
    assert parse_cancel(message) == key


@pytest.mark.parametrize(
    ("raw", "ids"),
    [
        (b"7", {7}),
        (b"7,9,7", {7, 9}),
        (b"", set()),
        (b"7,", set()),
        (b",7", set()),
        (b"7;9", set()),
        (b"-7", set()),
        (b" 7", set()),
        (b"9" * 21, set()),
        (b",".join([b"1"] * (MAX_PACK_REQUESTS * 11)), set()),
    ],
)
def test_a_packs_withdrawals_are_request_ids_or_none(raw: bytes, ids: set[int]) -> None:
    assert parse_withdrawn(raw) == ids
