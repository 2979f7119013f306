"""The dashboard's changes need its token, checked by the gateway's ``Token`` (door/auth.py):
refused with 401 without it, 403 on a read-only dashboard. Every request here is answered
before Redis is asked anything (the URL's port has no server)."""

from __future__ import annotations

import httpx
import pytest

from queueserve.dashboard.app import create_app

TOKEN = "pässwort"  # not ASCII: a client sends its UTF-8 bytes
CHANGES = ["/api/config", "/api/dead-letters/replay", "/api/dead-letters/drop"]


def client(token: str | None) -> httpx.AsyncClient:
    app = create_app("redis://127.0.0.1:1/0", prefix="qs", token=token)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash")


@pytest.mark.parametrize("path", CHANGES)
async def test_a_change_needs_the_token_sent_as_its_bytes(path: str) -> None:
    sent = f"Bearer {TOKEN}".encode()
    async with client(TOKEN) as http:
        missing = await http.post(path, json={})
        wrong = await http.post(path, json={}, headers={"authorization": b"Bearer pa"})
        # The token passes; the empty body is what is refused, before any Redis read
        right = await http.post(path, json={}, headers={"authorization": sent})
    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        error = refused.json()["error"]
        assert error["type"] == "unauthorized"
        assert "enter the dashboard's --token in the page" in error["message"]
    assert right.status_code == 400 and right.json()["error"]["type"] == "bad_request"


async def test_a_dashboard_without_a_token_is_read_only() -> None:
    async with client(None) as http:
        answer = await http.post("/api/config", json={}, headers={"authorization": "Bearer x"})
    assert answer.status_code == 403 and answer.json()["error"]["type"] == "read_only"


def test_an_empty_token_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="token must not be empty"):
        create_app("redis://127.0.0.1:1/0", token="")
