"""Bearer-token auth: a pure ASGI middleware in front of every route but ``/healthz`` and
``/readyz`` (the busiest route checks the same ``Token`` itself: fast.py). The dashboard's
changes check the same ``Token`` (queueserve/dashboard/app.py).

A load balancer's health check carries no token, and a liveness or readiness answer tells
nothing (readiness: whether Redis answers; its 503 names no address); the metrics, the models
list and every serving need the token when one is set.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from queueserve.gateway.errors import ApiError, error_response
from queueserve.gateway.paths import route_path

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


class Token:
    """The bearer token a request must carry (``Authorization: Bearer <token>``)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the token must not be empty; leave it out for none")
        self._expected = token.encode()

    def allows(self, scope: Scope) -> bool:
        """Whether the request's first Authorization header carries the token: the scheme
        ``Bearer`` in any case (RFC 9110 section 11.1, RFC 6750 section 2.1), one space (a
        second is read as part of the token), then the token as the bytes sent (UTF-8 for a
        token that is not ASCII), compared in constant time. Whitespace around the whole
        value is not part of it (RFC 9110 section 5.5): h11 strips it, httptools keeps a
        trailing one, and both servers must answer alike."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.strip(b" \t").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._expected)


class BearerAuth:
    def __init__(self, app: ASGIApp, token: Token) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS or self.token.allows(scope):
            await self.app(scope, receive, send)
            return
        await error_response(refused())(scope, receive, send)


def refused(
    what_to_do: str = "send 'Authorization: Bearer <token>' with the gateway's --token",
) -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        f"missing or wrong bearer token: {what_to_do}",
        {"WWW-Authenticate": "Bearer"},
    )
