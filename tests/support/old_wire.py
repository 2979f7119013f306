"""The request header as the version before the header's map of optional fields wrote and read
it (copied from wire/messages.py and worker/pipeline/decode.py of that version), to test mixed
versions during a rolling upgrade (docs/architecture.md, "Wire versions")."""

from __future__ import annotations

from typing import Any

import msgpack

from queueserve.wire.codec import Codec
from queueserve.wire.priority import check_priority
from queueserve.wire.protocol import H_EVENTS, H_PRIORITY, H_VERSION, WIRE_VERSION


def old_encode_request(
    codec: Codec,
    rid: int,
    items: list[Any],
    reply_to: str,
    deadline: float | None,
    events: str = "",
    priority: int = 0,
) -> tuple[bytes, bytes]:
    """What a client of the old version XADDs as ``h`` and ``p``."""
    fields = [
        WIRE_VERSION,
        rid,
        len(items),
        reply_to,
        0 if deadline is None else int(deadline * 1000),
        codec.name,
    ]
    if events or priority:
        fields.append(events)
    if priority:
        fields.append(priority)
    return msgpack.packb(fields, use_bin_type=True), codec.dumps(items)


def old_parse_header(raw: bytes) -> list[Any]:
    """How a worker of the old version reads a header (both of its decode paths refused what
    this refuses)."""
    try:
        header = msgpack.unpackb(raw, raw=False)
    except Exception as e:
        raise ValueError(f"header is not msgpack: {e}") from None
    if not isinstance(header, list) or len(header) not in (6, 7, 8):
        raise ValueError(f"header must be a list of 6 to 8 fields, got {header!r:.200}")
    if header[H_VERSION] != WIRE_VERSION:
        raise ValueError(f"wire version {header[H_VERSION]!r} is not supported")
    rid, n, reply_to, deadline = header[1:5]
    events = header[H_EVENTS] if len(header) > H_EVENTS else ""
    if not (
        isinstance(rid, int)
        and isinstance(n, int)
        and n >= 1
        and isinstance(reply_to, str)
        and isinstance(deadline, int)
        and isinstance(events, str)
    ):
        raise ValueError(f"header fields have wrong types: {header!r:.200}")
    if len(header) > H_PRIORITY:
        check_priority(header[H_PRIORITY])
    return header


def old_parse_reply(message: bytes, codec: Codec) -> list[tuple[Any, ...]]:
    """How a client of the old version read a reply message: positional rows after a tag."""
    assert message[0] == codec.tag
    return [tuple(row) for row in codec.loads(memoryview(message)[1:])]
