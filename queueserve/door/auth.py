"""Bearer tokens: how a request's token is read (``presented_token``) and checked
(``Token``: the dashboard's changes). The gateway maps tokens to tenants (tenants.py), whose
``TenantAuth`` middleware stands in front of every route but ``/healthz`` and ``/readyz`` (the
busiest route checks the same itself: fast.py).

A load balancer's health check carries no token, and a liveness or readiness answer tells
nothing (readiness: whether Redis answers; its 503 names no address); the metrics, the models
list and every serving need a token when tokens are set.
"""

from __future__ import annotations

import hmac

from starlette.types import Scope

from queueserve.door.http_errors import ApiError

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
        token = presented_token(scope)
        return token is not None and hmac.compare_digest(token, self._expected)


def presented_token(scope: Scope) -> bytes | None:
    """The bearer token of the request's first Authorization header, as ``Token.allows``
    reads it; None without one."""
    given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = given.strip(b" \t").partition(b" ")
    return token if token and scheme.lower() == b"bearer" else None


def refused(
    what_to_do: str = "send 'Authorization: Bearer <token>' with the gateway's --token",
) -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        f"missing or wrong bearer token: {what_to_do}",
        {"WWW-Authenticate": "Bearer"},
    )
