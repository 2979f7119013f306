"""What the gateway's token check promises beyond tests/integration/test_gateway_auth_bytes.py,
each written for a mutant of queueserve/door/auth.py that survived it (docs/testing.md):
only a space or a tab around the header's value is trimmed (RFC 9110's OWS, not Python's idea
of whitespace, and no other character), a token may hold a space, the empty token is refused
with what to do, and the 401 says what docs/http.md shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from queueserve.door.auth import Token
from queueserve.gateway import create_app

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "Tok3n-Secret.value_X9"


def scope(*values: bytes) -> dict[str, object]:
    return {"type": "http", "headers": [(b"authorization", v) for v in values]}


def test_the_token_check_reads_a_bare_scope_as_the_middleware_does() -> None:
    assert Token(TOKEN).allows(scope(b"Bearer " + TOKEN.encode()))
    assert not Token(TOKEN).allows(scope())


# RFC 9110 section 5.5: OWS around a field value is SP and HTAB. Any other byte there (Python's
# other whitespace among them, which bytes.strip() with no argument would drop) is part of the
# value, so the token no longer matches. A server refuses CR and LF before the app sees them,
# but an ASGI app may be called by anything (httpx.ASGITransport, a test client, a proxy).
# (plain ids: pytest cannot select an id with a backslash by name, which mutmut does)
NOT_OWS = {"VT": b"\x0b", "FF": b"\x0c", "CR": b"\r", "LF": b"\n", "FS": b"\x1c"}
NOT_OWS |= {"X": b"X", "B": b"B", "9": b"9"}


@pytest.mark.parametrize("byte", NOT_OWS.values(), ids=NOT_OWS.keys())
def test_only_space_and_tab_around_the_value_are_trimmed(byte: bytes) -> None:
    token, right = Token(TOKEN), b"Bearer " + TOKEN.encode()
    assert token.allows(scope(b" \t" + right + b"\t "))
    assert not token.allows(scope(byte + right)), f"{byte!r} before the value"
    assert not token.allows(scope(right + byte)), f"{byte!r} after the value"


def test_a_token_with_a_space_inside_is_compared_whole() -> None:
    # 'one space (a second is read as part of the token)': the value splits at its first space
    token = Token("two words")
    assert token.allows(scope(b"Bearer two words"))
    assert not token.allows(scope(b"Bearer two"))
    assert not token.allows(scope(b"Bearer words"))
    assert not token.allows(scope(b"Bearer two  words"))


def test_an_empty_token_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ValueError) as refused:
        Token("")
    assert str(refused.value) == "the token must not be empty; leave it out for none"


def documented_401() -> dict[str, Any]:
    """The 401 body docs/http.md shows for a route without the token."""
    lines = (ROOT / "docs" / "http.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("curl -s $GW/v1/models"))
    shown = lines[at + 1].removeprefix("# ")
    body: dict[str, Any] = json.loads(shown)
    return body


async def test_the_401_is_what_docs_http_shows() -> None:
    app = create_app("redis://127.0.0.1:1/0", token=TOKEN)  # never connects: refused first
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        answers = [
            await http.get("/v1/models"),
            await http.get("/v1/models", headers={"authorization": "Bearer wrong"}),
            await http.post("/v1/servings/s/dispatch", json={"item": 1}),  # FastDispatch's own
        ]
    want = documented_401()["error"]
    for answer in answers:
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        got = answer.json()["error"]
        assert {k: got[k] for k in want} == want
