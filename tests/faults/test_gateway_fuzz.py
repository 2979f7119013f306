"""The gateway's fuzzer: hostile bodies, fields, headers and serving names sent to every HTTP
endpoint of a real ``queueserve gateway`` process in front of a real worker (docs/gateway.md).

The Redis fuzzer (test_fuzz.py) attacks keys and channels; an HTTP endpoint is a surface of
another shape, so it has this table of its own. ENDPOINTS holds every route of the app, each
with a valid request and the fields a hostile value replaces; ``test_every_route_has_a_fuzz_entry``
fails when a route of ``create_app`` has no entry (or an entry no route).

Every answer must be an expected status (never 500 or 503, never a hang) with the gateway's
error shape when it is an error; the gateway's log holds no traceback; valid requests to every
endpoint are answered as before, after it all.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
import redis

from queueserve.gateway import create_app
from tests.support.door import Conn, all_closed, closing, connect, kept_alive, port_of
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import wait_until
from tests.support.listing_cost import commands, declare, ran, unrelated_keys
from tests.support.redis_server import RedisServer, prefixed_client

TOKEN = "fuzz-token"
MAX_BODY = 256 * 1024
SEED = 28
SERVINGS = [
    "tests.support.gateway_app:gated",
    "tests.support.gateway_app:hooked",
    "tests.support.gateway_app:vectors",
    "tests.support.gateway_app:spell",
]
NAMES = ["gated", "hooked", "vectors", "spell"]
# What a hostile request may get: a clear refusal, or an answer (an item is anything JSON
# holds, and a serving may fail on it: 502). Never 500 or 503: those are the gateway's faults.
EXPECTED = {200, 202, 400, 401, 403, 404, 405, 409, 413, 415, 502, 504}

# JSON values of every shape a field may meet: wrong types, extremes, NaN, deep nesting,
# long and odd strings (separators of Redis keys, NUL, a lone surrogate).
HOSTILE_VALUES: list[str] = [
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1.5",
    "1e308",
    "-1e308",
    "1e400",
    "9" * 400,
    "NaN",
    "Infinity",
    "-Infinity",
    '""',
    '" "',
    '"\\u0000"',
    '"\\ud800"',
    '"a:b{c}#d\\n"',
    '"' + "x" * 100_000 + '"',
    "[]",
    "{}",
    "[null]",
    "[" * 5_000 + "]" * 5_000,
    '{"a": ' * 2_000 + "1" + "}" * 2_000,
    '{"__proto__": 1}',
    '"9"',
    "[1, 2, 3]",
    "[" + ",".join(["null"] * 20_000) + "]",
]
# Whole bodies: not JSON, not UTF-8, truncated, another type than an object, duplicate keys.
HOSTILE_BODIES: list[bytes] = [
    b"",
    b"{",
    b"}",
    b"nope",
    b"\xff\xfe\x00",
    b"\x80abc",
    b'{"item": 1',
    b"[]",
    b"null",
    b'"item"',
    b"[" * 100_000,
    b'{"item": 1, "item": 2}',
    b'{"item": "\xff"}',
    b" " * 1000 + b"{}",
    b"\x00" * 100,
]
# Auth variants that are not the token: each must be 401 on every route but the open ones
# (tests/integration/test_gateway_auth_bytes.py has every near miss, on every route).
AUTH_REFUSED: list[dict[str, str]] = [
    {"authorization": ""},
    {"authorization": "Bearer"},
    {"authorization": f"Bearer {TOKEN}x"},
    {"authorization": f"Bearer {TOKEN[:-1]}"},
    {"authorization": f"Basic {TOKEN}"},
    {"authorization": "Bearer " + "x" * 8000},
]
OPEN_ROUTES = {("GET", "/healthz"), ("GET", "/readyz")}  # no token asked: 200 whatever is sent
# Headers: lying or nonsense lengths and types, and the token with the scheme in lower case
# (RFC 6750's scheme is case-insensitive: that is the token, answered as the valid request).
HOSTILE_HEADERS: list[dict[str, str]] = [
    {"authorization": f"bearer {TOKEN}"},
    {"content-type": "text/plain"},
    {"content-type": "application/json; charset=latin-1"},
    {"accept": "text/event-stream"},
    {"x-forwarded-for": "1.2.3.4, ::1"},
    {"content-encoding": "gzip"},
]
# Writes a page on another site could make a browser send (door/crosssite.py): a body of
# another type is 415, a foreign origin 403, on every route that writes (POST, DELETE).
HOSTILE_TYPES: list[str] = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
    "*/*",
    "text/json",
    "application/jsonp",
    "application/json-patch+json",
    "application/x-json",
    "json",
]
FOREIGN_ORIGINS: list[dict[str, str]] = [
    {"origin": "https://evil.example"},
    {"origin": "null"},
    {"origin": "http://127.0.0.1.evil.example"},
    {"origin": "http://localhost:1"},
    {"origin": "https://evil.example", "sec-fetch-site": "same-origin"},
    {"sec-fetch-site": "cross-site"},
    {"origin": "https://evil.example", "content-type": "text/plain"},
    {"origin": "x" * 5000},
]
WRITES = {"POST", "DELETE"}
# Serving names in the path: separators of Redis keys, traversal, encodings, length.
HOSTILE_NAMES: list[str] = [
    "a:b",
    "{x}",
    "x#1",
    "..",
    "%2e%2e",
    "%00",
    "%FF",
    "a%0Ab",
    "*",
    "?",
    "é",
    "x" * 5_000,
    "gated%20",
    "GATED",
    " ",
    "%7Bgated%7D",
]
# Job ids in the path: the names above, and ids of a job's shape that are not one.
HOSTILE_IDS: list[str] = [
    *HOSTILE_NAMES,
    "a-1",
    "-1",
    "a-",
    "a-1-2",
    "a-" + "9" * 30,
    "x" * 65 + "-1",
    "a.b_c-0",
    "a-1,a-2",
    "a:job:b-1",
]
# Values of query parameters.
HOSTILE_QUERY: list[str] = ["", "-1", "nan", "inf", "1e400", "301", "0x10", "True", "x" * 5000]
JOB = "{job}"  # in an entry's path: a fresh job's id, submitted before each use
# What every request of the fuzzer carries unless an attack replaces it: the token, and the
# type a JSON body is sent as
CLIENT_HEADERS = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}


@dataclass
class Endpoint:
    """One route: where to send a valid request, and which of its fields to attack."""

    method: str
    path: str  # the route's path with a real serving in place of {name}
    valid: dict[str, Any] | None = None  # a valid JSON body (None: no body)
    fields: list[str] = field(default_factory=list)
    named: bool = False  # the path holds a serving name to attack
    query: list[str] = field(default_factory=list)  # query parameters to attack


ENDPOINTS: dict[tuple[str, str], Endpoint] = {
    ("GET", "/healthz"): Endpoint("GET", "/healthz"),
    ("GET", "/readyz"): Endpoint("GET", "/readyz"),
    ("GET", "/metrics"): Endpoint("GET", "/metrics"),
    ("POST", "/v1/servings/{name}/dispatch"): Endpoint(
        "POST",
        "/v1/servings/gated/dispatch",
        {"item": "a", "priority": 1},
        ["item", "batch_key", "priority", "timeout"],
        named=True,
    ),
    ("POST", "/v1/servings/{name}/dispatch_many"): Endpoint(
        "POST",
        "/v1/servings/gated/dispatch_many",
        {"items": ["a", "b"]},
        ["items", "batch_key", "priority", "timeout", "return_exceptions"],
        named=True,
    ),
    ("POST", "/v1/servings/{name}/stream"): Endpoint(
        "POST",
        "/v1/servings/hooked/stream",
        {"items": ["a"]},
        ["items", "batch_key", "priority", "timeout", "max_in_flight"],
        named=True,
    ),
    ("POST", "/v1/servings/{name}/jobs"): Endpoint(
        "POST",
        "/v1/servings/gated/jobs",
        {"items": ["a", "b"], "keep": 60},
        ["items", "batch_key", "priority", "timeout", "keep"],
        named=True,
    ),
    ("GET", "/v1/jobs/{id}"): Endpoint("GET", f"/v1/jobs/{JOB}"),
    ("DELETE", "/v1/jobs/{id}"): Endpoint("DELETE", f"/v1/jobs/{JOB}"),
    ("GET", "/v1/jobs/{id}/result"): Endpoint(
        "GET", f"/v1/jobs/{JOB}/result", query=["timeout", "return_exceptions"]
    ),
    ("POST", "/v1/jobs/{id}/cancel"): Endpoint("POST", f"/v1/jobs/{JOB}/cancel"),
    ("GET", "/v1/models"): Endpoint("GET", "/v1/models"),
    ("POST", "/v1/embeddings"): Endpoint(
        "POST",
        "/v1/embeddings",
        {"model": "vectors", "input": ["a", "bc"]},
        ["model", "input", "encoding_format", "dimensions"],
    ),
    ("POST", "/v1/completions"): Endpoint(
        "POST",
        "/v1/completions",
        {"model": "spell", "prompt": "ab", "max_tokens": 4},
        [
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "seed",
            "stop",
            "stream",
            "n",
            "echo",
            "logprobs",
            "suffix",
        ],
    ),
}


def routes_of_the_app() -> set[tuple[str, str]]:
    app = create_app("redis://127.0.0.1:1/0")  # never connects: the client is made on use
    found = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":  # Starlette adds HEAD to every GET
                found.add((method, route.path))  # type: ignore[attr-defined]
    return found


def test_every_route_has_a_fuzz_entry() -> None:
    routes = routes_of_the_app()
    assert routes - ENDPOINTS.keys() == set(), "routes the gateway fuzzer does not attack"
    assert ENDPOINTS.keys() - routes == set(), "fuzz entries for routes the app lacks"


@pytest.fixture(scope="module")
def gateway(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    prefix = f"qsgwf{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway-fuzz")
    with (
        prefixed_client(redis_server, prefix),
        gateway_stack(
            redis_server,
            prefix,
            logs,
            SERVINGS,
            NAMES,
            "--token",
            TOKEN,
            "--max-body-bytes",
            str(MAX_BODY),
            *("--header-timeout", "1s", "--body-timeout", "1s", "--keep-alive-timeout", "3s"),
        ) as (_, proc),
    ):
        yield proc


Attack = tuple[str, str, bytes, dict[str, str]]


def attacks(endpoint: Endpoint, rng: random.Random) -> Iterator[Attack]:
    """(what, path, body, extra headers) of each hostile request to ``endpoint``."""
    valid = b"" if endpoint.valid is None else json.dumps(endpoint.valid).encode()
    for i, headers in enumerate(AUTH_REFUSED):
        yield f"auth {i}", endpoint.path, valid, headers
    for i, headers in enumerate(HOSTILE_HEADERS):
        yield f"header {i}", endpoint.path, valid, headers
    if endpoint.method in WRITES:
        for ctype in HOSTILE_TYPES:
            yield f"type {ctype!r}", endpoint.path, valid or b"{}", {"content-type": ctype}
        for i, headers in enumerate(FOREIGN_ORIGINS):
            yield f"origin {i}", endpoint.path, valid, headers
    if endpoint.valid is not None:
        for i, body in enumerate(HOSTILE_BODIES):
            yield f"body {i}", endpoint.path, body, {}
        for name in endpoint.fields:
            for i, value in enumerate(HOSTILE_VALUES):
                rest = {k: v for k, v in endpoint.valid.items() if k != name}
                head = json.dumps(rest)[:-1] + (", " if rest else "")
                body = f'{head}"{name}": {value}}}'.encode()
                yield f"field {name} value {i}", endpoint.path, body, {}
    yield from path_attacks(endpoint, rng, valid)


def path_attacks(endpoint: Endpoint, rng: random.Random, valid: bytes) -> Iterator[Attack]:
    """Hostile serving names, job ids and query parameters, with a valid body."""
    if endpoint.named:
        action = endpoint.path.rsplit("/", 1)[1]
        for name in rng.sample(HOSTILE_NAMES, len(HOSTILE_NAMES)):
            yield f"name {name[:20]!r}", f"/v1/servings/{name}/{action}", valid, {}
    if JOB in endpoint.path:
        for job_id in rng.sample(HOSTILE_IDS, len(HOSTILE_IDS)):
            yield f"id {job_id[:20]!r}", endpoint.path.replace(JOB, job_id), valid, {}
    for name in endpoint.query:
        for value in HOSTILE_QUERY:
            path = f"{endpoint.path}?{name}={value}"
            yield f"query {name}={value[:20]!r}", path, valid, {}


def check(what: str, response: httpx.Response, expected: set[int] = EXPECTED) -> None:
    assert response.status_code in expected, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["status"] == response.status_code and error["type"] and error["message"]


def with_job(http: httpx.Client, path: str) -> str:
    """``path`` with a fresh job's id for JOB (an attack may have forgotten the last one)."""
    if JOB not in path:
        return path
    submitted = http.post("/v1/servings/gated/jobs", json={"items": ["a"]})
    assert submitted.status_code == 202, submitted.text[:500]
    return path.replace(JOB, submitted.json()["id"])


def test_hostile_requests_to_every_endpoint_get_clear_answers(gateway: GatewayProc) -> None:
    rng = random.Random(SEED)
    sent = 0
    with httpx.Client(base_url=gateway.url, timeout=60, headers=CLIENT_HEADERS) as http:
        for key, endpoint in ENDPOINTS.items():
            for what, path, body, headers in attacks(endpoint, rng):
                response = http.request(
                    endpoint.method, with_job(http, path), content=body or None, headers=headers
                )
                if what.startswith("auth "):  # not the token: refused, unless no token is asked
                    check(f"{key} {what}", response, {200} if key in OPEN_ROUTES else {401})
                elif what.startswith(("type ", "origin ")):  # never parsed, never run
                    check(f"{key} {what}", response, {415} if what.startswith("type") else {403})
                else:
                    check(f"{key} {what}", response)
                sent += 1
        # After it all, every endpoint answers a valid request as before
        for key, endpoint in ENDPOINTS.items():
            path = with_job(http, endpoint.path)
            response = http.request(endpoint.method, path, json=endpoint.valid)
            assert response.status_code in (200, 202), (key, response.text[:500])
    assert sent > 500
    assert gateway.proc.poll() is None
    assert "Traceback" not in gateway.output(), gateway.output()[-5000:]


# --- large Redis state (issue 38, finding 5) -------------------------------------------------
LARGE_STATE = 100_000  # keys of another application beside the prefix's


def test_the_models_list_costs_no_scan_with_100000_unrelated_keys(
    redis_tmp_server: RedisServer, tmp_path: Path
) -> None:
    """GET /v1/models with hostile headers and queries, while Redis holds 100,000 keys that
    are not queueserve's and forged registry entries: every answer clear, the list the
    serving's alone, and Redis runs no SCAN for it (tests/integration/test_listing_cost.py
    counts the commands of a plain call)."""
    url = redis_tmp_server.url
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        declare(r, "qsgwl", "gated")
        unrelated_keys(r, LARGE_STATE)
        r.zadd("qsgwl:servings", {"a:b": 1e15, "x" * 300: 1e12, b"\xff": 1e12})
        proc = GatewayProc(url, "qsgwl", tmp_path / "gateway.log", "--token", TOKEN)
        try:
            before = commands(r)
            with httpx.Client(base_url=proc.url, timeout=60) as http:
                asks = [*HOSTILE_HEADERS, *({"x": "1"} for _ in range(5))]
                for headers in asks:
                    response = http.get(
                        "/v1/models", headers={"authorization": f"Bearer {TOKEN}", **headers}
                    )
                    check(f"/v1/models {headers}", response)
                    if response.status_code == 200:
                        assert [m["id"] for m in response.json()["data"]] == ["gated"]
                for value in HOSTILE_QUERY:
                    check(f"/v1/models?x={value[:20]}", http.get(f"/v1/models?x={value}"))
            during = ran(before, commands(r))
        finally:
            proc.stop()
    assert "scan" not in during and "keys" not in during, during
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


def test_connection_attacks_on_every_route_leave_it_answering(gateway: GatewayProc) -> None:
    """Connection-level attacks on each route, from 127.0.0.1: its head sent in part, its
    valid body in part (a slow body), and connections left idle after an answer; while they
    are held every route answers another address (127.0.0.2), and the server closes the
    heads and bodies by their deadlines (the fuzz gateway's --header-timeout and
    --body-timeout, 1 s; docs/gateway.md, "Connections")."""
    port = port_of(gateway.url)
    held: list[Conn] = []
    with closing(held):
        # Given each route's head cut short and its body cut short, ten times each
        for endpoint in ENDPOINTS.values():
            path = endpoint.path.replace(JOB, "fuzz-1").encode()
            head = b"%s %s HTTP/1.1\r\nhost: gw\r\n" % (endpoint.method.encode(), path)
            body = json.dumps(endpoint.valid).encode() if endpoint.valid else b"{}"
            slow = head + b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
            for _ in range(10):
                held.append(Conn(connect(port, "127.0.0.1", head + b"x-partial: ")))
                held.append(Conn(connect(port, "127.0.0.1", slow + b"\r\n" + body[:-1])))
        idle = [kept_alive(port, "127.0.0.1") for _ in range(50)]
        held += idle
        # When another address calls every route meanwhile, each answers as usual
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(
            base_url=gateway.url, timeout=60, headers=CLIENT_HEADERS, transport=transport
        ) as http:
            for key, endpoint in ENDPOINTS.items():
                path = with_job(http, endpoint.path)
                response = http.request(endpoint.method, path, json=endpoint.valid)
                assert response.status_code in (200, 202), (key, response.text[:500])
        # Then every head and body cut short is closed by its deadline
        cut = [c for c in held if c not in idle]
        wait_until(lambda: all_closed(cut), "the cut heads and bodies closed", process=gateway)
    assert gateway.proc.poll() is None
    assert "Traceback" not in gateway.output(), gateway.output()[-5000:]
