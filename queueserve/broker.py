"""The broker seam: the few Redis operations the client and worker need, and nothing else.

Every redis-py error is turned into a queueserve error here, at one boundary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from importlib import resources
from typing import Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from .errors import RedisUnavailable
from .protocol import GROUP, Keys, worker_key

log = logging.getLogger(__name__)

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0, 1, ...) against an unreachable Redis."""
    return float(min(0.05 * 2**attempt, 2.0))


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def load_script(name: str) -> str:
    return resources.files("queueserve").joinpath("lua", name).read_text()


@contextlib.contextmanager
def redis_errors(url: str) -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise RedisUnavailable(f"Redis at {url} is unavailable: {e}") from None


def enqueue_arguments(
    keys: Keys, requests: Sequence[tuple[str, int, bytes, bytes]], max_queue: int
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of enqueue.lua for these requests."""
    streams: dict[str, int] = {}
    args: list[Any] = [max_queue]
    for batch_key, n, header, payload in requests:
        stream = keys.stream(batch_key)
        index = streams.setdefault(stream, len(streams) + 1)
        args += (index, batch_key, n, header, payload)
    return [keys.queued, keys.keys, keys.meta, *streams], args


def connect(url: str) -> redis.Redis:
    """A client for ``url`` (redis://, rediss://, unix://)."""
    return redis.Redis.from_url(url, health_check_interval=30)


class RedisBroker:
    """Stream operations of one Redis deployment."""

    def __init__(self, url: str, *, client: redis.Redis | None = None) -> None:
        self.url = url
        self.redis = client if client is not None else connect(url)
        self._enqueue: Script = self.redis.register_script(load_script("enqueue.lua"))
        self._ack: Script = self.redis.register_script(load_script("ack.lua"))
        self._cancel: Script = self.redis.register_script(load_script("cancel.lua"))

    def close(self) -> None:
        self.redis.close()

    # -- producers --------------------------------------------------------------------------
    def enqueue(
        self, keys: Keys, requests: Sequence[tuple[str, int, bytes, bytes]], max_queue: int
    ) -> tuple[int, int, list[bytes | int]]:
        """Admit requests ``(batch_key, n_items, header, payload)`` atomically.

        Returns the limit in force, the queued item count after admission, and per request its
        stream entry id, or 0 when it was rejected for max_queue.
        """
        script_keys, args = enqueue_arguments(keys, requests, max_queue)
        with redis_errors(self.url):
            out = self._enqueue(keys=script_keys, args=args)
        return int(out[0]), int(out[1]), out[2:]

    def cancel(self, keys: Keys, stream: str, entry_id: bytes, n: int) -> bool:
        with redis_errors(self.url):
            return bool(
                self._cancel(keys=[stream, keys.queued, keys.cancel], args=[GROUP, entry_id, n])
            )

    def read_inbox(self, inbox: str, timeout: float, count: int = 512) -> list[bytes]:
        with redis_errors(self.url):
            out = self.redis.execute_command(  # type: ignore[no-untyped-call]
                "BLMPOP", timeout, 1, inbox, "LEFT", "COUNT", count
            )
        return [] if out is None else list(out[1])

    def alive_workers(self, keys: Keys, within: float) -> int:
        now_ms = int(time.time() * 1000)
        with redis_errors(self.url):
            return int(self.redis.zcount(keys.workers, now_ms - int(within * 1000), "+inf"))

    def meta(self, keys: Keys) -> dict[str, str]:
        with redis_errors(self.url):
            raw = self.redis.hgetall(keys.meta)
        return {text(k): text(v) for k, v in raw.items()}

    # -- consumers --------------------------------------------------------------------------
    def ensure_group(self, stream: str) -> None:
        """Create the consumer group at the start of the stream, so nothing queued is missed."""
        with redis_errors(self.url):
            try:
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def batch_keys(self, keys: Keys) -> set[str]:
        with redis_errors(self.url):
            return {text(k) for k in self.redis.smembers(keys.keys)}

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
                if "NOGROUP" not in str(e):
                    raise
                log.warning("consumer group missing on %s (%s): creating it again", self.url, e)
                for stream in streams:
                    self.ensure_group(stream)
                return []
        return cast(list[tuple[bytes, StreamEntries]], out or [])

    def reply_and_ack(
        self,
        keys: Keys,
        replies: Mapping[str, list[bytes]],
        acks: Mapping[str, list[Any]],
        inbox_ttl_ms: int,
        events: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Publish streamed events, push replies to client inboxes, then ack finished entries:
        one round trip, in that order (a batch's events precede its replies).

        Replies go before acks: a worker dying between the two re-runs the request, and the
        client drops the duplicate answer.
        """

        def send() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for channel, message in events:
                pipe.publish(channel, message)
            for inbox, messages in replies.items():
                pipe.rpush(inbox, *messages)
                pipe.pexpire(inbox, inbox_ttl_ms)
            # EVALSHA directly: redis-py's Script in a pipeline asks SCRIPT EXISTS on every
            # execute, one more round trip per batch.
            for stream, id_counts in acks.items():
                pipe.evalsha(self._ack.sha, 2, stream, keys.queued, GROUP, *id_counts)
            pipe.execute()

        with redis_errors(self.url):
            try:
                send()
            except NoScriptError:  # Redis restarted or flushed its scripts: load, send again
                self.redis.script_load(self._ack.script)
                send()  # the replies go twice; the clients keep the first of each

    def alive_consumers(self, keys: Keys, within: float) -> set[str]:
        now_ms = int(time.time() * 1000)
        with redis_errors(self.url):
            raw = self.redis.zrangebyscore(keys.workers, now_ms - int(within * 1000), "+inf")
        return {text(c) for c in cast(list[bytes], raw)}

    def pending_consumers(self, stream: str) -> list[tuple[str, int]]:
        """Consumers of ``stream`` holding unacked entries, with how many."""
        with redis_errors(self.url):
            summary = self.redis.xpending(stream, GROUP)
        return [(text(c["name"]), int(c["pending"])) for c in summary.get("consumers") or []]

    def claim(
        self, stream: str, owner: str, claimer: str, min_idle_ms: int, count: int,
        skip: AbstractSet[bytes] = frozenset(),
    ) -> list[tuple[bytes, dict[bytes, bytes], int]]:
        """Move up to ``count`` of ``owner``'s entries idle for ``min_idle_ms`` to ``claimer``.

        Returns (entry id, fields, times delivered so far). The claim does not count as a
        delivery (JUSTID): only running a redelivered entry does (``count_delivery``), so
        requests that merely sat beside a crasher are not blamed for its crashes. Entries
        deleted meanwhile (cancelled) leave the pending list without being returned. Two
        claimers racing never both get an entry: the claim resets its idle time.
        """
        with redis_errors(self.url):
            pending = self.redis.xpending_range(
                stream, GROUP, min="-", max="+", count=count, consumername=owner,
                idle=min_idle_ms,
            )
            if not pending:
                return []
            deliveries = {
                p["message_id"]: int(p["times_delivered"])
                for p in pending
                if p["message_id"] not in skip
            }
            if not deliveries:
                return []
            claimed = cast(list[bytes], self.redis.xclaim(
                stream, GROUP, claimer, min_idle_ms, list(deliveries), justid=True
            ))
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in claimed:
                pipe.xrange(stream, entry_id, entry_id)
            found = pipe.execute()
        return [
            (entry[0][0], entry[0][1], deliveries.get(entry[0][0], 1))
            for entry in found
            if entry
        ]

    def count_delivery(self, stream: str, consumer: str, entry_id: bytes) -> None:
        """Count one more delivery of an entry this consumer is about to run."""
        with redis_errors(self.url):
            self.redis.xclaim(stream, GROUP, consumer, 0, [entry_id])

    def consumers(self, stream: str) -> list[tuple[str, int, int]]:
        """(name, pending, idle ms) of every consumer in the stream's group."""
        with redis_errors(self.url):
            info = self.redis.xinfo_consumers(stream, GROUP)
        return [(text(c["name"]), int(c["pending"]), int(c["idle"])) for c in info]

    def forget_consumer(self, stream: str, consumer: str) -> None:
        with redis_errors(self.url):
            self.redis.xgroup_delconsumer(stream, GROUP, consumer)

    def queue_depths(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, str, int, int]]:
        """(serving keys, batch key, stream length, pending) for every stream of the servings.

        Acked entries are deleted, so length - pending is what waits to be read."""
        with redis_errors(self.url):
            streams = [
                (keys, text(k))
                for keys in keys_list
                for k in sorted(cast(set[bytes], self.redis.smembers(keys.keys)))
            ]
            pipe = self.redis.pipeline(transaction=False)
            for keys, key in streams:
                pipe.xlen(keys.stream(key))
                pipe.xpending(keys.stream(key), GROUP)
            out = pipe.execute(raise_on_error=False)
        result = []
        for i, (keys, key) in enumerate(streams):
            length, pending = out[2 * i], out[2 * i + 1]
            held = pending["pending"] if isinstance(pending, dict) else 0
            result.append((keys, key, int(length) if isinstance(length, int) else 0, int(held)))
        return result

    def servings(self, prefix: str) -> list[str]:
        """Names of the servings any worker ever declared under ``prefix``."""
        names = set()
        with redis_errors(self.url):
            for key in self.redis.scan_iter(match=f"{prefix}:{{*}}:meta", count=500):
                name = text(key)
                names.add(name[name.index("{") + 1 : name.rindex("}")])
        return sorted(names)

    def group_stats(self, keys: Keys) -> list[tuple[str, int, int, int | None, int]]:
        """Per batch key: (key, stream length, pending, lag, entries read by the group)."""
        out: list[tuple[str, int, int, int | None, int]] = []
        with redis_errors(self.url):
            for key in sorted(text(k) for k in cast(set[bytes], self.redis.smembers(keys.keys))):
                stream = keys.stream(key)
                length = int(self.redis.xlen(stream))
                try:
                    groups = self.redis.xinfo_groups(stream)
                except redis.ResponseError:  # no stream or group yet
                    groups = []
                group = next((g for g in groups if text(g["name"]) == GROUP), None)
                if group is None:
                    out.append((key, length, 0, length, 0))
                    continue
                lag = group.get("lag")
                out.append((key, length, int(group["pending"]),
                            None if lag is None else int(lag), int(group.get("entries-read") or 0)))
        return out

    def dead_letter_depths(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, int]]:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.xlen(keys.dead)
            return list(zip(keys_list, (int(n) for n in pipe.execute()), strict=True))

    def ping(self) -> bool:
        try:
            with redis_errors(self.url):
                return bool(self.redis.ping())
        except RedisUnavailable:
            return False

    def dead_letter(
        self, keys: Keys, stream: str, entry_id: bytes, record: Mapping[str, Any],
        *, ack_now: bool,
    ) -> None:
        """Copy an entry to the serving's dead-letter stream with why (``record``).

        ``ack_now`` acks and deletes the entry here, for entries nobody can be answered for;
        otherwise the replier acks it after telling the caller.
        """
        fields: dict[Any, Any] = {
            "stream": stream, "entry_id": entry_id, "at_ms": int(time.time() * 1000), **record
        }
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(keys.dead, fields)
            if ack_now:
                pipe.xack(stream, GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            pipe.execute()

    def config(self, keys: Keys) -> dict[str, str]:
        with redis_errors(self.url):
            raw = self.redis.hgetall(keys.config)
        return {text(k): text(v) for k, v in raw.items()}

    def set_config(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Store run-time overrides, and show them in the declared options at once."""
        fields: dict[Any, Any] = {k: str(v) for k, v in options.items()}
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(keys.config, mapping=fields)
            pipe.hset(keys.meta, mapping=fields)
            pipe.execute()

    def declare(self, keys: Keys, options: Mapping[str, Any]) -> None:
        """Publish a serving's options (clients read codec and max_queue from them)."""
        with redis_errors(self.url):
            self.redis.hset(keys.meta, mapping={k: str(v) for k, v in options.items()})

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
            pipe.execute()

    def leave(self, keys_list: Sequence[Keys], consumer: str) -> None:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(worker_key(keys_list[0].prefix, consumer))
            for keys in keys_list:
                pipe.zrem(keys.workers, consumer)
            pipe.execute()
