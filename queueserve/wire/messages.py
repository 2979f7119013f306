"""Messages on the wire that both sides build or read: request headers, errors and cancels.

A request entry's header is a msgpack list (``protocol.WIRE_VERSION``, request id, item count,
reply inbox, deadline in unix ms, codec name[, events channel]); its payload is the items,
encoded by the request's codec. An error travels as [remote type, message, traceback, kind].

A cancel (``cancel.lua`` publishes it on ``P:{S}:cancel``) is ``stream + "\\n" + entry id``.
The stream's name holds a batch key, which may hold anything, newlines too; the entry id is
digits and one '-'. So the message is split at its *last* newline: that is unambiguous
whatever the key holds, and the format stays the one every version of the worker and the
client writes.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import msgpack

from queueserve.errors import BadRequest, DeadLettered, QueueServeError, RemoteError, Timeout
from queueserve.wire import protocol as P
from queueserve.wire.codec import Codec, pack_plain


def encode_request(
    codec: Codec, rid: int, items: list[Any], reply_to: str, deadline: float | None,
    events: str = "", priority: int = 0,
) -> tuple[bytes, bytes]:
    fields = [P.WIRE_VERSION, rid, len(items), reply_to,
              0 if deadline is None else int(deadline * 1000), codec.name]
    if events or priority:
        fields.append(events)
    if priority:  # left out at 0: such headers stay readable by workers without priorities
        fields.append(priority)
    return pack_plain(fields), codec.dumps(items)


def error_to_wire(exc: BaseException, kind: str = P.ERR_REMOTE) -> list[str]:
    tb = "".join(traceback.format_exception(exc))
    return [type(exc).__qualname__, str(exc), tb, kind]


def error_from_wire(body: list[str]) -> QueueServeError:
    remote_type, message, tb, kind = body
    if kind == P.ERR_TIMEOUT:
        return Timeout(message)
    if kind == P.ERR_BAD_REQUEST:
        return BadRequest(message)
    if kind == P.ERR_DEAD_LETTER:
        return DeadLettered(message)
    return RemoteError(remote_type, message, tb)


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
        if type(member) is not list or len(member) != 3 or not all(
            type(value) is bytes for value in member
        ):
            raise ValueError(
                f"each request of a pack must be [header, payload, items] (3 byte strings), "
                f"got {member!r:.200}"
            )
        out.append({b"h": member[0], b"p": member[1], b"a": member[2]})
    return out


_ENTRY_ID = re.compile(rb"[0-9]{1,20}-[0-9]{1,20}")


def parse_cancel(message: bytes) -> tuple[str, bytes] | None:
    """(stream, entry id) of a cancel message; None when it is not one (anyone may publish
    on the channel: junk is ignored, never raised)."""
    stream, sep, entry_id = message.rpartition(b"\n")
    if not sep or _ENTRY_ID.fullmatch(entry_id) is None:
        return None
    try:
        return stream.decode(), entry_id
    except UnicodeDecodeError:
        return None
