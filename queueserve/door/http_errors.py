"""Errors as HTTP: each queueserve error maps to a status and a ``type``, in one table.

Every error the gateway answers has the body ``{"error": {"type", "status", "message",
"param", "code"}}``: OpenAI's error object (its ``Error`` requires ``param`` and ``code``, which
may be null: tests/contracts/openai_schema.json), plus the status. docs/gateway.md lists the
table for users.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ExceptionHandler

from queueserve import errors
from queueserve.errors import QueueServeError

# How long a client told 429 should wait: about one batch time of a busy serving, which is
# when admission has room again; a client that retries sooner is refused again at no cost.
RETRY_AFTER_S = 1

# queueserve error -> (HTTP status, type). Checked in order: the first class that matches.
STATUS: tuple[tuple[type[QueueServeError], int, str], ...] = (
    (errors.BadRequest, 400, "bad_request"),
    (errors.IdempotencyConflict, 422, "idempotency_conflict"),
    (errors.QueueFull, 429, "queue_full"),
    (errors.Timeout, 504, "timeout"),
    (errors.RemoteError, 502, "remote_error"),
    (errors.DeadLettered, 502, "dead_lettered"),
    (errors.Cancelled, 503, "cancelled"),
    (errors.RedisUnavailable, 503, "redis_unavailable"),
    (errors.NotReplicated, 503, "not_replicated"),
    (errors.RedisCommandError, 500, "redis_command_error"),
)


class ApiError(Exception):
    """An error the gateway itself answers with (bad body, unknown serving, no token)."""

    def __init__(
        self, status: int, kind: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}


class ClientGone(Exception):
    """The HTTP client disconnected."""


def bad_request(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def from_queueserve(error: QueueServeError) -> ApiError:
    """The HTTP form of ``error``; a 429 says when to come back."""
    for cls, status, kind in STATUS:
        if isinstance(error, cls):
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
            return ApiError(status, kind, str(error), headers)
    return ApiError(500, "internal_error", str(error))


def internal(error: Exception) -> ApiError:
    """An unexpected error in the gateway, as the client sees it (the log has the rest)."""
    return ApiError(500, "internal_error", f"{type(error).__name__} in the gateway (see its log)")


def error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "type": error.kind,
            "status": error.status,
            "message": str(error),
            "param": None,
            "code": None,
        }
    }


def item_error(error: QueueServeError) -> dict[str, Any]:
    """One item's error inside a ``dispatch_many`` answer with ``return_exceptions``."""
    return error_body(from_queueserve(error))


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def client_gone(request: Request, exc: Exception) -> Response:
    """A client that left, or was closed by its body's deadline (connections.py), before its
    body arrived whole: nothing was submitted, and nobody reads this (the metrics count it);
    not an error of the server's, to log with a traceback."""
    return error_response(
        ApiError(499, "client_closed_request", "the HTTP client left before its body arrived")
    )


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in the gateway's error shape."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(
        ApiError(
            exc.status_code,
            kind,
            f"{exc.detail}: {request.method} {request.url.path[:200]}",
            dict(exc.headers or {}),
        )
    )


# Starlette's exception_handlers, as both servers install them; each adds its own for
# Exception (a 500 that names the server).
HANDLERS: Final[Mapping[Any, ExceptionHandler]] = {
    ApiError: api_error,
    ClientGone: client_gone,
    HTTPException: http_error,
}
