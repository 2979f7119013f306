"""Stream entries into requests (docs/design.md §5 "bad input"): nothing in an entry is trusted."""

from __future__ import annotations

import pickle
import time
from typing import Any

import msgpack
import numpy as np
import pytest

import queueserve as qs
from queueserve.wire.codec import get_codec
from queueserve.wire.kinds import ERR_BAD_REQUEST, ERR_TIMEOUT
from queueserve.wire.protocol import WIRE_VERSION
from queueserve.wire.request import encode_request
from queueserve.worker.pipeline.decode import Accepted, Rejected, decode_entry

MSGPACK = get_codec("msgpack")
PICKLE = get_codec("pickle")
STREAM = "qs:{echo}:in:default"
ENTRY = b"1700000000000-0"
INBOX = "qs:inbox:abc"


def echo(xs: list[Any]) -> list[Any]:
    return xs


SERVING = qs.Serving(echo, name="echo", batch_size=4)


def header(
    version: Any = WIRE_VERSION,
    rid: Any = 7,
    n: Any = 2,
    reply_to: Any = INBOX,
    deadline_ms: Any = 0,
    codec: Any = "msgpack",
) -> bytes:
    return msgpack.packb([version, rid, n, reply_to, deadline_ms, codec])


def fields(h: bytes | None = None, p: bytes | None = None, **extra: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    if h is not None:
        out[b"h"] = h
    if p is not None:
        out[b"p"] = p
    out.update({k.encode(): v for k, v in extra.items()})
    return out


def decode(
    f: dict[bytes, bytes], serving: qs.Serving = SERVING, codec: Any = MSGPACK
) -> Accepted | Rejected:
    return decode_entry(serving, codec, "qs", STREAM, ENTRY, f)


def rejected(result: Accepted | Rejected) -> Rejected:
    assert isinstance(result, Rejected), result
    assert result.entry_id == ENTRY
    assert result.stream == STREAM
    return result


# -- the happy path ----------------------------------------------------------------------------
def test_a_well_formed_entry_is_accepted_as_one_slice() -> None:
    items = [1, {"x": np.arange(3)}]
    h, p = encode_request(MSGPACK, 7, items, INBOX, None)
    result = decode(fields(h, p))
    assert isinstance(result, Accepted)
    req = result.request
    assert (req.entry_id, req.stream, req.rid, req.reply_to, req.n) == (ENTRY, STREAM, 7, INBOX, 2)
    assert req.deadline == 0.0
    assert req.remaining == 2
    assert result.rejected_items == []
    (s,) = result.slices
    assert s.request is req
    assert s.offset == 0
    assert s.items[0] == 1
    np.testing.assert_array_equal(s.items[1]["x"], np.arange(3))
    assert s.costs is None


def test_a_future_deadline_is_kept_in_seconds() -> None:
    deadline = time.time() + 60
    h, p = encode_request(MSGPACK, 1, ["a"], INBOX, deadline)
    result = decode(fields(h, p))
    assert isinstance(result, Accepted)
    assert result.request.deadline == pytest.approx(deadline, abs=0.002)


def test_extra_fields_are_ignored() -> None:
    h, p = encode_request(MSGPACK, 1, ["a"], INBOX, None)
    assert isinstance(decode(fields(h, p, trace=b"xyz")), Accepted)


def test_pickle_serving_accepts_pickle_requests() -> None:
    serving = qs.Serving(echo, name="echo", codec="pickle")
    h, p = encode_request(PICKLE, 1, [{1, 2}], INBOX, None)
    result = decode(fields(h, p), serving, PICKLE)
    assert isinstance(result, Accepted)
    assert result.slices[0].items == [{1, 2}]


# -- malformed headers: nobody to answer -------------------------------------------------------
@pytest.mark.parametrize(
    ("h", "reason"),
    [
        (None, "no 'h'"),
        (b"", "malformed"),
        (b"\xc1garbage", "malformed"),
        (b"not msgpack at all \xff\xfe", "malformed"),
        (msgpack.packb({"v": 1}), "header must be a list"),
        (msgpack.packb([1, 2, 3]), "header must be a list"),
        (msgpack.packb([1, 7, 2, INBOX, 0, "msgpack", "", *range(10)]), "header must be a list"),
        (msgpack.packb("header"), "header must be a list"),
        (msgpack.packb(None), "header must be a list"),
        (header(rid="7"), "wrong types"),
        (header(rid=1.5), "wrong types"),
        (header(n="2"), "wrong types"),
        (header(n=0), "wrong types"),
        (header(n=-1), "wrong types"),
        (header(reply_to=b"qs:inbox:abc"), "wrong types"),
        (header(reply_to=None), "wrong types"),
        (header(deadline_ms=1.5e12), "wrong types"),
        (header(deadline_ms="soon"), "wrong types"),
    ],
    ids=[
        "missing",
        "empty",
        "garbage",
        "binary-junk",
        "map",
        "short",
        "long",
        "str",
        "nil",
        "rid-str",
        "rid-float",
        "n-str",
        "n-zero",
        "n-negative",
        "reply-bytes",
        "reply-nil",
        "deadline-float",
        "deadline-str",
    ],
)
def test_unreadable_headers_are_rejected_with_no_one_to_answer(
    h: bytes | None, reason: str
) -> None:
    result = rejected(decode(fields(h, MSGPACK.dumps([1, 2]))))
    assert result.request is None
    assert result.kind == ERR_BAD_REQUEST
    assert "malformed entry" in result.reason
    assert reason in result.reason


@pytest.mark.parametrize("version", [0, 2, 99, "1", None])
def test_other_wire_versions_are_rejected_naming_both_versions(version: Any) -> None:
    result = rejected(decode(fields(header(version=version), MSGPACK.dumps([1, 2]))))
    assert result.kind == ERR_BAD_REQUEST
    assert "wire version" in result.reason
    assert repr(version) in result.reason
    assert str(WIRE_VERSION) in result.reason


def test_reasons_of_huge_garbage_headers_stay_short() -> None:
    result = rejected(decode(fields(msgpack.packb(["x" * 100_000]), MSGPACK.dumps([1]))))
    assert len(result.reason) < 1000


# -- readable headers: the caller is answered --------------------------------------------------
def _answerable(result: Accepted | Rejected, kind: str = ERR_BAD_REQUEST) -> Rejected:
    r = rejected(result)
    assert r.kind == kind
    assert r.request is not None
    assert (r.request.rid, r.request.reply_to, r.request.n) == (7, INBOX, 2)
    assert r.request.entry_id == ENTRY
    return r


def test_missing_payload_is_answered() -> None:
    r = _answerable(decode(fields(header(), None)))
    assert "no 'p'" in r.reason


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x92\x01", b"", MSGPACK.dumps([1, 2]) + b"trailing"],
    ids=["reserved-byte", "truncated", "empty", "trailing-bytes"],
)
def test_undecodable_payload_is_answered(payload: bytes) -> None:
    r = _answerable(decode(fields(header(), payload)))
    assert "could not be decoded" in r.reason
    assert "'msgpack'" in r.reason


def test_a_pickle_payload_sent_to_a_msgpack_serving_is_never_unpickled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle.loads was called")

    monkeypatch.setattr(pickle, "loads", refuse)
    r = _answerable(decode(fields(header(), pickle.dumps([1, 2]))))
    assert "could not be decoded" in r.reason


@pytest.mark.parametrize(
    ("items", "got"),
    [
        ([1], "1 items"),
        ([1, 2, 3], "3 items"),
        ([], "0 items"),
        ({"a": 1}, "dict"),
        ("ab", "str"),
        (None, "NoneType"),
    ],
    ids=["fewer", "more", "none", "dict", "str", "nil"],
)
def test_item_count_mismatch_is_answered(items: Any, got: str) -> None:
    r = _answerable(decode(fields(header(n=2), MSGPACK.dumps(items))))
    assert "list of 2 items" in r.reason
    assert got in r.reason


@pytest.mark.parametrize("codec_name", ["pickle", "json", 5])
def test_a_codec_other_than_the_servings_is_answered(codec_name: Any) -> None:
    r = _answerable(decode(fields(header(codec=codec_name), MSGPACK.dumps([1, 2]))))
    assert "'echo'" in r.reason
    assert "'msgpack'" in r.reason
    assert repr(codec_name) in r.reason


def test_a_msgpack_request_to_a_pickle_serving_is_answered() -> None:
    serving = qs.Serving(echo, name="echo", codec="pickle")
    r = _answerable(decode(fields(header(), MSGPACK.dumps([1, 2])), serving, PICKLE))
    assert "'pickle'" in r.reason and "'msgpack'" in r.reason


def test_an_expired_deadline_is_answered_with_a_timeout() -> None:
    past_ms = int((time.time() - 5) * 1000)
    r = _answerable(
        decode(fields(header(deadline_ms=past_ms), MSGPACK.dumps([1, 2]))), kind=ERR_TIMEOUT
    )
    assert "deadline" in r.reason
    assert r.request is not None
    assert r.request.deadline == pytest.approx(past_ms / 1000)


def test_an_expired_deadline_wins_over_an_undecodable_payload() -> None:
    """Work for a caller who left is dropped before the payload is even decoded."""
    r = _answerable(decode(fields(header(deadline_ms=1), b"\xc1")), kind=ERR_TIMEOUT)
    assert "deadline" in r.reason


# -- cost --------------------------------------------------------------------------------------
def test_cost_is_computed_per_item() -> None:
    serving = qs.Serving(echo, name="tok", batch_size=10, cost=len)
    h, p = encode_request(MSGPACK, 7, ["ab", "cde", ""], INBOX, None)
    result = decode(fields(h, p), serving)
    assert isinstance(result, Accepted)
    (s,) = result.slices
    assert s.costs == [2.0, 3.0, 0.0]
    assert s.weight == 5.0
    assert result.rejected_items == []


def test_items_costlier_than_capacity_are_rejected_alone() -> None:
    serving = qs.Serving(echo, name="tok", batch_size=5, cost=len)
    items = ["aa", "bbbbbbb", "c", "dd", "eeeeeeeeee", "f"]
    h, p = encode_request(MSGPACK, 7, items, INBOX, None)
    result = decode(fields(h, p), serving)
    assert isinstance(result, Accepted)
    assert result.request.n == 6
    assert [(s.offset, s.items, s.costs) for s in result.slices] == [
        (0, ["aa"], [2.0]),
        (2, ["c", "dd"], [1.0, 2.0]),
        (5, ["f"], [1.0]),
    ]
    assert [off for off, _ in result.rejected_items] == [1, 4]
    for _, reason in result.rejected_items:
        assert "more than the capacity" in reason
        assert "'tok'" in reason
        assert "batch_size=5" in reason
    assert "costs 7" in result.rejected_items[0][1]
    assert "costs 10" in result.rejected_items[1][1]
    # every item is accounted for exactly once
    offsets = sorted(
        [s.offset + i for s in result.slices for i in range(len(s.items))]
        + [off for off, _ in result.rejected_items]
    )
    assert offsets == list(range(6))


def test_a_request_of_only_oversize_items_has_no_slices() -> None:
    serving = qs.Serving(echo, name="tok", batch_size=2, cost=len)
    h, p = encode_request(MSGPACK, 7, ["abc", "defg"], INBOX, None)
    result = decode(fields(h, p), serving)
    assert isinstance(result, Accepted)
    assert result.slices == []
    assert [off for off, _ in result.rejected_items] == [0, 1]


def test_a_failing_cost_function_rejects_only_that_item() -> None:
    serving = qs.Serving(echo, name="tok", batch_size=10, cost=len)
    h, p = encode_request(MSGPACK, 7, ["ab", 5, "cd"], INBOX, None)
    result = decode(fields(h, p), serving)
    assert isinstance(result, Accepted)
    assert [(s.offset, s.items) for s in result.slices] == [(0, ["ab"]), (2, ["cd"])]
    ((offset, reason),) = result.rejected_items
    assert offset == 1
    assert "cost function failed" in reason
    assert "TypeError" in reason


def test_items_exactly_at_capacity_are_accepted() -> None:
    serving = qs.Serving(echo, name="tok", batch_size=3, cost=len)
    h, p = encode_request(MSGPACK, 7, ["abc", "xyz"], INBOX, None)
    result = decode(fields(h, p), serving)
    assert isinstance(result, Accepted)
    assert result.rejected_items == []
    assert [s.items for s in result.slices] == [["abc", "xyz"]]
