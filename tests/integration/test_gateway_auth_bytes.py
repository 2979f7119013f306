"""The gateway's bearer token, checked byte for byte on every route (docs/gateway.md, "Auth").

The rule (queueserve/door/auth.py, ``Token.allows``): the first Authorization header's
value, less the whitespace around it (RFC 9110 section 5.5: not part of a field value; h11
strips it, httptools keeps a trailing one), is the scheme ``Bearer`` in any case (RFC 9110
section 11.1, RFC 6750 section 2.1), one space, and the token exactly. Each near miss of the
token (one character more or less, a prefix or suffix of it or it of them, other case,
whitespace inside, another scheme, none) must be 401 on every route but ``/healthz`` and
``/readyz``, an unknown route too, and never reach a serving; each accepted form answers as
the token does.

The routes are sent over raw sockets (the bytes as written, whitespace included) to a real
``queueserve gateway`` process, whose ``POST .../dispatch`` is answered by ``DispatchHttp``
ahead of uvicorn's cycle (and with a query string, through it to ``FastDispatch``); in
process, through ``httpx.ASGITransport``, with and without a user's middleware (which sends
the dispatch route through the router and ``BearerAuth`` instead of ``FastDispatch``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

import httpx
import pytest
import redis
from starlette.middleware.base import BaseHTTPMiddleware

from queueserve.door.auth import Token
from queueserve.gateway import create_app
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.redis_server import prefixed_client

TOKEN = "Tok3n-Secret.value_X9"  # both cases, digits, '-', '.', '_'
T = TOKEN.encode()
Auth = tuple[bytes, ...]  # the values of the Authorization headers sent, in order

REFUSED: dict[str, Auth] = {
    "no header": (),
    "an empty value": (b"",),
    "the scheme alone": (b"Bearer",),
    "an empty token": (b"Bearer ",),
    "the token plus one character": (b"Bearer " + T + b"x",),
    "the token less its last character": (b"Bearer " + T[:-1],),
    "the token less its first character": (b"Bearer " + T[1:],),
    "a prefix of the token": (b"Bearer " + T[:8],),
    "a suffix of the token": (b"Bearer " + T[-8:],),
    "the token as a prefix": (b"Bearer " + T + b"-and-more",),
    "the token as a suffix": (b"Bearer more-" + T,),
    "the token in upper case": (b"Bearer " + T.upper(),),
    "the token in lower case": (b"Bearer " + T.lower(),),
    "the token's case swapped": (b"Bearer " + T.swapcase(),),
    "two spaces before the token": (b"Bearer  " + T,),
    "a tab for the space": (b"Bearer\t" + T,),
    "a space inside the token": (b"Bearer " + T[:5] + b" " + T[5:],),
    "a word after the token": (b"Bearer " + T + b" x",),
    "no space": (b"Bearer" + T,),
    "no scheme": (T,),
    "scheme Basic": (b"Basic " + T,),
    "scheme Token": (b"Token " + T,),
    "scheme Bearer plus a letter": (b"Bearers " + T,),
    "scheme Bearer less a letter": (b"Beare " + T,),
    "a wrong header before the right one": (b"Bearer wrong", b"Bearer " + T),
}
ACCEPTED: dict[str, Auth] = {
    "the token": (b"Bearer " + T,),
    "scheme in lower case": (b"bearer " + T,),
    "scheme in upper case": (b"BEARER " + T,),
    "scheme in mixed case": (b"bEaReR " + T,),
    "a space before the value": (b" Bearer " + T,),
    "a space after the value": (b"Bearer " + T + b" ",),
    "a tab after the value": (b"Bearer " + T + b"\t",),
}
JOB = "{job}"  # in a path: a fresh job's id, submitted with the token before each use
ITEM = "%ITEM%"  # in a body: an item naming the request, to find it in a serving's batches


@dataclass(frozen=True)
class Route:
    template: tuple[str, str]  # (method, route path) as create_app declares it
    path: str  # what is sent
    body: dict[str, Any] | None
    ok: int  # the status of the request with the token


ROUTES = [
    Route(("GET", "/metrics"), "/metrics", None, 200),
    Route(
        ("POST", "/v1/servings/{name}/dispatch"),
        "/v1/servings/gated/dispatch",  # DispatchHttp, ahead of uvicorn's cycle
        {"item": ITEM},
        200,
    ),
    Route(
        ("POST", "/v1/servings/{name}/dispatch"),
        "/v1/servings/gated/dispatch?through=uvicorn",  # uvicorn's cycle, then FastDispatch
        {"item": ITEM},
        200,
    ),
    Route(
        ("POST", "/v1/servings/{name}/dispatch_many"),
        "/v1/servings/gated/dispatch_many",
        {"items": [ITEM]},
        200,
    ),
    Route(
        ("POST", "/v1/servings/{name}/stream"),
        "/v1/servings/gated/stream",
        {"items": [ITEM]},
        200,
    ),
    Route(("POST", "/v1/servings/{name}/jobs"), "/v1/servings/gated/jobs", {"items": [ITEM]}, 202),
    Route(("GET", "/v1/jobs/{id}"), f"/v1/jobs/{JOB}", None, 200),
    Route(("GET", "/v1/jobs/{id}/result"), f"/v1/jobs/{JOB}/result?timeout=60", None, 200),
    Route(("POST", "/v1/jobs/{id}/cancel"), f"/v1/jobs/{JOB}/cancel", None, 200),
    Route(("DELETE", "/v1/jobs/{id}"), f"/v1/jobs/{JOB}", None, 200),
    Route(("GET", "/v1/models"), "/v1/models", None, 200),
    Route(("POST", "/v1/embeddings"), "/v1/embeddings", {"model": "vectors", "input": ITEM}, 200),
    Route(
        ("POST", "/v1/completions"),
        "/v1/completions",
        {"model": "spell", "prompt": ITEM, "max_tokens": 2},
        200,
    ),
]
UNKNOWN = Route(("GET", "/v1/no-such-route"), "/v1/no-such-route", None, 404)
OPEN = [
    Route(("GET", "/healthz"), "/healthz", None, 200),
    Route(("GET", "/readyz"), "/readyz", None, 200),
]


def routes_of_the_app() -> set[tuple[str, str]]:
    app = create_app("redis://127.0.0.1:1/0")  # never connects: the client is made on use
    return {
        (method, route.path)  # type: ignore[attr-defined]
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    }


def test_every_route_of_the_app_is_in_the_table() -> None:
    assert {r.template for r in [*ROUTES, *OPEN]} == routes_of_the_app()


def test_the_variants_are_what_their_names_say() -> None:
    """The near misses differ from the token's header, and the accepted forms from it only
    by the scheme's case and the whitespace around the value."""
    exact = b"Bearer " + T
    for name, values in REFUSED.items():
        assert values[:1] != (exact,), name
    for name, values in ACCEPTED.items():
        (value,) = values
        assert value.strip(b" \t").lower() == exact.lower(), name


@pytest.mark.parametrize(
    "values", [*REFUSED.values(), *ACCEPTED.values()], ids=[*REFUSED, *ACCEPTED]
)
def test_token_allows_only_the_token(values: Auth) -> None:
    scope = {"type": "http", "headers": [(b"authorization", v) for v in values]}
    assert Token(TOKEN).allows(scope) is (values in ACCEPTED.values())


# --- a real gateway, over raw sockets ----------------------------------------------------------
@dataclass
class Stack:
    redis: redis.Redis
    prefix: str
    gateway: GatewayProc

    def batches(self) -> list[Any]:
        return [json.loads(b) for b in self.redis.lrange(f"{self.prefix}:gw:batches", 0, -1)]


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix = f"qsab{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway-auth")
    servings = [f"tests.support.gateway_app:{n}" for n in ("gated", "vectors", "spell")]
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server, prefix, logs, servings, ["gated", "vectors", "spell"], "--token", TOKEN
        ) as (_, gateway),
    ):
        yield Stack(r, prefix, gateway)


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def error(self) -> dict[str, Any]:
        error: dict[str, Any] = json.loads(self.body)["error"]
        return error


def send(url: str, method: str, path: str, auth: Auth, body: bytes | None) -> Answer:
    """One request on a connection of its own, its Authorization headers as the bytes given."""
    where = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1".encode(), b"host: gateway", b"connection: close"]
    head += [b"authorization: " + value for value in auth]
    if body is not None:
        head += [b"content-type: application/json", b"content-length: %d" % len(body)]
    with socket.create_connection((where.hostname, where.port), timeout=60) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + (body or b""))
        received = bytearray()
        while chunk := s.recv(65536):
            received += chunk
    top, _, rest = bytes(received).partition(b"\r\n\r\n")
    status_line, *lines = top.split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, rest)


def request(stack: Stack, route: Route, auth: Auth, tag: str) -> Answer:
    path = route.path
    if JOB in path:  # a job of its own, submitted with the token
        job = send(
            stack.gateway.url,
            "POST",
            "/v1/servings/gated/jobs",
            ACCEPTED["the token"],
            json.dumps({"items": ["job"], "keep": 60}).encode(),
        )
        assert job.status == 202, job.body
        path = path.replace(JOB, json.loads(job.body)["id"])
    body = None if route.body is None else json.dumps(route.body).replace(ITEM, tag).encode()
    return send(stack.gateway.url, route.template[0], path, auth, body)


def test_every_near_miss_of_the_token_is_401_on_every_route_and_reaches_no_serving(
    stack: Stack,
) -> None:
    for route in [*ROUTES, UNKNOWN]:
        for name, auth in REFUSED.items():
            answer = request(stack, route, auth, f"refused:{name}")
            what = (route.path, name, answer.body[:300])
            assert answer.status == 401, what
            assert answer.headers[b"www-authenticate"] == b"Bearer", what
            assert answer.error()["type"] == "unauthorized", what
    # nothing refused was queued: the serving's batches hold none of those items
    assert not [item for b in stack.batches() for item in b if str(item).startswith("refused:")]


def test_each_accepted_form_answers_as_the_token_does_on_every_route(stack: Stack) -> None:
    for route in [*ROUTES, UNKNOWN]:
        for name, auth in ACCEPTED.items():
            answer = request(stack, route, auth, f"ok:{name}")
            assert answer.status == route.ok, (route.path, name, answer.body[:300])


def test_healthz_and_readyz_are_open_to_every_variant(stack: Stack) -> None:
    for route in OPEN:
        for name, auth in {**REFUSED, **ACCEPTED}.items():
            assert request(stack, route, auth, name).status == 200, (route.path, name)


# --- in process: the stack's own check of the dispatch route -----------------------------------
class UsersMiddleware(BaseHTTPMiddleware):
    """A middleware a user adds: the dispatch route then goes through the stack."""

    async def dispatch(self, request: Any, call_next: Any) -> Any:
        return await call_next(request)


@pytest.mark.parametrize("users_middleware", [False, True], ids=["fast", "router"])
async def test_in_process_every_near_miss_is_401_and_the_token_passes(
    redis_server: str, users_middleware: bool
) -> None:
    app = create_app(redis_server, prefix=f"qsabp{uuid4().hex[:8]}", token=TOKEN)
    if users_middleware:
        app.add_middleware(UsersMiddleware)
    assert (app.dispatcher() is None) is users_middleware
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            for route in [*ROUTES, UNKNOWN, *OPEN]:
                path = route.path.replace(JOB, "nobody-1")
                body = None if route.body is None else json.dumps(route.body).replace(ITEM, "x")
                for name, auth in {**REFUSED, **ACCEPTED}.items():
                    headers = [(b"authorization", v) for v in auth]
                    answer = await http.request(
                        route.template[0], path, content=body, headers=headers
                    )
                    what = (path, name, answer.text[:300])
                    if name in ACCEPTED or route in OPEN:
                        assert answer.status_code != 401, what  # no worker here: 404s
                    else:
                        assert answer.status_code == 401, what
                        assert answer.headers["www-authenticate"] == "Bearer", what
    finally:
        await app.state.gateway.aclose()
