"""The dashboard's fuzzer: hostile bodies, fields, headers and serving names sent to every
HTTP endpoint of a real ``queueserve dashboard`` process in front of a real worker
(docs/operations.md, "Dashboard"), in the manner of test_gateway_fuzz.py, whose hostile
values it reuses. ENDPOINTS holds every route of the app; ``test_every_route_has_a_fuzz_entry``
fails when a route of ``create_app`` has no entry (or an entry no route).

Every answer must be an expected status (never 500 or 503, never a hang) in the gateway's
error shape when it is an error; the log holds no traceback; no hostile request changes an
option or loses a dead letter; valid requests are answered as before, after it all.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from queueserve.dashboard import create_app
from queueserve.wire.figures import field_of
from queueserve.wire.keys import Keys, worker_key
from tests.faults.fuzz.surfaces import dashboard_reads
from tests.faults.fuzz.values import FAMILIES
from tests.faults.test_gateway_fuzz import (
    FOREIGN_ORIGINS,
    HOSTILE_BODIES,
    HOSTILE_HEADERS,
    HOSTILE_NAMES,
    HOSTILE_QUERY,
    HOSTILE_TYPES,
    HOSTILE_VALUES,
    check,
)
from tests.support.dashboard_proc import DashboardProc, dashboard_over_a_worker
from tests.support.door import PAGE, Conn, all_closed, closing, connect, kept_alive, port_of
from tests.support.helpers import wait_until
from tests.support.listing_cost import commands, declare, fill_batch_keys, ran, unrelated_keys
from tests.support.redis_server import RedisServer

TOKEN = "fuzz-token"  # the gateway fuzzer's: its hostile headers are built on it
SEED = 27


@dataclass
class Endpoint:
    """One route: a valid request, its answer's status, and which fields to attack."""

    method: str
    path: str  # with a real serving in place of {name}
    valid: dict[str, Any] | None = None
    fields: list[str] = field(default_factory=list)
    ok: int = 200  # a valid request's status (a dead letter that is not there: 404)
    named: bool = False  # the path ends with a serving name to attack
    query: list[str] = field(default_factory=list)  # query parameters to attack


ENDPOINTS: dict[tuple[str, str], Endpoint] = {
    ("GET", "/"): Endpoint("GET", "/"),
    ("GET", "/dashboard.js"): Endpoint("GET", "/dashboard.js"),
    ("GET", "/api/overview"): Endpoint("GET", "/api/overview", query=["offset", "filter"]),
    ("GET", "/metrics"): Endpoint("GET", "/metrics"),
    ("GET", "/api/dead-letters/{name}"): Endpoint("GET", "/api/dead-letters/square", named=True),
    ("POST", "/api/dead-letters/replay"): Endpoint(
        "POST",
        "/api/dead-letters/replay",
        {"serving": "square", "id": "1-1"},
        ["serving", "id"],
        404,
    ),
    ("POST", "/api/dead-letters/drop"): Endpoint(
        "POST", "/api/dead-letters/drop", {"serving": "square", "id": "1-1"}, ["serving", "id"], 404
    ),
    ("POST", "/api/config"): Endpoint(
        "POST",
        "/api/config",
        {"serving": "square", "assignments": ["batch_size=8"]},
        ["serving", "assignments"],
    ),
}


def routes_of_the_app() -> set[tuple[str, str]]:
    app = create_app("redis://127.0.0.1:1/0")  # never connects: the client is made on use
    found = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, route.path))  # type: ignore[attr-defined]
    return found


def test_every_route_has_a_fuzz_entry() -> None:
    routes = routes_of_the_app()
    assert routes - ENDPOINTS.keys() == set(), "routes the dashboard fuzzer does not attack"
    assert ENDPOINTS.keys() - routes == set(), "fuzz entries for routes the app lacks"


@pytest.fixture
def dashboard(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[DashboardProc]:
    with dashboard_over_a_worker(redis_url, prefix, tmp_path, TOKEN) as proc:
        yield proc


Attack = tuple[str, str, bytes, dict[str, str]]


def attacks(endpoint: Endpoint, rng: random.Random) -> Iterator[Attack]:
    valid = b"" if endpoint.valid is None else json.dumps(endpoint.valid).encode()
    for i, headers in enumerate(HOSTILE_HEADERS):
        yield f"header {i}", endpoint.path, valid, headers
    if endpoint.method == "POST":  # the changes: another type 415, a foreign origin 403
        for ctype in HOSTILE_TYPES:
            yield f"type {ctype!r}", endpoint.path, valid, {"content-type": ctype}
        for i, headers in enumerate(FOREIGN_ORIGINS):
            yield f"origin {i}", endpoint.path, valid, headers
    if endpoint.valid is not None:
        for i, body in enumerate(HOSTILE_BODIES):
            yield f"body {i}", endpoint.path, body, {}
        for name in endpoint.fields:
            for i, value in enumerate(HOSTILE_VALUES):
                rest = {k: v for k, v in endpoint.valid.items() if k != name}
                head = json.dumps(rest)[:-1] + (", " if rest else "")
                yield (
                    f"field {name} value {i}",
                    endpoint.path,
                    f'{head}"{name}": {value}}}'.encode(),
                    {},
                )
    yield from path_attacks(endpoint, rng, valid)


def path_attacks(endpoint: Endpoint, rng: random.Random, valid: bytes) -> Iterator[Attack]:
    """Hostile serving names and query parameters, with a valid body."""
    if endpoint.named:
        base = endpoint.path.rsplit("/", 1)[0]
        for name in rng.sample(HOSTILE_NAMES, len(HOSTILE_NAMES)):
            yield f"name {name[:20]!r}", f"{base}/{name}", valid, {}
    for name in endpoint.query:
        for value in [*HOSTILE_QUERY, *HOSTILE_NAMES]:
            yield f"query {name}={value[:20]!r}", f"{endpoint.path}?{name}={value}", valid, {}
    if endpoint.query:
        yield "query unknown", f"{endpoint.path}?nosuch=1", valid, {}


def test_hostile_requests_to_every_endpoint_get_clear_answers(
    dashboard: DashboardProc, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a dead letter the attacks must not lose, and the options as the worker declared
    keys = Keys(prefix, "square")
    kept = redis_client.xadd(keys.dead, {"reason": "kept", "stream": "x", "entry_id": "1-0"})
    rng = random.Random(SEED)
    sent = 0
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    with httpx.Client(base_url=dashboard.url, timeout=60, headers=headers) as http:
        for key, endpoint in ENDPOINTS.items():
            for what, path, body, headers in attacks(endpoint, rng):
                response = http.request(
                    endpoint.method, path, content=body or None, headers=headers
                )
                if what.startswith(("type ", "origin ")):  # refused before anything is read
                    check(f"{key} {what}", response, {415} if what[0] == "t" else {403})
                else:
                    check(f"{key} {what}", response)
                sent += 1
        # Then every endpoint answers a valid request as before
        for key, endpoint in ENDPOINTS.items():
            response = http.request(endpoint.method, endpoint.path, json=endpoint.valid)
            assert response.status_code == endpoint.ok, (key, response.text[:500])
        # and changes without the token are refused
        for key, endpoint in ENDPOINTS.items():
            if endpoint.method == "POST":
                response = http.post(
                    endpoint.path, json=endpoint.valid, headers={"authorization": ""}
                )
                assert response.status_code == 401, (key, response.text[:500])
    assert sent > 300
    assert [i for i, _ in redis_client.xrange(keys.dead)] == [kept]
    assert redis_client.hget(keys.meta, "batch_size") == b"8"
    assert dashboard.proc.poll() is None
    assert "Traceback" not in dashboard.output(), dashboard.output()[-5000:]


def test_hostile_worker_records_and_a_servings_key_of_another_type_leave_the_overview_whole(
    dashboard: DashboardProc, redis_client: redis.Redis, prefix: str
) -> None:
    """The overview reads every worker's record (anyone may write one) and every serving's
    keys: a hostile field, a record of another type or a serving whose keys are of another
    type is shown as such (a record of another type failed every serving it named with a
    500; a serving's, the whole page)."""
    keys = Keys(prefix, "square")
    rng = random.Random(SEED)
    [live] = [c.decode() for c in redis_client.zrange(keys.workers, 0, -1)]
    now_ms = int(redis_client.time()[0]) * 1000
    fields = (*dashboard_reads(), field_of("square"))  # and the serving's own figures
    with httpx.Client(base_url=dashboard.url, timeout=60) as http:

        def overview(what: str) -> dict[str, Any]:
            response = http.get("/api/overview")
            assert response.status_code == 200, (what, response.text[:500])
            return {s["name"]: s for s in response.json()["servings"]}

        # When each field the dashboard reads of a worker's record holds a value of each
        # family, in the live worker's record and in an alive ghost's
        redis_client.zadd(keys.workers, {"fuzz-ghost": now_ms + 600_000})
        for name, family in FAMILIES.items():
            value = family(rng)[:100_000]  # (12 fields of 10 MB would cost, not break)
            for record in (worker_key(prefix, live), worker_key(prefix, "fuzz-ghost")):
                redis_client.hset(record, mapping=dict.fromkeys(fields, value))
            # Then every row is there, its counts counts and its texts bounded
            rows = overview(name)["square"]["workers"]
            assert {w["id"] for w in rows} == {live, "fuzz-ghost"}, rows
            for w in rows:
                counts = ("items", "batches", "failures")
                assert all(type(w[k]) is int and w[k] >= 0 for k in counts), w
                assert all(len(w[k]) <= 100 for k in ("host", "pid", "partition", "device")), w

        # When the ghost's record is of another type, and another serving's workers set too
        redis_client.delete(worker_key(prefix, "fuzz-ghost"))
        redis_client.set(worker_key(prefix, "fuzz-ghost"), "wrong type")
        broken = Keys(prefix, "fuzzbroken")
        redis_client.hset(broken.meta, mapping={"codec": "msgpack", "batch_size": "8"})
        redis_client.zadd(broken.servings, {"fuzzbroken": now_ms})  # as its worker lists it
        redis_client.set(broken.workers, "wrong type")

        # Then the page has both servings (once its snapshot of a second ago is past): the
        # ghost's row empty, the broken serving's error
        def ghost_of(servings: dict[str, Any]) -> dict[str, Any]:
            return next(w for w in servings["square"]["workers"] if w["id"] == "fuzz-ghost")

        servings = wait_until(
            lambda: next((s for s in [overview("of another type")] if "fuzzbroken" in s), None),
            "the overview after the writes",
        )
        assert "error" not in servings["square"], servings["square"]
        ghost = ghost_of(servings)
        assert ghost["host"] == "" and ghost["items"] == 0, ghost
        assert "WRONGTYPE" in servings["fuzzbroken"]["error"], servings["fuzzbroken"]
    assert "Traceback" not in dashboard.output(), dashboard.output()[-5000:]


# --- large Redis state (issue 38, finding 5) -------------------------------------------------
LARGE_STATE = 100_000  # batch keys of one serving, each holding a queued request


def test_hostile_overview_reads_over_100000_batch_keys_cost_a_page_each(
    redis_tmp_server: RedisServer, tmp_path: Path
) -> None:
    """The overview's hostile queries while one serving holds 100,000 batch keys with work
    and Redis 100,000 keys of another application: every answer clear, and no read costs
    more Redis commands than one page of the overview, however many keys there are (it ran
    about 33 per key with work: 3.3 million for this state)."""
    url, prefix = redis_tmp_server.url, "qsdfl"
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        declare(r, prefix, "square")
        fill_batch_keys(url, prefix, "square", 0, LARGE_STATE)
        unrelated_keys(r, LARGE_STATE)
        proc = DashboardProc(url, prefix, tmp_path / "dashboard.log")
        try:
            with httpx.Client(base_url=proc.url, timeout=60) as http:
                before = commands(r)
                response = http.get("/api/overview")
                assert response.status_code == 200, response.text[:500]
                page = sum(ran(before, commands(r)).values())
                [serving] = response.json()["servings"]
                assert serving["queue_counts"]["keys_with_work"] == LARGE_STATE
                reads = 0
                for name in ("offset", "filter"):
                    for value in [*HOSTILE_QUERY, *HOSTILE_NAMES, "squ", "sq"]:
                        before = commands(r)
                        response = http.get(f"/api/overview?{name}={value}")
                        check(f"overview {name}={value[:20]!r}", response)
                        cost = sum(ran(before, commands(r)).values())
                        assert cost <= page + 10, (name, value[:20], cost, page)
                        reads += 1
            assert reads > 20
        finally:
            proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


def test_connection_attacks_on_every_route_leave_the_dashboard_answering(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """Each route's head and body cut short, and idle kept-alive connections, from 127.0.0.1;
    while they are held every route answers another address (127.0.0.2), and the heads and
    bodies are closed by their deadlines (--header-timeout and --body-timeout 1 s)."""
    deadlines = ("--header-timeout", "1s", "--body-timeout", "1s", "--token", TOKEN)
    proc = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log", *deadlines)
    held: list[Conn] = []
    try:
        with closing(held):
            for endpoint in ENDPOINTS.values():
                head = b"%s %s HTTP/1.1\r\nhost: board\r\n" % (
                    endpoint.method.encode(),
                    endpoint.path.encode(),
                )
                body = json.dumps(endpoint.valid).encode() if endpoint.valid else b"{}"
                slow = head + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
                    len(body)
                )
                for _ in range(5):  # (within its cap of 100 per address)
                    held.append(Conn(connect(port_of(proc.url), "127.0.0.1", head + b"x-a: ")))
                    held.append(Conn(connect(port_of(proc.url), "127.0.0.1", slow + body[:-1])))
            held += [kept_alive(port_of(proc.url), "127.0.0.1", PAGE) for _ in range(20)]
            transport = httpx.HTTPTransport(local_address="127.0.0.2")
            headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
            with httpx.Client(
                base_url=proc.url, timeout=60, headers=headers, transport=transport
            ) as http:
                for key, endpoint in ENDPOINTS.items():
                    response = http.request(endpoint.method, endpoint.path, json=endpoint.valid)
                    assert response.status_code in (200, 404), (key, response.text[:500])
            # (the idle ones by the dashboard's keep-alive timeout, 5 s)
            wait_until(lambda: all_closed(held), "every cut and idle connection closed")
    finally:
        proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]
