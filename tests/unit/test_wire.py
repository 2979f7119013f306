"""Every message of the wire (queueserve/wire/) round-trips: what one side builds, the other
reads back as it was; and headers of the version before the map of optional fields and of
this one are read alike by both versions where docs/architecture.md ("Wire versions") says
they are."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from queueserve.errors import BadRequest, DeadLettered, RemoteError, Timeout
from queueserve.wire.cancel import parse_cancel
from queueserve.wire.codec import CODECS, get_codec, pack_plain
from queueserve.wire.error import (
    EXPIRED,
    EXPIRED_GENERATING,
    bad_request,
    dead_lettered,
    error_body,
    raised,
)
from queueserve.wire.event import (
    encode_events,
    event_problem,
    hook_event,
    output_event,
    parse_events,
    restart_event,
)
from queueserve.wire.kinds import (
    BATCHED,
    ERR_BAD_REQUEST,
    ERR_REMOTE,
    ERR_TIMEOUT,
    ERROR,
    RESULTS,
    STEPS,
)
from queueserve.wire.protocol import H_DEADLINE, H_FIELDS, WIRE_VERSION
from queueserve.wire.reply import ReplyEncoder, parse_reply
from queueserve.wire.request import (
    decode_items,
    encode_request,
    header_events,
    header_priority,
    parse_header,
    without_deadline,
)
from tests.support.old_wire import old_encode_request, old_parse_header, old_parse_reply

MSGPACK = get_codec("msgpack")
INBOX = "qs:inbox:abc"

# (events, priority, fields): every shape of header a client writes
SHAPES = [
    ("", 0, None),
    ("qs:events:abc", 0, None),
    ("", 3, None),
    ("qs:events:abc", 9, None),
    ("", 0, {"trace": "00-4bf92f-00f067-01"}),
    ("qs:events:abc", 2, {"job_keep": 60000, "tenant": "acme", "unknown-later": [1, 2]}),
]


@pytest.mark.parametrize(("events", "priority", "fields"), SHAPES)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_request_reads_back_as_it_was_sent(
    codec: str, events: str, priority: int, fields: dict[str, Any] | None
) -> None:
    c = get_codec(codec)
    raw, payload = encode_request(
        c, 41, ["a", 2, None], INBOX, 1_700_000_000.5, events, priority, fields
    )
    header = parse_header(raw)
    assert header[:6] == [WIRE_VERSION, 41, 3, INBOX, 1_700_000_000_500, codec]
    assert header_events(header) == events
    assert header_priority(header) == priority
    assert (header[H_FIELDS] if len(header) > H_FIELDS else None) == fields
    assert decode_items(c, payload, 3) == ["a", 2, None]
    replayed = parse_header(without_deadline(header))
    assert replayed[H_DEADLINE] == 0 and replayed[:4] == header[:4]


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([1, 1, 1, INBOX, 0, "msgpack", "", 0, ["not", "a", "map"]], "optional fields"),
        ([1, 1, 1, INBOX, 0, "msgpack", "", 0, {1: "int key"}], "not allowed for map key"),
        ([1, 1, 1, INBOX, 0, "msgpack", "", 0, {str(i): i for i in range(65)}], "optional fields"),
        ([1, 1, 1, INBOX, 0, "msgpack", "", 0, {}, "tenth"], "6 to 9 fields"),
        ([1, 1, 1, INBOX, 0, "msgpack", "", 10], "priority"),
        ([2, 1, 1, INBOX, 0, "msgpack"], "wire version 2"),
    ],
)
def test_a_header_the_worker_cannot_read_says_why(raw: list[Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_header(pack_plain(raw))


@pytest.mark.parametrize(("events", "priority"), [(e, p) for e, p, f in SHAPES if not f])
def test_old_and_new_versions_read_each_others_headers_without_fields(
    events: str, priority: int
) -> None:
    # A header of the old version, read by this one
    old, _ = old_encode_request(MSGPACK, 5, [1], INBOX, None, events, priority)
    assert parse_header(old) == old_parse_header(old)
    # and this version's header, without optional fields, read by the old version: the same
    new, _ = encode_request(MSGPACK, 5, [1], INBOX, None, events, priority)
    assert new == old
    assert old_parse_header(new) == parse_header(new)


def test_an_old_worker_refuses_a_header_with_fields_which_is_why_clients_wait_for_workers() -> None:
    new, _ = encode_request(MSGPACK, 5, [1], INBOX, None, fields={"tenant": "acme"})
    with pytest.raises(ValueError, match="6 to 8 fields"):
        old_parse_header(new)


def test_reply_rows_read_back_as_encoded_by_both_versions_of_the_client() -> None:
    rows = [
        [1, 0, 2, RESULTS, ["x", {"k": 1}]],
        [2, 3, 1, BATCHED, np.arange(3, dtype=np.int16).reshape(1, 3)],
        [3, 0, 1, ERROR, error_body(ValueError("boom"))],
        [4, 0, 1, STEPS, [["s1", "s2"]], 2, 77],
    ]
    errors: dict[str, int] = {}
    [message] = ReplyEncoder(MSGPACK, bytes((MSGPACK.tag,)), 1 << 20, errors).messages(rows)
    for read in (parse_reply(message, {MSGPACK.tag}), old_parse_reply(message, MSGPACK)):
        assert [list(r[:4]) for r in read] == [r[:4] for r in rows]
        assert read[0][4] == ["x", {"k": 1}]
        assert np.array_equal(read[1][4], rows[1][4])
        assert list(read[3][5:]) == [2, 77]
    assert errors == {}


def test_a_reply_over_the_limit_is_cut_and_its_oversized_item_answered_with_an_error() -> None:
    errors: dict[str, int] = {}
    rows = [[1, 0, 2, RESULTS, ["small", "x" * 500]]]
    messages = ReplyEncoder(MSGPACK, bytes((MSGPACK.tag,)), 200, errors).messages(rows)
    read = [row for m in messages for row in parse_reply(m, {MSGPACK.tag})]
    assert read[0][:5] == [1, 0, 1, RESULTS, ["small"]]
    assert read[1][:4] == [1, 1, 1, ERROR] and "max_reply_bytes" in read[1][4][1]
    assert errors == {ERR_REMOTE: 1}


def test_a_reply_in_a_codec_the_client_never_chose_is_refused() -> None:
    pickle = get_codec("pickle")
    with pytest.raises(ValueError, match="never sent"):
        parse_reply(bytes((pickle.tag,)) + pickle.dumps([]), {MSGPACK.tag})


@pytest.mark.parametrize(
    ("body", "raises", "message"),
    [
        (error_body(KeyError("k")), RemoteError, "'k'"),
        (EXPIRED, Timeout, "before its batch ran"),
        (EXPIRED_GENERATING, Timeout, "before it finished generating"),
        (bad_request("no such thing"), BadRequest, "no such thing"),
        (bad_request("too late", ERR_TIMEOUT), Timeout, "too late"),
        (dead_lettered("moved"), DeadLettered, "moved"),
        (error_body(ValueError("v"), ERR_BAD_REQUEST), BadRequest, "v"),
    ],
)
def test_each_error_kind_is_raised_by_the_client_as_the_table_says(
    body: list[str], raises: type[Exception], message: str
) -> None:
    [row] = parse_reply(
        ReplyEncoder(MSGPACK, b"m", 1 << 20, {}).messages([[1, 0, 1, ERROR, body]])[0],
        {MSGPACK.tag},
    )
    error = raised(row[4])
    assert type(error) is raises and message in str(error)


def test_events_read_back_one_alone_and_several_of_a_channel_as_one_message() -> None:
    events = [
        ("qs:events:a", [1, 0, *hook_event("progress", {"p": 0.5}, 0, 2)]),
        ("qs:events:b", [2, 0, *restart_event(9)]),
        ("qs:events:a", [1, 1, *output_event(["tok"], 1)]),
    ]
    sent = dict(encode_events(MSGPACK, events, 1 << 20))
    assert parse_events(sent["qs:events:a"], {MSGPACK.tag}) == [
        e for c, e in events if c == "qs:events:a"
    ]
    assert parse_events(sent["qs:events:b"], {MSGPACK.tag}) == [events[1][1]]
    for _, event in events:
        assert event_problem(event, 2) is None


@pytest.mark.parametrize(
    "event",
    [
        "junk",
        [],
        ["rid", 0],
        [1, -1, "h", "n", None, 0, 1],
        [1, 0, "o", 0, ["a"], 1, 5],
        [1, 0, "r", 0],
        [1, 0, "x", 1, 2, 3, 4],
    ],
)
def test_a_malformed_event_is_named(event: Any) -> None:
    assert event_problem(event, 2) is not None


@pytest.mark.parametrize(
    ("message", "ref"),
    [
        (b"qs:{s}:in:default\n1-0", ("qs:{s}:in:default", b"1-0")),
        (b"qs:{s}:in:a\nkey\n17-3", ("qs:{s}:in:a\nkey", b"17-3")),
        (b"no newline", None),
        (b"s\n1-x", None),
        (b"\xff\n1-0", None),
    ],
)
def test_a_cancel_names_its_stream_and_entry_whatever_the_key_holds(
    message: bytes, ref: tuple[str, bytes] | None
) -> None:
    assert parse_cancel(message) == ref
