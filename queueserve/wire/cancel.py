"""Cancels of requests a worker holds, and withdrawals of packed requests no worker read yet.

A cancel message: ``cancel.lua`` publishes it on ``P:{S}:cancel`` when a caller cancels a
request a worker already read, as ``stream + "\\n" + entry id`` (a request alone in its entry)
or ``stream + "\\n" + entry id + "/" + request id`` (one request of a pack: the entry holds
other callers' requests too, which must run). Workers before packed cancels read the second
shape as junk and ignore it.

The stream's name holds a batch key, which may hold anything, newlines too; the entry id is
digits and one '-'. So the message is split at its *last* newline: that is unambiguous
whatever the key holds.

A withdrawal: ``cancel.lua`` records the requests of a pack no worker read yet that their
callers cancelled in ``P:{S}:withdrawn`` (field ``stream + "\\n" + entry id``, value the request
ids, ``"7,9"``), and ``read.lua`` hands them to the worker with the pack, as its field ``w``.
"""

from __future__ import annotations

import re

from queueserve.wire.protocol import MAX_PACK_REQUESTS

_ENTRY_ID = re.compile(rb"([0-9]{1,20}-[0-9]{1,20})(?:/([0-9]{1,20}))?")
_RIDS = re.compile(rb"[0-9]{1,20}(?:,[0-9]{1,20})*")

# What a cancel names: a request alone in its entry by (stream, entry id); a request of a pack
# by (stream, entry id, request id)
CancelKey = tuple[str, bytes] | tuple[str, bytes, int]


def parse_cancel(message: bytes) -> CancelKey | None:
    """(stream, entry id), or (stream, entry id, request id) for one request of a pack, of a
    cancel message; None when it is not one (anyone may publish on the channel: junk is
    ignored, never raised)."""
    stream, sep, tail = message.rpartition(b"\n")
    found = _ENTRY_ID.fullmatch(tail) if sep else None
    if found is None:
        return None
    try:
        name = stream.decode()
    except UnicodeDecodeError:
        return None
    entry_id, rid = found.groups()
    return (name, entry_id) if rid is None else (name, entry_id, int(rid))


def parse_withdrawn(raw: bytes) -> frozenset[int]:
    """The request ids of a pack's ``w`` field (read.lua's, from P:{S}:withdrawn): decimal ids
    separated by commas, at most MAX_PACK_REQUESTS of them. Anything else names none (anyone
    may write the hash, or the field on an entry of their own): the pack runs whole."""
    if len(raw) > 21 * MAX_PACK_REQUESTS or _RIDS.fullmatch(raw) is None:
        return frozenset()
    return frozenset(map(int, raw.split(b",")))
