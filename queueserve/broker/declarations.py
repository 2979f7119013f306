"""A worker's declarations in Redis: its servings' options (the meta hash clients read, and the
prefix's registry of servings), its heartbeat, and the bookkeeping keys it clears when they
hold another type than queueserve writes there. A part of the worker's ``Consumer``
(``consumer.declared``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from queueserve.broker.common import register_servings, text, texts
from queueserve.broker.core import BrokerCore
from queueserve.broker.redis_errors import error_code, raise_but_wrong_type, redis_errors
from queueserve.wire.keys import Keys, worker_key


class Declarations:
    """Declaring servings and keeping the worker's record alive, over the consumer's
    connection."""

    def __init__(self, core: BrokerCore) -> None:
        self.url, self.redis = core.url, core.redis

    def clear_junk_bookkeeping(self, keys: Keys) -> list[str]:
        """Delete those of a serving's bookkeeping keys (never its streams) that hold another
        type than queueserve writes there, and return their names. Anyone may write them, and
        a string where the meta hash or the workers set belongs made every starting worker
        fail; none of them holds what a worker cannot rebuild (declarations, heartbeats,
        ready marks, counts), and a config hash of another type holds no override."""
        expected = {
            keys.meta: "hash",
            keys.config: "hash",
            keys.depth: "hash",
            keys.workers: "zset",
            keys.seen: "zset",
            keys.ready: "zset",
            keys.active: "zset",
            keys.keys: "set",
            keys.wake: "stream",
            keys.queued: "string",
            keys.servings: "zset",
        }
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for key in expected:
                pipe.type(key)
            found = [text(t) for t in pipe.execute()]
            junk = [
                key
                for (key, want), got in zip(expected.items(), found, strict=True)
                if got not in ("none", want)
            ]
            if junk:
                self.redis.delete(*junk)
        return junk

    def declare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Publish a serving's options (clients read codec and max_queue from them), and list
        the serving in the prefix's registry (P:servings), in the same round trip."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})
            self._registered(pipe, [keys], 1)

    def redeclare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Replace a meta key of another type by the declaration (``declare`` would fail)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(keys.meta)
            pipe.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})
            pipe.execute()
            # apart: on a cluster the registry is in another slot than the transaction's
            self._registered(self.redis.pipeline(transaction=False), [keys], 0)

    def _registered(self, pipe: Any, keys_list: Sequence[Keys], before: int) -> None:
        """Run ``pipe`` (``before`` commands queued) with the registry's refresh for
        ``keys_list`` added, raising the first error of those ``before``. A registry of
        another type (anyone may write one: it holds nothing a worker cannot rebuild) is
        replaced, never a failed heartbeat or declaration."""
        now_ms = int(time.time() * 1000)
        register_servings(pipe, keys_list, now_ms)
        replies = pipe.execute(raise_on_error=False)
        errors = [r for r in replies if isinstance(r, Exception)]
        if any(
            not isinstance(e, redis.RedisError) or error_code(e) != "WRONGTYPE" for e in errors
        ) or any(isinstance(r, Exception) for r in replies[:before]):
            raise errors[0]
        if errors:  # the registry's
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(keys_list[0].servings)
            register_servings(pipe, keys_list, now_ms)
            pipe.execute()

    def declarations(
        self, keys: Keys, last: Keys | None
    ) -> tuple[dict[str, str] | None, dict[str, str] | None, dict[str, str] | None]:
        """The meta hash, the config hash and the last shard's meta hash (``last``; None when
        not asked) as Redis holds them, in one round trip, each None when its key holds
        another type. The meta hash is read first (worker/pipeline/declaration.py says why)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(keys.meta)
            pipe.hgetall(keys.config)
            if last is not None:
                pipe.hgetall(last.meta)
            found = raise_but_wrong_type(pipe.execute(raise_on_error=False))
        meta, config, *rest = [
            texts(reply, "replace") if isinstance(reply, dict) else None for reply in found
        ]
        return meta, config, rest[0] if rest else None

    def heartbeat(
        self, keys_list: Sequence[Keys], consumer: str, ttl_ms: int, info: Mapping[str, str | int]
    ) -> None:
        """Say ``consumer`` is alive, per serving, and refresh its registry record."""
        now_ms = int(time.time() * 1000)
        record = worker_key(keys_list[0].prefix, consumer)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            fields: dict[Any, Any] = {**info, "heartbeat_ms": now_ms}
            pipe.hset(record, mapping=fields)
            pipe.pexpire(record, ttl_ms)
            for keys in keys_list:
                pipe.zadd(keys.workers, {consumer: now_ms})
                pipe.zremrangebyscore(keys.workers, "-inf", now_ms - ttl_ms)
                pipe.pexpire(keys.workers, ttl_ms)
            # The servings registry rides along: the listings read it, never a SCAN
            self._registered(pipe, keys_list, 2 + 3 * len(keys_list))

    def leave(self, keys_list: Sequence[Keys], consumer: str) -> None:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(worker_key(keys_list[0].prefix, consumer))
            for keys in keys_list:
                pipe.zrem(keys.workers, consumer)
            pipe.execute()
