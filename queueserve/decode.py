"""Stream entries into requests: everything a worker checks before an item may join a batch.

Anyone who can write to Redis can write to a stream, so nothing in an entry is trusted: each
failure becomes an error reply (when the entry names a readable reply address) or a dead letter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack

from . import protocol as P
from .batching import Request, Slice
from .codec import Codec
from .serving import Serving


@dataclass(slots=True)
class Rejected:
    """An entry that will not run: why, and whom to tell (reply_to/rid) if anyone."""

    entry_id: bytes
    stream: str
    reason: str
    kind: str  # protocol ERR_* kind for the caller
    request: Request | None  # set when the caller can be answered


@dataclass(slots=True)
class Accepted:
    request: Request
    slices: list[Slice]
    rejected_items: list[tuple[int, str]]  # (offset, reason): items over capacity


def _header(fields: dict[bytes, bytes]) -> list[Any]:
    raw = fields.get(b"h")
    if raw is None:
        raise ValueError("entry has no 'h' (header) field")
    header = msgpack.unpackb(raw, raw=False)
    if not isinstance(header, list) or len(header) not in (6, 7):
        raise ValueError(f"header must be a list of 6 or 7 fields, got {header!r:.200}")
    if header[P.H_VERSION] != P.WIRE_VERSION:
        raise ValueError(
            f"wire version {header[P.H_VERSION]!r} is not supported (this worker speaks "
            f"{P.WIRE_VERSION}); upgrade the older side"
        )
    rid, n, reply_to, deadline = header[1:5]
    events = header[P.H_EVENTS] if len(header) > P.H_EVENTS else ""
    if not (isinstance(rid, int) and isinstance(n, int) and n >= 1 and isinstance(reply_to, str)
            and isinstance(deadline, int) and isinstance(events, str)):
        raise ValueError(f"header fields have wrong types: {header!r:.200}")
    return header


def _refusal(
    serving: Serving, codec: Codec, request: Request, codec_name: str
) -> tuple[str, str] | None:
    """(reason, error kind) when the header alone rules the request out."""
    if request.deadline and request.deadline <= time.time():
        return "the request's deadline passed before a worker took it", P.ERR_TIMEOUT
    if request.no_split and request.n > serving.batch_size:
        return (
            f"serving {serving.name!r} streams events, so a request always runs in one batch; "
            f"this one has {request.n} items, more than batch_size={serving.batch_size}: send "
            f"at most {serving.batch_size} items per request (client.stream does)",
            P.ERR_BAD_REQUEST,
        )
    if codec_name != codec.name:
        return (
            f"serving {serving.name!r} accepts codec {codec.name!r}, the request used "
            f"{codec_name!r}; send with the serving's codec",
            P.ERR_BAD_REQUEST,
        )
    return None


def decode_entry(
    serving: Serving, codec: Codec, stream: str, entry_id: bytes, fields: dict[bytes, bytes]
) -> Accepted | Rejected:
    try:
        header = _header(fields)
    except Exception as e:
        return Rejected(entry_id, stream, f"malformed entry: {e}", P.ERR_BAD_REQUEST, None)
    rid, n, reply_to, deadline_ms, codec_name = header[1:6]
    events = header[P.H_EVENTS] if len(header) > P.H_EVENTS else ""
    no_split = bool(events) or serving.hooks is not None
    request = Request(entry_id, stream, rid, reply_to, deadline_ms / 1000.0, n, events, no_split)
    request.admitted = _admitted(fields)
    problem = _refusal(serving, codec, request, codec_name) or _payload_refusal(serving, fields)
    if problem is not None:
        return Rejected(entry_id, stream, problem[0], problem[1], request)
    try:
        items = codec.loads(fields[b"p"])
    except Exception as e:
        reason = f"payload could not be decoded with codec {codec.name!r}: {e}"
        return Rejected(entry_id, stream, reason, P.ERR_BAD_REQUEST, request)
    if not isinstance(items, list) or len(items) != n:
        got = f"{len(items)} items" if isinstance(items, list) else type(items).__name__
        reason = f"payload must be a list of {n} items as the header says, got {got}"
        return Rejected(entry_id, stream, reason, P.ERR_BAD_REQUEST, request)
    accepted = _slices(serving, request, items)
    if no_split and (weight := sum(s.weight for s in accepted.slices)) > serving.batch_size:
        reason = (
            f"serving {serving.name!r} streams events, so a request always runs in one batch; "
            f"this one costs {weight:g}, more than the capacity (batch_size="
            f"{serving.batch_size}): send fewer items per request"
        )
        return Rejected(entry_id, stream, reason, P.ERR_BAD_REQUEST, request)
    return accepted


def _payload_refusal(serving: Serving, fields: dict[bytes, bytes]) -> tuple[str, str] | None:
    payload = fields.get(b"p")
    if payload is None:
        return "entry has no 'p' (payload) field", P.ERR_BAD_REQUEST
    if len(payload) > serving.max_payload_bytes:
        return (
            f"payload of {len(payload)} bytes is over max_payload_bytes="
            f"{serving.max_payload_bytes} of serving {serving.name!r}; send fewer or smaller "
            "items",
            P.ERR_BAD_REQUEST,
        )
    return None


def _admitted(fields: dict[bytes, bytes]) -> int:
    try:
        return max(0, int(fields.get(b"a", b"0")))
    except ValueError:
        return 0


def _admit(serving: Serving, item: Any) -> tuple[Any, float]:
    """The item as the batch function will see it, and its cost; ValueError when it cannot
    join any batch (fails the serving's input_model, or costs more than the capacity)."""
    item = serving.validate_item(item)
    if serving.cost is None:
        return item, 1.0
    try:
        cost = serving.item_cost(item)
    except Exception as e:  # the caller learns why its item was refused
        raise ValueError(f"the serving's cost function failed for this item: {e!r}") from None
    if cost > serving.batch_size:
        raise ValueError(
            f"item costs {cost:g}, more than the capacity of serving {serving.name!r} "
            f"(batch_size={serving.batch_size}); split the item or raise batch_size"
        )
    return item, cost


def _slices(serving: Serving, request: Request, items: list[Any]) -> Accepted:
    if serving.cost is None and serving.input_model is None:
        return Accepted(request, [Slice(request, 0, items)], [])
    slices: list[Slice] = []
    rejected: list[tuple[int, str]] = []
    run: list[Any] = []
    costs: list[float] = []
    start = 0
    for i, raw in enumerate(items):
        try:
            item, cost = _admit(serving, raw)
        except ValueError as e:
            if run:
                slices.append(Slice(request, start, run, costs if serving.cost else None))
            rejected.append((i, str(e)))
            run, costs, start = [], [], i + 1
            continue
        run.append(item)
        costs.append(cost)
    if run:
        slices.append(Slice(request, start, run, costs if serving.cost else None))
    return Accepted(request, slices, rejected)
