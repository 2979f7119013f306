"""``POST /v1/servings/{name}/dispatch`` as plain ASGI, ahead of Starlette's middleware stack.

One item per request is the gateway's busiest route, and a request's own work (parse, submit,
wait, answer) is small: Starlette's router, its two exception layers with their ``send``
wrappers, its Request and Response objects, and the metrics middleware's ``send`` wrapper cost
about as much again (bench/gateway.py, docs/benchmarks.md). ``GatewayApp`` hands that route to
``FastDispatch``, which does what the stack would, in one layer: the bearer token, the
Origin and Content-Type rule (crosssite.py), the same body checks, errors and
disconnect-cancel, the request counted in the metrics, and an unexpected error answered with
a 500 and raised on to the server (which logs it).
``servings.routes`` still declares the route: the router answers it when the app is not a
``GatewayApp`` (and the fuzzer's registry sees it).
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.types import Message, Receive, Scope, Send

from queueserve.door.auth import refused
from queueserve.door.body import dumps, idempotency_key, receive_body, validated
from queueserve.door.crosssite import WriteRule
from queueserve.door.http_errors import ApiError, ClientGone, error_response, internal
from queueserve.gateway.core import Gateway
from queueserve.gateway.metrics import HttpMetrics
from queueserve.gateway.paths import route_path
from queueserve.gateway.servings import Dispatch
from queueserve.gateway.tenants import Tenant, Tenants

HEAD, TAIL = "/v1/servings/", "/dispatch"
ROUTE = HEAD + "{name}" + TAIL  # its metrics' label
JSON_TYPE = (b"content-type", b"application/json")


def serving_of(scope: Scope) -> str | None:
    """The serving a ``POST .../{name}/dispatch`` names (the route's path, below any mount);
    None for every other request."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path = route_path(scope)
    if not (path.startswith(HEAD) and path.endswith(TAIL)):
        return None
    name = path[len(HEAD) : -len(TAIL)]
    return name if name and "/" not in name else None


class FastDispatch:
    rule = WriteRule()  # the app's Origin and Content-Type rule (create_app sets it)

    def __init__(self, gateway: Gateway, metrics: HttpMetrics, tenants: Tenants) -> None:
        self.gw = gateway
        self.metrics = metrics
        self.tenants = tenants

    async def __call__(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        metrics = self.metrics
        metrics.active += 1
        status = 500  # what the client saw if it left before its answer
        try:
            status = await self.respond(name, scope, receive, send)
        finally:
            metrics.active -= 1
            metrics.record(ROUTE, "POST", status, start)

    async def respond(self, name: str, scope: Scope, receive: Receive, send: Send) -> int:
        """Answers the request; the status it answered with."""
        try:
            tenant = self.tenants.of(scope)
            if tenant is None:
                raise refused()
            refusal = self.rule.refusal(scope)
            if refusal is not None:  # another site's page, or a body not sent as JSON
                raise refusal
            body = await self.answer(name, scope, receive, tenant)
        except ApiError as e:
            await error_response(e)(scope, receive, send)
            return e.status
        except ClientGone:  # left while sending its body: nothing was submitted
            return 500
        except Exception as e:  # as Starlette's ServerErrorMiddleware does (app.internal_error)
            await error_response(internal(e))(scope, receive, send)
            raise
        headers = [JSON_TYPE, (b"content-length", str(len(body)).encode())]
        head: Message = {"type": "http.response.start", "status": 200, "headers": headers}
        await send(head)
        await send({"type": "http.response.body", "body": body})
        return 200

    async def answer(self, name: str, scope: Scope, receive: Receive, tenant: Tenant) -> bytes:
        gw = self.gw
        request = validated(await receive_body(scope, receive, gw.max_body_bytes), Dispatch)
        key = idempotency_key(scope)
        (result,) = await gw.call(receive, tenant, name, [request.item], request, False, key)
        try:
            return dumps({"result": result})
        except TypeError as e:
            raise ApiError(502, "unencodable_result", str(e)) from None


class GatewayApp(Starlette):
    """The gateway's Starlette app, whose ``POST /v1/servings/{name}/dispatch`` requests go to
    ``FastDispatch`` instead of through the middleware stack and router, unless a user added
    middleware of their own (``add_middleware``): that sees every request."""

    fast: FastDispatch
    own_middleware: int  # how many create_app installed

    def dispatcher(self) -> FastDispatch | None:
        """``fast``, or None while a user's middleware must see the dispatch route too."""
        return self.fast if len(self.user_middleware) == self.own_middleware else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = serving_of(scope)
        fast = None if name is None else self.dispatcher()
        if name is None or fast is None:
            await super().__call__(scope, receive, send)
        else:
            await fast(name, scope, receive, send)
