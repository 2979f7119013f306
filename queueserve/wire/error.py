"""The error table: every error kind a reply can carry, the body a worker sends for it, and the
exception a client raises for it. Both sides read this one table, so a kind added here is sent
and understood alike.

An error body is ``[remote type, message, traceback, kind]`` (wire/protocol.py, "Reply").
"""

from __future__ import annotations

import traceback
from typing import Final

from queueserve.errors import BadRequest, DeadLettered, QueueServeError, RemoteError, Timeout
from queueserve.wire.kinds import ERR_BAD_REQUEST, ERR_DEAD_LETTER, ERR_REMOTE, ERR_TIMEOUT

ErrorBody = list[str]

# kind -> the exception a client raises for it (a kind not here raises RemoteError).
RAISED: Final[dict[str, type[QueueServeError]]] = {
    ERR_TIMEOUT: Timeout,
    ERR_BAD_REQUEST: BadRequest,
    ERR_DEAD_LETTER: DeadLettered,
}

# A request whose deadline passed before its batch ran, or before it finished generating.
EXPIRED: Final[ErrorBody] = [
    "Timeout",
    "the request's deadline passed before its batch ran",
    "",
    ERR_TIMEOUT,
]
EXPIRED_GENERATING: Final[ErrorBody] = [
    "Timeout",
    "the request's deadline passed before it finished generating",
    "",
    ERR_TIMEOUT,
]


def error_body(exc: BaseException, kind: str = ERR_REMOTE) -> ErrorBody:
    """An exception raised in the worker, with its traceback, as the caller will get it."""
    tb = "".join(traceback.format_exception(exc))
    return [type(exc).__qualname__, str(exc), tb, kind]


def bad_request(reason: str, kind: str = ERR_BAD_REQUEST) -> ErrorBody:
    """A request the worker refused before running it: the caller raises BadRequest (or, for
    ``kind`` ERR_TIMEOUT, Timeout: a request that expired before a worker took it)."""
    return ["BadRequest", reason, "", kind]


def dead_lettered(message: str) -> ErrorBody:
    """A request moved to the dead-letter stream (the caller raises DeadLettered)."""
    return ["DeadLettered", message, "", ERR_DEAD_LETTER]


def raised(body: ErrorBody) -> QueueServeError:
    """The exception a client raises for an error body."""
    remote_type, message, tb, kind = body
    exc_type = RAISED.get(kind)
    if exc_type is None:
        return RemoteError(remote_type, message, tb)
    return exc_type(message)
