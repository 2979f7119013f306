"""The connection core every broker side shares: one Redis deployment's client, its scripts,
cluster routing and the raw fast path (broker/raw.py), and the few reads every side makes.

Every redis-py error is turned into a queueserve error in broker/, at one boundary; the
producer (client), consumer (worker) and admin (ops) sides subclass ``BrokerCore``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from queueserve.broker import raw
from queueserve.broker.common import load_script, names, pubsub_data, since_ms, texts
from queueserve.broker.connect import (
    DEFAULT_POOL_SIZE,
    allow_connections,
    close,
    connect,
    is_cluster,
)
from queueserve.broker.redis_errors import error_code, redis_errors
from queueserve.broker.retry import Outage
from queueserve.broker.urls import redact_url
from queueserve.errors import RedisUnavailable
from queueserve.wire.keys import Keys, tenants_key
from queueserve.wire.tenants import MAX_TENANT_WEIGHTS, parse_weights

IDLE_CLOSE_S = 10.0  # a connection not needed this long is closed (close_idle)


def no_group(error: redis.ResponseError) -> bool:
    return error_code(error) == "NOGROUP"


@contextlib.contextmanager
def pubsub_errors(url: str) -> Iterator[None]:
    """``redis_errors`` for a pub/sub connection: redis-py reading one it has just dropped (its
    socket gone) raises TypeError, AttributeError or OSError, a broken connection like any
    other."""
    try:
        with redis_errors(url):
            yield
    except (TypeError, AttributeError, OSError) as e:
        raise RedisUnavailable(
            f"the pub/sub connection to Redis at {redact_url(url)} broke ({e!r})"
        ) from None


class Subscription:
    """Pub/sub channels, read with ``get``; resubscribes by itself after a reconnect.

    After a failure the pub/sub connection is made anew: a cluster's pub/sub client stays
    bound to the node it picked, which may be the one that died."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, url: str, *channels: str) -> None:
        self.url = url
        self.channels = channels
        self.confirmed = False  # Redis confirmed the subscription at least once
        self._client = client
        self._pubsub: Any = None

    def _subscribed(self) -> Any:
        if self._pubsub is None:
            self._pubsub = self._client.pubsub(  # type: ignore[no-untyped-call, unused-ignore]
                ignore_subscribe_messages=False
            )
        if not self._pubsub.subscribed:
            self._pubsub.subscribe(*self.channels)
        return self._pubsub

    def open(self) -> None:
        """Subscribe now (``get`` would subscribe on first use)."""
        with self._renewed_on_failure():
            self._subscribed()

    def get(self, timeout: float) -> bytes | None:
        """The next message published, or None after ``timeout`` seconds (or a confirmation)."""
        with self._renewed_on_failure():
            confirmation, data = pubsub_data(self._subscribed().get_message(timeout=timeout))
        self.confirmed = self.confirmed or confirmation
        return data

    @contextlib.contextmanager
    def _renewed_on_failure(self) -> Iterator[None]:
        try:
            with pubsub_errors(self.url):
                yield
        except RedisUnavailable:
            self.close()  # made anew by the next get
            raise

    def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                pubsub.close()


class BrokerCore:
    """One Redis deployment: its client, the scripts, routing and the raw fast path."""

    # Connections of this broker's own beyond those of its users' threads (a worker's shared
    # pub/sub and wake watch: broker/channels.py, broker/wakes.py).
    OWN_CONNECTIONS = 0

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        self.url = url
        self.redis = client if client is not None else connect(url)
        # The loops of whoever uses this broker log an outage of it once, under this name.
        self.outage = Outage(owner or f"Redis at {redact_url(url)}")
        self._enqueue: Script = self.redis.register_script(load_script("enqueue.lua"))
        self._ack: Script = self.redis.register_script(load_script("ack.lua"))
        self._job: Script = self.redis.register_script(load_script("job.lua"))
        self._cancel: Script = self.redis.register_script(load_script("cancel.lua"))
        self._read: Script = self.redis.register_script(load_script("read.lua"))
        self._sweep: Script = self.redis.register_script(load_script("sweep.lua"))
        self._replay: Script = self.redis.register_script(load_script("replay.lua"))
        self._split: Script = self.redis.register_script(load_script("split.lua"))
        self._claim: Script = self.redis.register_script(load_script("claim.lua"))
        self._loaded_on: set[int] = set()  # connections enqueue.lua was loaded on (durable)
        # The hot path's round trips go straight onto a pooled connection (broker/raw.py),
        # except on a cluster, whose client routes each command to its slot's master.
        plain = not is_cluster(self.redis)
        self._raw = (
            raw.Connections(cast(redis.Redis, self.redis).connection_pool) if plain else None
        )
        self._trimmed_at = time.monotonic()  # (close_idle)

    def close_idle(self) -> None:
        """Close the connections not needed for IDLE_CLOSE_S (call it now and then: a
        partition does at each heartbeat). What a burst opened, or a partition's start, when
        each serving blocked on a connection of its own, is given back to Redis; the fast
        path's connections kept are those it took at once in that time."""
        now = time.monotonic()
        if now - self._trimmed_at < IDLE_CLOSE_S:
            return
        self._trimmed_at = now
        if self._raw is not None:
            self._raw.trim()
            # (redis-py's pool makes a closed connection anew when it hands it out again)
            cast(redis.Redis, self.redis).connection_pool.disconnect(inuse_connections=False)

    def size_pool(self, threads: int) -> None:
        """Size the pool for ``threads`` threads that use this broker at once (a worker
        partition's: broker/connect.py's pool limit is redis-py's 100 otherwise, which a
        worker of 50 servings reached). A thread holds one connection at a time, but may
        leave one idle on each side: in the raw fast path's list and in redis-py's pool,
        neither of which takes the other's. Never fewer than redis-py's default."""
        limit = max(DEFAULT_POOL_SIZE, 2 * threads + self.OWN_CONNECTIONS)
        allow_connections(self.redis, limit)

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        close(self.redis)

    def _evalsha(self, script: Script, script_keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` (one round trip; on a server that lost its scripts, loaded first)."""
        if self._raw is None:
            return script(keys=script_keys, args=args)
        command = ("EVALSHA", script.sha, len(script_keys), *script_keys, *args)
        (reply,) = raw.run(self._raw, [command])
        if isinstance(reply, NoScriptError):  # Redis restarted or flushed its scripts
            (reply,) = raw.run(self._raw, [("SCRIPT", "LOAD", script.script), command])[1:]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _load(self, script: Script) -> None:
        """Load ``script`` on the server the hot path's commands go to (after a failover,
        redis-py's pool may still hold a connection to the old master, now a replica, which
        would take the script without complaint)."""
        if self._raw is None:
            self.redis.script_load(script.script)
        else:
            (reply,) = raw.run(self._raw, [("SCRIPT", "LOAD", script.script)])
            if isinstance(reply, Exception):
                raise reply

    def _node(self, key: str) -> Any:
        """A plain client of the master serving ``key``: on a cluster, commands sent through it
        skip the cluster client's routing. redis-py asks ``COMMAND GETKEYS`` of its default
        node (always the same master) before every command whose keys it cannot place itself
        (BLMPOP, XREAD): one more round trip per call, and that master's CPU. Not a cluster:
        the client itself."""
        client: Any = self.redis
        if is_cluster(client):
            return client.get_redis_connection(client.get_node_from_key(key))
        return client

    def _target(self, key: str) -> dict[str, Any]:
        """Options naming the node of ``key`` for a command in a cluster pipeline."""
        if is_cluster(self.redis):
            return {"target_nodes": self.redis.get_node_from_key(key)}  # type: ignore[union-attr]
        return {}

    def _moved(self, key: str, reply: object) -> None:
        """Raise a transient error for a MOVED/ASK ``reply`` of a command sent through
        ``_node`` (a failover or resharding moved the slot), after reloading the slot map;
        the retry helper then sends it again, to the new master."""
        if isinstance(reply, redis.ResponseError) and error_code(reply) in ("MOVED", "ASK"):
            self._refresh_slots()
            raise redis.ConnectionError(f"the slot of {key} moved: {reply}")

    @contextlib.contextmanager
    def _routed(self, key: str) -> Iterator[None]:
        """Around commands sent through ``_node(key)``: a MOVED, or a master that cannot be
        reached, reloads the slot map before the error goes on."""
        try:
            yield
        except redis.ResponseError as e:
            self._moved(key, e)
            raise
        except redis.ConnectionError:
            self._refresh_slots()
            raise

    def _refresh_slots(self) -> None:
        if is_cluster(self.redis):
            with contextlib.suppress(redis.RedisError):
                self.redis.nodes_manager.initialize()  # type: ignore[union-attr]

    def subscribe(self, *channels: str) -> Subscription:
        return Subscription(self.redis, self.url, *channels)

    def meta(self, keys: Keys) -> dict[str, str]:
        """The options workers declared; empty when none did, or when the key is not a hash
        (anyone may write it: a string there reads as no declaration, not as an error that
        every call of the serving would raise)."""
        with redis_errors(self.url):
            try:
                return texts(self.redis.hgetall(keys.meta), "replace")
            except redis.ResponseError as e:
                if error_code(e) != "WRONGTYPE":
                    raise
                return {}

    def config(self, keys: Keys) -> dict[str, str]:
        with redis_errors(self.url):
            return texts(self.redis.hgetall(keys.config), "replace")

    def run_time_config(self, keys: Keys) -> tuple[dict[str, str], dict[str, float]]:
        """``config`` and the tenants' weights other than 1 (``P:tenants``, checked:
        wire/tenants.py) in one round trip: none when the hash holds more fields than a worker
        reads, or is a key of another type (anyone may write it)."""
        tenants = tenants_key(keys.prefix)
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(keys.config)
            pipe.hlen(tenants)
            pipe.hrandfield(tenants, MAX_TENANT_WEIGHTS, withvalues=True)
            config, size, fields = pipe.execute(raise_on_error=False)
            if isinstance(config, Exception):
                raise config
        if isinstance(size, Exception) or isinstance(fields, Exception) or size > len(fields) // 2:
            return texts(config, "replace"), {}
        pairs = dict(zip(fields[::2], fields[1::2], strict=True))
        return texts(config, "replace"), parse_weights(pairs)

    def alive_workers(self, keys: Keys, within: float) -> int:
        with redis_errors(self.url):
            return int(self.redis.zcount(keys.workers, since_ms(within), "+inf"))

    def alive_consumers(self, keys: Keys, within: float) -> set[str]:
        with redis_errors(self.url):
            raw = self.redis.zrangebyscore(keys.workers, since_ms(within), "+inf")
        return set(names(cast(list[bytes], raw)))

    def ping(self) -> bool:
        try:
            with redis_errors(self.url):
                return bool(self.redis.ping())
        except RedisUnavailable:
            return False
