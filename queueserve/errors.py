"""queueserve's exceptions: callers catch these, never a library's.

    QueueServeError
    ├── RemoteError          the batch function (or the worker) failed for this item
    ├── QueueFull            admission would pass the serving's max_queue items
    ├── Timeout              the caller's deadline passed before its answer came
    ├── Cancelled            the request was cancelled by its caller
    ├── BadRequest           the request itself is invalid (too large, wrong codec, bad input)
    ├── DeadLettered         the request killed max_deliveries workers; see the dead-letter stream
    ├── RedisUnavailable     Redis cannot serve right now: unreachable, loading, out of memory,
    │   │                    read-only or failing over; retried with backoff, raised when the
    │   │                    caller's time is up
    │   └── ConnectionPoolExhausted
    │                        not Redis: this process holds as many connections as its pool
    │                        allows; retried as an outage is, and said to be a pool limit
    ├── RedisCommandError    Redis refused a command in a way retrying will not fix (NOPERM,
    │                        WRONGTYPE, a failing script, a wrong password)
    ├── NotReplicated        a durable serving's request reached the primary, but no replica
    │                        acknowledged it in time: a failover now could lose it
    ├── UnknownServing       the call named a serving no worker ever declared under the prefix
    ├── IdempotencyConflict  the call reused an idempotency key of the serving for other items
    ├── BatchResultError     (results.py) a batch function's return value does not give one
    │                        result per item; its callers get it as a RemoteError
    ├── ServingNotFound      (worker/loading.py) a ``module:attr`` that names no serving
    ├── KeyLoadError         (key_states.py) a batch key's state could not be loaded (load_key
    │                        raised, or it is backing off): the worker answers that key's
    │                        requests with the error, its callers get a RemoteError
    └── StartupFailed        (worker/partition.py) a worker partition could not start serving

Every public exception of queueserve derives from ``QueueServeError``; the four defined
beside the code that raises them are listed here too (tests/unit/test_errors_tree.py holds it).
"""

from __future__ import annotations


class QueueServeError(Exception):
    """Root of every error queueserve raises."""


class RemoteError(QueueServeError):
    """An item failed remotely; carries the remote exception's type name, message and traceback.

    >>> try:
    ...     client.dispatch("square", "2")
    ... except qs.RemoteError as e:
    ...     print(e.remote_type, e.remote_message)
    TypeError can't multiply sequence by non-int of type 'str'
    """

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{remote_type}: {remote_message}")
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str, str]]:
        return (type(self), (self.remote_type, self.remote_message, self.remote_traceback))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteError) and (self.remote_type, self.remote_message) == (
            other.remote_type,
            other.remote_message,
        )

    __hash__ = Exception.__hash__


class QueueFull(QueueServeError):
    """The serving's queue holds max_queue items already; retry later or raise max_queue."""


class Timeout(QueueServeError):
    """The request's deadline passed before its answer arrived."""


class Cancelled(QueueServeError):
    """The request was cancelled by its caller before it completed."""


class BadRequest(QueueServeError):
    """The request can never succeed as sent (oversize, undecodable, failed validation)."""


class DeadLettered(QueueServeError):
    """The request was delivered more than max_deliveries times, each time to a worker that
    died before answering; it was moved to the serving's dead-letter stream."""


class RedisUnavailable(QueueServeError):
    """Redis cannot serve now (connection lost, LOADING, OOM, READONLY, UNBLOCKED, NOGROUP,
    MASTERDOWN); the message names the URL, without its password, and Redis's own words."""


class ConnectionPoolExhausted(RedisUnavailable):
    """This process's connection pool to Redis is at its limit: every connection it may hold is
    in use, and Redis itself may be fine. Ridden out as an outage is (a connection given back
    ends it), but reported as what it is; the message names the pool's size."""


class RedisCommandError(QueueServeError):
    """Redis refused a command for good: missing ACL permission, a key of the wrong type, a
    failing script, a wrong password. The message says which, with Redis's own words."""


class UnknownServing(QueueServeError):
    """A call named a serving that no worker ever declared under the client's prefix (a typo,
    or another prefix or Redis). Raised at once, listing the declared names closest first;
    a client started before its workers passes ``wait_for_worker=True`` to wait instead."""


class NotReplicated(QueueServeError):
    """A request of a ``durable=True`` serving was queued on the primary, but no replica
    acknowledged it within the wait (``WAIT 1``): a failover now could lose it. It may still
    run; resending it is safe when the batch function may run twice for one request."""


class IdempotencyConflict(QueueServeError):
    """A call reused an idempotency key, within the serving's ``idempotency_ttl``, for other
    items (or another batch key) than the key's first call: a key names one request, as in the
    IETF Idempotency-Key draft and Stripe's API (the gateway answers HTTP 422). The message
    names the key and the job of its first call.

    >>> client.submit("embed", ["a"], idempotency_key="doc-42").result()
    >>> client.submit("embed", ["b"], idempotency_key="doc-42")   # raises IdempotencyConflict
    """
