"""Every redis-py error becomes a queueserve error here, for the sync and the async broker.

Transient failures, which a loop rides out with backoff (``queueserve.broker.retry``), become
``RedisUnavailable``: a lost or timed-out connection, LOADING after a restart, OOM under
``maxmemory``/noeviction, READONLY and UNBLOCKED while a primary turns into a replica,
MASTERDOWN, cluster TRYAGAIN/CLUSTERDOWN (and redis-py's cluster exceptions: no node
reachable, a slot not served), and NOGROUP (a Redis that came back without its data;
the broker makes the group again where it can). Everything else Redis refuses will be refused
again, and becomes ``RedisCommandError``.

Two limits are transient too, and said to be limits, never that Redis is down: a connection
pool with every connection in use (redis-py's ``MaxConnectionsError``, "Too many connections":
``ConnectionPoolExhausted``, naming the pool's size), and a server at its ``maxclients``.
"""

from __future__ import annotations

from typing import Any

import redis
from redis import exceptions as rx

from queueserve.broker.urls import redact_url
from queueserve.errors import (
    ConnectionPoolExhausted,
    QueueServeError,
    RedisCommandError,
    RedisUnavailable,
)

# Error codes redis-py leaves as a plain ResponseError whose cause passes.
TRANSIENT_CODES = frozenset(
    {
        "UNBLOCKED",
        "NOGROUP",
        "LOADING",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "OOM",
        "READONLY",
        "BUSY",
    }
)
_TRANSIENT_TYPES: tuple[type[Exception], ...] = (
    rx.OutOfMemoryError,
    rx.ReadOnlyError,
    rx.BusyLoadingError,
    rx.MasterDownError,
    rx.TryAgainError,
    rx.ClusterDownError,
)
_PIPELINE_PREFIX = "of pipeline caused error: "

_ADVICE = {
    "NOPERM": "grant the Redis ACL user the commands and keys queueserve uses "
    "(see docs/usage.md), or use another user",
    "WRONGTYPE": "a key under queueserve's prefix holds another type: use a prefix no other "
    "application writes to, or delete the key",
    "AUTH": "check the user name and password in the Redis URL",
    "MOVED": "this Redis is a Redis Cluster node that was not reachable when the client or "
    "worker started, so it was not detected: use a redis+cluster://host:port URL",
    "CROSSSLOT": "a command touched keys of several cluster slots; this is a bug: report it "
    "with this message",
    "SCRIPT": "a queueserve Lua script failed; this is a bug or a key of the wrong type: "
    "report it with this message",
}


def error_code(error: redis.RedisError) -> str:
    """Redis's error code (``NOGROUP``, ``WRONGTYPE``, ...) of a reply error, or ``""``.

    redis-py strips the code from the message of the errors it has a class for, and prefixes
    errors raised from a pipeline with the failing command."""
    code = getattr(error, "status_code", None)
    if code:
        return str(code)
    message = str(error)
    if _PIPELINE_PREFIX in message:
        message = message.split(_PIPELINE_PREFIX, 1)[1]
    word = message.split(" ", 1)[0]
    return word if word.isupper() else ""


def raise_but_wrong_type(replies: list[Any]) -> list[Any]:
    """``replies`` of a pipeline run with ``raise_on_error=False``, raising any error in them
    but WRONGTYPE (a key of another type under the prefix: it holds nothing of ours)."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError) and error_code(reply) != "WRONGTYPE":
            raise reply
    return replies


def is_transient(error: redis.RedisError) -> bool:
    if isinstance(error, rx.AuthenticationError):
        return False
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, *_TRANSIENT_TYPES)):
        return True
    return error_code(error) in TRANSIENT_CODES


def _words(error: redis.RedisError) -> str:
    """Redis's words, without the arguments redis-py quotes for a failing pipeline command
    (payloads: large, and not for logs)."""
    message = str(error)
    if _PIPELINE_PREFIX not in message:
        return message
    head, reply = message.split(_PIPELINE_PREFIX, 1)
    command = head.partition("(")[2].split(" ", 1)[0].rstrip(")")
    return f"{command} in a pipeline: {reply}"


def pool_exhausted(error: BaseException) -> bool:
    """Whether ``error`` is a connection pool's limit (redis-py 8's ``MaxConnectionsError``; a
    plain ``ConnectionError("Too many connections")`` before it), not a failed connection."""
    return isinstance(error, redis.ConnectionError) and str(error).startswith(
        "Too many connections"
    )


def translate(error: redis.RedisError, url: str) -> QueueServeError:
    """The queueserve error for ``error``, naming the (redacted) URL and what to do."""
    where = f"Redis at {redact_url(url)}"
    detail = f"{type(error).__name__}: {_words(error)}"
    if pool_exhausted(error):
        limit = getattr(error, "limit", None)  # a pool made by broker/connect.py names it
        size = "" if limit is None else f"of {limit} "
        return ConnectionPoolExhausted(
            f"connection pool {size}exhausted: every connection this process may hold to "
            f"{where} is in use (redis-py: {error}); Redis itself is not the limit. A worker "
            "sizes its pool from what its partition runs: report this with the servings it "
            "runs; a client holds one connection per thread blocked on it at once"
        )
    if isinstance(error, redis.ConnectionError) and "max number of clients" in str(error):
        return RedisUnavailable(
            f"{where} refused a new connection: it serves as many clients as its maxclients "
            f"allows ({detail}); raise maxclients (CONFIG SET maxclients) or run fewer clients"
        )
    if is_transient(error):
        return RedisUnavailable(
            f"{where} is unavailable ({detail}): check that it is up, has memory left and is "
            "a primary"
        )
    if isinstance(error, rx.AuthenticationError):
        advice = _ADVICE["AUTH"]
    elif isinstance(error, rx.NoPermissionError):
        advice = _ADVICE["NOPERM"]
    else:
        code = error_code(error)
        script = "script" in str(error).lower() or isinstance(error, rx.NoScriptError)
        advice = _ADVICE.get(code) or (
            _ADVICE["SCRIPT"] if script else "this will fail again as sent: report it if unexpected"
        )
    return RedisCommandError(f"{where} refused a command ({detail}): {advice}")


class redis_errors:  # (lower case: named as the function it replaced, at 89 call sites)
    """Turn any redis-py error raised in the block into a queueserve error. Works around
    ``await`` too: ``with redis_errors(url): await client.get(key)``. A class, not a
    ``contextlib.contextmanager``: the hot path enters one per round trip, and a generator's
    set-up costs about a microsecond more each time."""

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if isinstance(error, redis.RedisError):
            raise translate(error, self.url) from None
        if isinstance(error, rx.RedisClusterException):
            # Not a RedisError: no node of the cluster reachable, or a slot no master serves
            # (a failover under way). Both pass.
            raise RedisUnavailable(
                f"Redis Cluster at {redact_url(self.url)} is unavailable "
                f"({type(error).__name__}: {error}): check that its nodes are up and every "
                "slot is served (CLUSTER INFO)"
            ) from None
