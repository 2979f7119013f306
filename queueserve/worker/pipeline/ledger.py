"""What one serving's partition holds, from read to ack, and the cancels that concern it.

Every thread of the pipeline (reader, executors, replier, cancel listener, step executor)
shares one lock, the ledger's ``cond``: it also guards the assembler and the read lease, and
is the condition those threads wait on for each other. Methods whose docstring says "caller
holds cond" are called inside it; the others take it.

A cancel names a request (wire/cancel.py's ``CancelKey``): one alone in its entry by the entry,
(stream, entry id); one of a pack by the entry and its request id, since the pack's other
requests, other callers' maybe, must still run.
"""

from __future__ import annotations

import threading
import time

from queueserve.wire.cancel import CancelKey
from queueserve.worker.pipeline.batching import Request, Slice, TakenBatch
from queueserve.worker.pipeline.execute import Row

Ref = tuple[str, bytes]  # (stream, entry id): entry ids are unique only within one stream

RECENT_CANCELS = 10_000  # cancels of entries not held kept at most (junk floods the channel)
RECENT_CANCEL_S = 60.0  # and for this long


def cancel_key(request: Request) -> CancelKey:
    """What a cancel of ``request`` names: its entry, and its request id in a pack."""
    if request.pack is None:
        return request.stream, request.entry_id
    return request.stream, request.entry_id, request.rid


class Ledger:
    """Held entries, the cancels among them, held packs, and cancels of entries not yet held."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.held: set[Ref] = set()  # entries read and not yet acked
        # Requests held whose callers cancelled them (cancel_key): a set object that running
        # batches keep (batch_context.py), so it is only ever changed in place
        self.cancelled: set[CancelKey] = set()
        # Held packs (entries of several requests): a cancel that names the entry alone never
        # drops one (cancel.lua names a request of a pack by its id; forged ones land here)
        self.packs: set[Ref] = set()
        self.recent_cancels: dict[CancelKey, float] = {}  # cancels of requests not (yet) held

    def cancel(self, key: CancelKey) -> None:
        """A caller cancelled the request ``key`` names: drop it if held, else remember it for
        a while (it may have been read and not yet recorded as held: ``hold`` looks)."""
        with self.cond:
            ref = (key[0], key[1])
            if len(key) == 2 and ref in self.packs:
                return
            if ref in self.held:
                self.cancelled.add(key)
            else:
                self._remember_cancel(key)

    def _remember_cancel(self, key: CancelKey) -> None:
        """Keep a cancel for a request not (yet) held for RECENT_CANCEL_S, and at most
        RECENT_CANCELS of them (caller holds cond); oldest first, so pruning stops at the first
        one young enough."""
        now = time.monotonic()
        recent = self.recent_cancels
        recent.pop(key, None)
        recent[key] = now
        while len(recent) > RECENT_CANCELS or next(iter(recent.values())) < now - RECENT_CANCEL_S:
            del recent[next(iter(recent))]

    def hold(self, slices: list[tuple[str, Slice]], rows: list[Row]) -> None:
        """Record every request taken in, also those answered only with errors: held until
        acked (caller holds cond)."""
        held = self.held
        held.update(piece.request.ref for _, piece in slices)
        held.update(row[0].ref for row in rows)
        packs = {p.request.ref for _, p in slices if p.request.pack is not None}
        if packs or any(row[0].pack is not None for row in rows):
            packs.update(row[0].ref for row in rows if row[0].pack is not None)
            self.packs.update(packs)
        if self.recent_cancels:
            recent = self.recent_cancels
            self.cancelled.update(held.intersection(recent) - self.packs)
            if packs:
                members = {cancel_key(p.request) for _, p in slices if p.request.pack is not None}
                self.cancelled.update(members.intersection(recent))

    def withdraw_cancelled(self, batch: TakenBatch) -> list[Slice]:
        """Remove slices whose callers cancelled (caller holds cond); returns them."""
        cancelled = self.cancelled
        if not cancelled:
            return []
        dropped = [s for s in batch.slices if cancel_key(s.request) in cancelled]
        if dropped:
            batch.slices = [s for s in batch.slices if cancel_key(s.request) not in cancelled]
        return dropped

    def withdraw_cancelled_now(self, batch: TakenBatch) -> list[Slice]:
        with self.cond:
            return self.withdraw_cancelled(batch)

    def held_now(self) -> set[Ref]:
        """A copy of the held entries (caller holds cond)."""
        return set(self.held)

    def settle(self, finished: list[Ref]) -> None:
        """Forget entries answered and acked."""
        with self.cond:
            self.held.difference_update(finished)
            if self.packs:
                self.packs.difference_update(finished)
            if self.cancelled:
                done = set(finished)
                self.cancelled.difference_update(
                    [k for k in self.cancelled if (k[0], k[1]) in done]
                )
