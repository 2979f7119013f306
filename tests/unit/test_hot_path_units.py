"""Pieces of the single-item path that need no Redis: a call's waiter made only when needed,
and the reply queue that lets an idle executor send its own replies, in order."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest

import queueserve as qs
from queueserve.client.calls import Call
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys
from queueserve.wire.protocol import WIRE_VERSION
from queueserve.worker.pipeline.decode import Accepted, Rejected, decode_entry
from queueserve.worker.pipeline.replies import ReplyQueue

KEYS = Keys("qs", "s")


def call() -> Call:
    return Call(1, 1, KEYS, "default")


def test_a_call_answered_before_anyone_waits_never_makes_a_lock() -> None:
    c = call()
    c.apply(0, ["r"])
    c.finish()
    assert c.wait(0) and c._waiter is None
    assert c.results == ["r"]


def test_waiters_before_the_answer_share_one_lock_and_all_wake() -> None:
    c = call()
    woke: list[bool] = []
    threads = [threading.Thread(target=lambda: woke.append(c.wait(10))) for _ in range(3)]
    for t in threads:
        t.start()
    while c._waiter is None:  # a waiter made the lock; the others share it
        threading.Event().wait(0.001)
    c.finish()
    for t in threads:
        t.join(10)
    assert woke == [True, True, True]


def test_a_wait_times_out_while_the_call_is_pending() -> None:
    c = call()
    assert not c.wait(0.01)
    c.finish()
    assert c.wait(0.01)


def test_an_executor_claims_the_send_only_when_nothing_is_queued_or_being_sent() -> None:
    q = ReplyQueue()
    assert q.claim()  # idle: the executor may send itself
    assert not q.claim()  # someone is sending
    q.done()
    q.put([])
    assert not q.claim()  # rows queued first must leave first: the replier sends them
    assert q.take() == [[]]
    assert not q.claim()  # the replier is sending
    q.done()
    assert q.claim()


def test_the_replier_waits_while_an_executor_sends() -> None:
    q = ReplyQueue()
    assert q.claim()
    taken: list[object] = []
    replier = threading.Thread(target=lambda: taken.append(q.take()))
    replier.start()
    q.put(None)
    replier.join(0.05)
    assert replier.is_alive() and not taken  # it may not send beside the executor
    q.done()
    replier.join(10)
    assert taken == [[None]]


# -- the worker's one-pass decode of the common entry ---------------------------------------------
SERVING = qs.Serving(lambda xs: xs, name="echo", batch_size=4, max_payload_bytes=64)
INBOX = "qs:inbox:abc"
STREAM = "qs:{echo}:in:default"


def packed(*header: Any) -> bytes:
    return bytes(msgpack.packb(list(header)))


GOOD_H = packed(WIRE_VERSION, 7, 2, INBOX, 0, "msgpack")
GOOD_P = bytes(msgpack.packb(["a", "b"]))
ENTRIES: dict[str, dict[bytes, bytes]] = {
    "valid": {b"h": GOOD_H, b"p": GOOD_P, b"a": b"2"},
    "valid, priority 7": {
        b"h": packed(1, 7, 2, INBOX, 0, "msgpack", "", 7),
        b"p": GOOD_P,
        b"a": b"2",
    },
    "valid, deadline ahead": {
        b"h": packed(1, 7, 2, INBOX, int(time.time() * 1000) + 86_400_000, "msgpack"),
        b"p": GOOD_P,
        b"a": b"2",
    },
    "valid, no 'a'": {b"h": GOOD_H, b"p": GOOD_P},
    "no header": {b"p": GOOD_P, b"a": b"2"},
    "no payload": {b"h": GOOD_H, b"a": b"2"},
    "garbage header": {b"h": b"\xc1\xff", b"p": GOOD_P, b"a": b"2"},
    "header not a list": {b"h": packed(1)[1:], b"p": GOOD_P},
    "wrong version": {b"h": packed(99, 7, 2, INBOX, 0, "msgpack"), b"p": GOOD_P},
    "rid not an int": {b"h": packed(1, "7", 2, INBOX, 0, "msgpack"), b"p": GOOD_P},
    "bool count": {b"h": packed(1, 7, True, INBOX, 0, "msgpack"), b"p": GOOD_P},
    "zero items": {b"h": packed(1, 7, 0, INBOX, 0, "msgpack"), b"p": GOOD_P},
    "foreign inbox": {b"h": packed(1, 7, 2, "other:key", 0, "msgpack"), b"p": GOOD_P},
    "reply address a list": {b"h": packed(1, 7, 2, [INBOX], 0, "msgpack"), b"p": GOOD_P},
    "expired": {b"h": packed(1, 7, 2, INBOX, 1, "msgpack"), b"p": GOOD_P, b"a": b"2"},
    "other codec": {b"h": packed(1, 7, 2, INBOX, 0, "pickle"), b"p": GOOD_P},
    "declined: events": {b"h": packed(1, 7, 2, INBOX, 0, "msgpack", "qs:events:abc"), b"p": GOOD_P},
    "priority 10": {b"h": packed(1, 7, 2, INBOX, 0, "msgpack", "", 10), b"p": GOOD_P},
    "priority a str": {b"h": packed(1, 7, 2, INBOX, 0, "msgpack", "", "9"), b"p": GOOD_P},
    "'a' over n": {b"h": GOOD_H, b"p": GOOD_P, b"a": b"3"},
    "'a' not digits": {b"h": GOOD_H, b"p": GOOD_P, b"a": b"-1"},
    "'a' huge": {b"h": GOOD_H, b"p": GOOD_P, b"a": b"1" * 13},
    "payload too large": {b"h": GOOD_H, b"p": bytes(msgpack.packb(["x" * 40, "y" * 40]))},
    "payload undecodable": {b"h": GOOD_H, b"p": b"\xc1\x00"},
    "count mismatch": {b"h": packed(1, 7, 3, INBOX, 0, "msgpack"), b"p": GOOD_P},
    "payload not a list": {b"h": GOOD_H, b"p": bytes(msgpack.packb({"a": 1}))},
}


@pytest.mark.parametrize("name", list(ENTRIES))
def test_one_pass_decode_accepts_only_what_decode_entry_accepts_and_the_same(name: str) -> None:
    f = ENTRIES[name]
    codec = get_codec("msgpack")
    slow = decode_entry(SERVING, codec, "qs", STREAM, b"1-0", f)
    fast = decode_entry(SERVING, codec, "qs", STREAM, b"1-0", f, time.time(), {INBOX}, fast=True)
    if name.startswith("valid"):
        assert isinstance(fast, tuple) and isinstance(slow, Accepted), slow
        request, piece = fast
        for attr in (
            "rid",
            "reply_to",
            "deadline",
            "n",
            "priority",
            "admitted",
            "events",
            "no_split",
            "alone",
            "remaining",
        ):
            assert getattr(request, attr) == getattr(slow.request, attr), attr
        assert piece.items == slow.slices[0].items and piece.offset == 0
    else:
        # a streamed request is valid, but not the common shape: the full checks take it
        assert isinstance(slow, Accepted if name.startswith("declined") else Rejected), slow
        # and the fast path's entry goes on to them: the same outcome, for the same reason
        assert type(fast) is type(slow), fast
        if isinstance(slow, Rejected):
            assert isinstance(fast, Rejected)
            assert (fast.reason, fast.kind) == (slow.reason, slow.kind)


def test_one_pass_decode_leaves_an_address_it_has_not_seen_to_the_full_checks() -> None:
    f = ENTRIES["valid"]
    codec = get_codec("msgpack")
    known: set[str] = set()
    first = decode_entry(SERVING, codec, "qs", STREAM, b"1-0", f, time.time(), known, fast=True)
    assert isinstance(first, Accepted)  # the full checks found the address valid
    assert known == {INBOX}
    again = decode_entry(SERVING, codec, "qs", STREAM, b"1-0", f, time.time(), known, fast=True)
    assert isinstance(again, tuple)
