"""What a partition takes in: new entries, entries reclaimed from dead consumers, and the
decisions made before any item may join a batch (decode, reject, dead-letter, split), which
the reader applies (reader.py): deciding does no I/O.

Reclaiming is what makes a SIGKILLed worker lose nothing. Every live partition checks, every
``RECLAIM_EVERY_S``, which consumers hold unacked entries without having sent a heartbeat for
``DEAD_AFTER_S`` (or were taken off the live set by the supervisor that saw them die); it
claims their entries (XCLAIM with the ``CLAIM_IDLE_S`` idle floor, so two claimers never both
win one) and serves them. A live worker's heartbeat is its claim: however long its batch runs,
its entries are never taken from it. A reclaimed request's run counts as a delivery; its first
redelivery runs batched, later ones alone (``runs_alone``). One already delivered
``max_deliveries`` times — it keeps killing the processes that run it — goes to the
dead-letter stream instead, and its caller is told; requests that shared its batches are
answered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from queueserve.broker.consumer import Consumer
from queueserve.broker.dead_letters import DeadLetter
from queueserve.serving import Serving
from queueserve.wire.cache import digest as cache_digest
from queueserve.wire.cancel import parse_withdrawn
from queueserve.wire.codec import Codec
from queueserve.wire.error import bad_request, dead_lettered, error_body
from queueserve.wire.keys import Keys
from queueserve.wire.kinds import DROP, ERR_BAD_REQUEST, ERROR
from queueserve.wire.protocol import MAX_PACK_REQUESTS
from queueserve.wire.request import pack_members
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batching import Pack, Request, Slice
from queueserve.worker.pipeline.decode import Accepted, Rejected, admitted_count, decode_entry
from queueserve.worker.pipeline.execute import Row

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]
    deliveries: int = 1
    reclaimed: bool = False


@dataclass(slots=True)
class Decisions:
    """What a read's entries come to. Deciding does no I/O: the reader applies the decisions
    (reader.py, ``take_in``): splits and dead letters first, in one round trip, then the slices
    join the assembler and the rows go to the replier."""

    slices: list[tuple[str, Slice]] = field(default_factory=list)  # (batch key, slice)
    rows: list[Row] = field(default_factory=list)  # errors to answer at once
    dead: list[DeadLetter] = field(default_factory=list)
    splits: list[Entry] = field(default_factory=list)  # reclaimed packs, to split (split.lua)


@dataclass(slots=True)
class Intake:
    """Turns stream entries into slices for the assembler and rows for the replier."""

    serving: Serving
    codec: Codec
    keys: Keys
    broker: Consumer
    consumer: str
    middleware: Middleware
    inboxes: set[str] = field(default_factory=set)  # reply addresses found valid

    def ingest(self, entries: list[Entry]) -> Decisions:
        """What to do with ``entries``: slices to assemble, rows to send at once, dead letters
        and pack splits to write."""
        out = Decisions()
        slices, rows = out.slices, out.rows
        serving, codec, prefix = self.serving, self.codec, self.keys.prefix
        now = time.time()
        key_of: dict[str, str] = {}  # entries come in runs of one stream
        plain = serving.cost is None and serving.input_model is None and serving.hooks is None
        version = serving.cache_version if serving.cache_ttl > 0 else None
        for entry in entries:
            if b"k" in entry.fields:
                self._ingest_pack(entry, out, now, plain)
                continue
            decoded = decode_entry(
                serving,
                codec,
                prefix,
                entry.stream,
                entry.entry_id,
                entry.fields,
                now,
                self.inboxes,
                # (an entry split.lua made, 'r', ran before: the full checks mark it a replay)
                plain and not entry.reclaimed and b"r" not in entry.fields,
            )
            if isinstance(decoded, tuple):  # the common entry, decoded in one pass
                key = key_of.get(entry.stream)
                if key is None:
                    key = key_of[entry.stream] = self.keys.batch_key_of(entry.stream)
                mark_cached(decoded[0], version, key, entry.fields)
                slices.append((key, decoded[1]))
            elif entry.reclaimed and entry.deliveries >= serving.max_deliveries:
                self._dead_letter(entry, decoded, out)
            elif isinstance(decoded, Rejected):
                self._reject(entry, decoded, out)
            else:
                decoded.request.redelivered = entry.reclaimed
                decoded.request.replay = b"r" in entry.fields  # split from a reclaimed pack
                decoded.request.alone = entry.reclaimed and runs_alone(
                    entry.deliveries, serving.max_deliveries
                )
                key = key_of.get(entry.stream)
                if key is None:
                    key = key_of[entry.stream] = self.keys.batch_key_of(entry.stream)
                if len(decoded.slices) == 1:
                    mark_cached(decoded.request, version, key, entry.fields)
                    slices.append((key, decoded.slices[0]))
                else:
                    slices += [(key, piece) for piece in decoded.slices]
                rows += _item_errors(decoded)
        return out

    def _ingest_pack(self, entry: Entry, out: Decisions, now: float, plain: bool) -> None:
        """Each request of a pack as if it came alone; they share the entry, acked when the
        last is answered. A reclaimed pack is split instead (split.lua), so that whatever
        killed its worker is blamed on one request, not on its pack."""
        if entry.reclaimed:
            out.splits.append(entry)
            return
        members = self._members(entry, out)
        if members is None:
            return
        slices, rows = out.slices, out.rows
        serving, codec = self.serving, self.codec
        key = self.keys.batch_key_of(entry.stream)
        pack = Pack(0, 0)
        version = serving.cache_version if serving.cache_ttl > 0 else None
        orphans: list[tuple[dict[bytes, bytes], str]] = []  # requests nobody can be told of
        # its requests cancelled before this read (read.lua): answered by none, acked with it
        raw = entry.fields.get(b"w")
        withdrawn = parse_withdrawn(raw) if raw is not None else None
        for fields in members:
            decoded = decode_entry(
                serving,
                codec,
                self.keys.prefix,
                entry.stream,
                entry.entry_id,
                fields,
                now,
                self.inboxes,
                plain,
            )
            if isinstance(decoded, tuple):  # the common request, decoded in one pass
                _join(decoded[0], pack)
                if withdrawn and _withdrawn(decoded[0], withdrawn, out):
                    continue
                mark_cached(decoded[0], version, key, fields)
                slices.append((key, decoded[1]))
                continue
            if decoded.request is None:
                orphans.append((fields, decoded.reason))
                pack.admitted += _released(fields)  # released with the pack's ack
                continue
            _join(decoded.request, pack)
            if withdrawn and _withdrawn(decoded.request, withdrawn, out):
                continue
            if isinstance(decoded, Rejected):
                self._reject(entry, decoded, out)
            else:
                mark_cached(decoded.request, version, key, fields)
                slices += [(key, piece) for piece in decoded.slices]
                rows += _item_errors(decoded)
        if orphans:
            out.dead.append(self._orphans(entry, orphans, pack))

    def _members(self, entry: Entry, out: Decisions) -> list[dict[bytes, bytes]] | None:
        """The requests of a pack entry, or None when it is dead-lettered whole, unread."""
        try:
            members = pack_members(entry.fields)
        except ValueError as e:
            out.dead.append(self._rejected_pack(entry, str(e)))
            return None
        if len(members) > MAX_PACK_REQUESTS:  # enqueue.lua never writes one: forged
            out.dead.append(
                self._rejected_pack(
                    entry,
                    f"it holds {len(members)} requests, more than the "
                    f"{MAX_PACK_REQUESTS} of any pack a client sends",
                )
            )
            return None
        return members

    def _orphans(
        self, entry: Entry, orphans: list[tuple[dict[bytes, bytes], str]], pack: Pack
    ) -> DeadLetter:
        """The requests of a pack that nobody can be told of, as one dead letter of a record
        each (a pack of a thousand forged requests costs the reader one round trip, not a
        thousand). When none of its requests is left to answer the pack is acked now, and its
        items given back; otherwise the replier acks it after the last answer, giving back
        the orphans' items too (``pack.admitted`` counts them)."""
        log.warning(
            "serving %s: %d requests of pack %s of %s rejected, the first: %s",
            self.serving.name,
            len(orphans),
            entry.entry_id.decode(),
            entry.stream,
            orphans[0][1],
        )
        records = [
            {
                "reason": reason,
                "deliveries": entry.deliveries,
                **{f"field:{k.decode()}": v for k, v in fields.items()},
            }
            for fields, reason in orphans
        ]
        self.middleware.dead_lettered(self.serving, len(records))
        ack_now = pack.left == 0
        return DeadLetter(
            entry.stream, entry.entry_id, records, ack_now, pack.admitted if ack_now else 0
        )

    def _rejected_pack(self, entry: Entry, why: str) -> DeadLetter:
        """A pack dead-lettered whole, unread: it is not a pack as enqueue.lua writes one."""
        return self._unanswerable(entry, f"malformed pack: {why}")

    def split_refused(self, entry: Entry) -> DeadLetter:
        """A reclaimed pack that split.lua could not split (it returned -1)."""
        return self._rejected_pack(
            entry,
            "split.lua could not read its 'k' field as a list of "
            f"at most {MAX_PACK_REQUESTS} requests",
        )

    def _unanswerable(self, entry: Entry, reason: str) -> DeadLetter:
        """An entry rejected with nobody to answer: kept for an operator, with the reason."""
        log.warning(
            "serving %s: entry %s of %s rejected: %s",
            self.serving.name,
            entry.entry_id.decode(),
            entry.stream,
            reason,
        )
        self.middleware.dead_lettered(self.serving, 1)  # counted as every dead letter is
        record = {"reason": reason, "deliveries": entry.deliveries, **_raw(entry)}
        return DeadLetter(entry.stream, entry.entry_id, [record], True, _released(entry.fields))

    def _reject(self, entry: Entry, rejected: Rejected, out: Decisions) -> None:
        request = rejected.request
        if request is None:
            out.dead.append(self._unanswerable(entry, rejected.reason))
            return
        log.warning(
            "serving %s: entry %s of %s rejected: %s",
            self.serving.name,
            entry.entry_id.decode(),
            entry.stream,
            rejected.reason,
        )
        out.rows.append((request, 0, request.n, ERROR, bad_request(rejected.reason, rejected.kind)))

    def _dead_letter(self, entry: Entry, decoded: Accepted | Rejected, out: Decisions) -> None:
        reason = (
            f"delivered {entry.deliveries} times (max_deliveries="
            f"{self.serving.max_deliveries}): each worker holding it died before answering"
        )
        request = decoded.request
        self.middleware.dead_lettered(self.serving, 1)
        dead = self.keys.shard_of(entry.stream).dead  # each shard keeps its own dead letters
        log.error(
            "serving %s: entry %s of %s moved to %s: %s",
            self.serving.name,
            entry.entry_id.decode(),
            entry.stream,
            dead,
            reason,
        )
        record = {
            "reason": reason,
            "deliveries": entry.deliveries,
            "claimed_by": self.consumer,
            **_raw(entry),
        }
        if request is None:  # nobody to answer: acked now, its items given back
            out.dead.append(
                DeadLetter(entry.stream, entry.entry_id, [record], True, _released(entry.fields))
            )
            return
        out.dead.append(DeadLetter(entry.stream, entry.entry_id, [record], False))
        # the replier answers, then acks and releases its items
        message = f"{reason}; it was moved to the dead-letter stream {dead}"
        out.rows.append((request, 0, request.n, ERROR, dead_lettered(message)))


def mark_cached(
    request: Request, version: str | None, key: str, fields: dict[bytes, bytes]
) -> None:
    """With a ``version`` (the serving caches results), name the result a request of one item
    is cached under (wire/cache.py): the digest of its payload as it came, computed here,
    never taken from the request (a client naming another item's digest would have this
    result answer that item)."""
    if version is None:
        return
    payload = fields.get(b"p")
    if request.n == 1 and not request.events and payload is not None:
        request.cache = cache_digest(version, key, payload)


def _item_errors(decoded: Accepted) -> list[Row]:
    """A BadRequest row for each item of an accepted request that its checks refused."""
    return [
        (decoded.request, offset, 1, ERROR, error_body(ValueError(reason), ERR_BAD_REQUEST))
        for offset, reason in decoded.rejected_items
    ]


def _released(fields: dict[bytes, bytes]) -> int:
    """What an entry (or a pack's request) nobody can answer gives back to the admission
    counters when it is dropped: its 'a' as checked when its header is unreadable, else 0."""
    return admitted_count(fields, fields.get(b"p", fields.get(b"k"))) or 0


def _withdrawn(request: Request, withdrawn: frozenset[int], out: Decisions) -> bool:
    """Whether a request of a pack was withdrawn by its caller before the read (decoded as any
    request, its deadline aside): then it is answered by nothing (a DROP row counts it done),
    and its items are released with the pack's ack, as its pack-mates' are."""
    if request.rid not in withdrawn:
        return False
    out.rows.append((request, 0, request.n, DROP, None))
    return True


def _join(request: Request, pack: Pack) -> None:
    request.pack = pack
    pack.left += 1
    pack.admitted += request.admitted


def runs_alone(deliveries: int, max_deliveries: int) -> bool:
    """Whether a reclaimed entry, delivered ``deliveries`` times so far, runs in a batch of its
    own (docs/design.md §5 "Poison items").

    Most entries reclaimed after a kill are the healthy batch-mates of whatever died, so their
    first redelivery runs batched like any request: one batch per request would hold the
    recovery of a killed worker's ~50 requests for seconds. That run is counted, so when it
    dies too, every later redelivery runs alone, where a crash is the request's own. A request
    thus shares the blame for at most one death besides its original run's; with
    ``max_deliveries`` under 3 that one would be enough to dead-letter it, so there every
    redelivery runs alone.
    """
    return deliveries > 1 or max_deliveries < 3


def _raw(entry: Entry) -> dict[str, bytes]:
    """The entry's own fields, kept so `queueserve dead-letter replay` can re-send it."""
    return {f"field:{k.decode(errors='replace')}": v for k, v in entry.fields.items()}
