"""What the dashboard reads besides Admin's: a serving's workers with their heartbeats, and
their registry records (host, pid, partition, device, and the batches and items they ran)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from queueserve.broker.admin import Admin
from queueserve.broker.common import names, texts
from queueserve.broker.errors import raise_but_wrong_type, redis_errors
from queueserve.wire.protocol import Keys, worker_key

MAX_WORKERS = 200  # shown per serving: the most recent heartbeats


class Fleet(Admin):
    def workers(self, keys: Keys) -> list[tuple[str, int]]:
        """(consumer, last heartbeat in unix ms) of a serving's workers, newest first."""
        with redis_errors(self.url):
            raw = self.redis.zrevrange(keys.workers, 0, MAX_WORKERS - 1, withscores=True)
        out = []
        for member, score in cast(list[tuple[bytes, float]], raw):
            for name in names([member]):  # a member that is not UTF-8 is nobody's: skipped
                out.append((name, int(score) if math.isfinite(score) else 0))
        return out

    def worker_records(self, prefix: str, consumers: Sequence[str]) -> list[dict[str, str]]:
        """Each consumer's registry record, in order: empty once it expired, or when its key
        holds another type (anyone may write one: it must not fail every serving's row)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for consumer in consumers:
                pipe.hgetall(worker_key(prefix, consumer))
            replies = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        return [texts(raw, "replace") if isinstance(raw, dict) else {} for raw in replies]
