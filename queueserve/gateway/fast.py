"""``POST /v1/servings/{name}/dispatch`` as plain ASGI, ahead of Starlette's router.

One item per request is the gateway's busiest route, and a request's own work (parse, submit,
wait, answer) is small: Starlette's router, its two exception layers with their ``send``
wrappers, and its Request and Response objects cost about as much again (bench/gateway.py,
docs/benchmarks.md). This middleware answers that route itself, the same way (same body
checks, errors, disconnect-cancel, metrics and auth outside it), and passes every other
request on to the app. ``servings.routes`` still declares the route: the router answers it
when this middleware is not in front (and the fuzzer's registry sees it).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from queueserve.gateway.body import dumps, receive_body, validated
from queueserve.gateway.core import Gateway
from queueserve.gateway.errors import ApiError, ClientGone, error_response
from queueserve.gateway.servings import Dispatch

HEAD, TAIL = "/v1/servings/", "/dispatch"
JSON_TYPE = (b"content-type", b"application/json")


def serving_of(scope: Scope) -> str | None:
    """The serving a ``POST .../{name}/dispatch`` names (the route's path, below any mount);
    None for every other request."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    if not (path.startswith(HEAD) and path.endswith(TAIL)):
        return None
    name = path[len(HEAD) : -len(TAIL)]
    return name if name and "/" not in name else None


class FastDispatch:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = serving_of(scope)
        if name is None:
            await self.app(scope, receive, send)
            return
        try:
            body = await self.answer(name, scope, receive)
        except ApiError as e:
            await error_response(e)(scope, receive, send)
            return
        except ClientGone:  # left while sending its body: nothing was submitted
            return
        headers = [JSON_TYPE, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def answer(self, name: str, scope: Scope, receive: Receive) -> bytes:
        gw = self.gw
        request = validated(await receive_body(scope, receive, gw.max_body_bytes), Dispatch)
        await gw.require(name)
        (result,) = await gw.call(receive, name, [request.item], request)
        try:
            return dumps({"result": result})
        except TypeError as e:
            raise ApiError(502, "unencodable_result", str(e)) from None
