"""No cross-site writes (issue 38, finding 4): the rule every request that writes (POST, PUT,
PATCH, DELETE) to the gateway or to the dashboard's changes must keep.

A page on another site can make a browser send a "simple" request without asking first (no
CORS preflight): a POST whose Content-Type is ``text/plain``, a form's, or none. Without a
token (the default on 127.0.0.1) such a POST with a JSON text as its body submitted a job. So:

- **Origin.** A request that carries a browser's ``Origin`` writes only when that origin is the
  server's own (its host and port are the request's ``Host``: a page the server itself serves)
  or one configured (``--allow-origin``, ``*`` for any); ``Sec-Fetch-Site: cross-site`` is
  refused the same way. Otherwise 403 ``forbidden_origin``. Clients that are not browsers send
  no ``Origin`` and are not affected.
- **Content-Type.** A request with a body must say ``Content-Type: application/json``
  (parameters such as ``; charset=utf-8`` allowed), which a page on another site cannot send
  without a preflight; otherwise 415 ``unsupported_media_type``. A request without a body
  (``POST /v1/jobs/{id}/cancel``, ``DELETE``) may leave the type out: a browser's bodiless
  cross-site POST carries an ``Origin``, which the rule above refuses.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from queueserve.door.http_errors import ApiError, error_response

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON = b"application/json"
DEFAULT_PORTS = {"http": "80", "https": "443"}


def origin_key(text: str) -> str:
    """``scheme://host:port`` of an origin, in lower case with its port always written (a
    default port left out and written are the same origin); the text itself for what is none
    (``null``, ``*``)."""
    scheme, sep, rest = text.strip().lower().rstrip("/").partition("://")
    if not sep or not rest or "/" in rest:
        return text.strip().lower()
    host, port = split_host(rest, DEFAULT_PORTS.get(scheme, ""))
    return f"{scheme}://{host}:{port}"


def split_host(authority: str, default_port: str) -> tuple[str, str]:
    """(host, port) of ``host[:port]`` (``[v6]:port`` too)."""
    if authority.startswith("["):
        host, _, rest = authority.partition("]")
        return host + "]", rest[1:] if rest.startswith(":") else default_port
    host, sep, port = authority.rpartition(":")
    return (host, port) if sep and port.isdigit() else (authority, default_port)


class WriteRule:
    """The Origin and Content-Type rule; ``allowed``: origins let through besides the server's
    own (``https://app.example.com``; ``*``: every one). ``setting`` names the flag and the
    variable that configure it, for the 403's message."""

    def __init__(self, allowed: Iterable[str] = (), setting: str = "--allow-origin") -> None:
        allowed = [a for a in allowed if a.strip()]
        self.any = "*" in (a.strip() for a in allowed)
        self.allowed = frozenset(origin_key(a) for a in allowed)
        self.setting = setting

    def refusal(self, scope: Scope) -> ApiError | None:
        """Why a write is refused (403 or 415), or None; ``scope`` is the request's."""
        ctype, origin, host, cross, has_body = read_headers(scope["headers"])
        if (origin is not None or cross) and not self.allows(origin, host):
            return self.foreign(origin)
        if ctype is None:
            return unsupported(scope, None) if has_body else None
        if ctype != JSON and ctype.partition(b";")[0].strip().lower() != JSON:
            return unsupported(scope, ctype)
        return None

    def allows(self, origin: bytes | None, host: bytes | None) -> bool:
        if origin is None:  # Sec-Fetch-Site: cross-site alone
            return self.any
        text = origin.decode("latin-1")
        if self.any or origin_key(text) in self.allowed:
            return True
        return host is not None and same_origin(text, host.decode("latin-1"))

    def foreign(self, origin: bytes | None) -> ApiError:
        said = (
            "a cross-site request"
            if origin is None
            else f"origin {origin[:100].decode('latin-1')!r}"
        )
        return ApiError(
            403,
            "forbidden_origin",
            f"writes from another site's page are refused ({said[:120]}): only the server's "
            f"own origin writes here; to let a web app's origin write, configure it with "
            f"{self.setting}",
        )


Headers = tuple[bytes | None, bytes | None, bytes | None, bool, bool]


def read_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """(Content-Type, Origin, Host, whether Sec-Fetch-Site says cross-site, whether a body
    comes), in one pass; the first of each header."""
    ctype = origin = host = None
    cross = has_body = False
    for name, value in headers:
        if name == b"content-type":
            ctype = value if ctype is None else ctype
        elif name == b"origin":
            origin = value if origin is None else origin
        elif name == b"host":
            host = value if host is None else host
        elif name == b"sec-fetch-site":
            cross = cross or value.strip().lower() == b"cross-site"
        elif name == b"content-length":
            has_body = has_body or value.strip() != b"0"
        elif name == b"transfer-encoding":
            has_body = True
    return ctype, origin, host, cross, has_body


def same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names the host and port of the request's
    ``Host`` (a port left out of either is the origin's scheme's default)."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or not rest or "/" in rest.rstrip("/"):
        return False
    default = DEFAULT_PORTS.get(scheme, "")
    return split_host(rest.rstrip("/"), default) == split_host(host.strip().lower(), default)


def unsupported(scope: Scope, ctype: bytes | None) -> ApiError:
    got = "none was sent" if ctype is None else f"got {ctype[:60].decode('latin-1')!r}"
    return ApiError(
        415,
        "unsupported_media_type",
        f"{scope.get('method', 'a write')} takes a JSON body: send 'Content-Type: "
        f"application/json' ({got})",
    )


class WriteRuleMiddleware:
    """``WriteRule`` in front of an ASGI app: every write it refuses is answered in the
    gateway's error shape, everything else passes on."""

    def __init__(self, app: ASGIApp, rule: WriteRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in WRITES:
            refused = self.rule.refusal(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)
