"""Every broker side on one connection, for tests that enqueue, read and inspect at once; and
the reads only tests make (the worker reads through read.lua, ``Consumer.read_ready``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import redis

from queueserve.broker.admin import Admin
from queueserve.broker.common import StreamEntries, text
from queueserve.broker.consumer import Consumer
from queueserve.broker.core import no_group
from queueserve.broker.producer import Producer
from queueserve.broker.redis_errors import redis_errors
from queueserve.broker.urls import redact_url
from queueserve.wire.keys import GROUP

log = logging.getLogger(__name__)


class RedisBroker(Producer, Consumer, Admin):
    """The producer's, consumer's and admin's operations of one Redis deployment."""

    def read(
        self, consumer: str, streams: Sequence[str], count: int, block_ms: int
    ) -> list[tuple[bytes, StreamEntries]]:
        """New entries for ``consumer`` from ``streams``, blocking up to ``block_ms``.

        A Redis that came back without its data (no persistence, a failover to an empty
        replica, a deleted stream) has lost the consumer groups: they are made again."""
        with redis_errors(self.url):
            try:
                out = self.redis.xreadgroup(
                    GROUP, consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms
                )
            except redis.ResponseError as e:
                if not no_group(e):
                    raise
                log.warning(
                    "consumer group missing on %s (%s): creating it again", redact_url(self.url), e
                )
                for stream in streams:
                    self.ensure_group(stream)
                return []
        return cast(list[tuple[bytes, StreamEntries]], out or [])

    def pending_consumers(self, stream: str) -> list[tuple[str, int]]:
        """Consumers of ``stream`` holding unacked entries, with how many. A group lost with
        Redis's data is made again: nothing is pending in it."""
        with redis_errors(self.url):
            try:
                summary = self.redis.xpending(stream, GROUP)
            except redis.ResponseError as e:
                if not no_group(e):
                    raise
                self.ensure_group(stream)
                return []
        return [(text(c["name"]), int(c["pending"])) for c in summary.get("consumers") or []]
