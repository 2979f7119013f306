"""The cancel listener of one serving's partition: cancels published after a request was read
(cancel.lua publishes each on the serving's cancel channel, one per shard) reach the ledger,
which drops the request from the batch that would run it, or stops a step or generator
request at its next step (ledger.py). A request of a pack is named by its entry and its
request id (wire/cancel.py): the pack's other requests run on."""

from __future__ import annotations

import functools
import logging
import threading

from queueserve.broker.consumer import Consumer
from queueserve.broker.core import Subscription
from queueserve.broker.retry import Retry
from queueserve.wire.cancel import parse_cancel
from queueserve.wire.keys import Keys
from queueserve.worker.pipeline.ledger import Ledger

log = logging.getLogger(__name__)


class CancelListener:
    """Subscribes to the cancel channels of a serving's shards and hands cancels to the ledger."""

    def __init__(self, name: str, broker: Consumer, shards: list[Keys], ledger: Ledger) -> None:
        self.name = name
        self.broker = broker
        self.shards = shards
        self.keys = shards[0]
        self.ledger = ledger
        self._junk_seen = False
        self._cancels: Subscription | None = None
        self._listening = threading.Event()  # cleared when the listener must end

    def listen(self) -> None:
        """Subscribe to the serving's cancel channel before reading: a cancel published
        between the first read and a later subscription would be missed."""
        self._cancels = self.broker.subscribe(*(keys.cancel for keys in self.shards))
        self._cancels.open()
        self._listening.set()

    def end(self) -> None:
        self._listening.clear()

    def loop(self) -> None:
        assert self._cancels is not None
        retry = Retry(self.broker.outage, "cancel listener")
        try:
            read = functools.partial(self._cancels.get, timeout=0.5)
            while self._listening.is_set():
                retry.once(read, self._on_cancel)
        finally:
            self._cancels.close()

    def _on_cancel(self, message: bytes | None) -> None:
        if message is None:  # none came within the read's timeout
            return
        key = parse_cancel(message)
        if key is None or not self._is_own_stream(key[0]):
            if not self._junk_seen:  # anyone may publish here: say so once
                self._junk_seen = True
                log.warning(
                    "serving %s: ignored a message on %s that is not a cancel of one "
                    "of its streams: %r",
                    self.name,
                    self.keys.cancel,
                    message[:200],
                )
            return
        self.ledger.cancel(key)

    def _is_own_stream(self, stream: str) -> bool:
        try:
            self.keys.parse_stream(stream)
        except ValueError:
            return False
        return True
