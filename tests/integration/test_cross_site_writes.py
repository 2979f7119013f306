"""No cross-site writes (issue 38, finding 4; docs/gateway.md, "Browsers: Origin and
Content-Type"): a real ``queueserve gateway`` without a token (the documented default on
127.0.0.1) and a real ``queueserve dashboard``, each in front of a real worker.

Before the rule (door/crosssite.py), a ``text/plain`` ``no-cors`` POST from a page on another
origin, which a browser sends without asking first, submitted a job: its body was parsed as
JSON whatever its Content-Type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
import redis

from tests.support.door import ServerProc, server, serving_worker
from tests.support.redis_server import prefixed_client

EVIL = "https://evil.example"
APP = "https://app.example.com"
# What a page on another site makes a browser send without a preflight: a "simple" POST.
NO_CORS = {
    "content-type": "text/plain;charset=UTF-8",
    "origin": EVIL,
    "sec-fetch-site": "cross-site",
}
JSON_TYPE = {"content-type": "application/json"}
SPECS = ("tests.support.gateway_app:gated", "tests.support.gateway_app:vectors")


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    prefix = f"qscsrf{uuid4().hex[:10]}"
    logs = tmp_path_factory.mktemp("csrf")
    with (
        prefixed_client(redis_server, prefix) as r,
        serving_worker(redis_server, prefix, logs / "worker.log", SPECS),
        server("gateway", redis_server, prefix, logs / "gateway.log") as gw,
        server(
            "gateway", redis_server, prefix, logs / "allowing.log", "--allow-origin", APP
        ) as allowing,
    ):
        yield r, prefix, gw, allowing


def ran(r: redis.Redis, prefix: str) -> list[Any]:
    """Every item the ``gated`` serving has run (tests/support/gateway_app.py)."""
    return [x for b in r.lrange(f"{prefix}:gw:batches", 0, -1) for x in json.loads(b)]


def post(gw: ServerProc, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(gw.url + path, content=body, headers=headers, timeout=30)


def error_type(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert error["status"] == response.status_code
    return str(error["type"])


def job(gw: ServerProc) -> str:
    made = httpx.post(gw.url + "/v1/servings/gated/jobs", json={"items": ["j"]}, timeout=30)
    assert made.status_code == 202, made.text
    return str(made.json()["id"])


def test_a_no_cors_text_plain_post_from_another_site_submits_nothing(stack: Any) -> None:
    r, prefix, gw, _ = stack
    # When a page on another site posts a JSON text as text/plain, and so does an old
    # browser that sends no Origin
    refused = post(gw, "/v1/servings/gated/dispatch", b'{"item": "csrf"}', NO_CORS)
    untyped = post(
        gw, "/v1/servings/gated/jobs", b'{"items": ["plain"]}', {"content-type": "text/plain"}
    )
    formed = post(
        gw,
        "/v1/servings/gated/dispatch",
        b'{"item": "form"}',
        {"content-type": "application/x-www-form-urlencoded"},
    )
    # Then the first is refused for its origin, the others for their type
    assert (refused.status_code, error_type(refused)) == (403, "forbidden_origin"), refused.text
    assert (untyped.status_code, error_type(untyped)) == (415, "unsupported_media_type")
    assert (formed.status_code, error_type(formed)) == (415, "unsupported_media_type")
    assert "application/json" in untyped.json()["error"]["message"]
    # and none of them ran: a request sent after them is answered, they are not in any batch
    after = post(gw, "/v1/servings/gated/dispatch", b'{"item": "after"}', JSON_TYPE)
    assert after.json() == {"result": "r:after"}
    assert "after" in ran(r, prefix)
    assert not {"csrf", "plain", "form"} & set(ran(r, prefix))


WRITES: list[tuple[str, str, bytes]] = [
    ("POST", "/v1/servings/gated/dispatch", b'{"item": "w"}'),
    ("POST", "/v1/servings/gated/dispatch_many", b'{"items": ["w"]}'),
    ("POST", "/v1/servings/gated/stream", b'{"items": ["w"]}'),
    ("POST", "/v1/servings/gated/jobs", b'{"items": ["w"]}'),
    ("POST", "/v1/jobs/{job}/cancel", b""),
    ("DELETE", "/v1/jobs/{job}", b""),
    ("POST", "/v1/embeddings", b'{"model": "vectors", "input": "w"}'),
    ("POST", "/v1/completions", b'{"model": "nosuch", "prompt": "w"}'),
]


@pytest.mark.parametrize(("method", "path", "body"), WRITES, ids=[f"{m} {p}" for m, p, _ in WRITES])
def test_every_write_route_refuses_a_foreign_origin_and_a_body_not_sent_as_json(
    stack: Any, method: str, path: str, body: bytes
) -> None:
    _, _, gw, allowing = stack

    def send(to: ServerProc, headers: dict[str, str], content: bytes = body) -> httpx.Response:
        where = path.replace("{job}", job(to)) if "{job}" in path else path
        return httpx.request(method, to.url + where, content=content, headers=headers, timeout=30)

    own = gw.url  # http://127.0.0.1:PORT: the gateway's own origin
    # A foreign origin, or a cross-site fetch, is refused whatever its type
    for headers in (
        {**JSON_TYPE, "origin": EVIL},
        {**JSON_TYPE, "origin": "null"},
        {**JSON_TYPE, "sec-fetch-site": "cross-site"},
        {**JSON_TYPE, "origin": own.replace("127.0.0.1", "localhost")},
        NO_CORS,
    ):
        refused = send(gw, headers)
        assert (refused.status_code, error_type(refused)) == (403, "forbidden_origin"), headers
    # A body not sent as JSON is 415 (and a bodiless write with such a type too)
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "application/jsonp",
    ):
        refused = send(gw, {"content-type": ctype}, body or b"{}")
        assert (refused.status_code, error_type(refused)) == (415, "unsupported_media_type"), ctype
    # Accepted: JSON with parameters, from the gateway's own origin or none, an origin
    # allowed with --allow-origin; a bodiless write without a type
    accepted = [
        (gw, {"content-type": "application/json; charset=utf-8", "origin": own}),
        (gw, {"content-type": "Application/JSON", "sec-fetch-site": "same-origin"}),
        (allowing, {**JSON_TYPE, "origin": APP, "sec-fetch-site": "cross-site"}),
        (allowing, {**JSON_TYPE, "origin": APP + ":443"}),
    ]
    if not body:
        accepted.append((gw, {}))
    for to, headers in accepted:
        response = send(to, headers)
        assert response.status_code not in (403, 415), (headers, response.text[:300])
        assert response.status_code in (200, 202, 404), (headers, response.text[:300])
    # and an origin allowed on one gateway is another's foreign one
    assert send(gw, {**JSON_TYPE, "origin": APP}).status_code == 403


def test_the_dashboards_changes_need_the_token_its_own_origin_and_json(
    stack: Any, redis_server: str, tmp_path: Path
) -> None:
    _, prefix, _, _ = stack
    token = {"authorization": "Bearer board-token"}
    with server(
        "dashboard", redis_server, prefix, tmp_path / "dashboard.log", "--token", "board-token"
    ) as board:
        changes = [
            ("/api/dead-letters/replay", {"serving": "gated", "id": "1-1"}),
            ("/api/dead-letters/drop", {"serving": "gated", "id": "1-1"}),
            ("/api/config", {"serving": "gated", "assignments": ["batch_timeout=0.02"]}),
        ]
        for path, body in changes:
            content = json.dumps(body).encode()
            foreign = post(board, path, content, {**token, **JSON_TYPE, "origin": EVIL})
            plain = post(board, path, content, {**token, "content-type": "text/plain"})
            no_token = post(board, path, content, {**JSON_TYPE, "origin": board.url})
            own = post(board, path, content, {**token, **JSON_TYPE, "origin": board.url})
            assert (foreign.status_code, error_type(foreign)) == (403, "forbidden_origin")
            assert (plain.status_code, error_type(plain)) == (415, "unsupported_media_type")
            assert no_token.status_code == 401
            assert own.status_code in (200, 404), own.text[:300]  # no dead letter 1-1: 404
