"""``POST /v1/servings/{name}/dispatch`` skips Starlette's middleware stack (gateway/fast.py):
what that stack did for it, the route does itself. Auth, errors and metrics of the route
against a real worker are in tests/integration/test_gateway.py; here, an error the gateway
did not expect, which no worker can cause on purpose."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from queueserve.gateway import create_app


async def test_an_unexpected_error_is_a_500_in_the_error_shape_raised_on_and_counted() -> None:
    app = create_app("redis://127.0.0.1:1/0", token="t")  # never connects: the calls are stubs

    async def require(name: str, what: str = "serving") -> None:
        pass

    async def call(*args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError("a bug")

    gw = app.state.gateway
    gw.require, gw.call = require, call
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"authorization": "Bearer t"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        answer = await http.post("/v1/servings/s/dispatch", json={"item": 1}, headers=headers)
        metrics = (await http.get("/metrics", headers=headers)).text
    assert answer.status_code == 500
    assert answer.json() == {
        "error": {
            "type": "internal_error",
            "status": 500,
            "message": "RuntimeError in the gateway (see its log)",
            "param": None,
            "code": None,
        }
    }
    assert 'route="/v1/servings/{name}/dispatch",status="500"} 1.0' in metrics

    # and the server sees the error, to log it
    strict = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=strict, base_url="http://gw") as http:
        with pytest.raises(RuntimeError, match="a bug"):
            await http.post("/v1/servings/s/dispatch", json={"item": 1}, headers=headers)
