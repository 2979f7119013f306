"""Taking back work from dead consumers, and work Redis says this consumer holds without its
knowing (docs/design.md §5): what makes a SIGKILLed worker lose nothing (see intake.py's
docstring for the rules). The entries come back as Entry(reclaimed=True) for ``Intake.ingest``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from queueserve.broker.consumer import Consumer
from queueserve.serving import Serving
from queueserve.wire.keys import Keys
from queueserve.wire.timing import CLAIM_IDLE_S, DEAD_AFTER_S
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.intake import Entry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reclaims:
    """Claims one serving's entries held by dead consumers or forgotten by this one."""

    serving: Serving
    keys: Keys
    broker: Consumer
    consumer: str
    middleware: Middleware

    def reclaim(
        self,
        streams: list[str],
        room: int,
        held: set[tuple[str, bytes]],
        lent_since: float | None = None,
    ) -> list[Entry]:
        """Claim up to ``room`` entries held by dead consumers, and take back entries Redis says
        this consumer holds but it does not know of (``held``: (stream, id) it knows; a read
        lent out since ``lent_since``, unix time, may bring more).
        ``streams`` are those read from lately (the only ones that can hold pending entries);
        their pending summaries come in one round trip, however many keys there are."""
        alive = self.broker.alive_consumers(self.keys, DEAD_AFTER_S) | {self.consumer}
        claimed: list[Entry] = []
        for stream, owners in self.broker.pending_by_stream(streams).items():
            mine = {entry_id for s, entry_id in held if s == stream}
            for owner, pending in owners:
                if owner == self.consumer and pending > len(mine) and room > 0:
                    forgotten = self._forgotten(stream, mine, room, lent_since)
                    claimed += forgotten
                    room -= len(forgotten)
                if owner in alive or room <= 0:
                    continue
                got = self.broker.claim(
                    stream, owner, self.consumer, int(CLAIM_IDLE_S * 1000), room
                )
                if got:
                    self.middleware.redelivered(self.serving, len(got))
                    log.warning(
                        "serving %s: reclaimed %d entries of %s from dead consumer %s",
                        self.serving.name,
                        len(got),
                        stream,
                        # a name that is not UTF-8 holds surrogates, which some log sinks refuse
                        owner.encode("utf-8", "backslashreplace").decode(),
                    )
                claimed += [Entry(stream, eid, fields, n, True) for eid, fields, n in got]
                room -= len(got)
        return claimed

    def _forgotten(
        self, stream: str, held: set[bytes], room: int, lent_since: float | None
    ) -> list[Entry]:
        """Entries pending for this consumer that it does not hold: a Redis restart that lost
        the last second of writes (AOF everysec) can bring back an acked entry, or a delivery
        the worker never saw. Its owner is alive, so no one else would ever reclaim it.

        Only entries delivered at least DEAD_AFTER_S before the read lent out now (an
        executor's, worker/pipeline/lease.py) was taken: that read has delivered entries it
        has not taken in yet, for as long as its taker's intake takes (a slow cost function,
        a starved CPU), and taking those too would run them twice."""
        idle_ms = int(DEAD_AFTER_S * 1000)
        if lent_since is not None:
            idle_ms += max(0, int((time.time() - lent_since) * 1000))
        got = self.broker.claim(
            stream,
            self.consumer,
            self.consumer,
            idle_ms,
            room + len(held),
            skip=held,
        )
        if got:
            log.warning(
                "serving %s: %d entries of %s were pending for this worker without its knowing "
                "(Redis lost writes?); serving them again",
                self.serving.name,
                len(got),
                stream,
            )
        return [Entry(stream, eid, fields, n, True) for eid, fields, n in got[:room]]

    def forget_dead_consumers(self, streams: list[str]) -> None:
        """Remove consumers that are dead and hold nothing, so the group lists the living."""
        alive = self.broker.alive_consumers(self.keys, DEAD_AFTER_S) | {self.consumer}
        for stream in streams:
            for name, pending, idle_ms in self.broker.consumers(stream):
                if name not in alive and pending == 0 and idle_ms > DEAD_AFTER_S * 1000:
                    self.broker.forget_consumer(stream, name)
