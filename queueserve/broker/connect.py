"""Redis clients for a URL: one server, a Redis Cluster, or a master found through Sentinel.

URL forms (``[user:password@]`` is optional everywhere)::

    redis://host:6379/0               one server; a cluster node is detected (INFO cluster)
    rediss://... , unix:///path.sock  TLS, a unix socket
    redis+cluster://host:7000[,host:7001...]
                                      Redis Cluster, from any of these startup nodes
    redis+sentinel://host:26379[,host:26380...]/service_name[/db]
                                      the master of ``service_name`` as the sentinels know it;
                                      ?password= (or user:password@) is the Redis password,
                                      ?sentinel_password= / ?sentinel_username= the sentinels'

``rediss+cluster://`` and ``rediss+sentinel://`` use TLS to the Redis servers.

The Sentinel client asks the sentinels for the master's address on every new connection, and
a connection that finds its server turned replica (READONLY) is dropped: after a failover, the
next attempt of the retry helper (``broker.retry``) reaches the new master. The cluster client
follows MOVED redirections and reloads the slot map after a node is lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterNode
from redis.connection import ConnectionPool
from redis.exceptions import MaxConnectionsError
from redis.sentinel import Sentinel, SentinelConnectionPool

from queueserve.broker.common import HiredisPacker
from queueserve.broker.urls import redact_url

log = logging.getLogger(__name__)

Kind = Literal["single", "cluster", "sentinel"]
HEALTH_CHECK_S = 30
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379
_SENTINEL_AUTH = {"sentinel_password", "sentinel_username"}
DEFAULT_POOL_SIZE = 100  # redis-py's connections per pool (per node on a cluster)


class _PoolExhausted(MaxConnectionsError):
    """redis-py's pool limit error, carrying the limit, which broker/redis_errors.py names in the
    ``ConnectionPoolExhausted`` it makes of it (redis-py's own error names none)."""

    def __init__(self, limit: int) -> None:
        super().__init__("Too many connections")
        self.limit = limit


class _Pool(ConnectionPool):
    """redis-py's pool, whose limit error carries the limit (and ``_SentinelPool``)."""

    def make_connection(self) -> Any:
        try:
            return super().make_connection()
        except MaxConnectionsError:
            raise _PoolExhausted(self.max_connections) from None


class _SentinelPool(SentinelConnectionPool):
    def make_connection(self) -> Any:
        try:
            return super().make_connection()
        except MaxConnectionsError:
            raise _PoolExhausted(self.max_connections) from None


@dataclass(frozen=True)
class Topology:
    """What a URL names: the kind of deployment, its seed hosts, and how to log in."""

    kind: Kind
    url: str  # the URL as given (a single server's URL goes to redis-py as it is)
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None
    sentinel_auth: dict[str, str] = field(default_factory=dict)


def parse_url(url: str) -> Topology:
    """The topology ``url`` names; a ValueError with the URL (redacted) when it is malformed."""
    scheme, _, _ = url.partition("://")
    base, plus, kind = scheme.lower().partition("+")
    if not plus:
        return Topology("single", url)
    if base not in ("redis", "rediss") or kind not in ("cluster", "sentinel"):
        raise ValueError(
            f"{redact_url(url)!r}: unknown scheme {scheme!r}; use redis+cluster://, "
            "redis+sentinel:// (or rediss+... for TLS)"
        )
    parts = urlsplit(url)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    default_port = SENTINEL_PORT if kind == "sentinel" else CLUSTER_PORT
    hosts = tuple(_host_port(url, h, default_port) for h in netloc.split(",") if h)
    if not hosts:
        raise ValueError(f"{redact_url(url)!r} names no host: write host:port[,host:port...]")
    options = dict(parse_qsl(parts.query))
    password = options.pop("password", password)
    username = options.pop("username", username)
    known = _SENTINEL_AUTH if kind == "sentinel" else set()
    unknown = set(options) - known
    if unknown:
        raise ValueError(
            f"{redact_url(url)!r}: unknown option(s) {sorted(unknown)}; a {kind} URL takes "
            f"{sorted({'password', 'username', *known})}"
        )
    sentinel_auth = {k.removeprefix("sentinel_"): v for k, v in options.items()}
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not path:
            raise ValueError(
                f"{redact_url(url)!r} names no service: write "
                "redis+sentinel://host:port[,host:port...]/service_name[/db]"
            )
        service = unquote(path[0])
        db = _db(url, path[1]) if len(path) > 1 else 0
    elif path and _db(url, path[0]) != 0:
        raise ValueError(f"{redact_url(url)!r}: a Redis Cluster has only database 0")
    return Topology(
        "sentinel" if kind == "sentinel" else "cluster",
        url,
        hosts,
        service,
        db,
        base == "rediss",
        username,
        password,
        sentinel_auth,
    )


def _host_port(url: str, text: str, default: int) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        return host.strip("[]"), int(port) if colon else default
    except ValueError:
        raise ValueError(f"{redact_url(url)!r}: {text!r} is not host:port") from None


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{redact_url(url)!r}: database {text!r} is not a number")
    return int(text)


def _is_cluster_node(url: str) -> bool:
    """Whether the server at a plain URL runs in cluster mode; False when it cannot be asked
    now (a later command to a cluster then fails with MOVED, whose advice names
    redis+cluster://)."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        return bool(probe.info("cluster").get("cluster_enabled"))
    except redis.RedisError:
        return False
    finally:
        probe.close()


def _common(t: Topology) -> dict[str, Any]:
    auth: dict[str, Any] = {"health_check_interval": HEALTH_CHECK_S}
    if t.password is not None:
        auth["password"] = t.password
    if t.username is not None:
        auth["username"] = t.username
    if t.tls:
        auth["ssl"] = True
    return auth


def _server_auth(t: Topology) -> dict[str, Any]:
    """Credentials and TLS of the Redis servers behind the sentinels (the connections to the
    sentinels themselves take ``sentinel_kwargs``)."""
    return {k: v for k, v in _common(t).items() if k != "health_check_interval"}


def connect(url: str) -> redis.Redis | redis.RedisCluster:
    """A sync client for ``url``: ``redis.Redis``, ``redis.RedisCluster``, or a Sentinel
    master client (a ``redis.Redis`` whose pool asks the sentinels where the master is)."""
    t = parse_url(url)
    if t.kind == "single":
        if not url.startswith("unix:") and _is_cluster_node(url):
            log.info("%s is a Redis Cluster node: using the cluster client", redact_url(url))
            return redis.RedisCluster.from_url(
                url, health_check_interval=HEALTH_CHECK_S, connection_pool_class=_Pool
            )
        pool = _Pool.from_url(
            url, health_check_interval=HEALTH_CHECK_S, command_packer=HiredisPacker()
        )
        return redis.Redis.from_pool(pool)  # (the client closes the pool, as from_url's does)
    # redis-py 8.1 leaves these constructors untyped and 8.2 types them: the ignores name
    # unused-ignore too, so either release type-checks (a lock bump stays one line).
    if t.kind == "cluster":
        nodes = [ClusterNode(h, p) for h, p in t.hosts]  # type: ignore[no-untyped-call, unused-ignore]
        return redis.RedisCluster(startup_nodes=nodes, connection_pool_class=_Pool, **_common(t))
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(t.hosts), sentinel_kwargs=dict(t.sentinel_auth), **_server_auth(t)
    )
    master: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        t.service,
        db=t.db,
        health_check_interval=HEALTH_CHECK_S,
        connection_pool_class=_SentinelPool,
    )
    return master


def allow_connections(client: redis.Redis | redis.RedisCluster, limit: int) -> None:
    """Let ``client`` hold up to ``limit`` connections at once (to each node, on a cluster):
    the size of its pool, whose limit error then names it."""
    if is_cluster(client):
        cluster: Any = client
        cluster.nodes_manager.connection_kwargs["max_connections"] = limit  # nodes found later
        for node in cluster.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.max_connections = limit
    else:
        cast(redis.Redis, client).connection_pool.max_connections = limit


def connect_async(url: str) -> aioredis.Redis | aioredis.RedisCluster:
    """``connect`` for asyncio. Detecting a cluster behind a plain URL asks the server once,
    synchronously, here (a client is made once; its calls never block the loop)."""
    t = parse_url(url)
    if t.kind == "single":
        if not url.startswith("unix:") and _is_cluster_node(url):
            return aioredis.RedisCluster.from_url(url, health_check_interval=HEALTH_CHECK_S)
        return aioredis.Redis.from_url(url, health_check_interval=HEALTH_CHECK_S)
    if t.kind == "cluster":
        nodes = [AsyncClusterNode(h, p) for h, p in t.hosts]
        return aioredis.RedisCluster(startup_nodes=nodes, **_common(t))
    sentinel = AsyncSentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(t.hosts), sentinel_kwargs=dict(t.sentinel_auth), **_server_auth(t)
    )
    master: aioredis.Redis = sentinel.master_for(
        t.service, db=t.db, health_check_interval=HEALTH_CHECK_S
    )
    return master


def is_cluster(client: object) -> bool:
    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def close(client: redis.Redis | redis.RedisCluster) -> None:
    """Close ``client``, and for a Sentinel client its connections to the sentinels too."""
    client.close()
    for sentinel in _sentinels_of(client):
        sentinel.close()


async def aclose(client: aioredis.Redis | aioredis.RedisCluster) -> None:
    await client.aclose()
    for sentinel in _sentinels_of(client):
        await sentinel.aclose()


def _sentinels_of(client: object) -> list[Any]:
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    return list(getattr(manager, "sentinels", []))
