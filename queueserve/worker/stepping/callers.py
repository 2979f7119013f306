"""Which streaming callers of a step serving went away: their requests leave the running set
(step_executor.py, step 1 of a cycle). The subscriber counts of their event channels are looked
at every ``CALLER_CHECK_EVERY_S`` at most, in one PUBSUB NUMSUB (stepping.CallerWatch)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from queueserve.broker.consumer import Consumer
from queueserve.errors import RedisCommandError, RedisUnavailable
from queueserve.wire.timing import CALLER_CHECK_EVERY_S
from queueserve.worker.stepping.calls import Member
from queueserve.worker.stepping.joins import CallerWatch, Waiting

log = logging.getLogger(__name__)


class GoneCallers:
    """A step serving's look at its streaming callers (``caller_gone_after`` seconds; None:
    it never looks)."""

    def __init__(self, name: str, broker: Consumer, gone_after: float | None) -> None:
        self.name = name
        self.broker = broker
        self.watch = (
            None
            if gone_after is None
            else CallerWatch(gone_after, min(CALLER_CHECK_EVERY_S, gone_after))
        )

    def watched(self, running: list[Member], waiting: Iterable[Waiting]) -> set[str] | None:
        """The event channels of the streaming callers of what runs and waits, when it is time
        to look whether they are still there; None otherwise (caller holds cond)."""
        if self.watch is None or not self.watch.due(time.monotonic()):
            return None
        requests = [m.request for m in running] + [w.piece.request for w in waiting]
        return {r.events for r in requests if r.events}

    def gone(self, channels: set[str] | None) -> set[str]:
        """The channels among ``channels`` whose callers went away (one PUBSUB NUMSUB)."""
        if channels is None or self.watch is None:
            return set()
        try:
            counts: dict[str, int] | None = self.broker.subscribers(sorted(channels))
        except (RedisUnavailable, RedisCommandError) as e:
            log.debug("serving %s: could not count subscribers: %s", self.name, e)
            counts = None
        gone = self.watch.looked(time.monotonic(), counts)
        if gone:
            log.info(
                "serving %s: %d streaming caller(s) gone (no subscriber for %gs): their "
                "requests leave",
                self.name,
                len(gone),
                self.watch.gone_after,
            )
        return gone
