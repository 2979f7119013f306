"""A cancel message: ``cancel.lua`` publishes it on ``P:{S}:cancel`` when a caller cancels a
request a worker already read, as ``stream + "\\n" + entry id``.

The stream's name holds a batch key, which may hold anything, newlines too; the entry id is
digits and one '-'. So the message is split at its *last* newline: that is unambiguous
whatever the key holds, and the format stays the one every version of the worker and the
client writes.
"""

from __future__ import annotations

import re

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
