"""A gateway mounted under a path (``Mount("/qs", app)``, or ``uvicorn --root-path``) sees the
whole path in ``scope["path"]`` and the mount point in ``scope["root_path"]``: the token's open
paths and the metrics' route labels are the routes' own paths below it (gateway/paths.py).
The calls are stubs: nothing here reaches Redis."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from queueserve.gateway import create_app
from queueserve.gateway.paths import route_path

TOKEN = {"authorization": "Bearer t"}


def stubbed_app() -> Any:
    app = create_app("redis://127.0.0.1:1/0", token="t")  # never connects

    async def require(name: str, what: str = "serving") -> None:
        pass

    async def call(
        receive: Any, tenant: Any, serving: str, items: list[Any], *args: Any
    ) -> list[Any]:
        return list(items)

    app.state.gateway.require, app.state.gateway.call = require, call
    return app


@pytest.mark.parametrize("how", ["Mount", "root_path"])
async def test_a_mounted_gateway_keeps_healthz_open_and_labels_its_routes(how: str) -> None:
    app = stubbed_app()
    if how == "Mount":
        transport = httpx.ASGITransport(app=Starlette(routes=[Mount("/qs", app=app)]))
    else:  # what uvicorn --root-path /qs hands the app
        transport = httpx.ASGITransport(app=app, root_path="/qs")
    async with httpx.AsyncClient(transport=transport, base_url="http://outer") as http:
        health = await http.get("/qs/healthz")
        refused = await http.get("/qs/metrics")
        one = await http.post("/qs/v1/servings/s/dispatch", json={"item": 1}, headers=TOKEN)
        many = await http.post(
            "/qs/v1/servings/s/dispatch_many", json={"items": [2]}, headers=TOKEN
        )
        missing = await http.get("/qs/nowhere", headers=TOKEN)
        metrics = (await http.get("/qs/metrics", headers=TOKEN)).text
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert refused.status_code == 401
    assert one.json() == {"result": 1} and many.json() == {"results": [2]}
    assert missing.status_code == 404
    for route, status in [
        ("/healthz", 200),
        ("/metrics", 401),
        ("/v1/servings/{name}/dispatch", 200),
        ("/v1/servings/{name}/dispatch_many", 200),
        ("other", 404),
    ]:
        assert f'route="{route}",status="{status}"}} 1.0' in metrics, route


@pytest.mark.parametrize(
    ("path", "root", "route"),
    [
        ("/healthz", "", "/healthz"),
        ("/qs/healthz", "/qs", "/healthz"),
        ("/qs", "/qs", ""),
        ("/qsx/healthz", "/qs", "/qsx/healthz"),  # not below the mount point: as it is
        ("/other/healthz", "/qs", "/other/healthz"),
    ],
)
def test_route_path_is_the_path_below_the_mount_point(path: str, root: str, route: str) -> None:
    assert route_path({"type": "http", "path": path, "root_path": root}) == route


async def test_a_middleware_a_user_adds_sees_the_dispatch_route_too() -> None:
    # Given the gateway app with a middleware of the user's own (an auth, a rate limit, CORS)
    app = stubbed_app()
    seen: list[str] = []

    class Seeing:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope["path"])
            await self.app(scope, receive, send)

    app.add_middleware(Seeing)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        # When a dispatch comes, then it passes through that middleware, and is answered
        one = await http.post("/v1/servings/s/dispatch", json={"item": 1}, headers=TOKEN)
        refused = await http.post("/v1/servings/s/dispatch", json={"item": 1})
    assert one.json() == {"result": 1} and refused.status_code == 401
    assert seen == ["/v1/servings/s/dispatch"] * 2
    assert app.dispatcher() is None  # nor does queueserve gateway's protocol go around it
