"""A request entry's header: built by clients, read by workers (both of their decode paths) and
by `queueserve dead-letter replay`, here alone.

The header is a msgpack list, positional up to the priority, then a map of optional fields::

    [version, request id, item count, reply inbox, deadline (unix ms, 0 = none), codec name
     (, events channel (, priority (, fields)))]

A trailing field is written only when it, or one after it, is set: a header without events,
priority and fields is the 6-field list every version of the worker reads. ``fields`` (a map of
str -> value) is how the header grows without a version bump per field: trace context, a
job's keep, tenant (``FIELDS``). A worker ignores keys it does not know. ``WIRE_VERSION``
changes only when an existing position changes meaning. docs/architecture.md ("Wire
versions") says what mixed versions do during a rolling upgrade.

Its payload is the items, encoded by the request's codec. A pack entry (several requests in
one entry, enqueue.lua) carries each request's header, payload and admitted items in ``k``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgpack

from queueserve.wire.codec import Codec, pack_plain
from queueserve.wire.job_record import check_keep_ms
from queueserve.wire.priority import check_priority
from queueserve.wire.protocol import H_DEADLINE, H_EVENTS, H_PRIORITY, WIRE_VERSION

# Optional header fields the project knows of (the map may carry others: they are ignored).
FIELDS: Final = ("trace", "job_keep", "tenant")
_MAX_FIELDS = 64  # a map is a stranger's: its size is bounded like everything else read
_VERSION: Final = WIRE_VERSION
_unpackb = msgpack.unpackb


def encode_request(
    codec: Codec,
    rid: int,
    items: list[Any],
    reply_to: str,
    deadline: float | None,
    events: str = "",
    priority: int = 0,
    fields: Mapping[str, Any] | None = None,
) -> tuple[bytes, bytes]:
    """(header, payload) of one request. ``fields``: optional header fields; send them only to
    workers that read them (docs/architecture.md, "Wire versions")."""
    header = [
        WIRE_VERSION,
        rid,
        len(items),
        reply_to,
        0 if deadline is None else int(deadline * 1000),
        codec.name,
    ]
    if events or priority or fields:
        header.append(events)
    if priority or fields:  # left out at 0: such headers stay readable by older workers
        header.append(priority)
    if fields:
        header.append(dict(fields))
    return pack_plain(header), codec.dumps(items)


def parse_header(raw: bytes) -> list[Any]:
    """A request header, checked; ValueError saying what is wrong with it. Its addresses are
    checked by the caller (``is_inbox``, ``is_events_channel``): they depend on the prefix.
    The worker's one-pass decode and its full decode both read headers with this."""
    # On every request's path: indexes, not unpacking into new lists.
    try:
        header = _unpackb(raw, raw=False)
    except Exception as e:
        raise ValueError(f"header is not msgpack: {e}") from None
    if type(header) is not list or not 6 <= (size := len(header)) <= 9:
        raise ValueError(f"header must be a list of 6 to 9 fields, got {header!r:.200}")
    if header[0] != _VERSION:
        raise ValueError(
            f"wire version {header[0]!r} is not supported (this worker speaks "
            f"{_VERSION}); upgrade the older side"
        )
    n = header[2]
    if not (
        isinstance(header[1], int)
        and isinstance(n, int)
        and n >= 1
        and isinstance(header[3], str)
        and isinstance(header[4], int)
        and (size == 6 or isinstance(header[6], str))
    ):
        raise ValueError(f"header fields have wrong types: {header!r:.200}")
    if size > 7:
        check_priority(header[7])
        if size > 8:
            _check_fields(header[8])
    return header


def _check_fields(fields: Any) -> None:
    if type(fields) is dict and len(fields) <= _MAX_FIELDS:
        for key in fields:  # (a loop: on every traced request's path, and a map of one key)
            if type(key) is not str:
                break
        else:
            return
    raise ValueError(
        f"header's optional fields must be a map of at most {_MAX_FIELDS} string keys, "
        f"got {fields!r:.200}"
    )


def job_keep(fields: dict[str, Any] | None) -> int:
    """A job's keep (ms) from a checked header's optional fields; 0 when it is no job;
    ValueError saying what is wrong with a forged one."""
    if fields is None or "job_keep" not in fields:
        return 0
    return check_keep_ms(fields["job_keep"])


def header_events(header: list[Any]) -> str:
    """The events channel a checked header names, or ""."""
    events: str = header[H_EVENTS] if len(header) > H_EVENTS else ""
    return events


def header_priority(header: list[Any]) -> int:
    priority: int = header[H_PRIORITY] if len(header) > H_PRIORITY else 0
    return priority


def decode_items(codec: Codec, payload: bytes, n: int) -> list[Any]:
    """The ``n`` items of a request's payload; ValueError saying what is wrong with it."""
    try:
        items = codec.loads(payload)
    except Exception as e:
        raise ValueError(f"payload could not be decoded with codec {codec.name!r}: {e}") from None
    if not isinstance(items, list) or len(items) != n:
        got = f"{len(items)} items" if isinstance(items, list) else type(items).__name__
        raise ValueError(f"payload must be a list of {n} items as the header says, got {got}")
    return items


def check_msgpack_items(payload: bytes, count: int) -> None:
    """ValueError unless a msgpack payload is a list of ``count`` items, read without decoding
    its items (for a payload of another codec nothing is decoded: pickle would run code)."""
    try:
        items = msgpack.unpackb(payload, raw=True, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"its payload is not msgpack: {e}") from None
    if type(items) is not list or len(items) != count:
        got = f"{len(items)} items" if type(items) is list else type(items).__name__
        raise ValueError(f"its header claims {count} items, its payload holds {got}")


def without_deadline(header: list[Any]) -> bytes:
    """A checked header encoded again with no deadline (a dead letter replayed)."""
    return pack_plain([*header[:H_DEADLINE], 0, *header[H_DEADLINE + 1 :]])


def pack_members(fields: dict[bytes, bytes]) -> list[dict[bytes, bytes]]:
    """The requests of a pack (an entry of several, enqueue.lua), each as the fields of an
    entry of one request; ValueError saying what is wrong when its 'k' field is not a pack."""
    try:
        members = msgpack.unpackb(fields[b"k"], raw=True)
    except Exception as e:
        raise ValueError(f"its 'k' field is not msgpack: {e}") from None
    if type(members) is not list or not members:
        raise ValueError(f"its 'k' field must be a list of requests, got {members!r:.200}")
    out = []
    for member in members:
        if (
            type(member) is not list
            or len(member) != 3
            or not all(type(value) is bytes for value in member)
        ):
            raise ValueError(
                f"each request of a pack must be [header, payload, items] (3 byte strings), "
                f"got {member!r:.200}"
            )
        out.append({b"h": member[0], b"p": member[1], b"a": member[2]})
    return out
