"""Stream entries into requests: everything a worker checks before an item may join a batch.

Anyone who can write to Redis can write to a stream, so nothing in an entry is trusted: each
failure becomes an error reply (when the entry names a readable reply address) or a dead letter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from queueserve.serving import Serving
from queueserve.wire.codec import Codec
from queueserve.wire.keys import is_events_channel, is_inbox
from queueserve.wire.kinds import ERR_BAD_REQUEST, ERR_TIMEOUT
from queueserve.wire.protocol import (
    H_CODEC,
    H_COUNT,
    H_DEADLINE,
    H_EVENTS,
    H_FIELDS,
    H_ID,
    H_PRIORITY,
    H_REPLY_TO,
)
from queueserve.wire.request import decode_items, header_events, header_priority, parse_header
from queueserve.worker.pipeline.batching import Request, Slice

_KNOWN_INBOXES = 4096  # valid reply addresses an intake remembers


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


def _refusal(
    serving: Serving, codec: Codec, request: Request, codec_name: str, now: float
) -> tuple[str, str] | None:
    """(reason, error kind) when the header alone rules the request out."""
    if request.deadline and request.deadline <= now:
        return "the request's deadline passed before a worker took it", ERR_TIMEOUT
    if request.no_split and request.n > serving.batch_size:
        return (
            f"serving {serving.name!r} streams events, so a request always runs in one batch; "
            f"this one has {request.n} items, more than batch_size={serving.batch_size}: send "
            f"at most {serving.batch_size} items per request (client.stream does)",
            ERR_BAD_REQUEST,
        )
    if codec_name != codec.name:
        return (
            f"serving {serving.name!r} accepts codec {codec.name!r}, the request used "
            f"{codec_name!r}; send with the serving's codec",
            ERR_BAD_REQUEST,
        )
    return None


def decode_entry(
    serving: Serving,
    codec: Codec,
    prefix: str,
    stream: str,
    entry_id: bytes,
    fields: dict[bytes, bytes],
    now: float | None = None,
    inboxes: set[str] | None = None,
    fast: bool = False,
) -> tuple[Request, Slice] | Accepted | Rejected:
    """Check and decode one entry, reading its header once; ``now`` (unix seconds) is when its
    deadline is judged, taken once for a whole read; ``inboxes`` holds reply addresses found
    valid already (a client's entries all name one), and gets this entry's when it is valid.

    With ``fast`` (the caller's serving has no cost function, input model or hooks, and the
    entry is no replay) the common entry, a valid, unexpired request without events to a
    reply address in ``inboxes``, comes back as its bare (Request, Slice): every request takes
    this path, so it allocates no Accepted. Any other entry goes on to the full checks, which
    say why it is refused."""
    raw = fields.get(b"h")
    if raw is None:
        reason = "malformed entry: entry has no 'h' (header) field"
        return Rejected(entry_id, stream, reason, ERR_BAD_REQUEST, None)
    try:
        header = parse_header(raw)
    except Exception as e:
        return Rejected(entry_id, stream, f"malformed entry: {e}", ERR_BAD_REQUEST, None)
    if now is None:
        now = time.time()
    if fast and inboxes and header[H_REPLY_TO] in inboxes:
        payload, admitted = fields.get(b"p"), fields.get(b"a", b"0")
        n, deadline_ms, size = header[H_COUNT], header[H_DEADLINE], len(header)
        if (
            payload is not None
            and len(payload) <= serving.max_payload_bytes
            and header[H_CODEC] == codec.name
            and not (deadline_ms and deadline_ms <= now * 1000)
            and admitted.isdigit()
            and len(admitted) <= 12
            and (size <= H_EVENTS or header[H_EVENTS] == "")  # events: the full checks
            and (count := int(admitted)) <= n
            and count <= len(payload)
        ):
            try:
                items = decode_items(codec, payload, n)
            except ValueError:  # the full checks say why
                pass
            else:
                request = Request(
                    entry_id, stream, header[H_ID], header[H_REPLY_TO], deadline_ms / 1000.0, n
                )
                request.priority = header[H_PRIORITY] if size > H_PRIORITY else 0
                request.fields = header[H_FIELDS] if size > H_FIELDS else None
                request.admitted = count
                return request, Slice(request, 0, items)
    return _checked(serving, codec, prefix, stream, entry_id, fields, header, now, inboxes)


def _checked(
    serving: Serving,
    codec: Codec,
    prefix: str,
    stream: str,
    entry_id: bytes,
    fields: dict[bytes, bytes],
    header: list[Any],
    now: float,
    inboxes: set[str] | None,
) -> Accepted | Rejected:
    """The full checks of an entry whose header ``parse_header`` read, with the reasons."""
    rid, n, reply_to, deadline_ms, codec_name = header[H_ID : H_CODEC + 1]
    if not _valid_inbox(prefix, reply_to, inboxes):
        reason = (
            f"malformed entry: reply address {reply_to!r:.100} is not an inbox of prefix "
            f"{prefix!r} ({prefix}:inbox:<client id>); only queueserve clients may enqueue"
        )
        return Rejected(entry_id, stream, reason, ERR_BAD_REQUEST, None)
    events = header_events(header)
    no_split = bool(events) or serving.hooks is not None
    bad_events = bool(events) and not is_events_channel(prefix, events)
    request = Request(
        entry_id,
        stream,
        rid,
        reply_to,
        deadline_ms / 1000.0,
        n,
        "" if bad_events else events,
        no_split,
    )
    request.priority = header_priority(header)
    request.fields = header[H_FIELDS] if len(header) > H_FIELDS else None
    payload = fields.get(b"p")
    admitted = admitted_count(fields, payload, n)
    request.admitted = admitted or 0
    problem = (
        _address_refusal(prefix, events, bad_events, admitted)
        or _refusal(serving, codec, request, codec_name, now)
        or _payload_refusal(serving, payload)
    )
    if problem is not None:
        return Rejected(entry_id, stream, problem[0], problem[1], request)
    try:
        items = decode_items(codec, payload, n)  # type: ignore[arg-type]  # _payload_refusal
    except ValueError as e:
        return Rejected(entry_id, stream, str(e), ERR_BAD_REQUEST, request)
    if serving.cost is None and serving.input_model is None:  # the common case
        return Accepted(request, [Slice(request, 0, items)], [])
    accepted = _slices(serving, request, items)
    if no_split and (weight := sum(s.weight for s in accepted.slices)) > serving.batch_size:
        reason = (
            f"serving {serving.name!r} streams events, so a request always runs in one batch; "
            f"this one costs {weight:g}, more than the capacity (batch_size="
            f"{serving.batch_size}): send fewer items per request"
        )
        return Rejected(entry_id, stream, reason, ERR_BAD_REQUEST, request)
    return accepted


def _valid_inbox(prefix: str, reply_to: str, known: set[str] | None) -> bool:
    if known is not None and reply_to in known:
        return True
    if not is_inbox(prefix, reply_to):
        return False
    if known is not None:
        if len(known) >= _KNOWN_INBOXES:  # forged addresses must not grow it for ever
            known.clear()
        known.add(reply_to)
    return True


def _payload_refusal(serving: Serving, payload: bytes | None) -> tuple[str, str] | None:
    if payload is None:
        return "entry has no 'p' (payload) field", ERR_BAD_REQUEST
    if len(payload) > serving.max_payload_bytes:
        return (
            f"payload of {len(payload)} bytes is over max_payload_bytes="
            f"{serving.max_payload_bytes} of serving {serving.name!r}; send fewer or smaller "
            "items",
            ERR_BAD_REQUEST,
        )
    return None


def admitted_count(
    fields: dict[bytes, bytes], body: bytes | None, n: int | None = None
) -> int | None:
    """Items the entry was admitted with ('a', written by enqueue.lua), or None when the field
    is forged: it is released from the admission counter on ack, so it may never exceed the
    entry's own item count ``n`` (when its header could be read), nor the bytes its ``body``
    (payload, or a pack's 'k') has to hold them (a forged 10**9 would zero the counter and
    lift max_queue for everyone)."""
    raw = fields.get(b"a", b"0")
    if not raw.isdigit() or len(raw) > 12:
        return None
    admitted = int(raw)
    if (n is not None and admitted > n) or admitted > len(body or b""):
        return None
    return admitted


def _address_refusal(
    prefix: str, events: str, bad_events: bool, admitted: int | None
) -> tuple[str, str] | None:
    if bad_events:
        return (
            f"malformed entry: events channel {events!r:.100} is not a client channel of prefix "
            f"{prefix!r} ({prefix}:events:<client id>)",
            ERR_BAD_REQUEST,
        )
    if admitted is None:
        return (
            "malformed entry: its admission count ('a') is not an integer between 0 and its "
            "item count; only queueserve clients may enqueue",
            ERR_BAD_REQUEST,
        )
    return None


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
