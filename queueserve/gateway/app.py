"""``create_app``: the gateway as an ASGI app (Starlette), to run with ``queueserve gateway``
or any ASGI server, or to mount in an application of your own."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queueserve.client.async_client import AsyncClient
from queueserve.door.body import JSON
from queueserve.door.crosssite import WriteRule, WriteRuleMiddleware
from queueserve.door.http_errors import HANDLERS, ApiError, error_response, internal
from queueserve.gateway import job_routes, openai_api, servings
from queueserve.gateway.core import Gateway
from queueserve.gateway.fast import FastDispatch, GatewayApp
from queueserve.gateway.metrics import HttpMetrics
from queueserve.gateway.tenants import TenantAuth, Tenants
from queueserve.options.servers import DEFAULT_MAX_BODY_BYTES, GatewayOptions

log = logging.getLogger(__name__)

KNOWN_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/v1/models", "/v1/embeddings", "/v1/completions"}
)


def create_app(
    client_or_url: AsyncClient | str | None = None,
    *,
    prefix: str | None = None,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    models: Mapping[str, str] | None = None,
    allow_origins: Iterable[str] = (),
    tenants: Tenants | str | Path | None = None,
) -> GatewayApp:
    """The gateway's ASGI app (a Starlette app).

    ``client_or_url``: an ``AsyncClient`` of yours (kept open: you close it), or a Redis URL
    (default ``QUEUESERVE_REDIS_URL``) for a client the app makes on first use and closes at
    shutdown. ``token``: every route but ``/healthz`` and ``/readyz`` requires
    ``Authorization: Bearer <token>`` (the one tenant ``default``). ``tenants``: a tenants file
    (its path; tenants.py, docs/gateway.md "Tenants") or ``Tenants`` instead: each tenant's
    token names it; with a path, SIGHUP reloads the file while the app runs. ``models``:
    OpenAI model name -> serving name, added to DEFAULT_MODELS; at startup (when the server runs
    the app's lifespan) each one whose serving no worker has declared is logged as a warning.

    ``GET /healthz`` answers 200 while the process serves (liveness); ``GET /readyz`` 200 while
    Redis answers, 503 while it does not (readiness: what a load balancer routes by).

    Every write (POST, DELETE) needs ``Content-Type: application/json`` when it has a body
    (415 otherwise), and one from a browser page (``Origin``) is refused (403) unless that
    page is the server's own or its origin is in ``allow_origins`` (``*``: any;
    crosssite.py).

    >>> app = create_app("redis://localhost:6379/0", token="s3cret")
    >>> # uvicorn.run(app, port=8000), or: outer_app.mount("/qs", app)
    """
    if (
        isinstance(max_body_bytes, bool)
        or not isinstance(max_body_bytes, int)
        or max_body_bytes < 1
    ):
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    tenants = Tenants.of_options(token, tenants)
    gw = Gateway(
        client_or_url, prefix, max_body_bytes, {**openai_api.DEFAULT_MODELS, **(models or {})}
    )
    metrics = HttpMetrics(KNOWN_PATHS)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reloading = tenants.path is not None and _reload_on_sighup(tenants, gw)
        await gw.declare_tenants(tenants)
        if models:
            await gw.check_models(models)
        yield
        if reloading:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await gw.aclose()

    async def healthz(request: Request) -> Response:
        return JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if await gw.ready():
            return JSON({"status": "ready"})
        raise ApiError(
            503,
            "redis_unavailable",
            "not ready: Redis does not answer the gateway (its log names the Redis and why); "
            "send no traffic here until this answers 200",
        )

    # Outermost: refused and failed requests are counted too.
    middleware = [Middleware(metrics.middleware)]
    if tenants.required:
        middleware.append(Middleware(TenantAuth, tenants=tenants))
    # After the token: no stranger learns more than 401. Every POST and DELETE, so a write
    # route added later is covered too.
    rule = WriteRule(allow_origins, f"--allow-origin ({GatewayOptions.variable('allow_origin')})")
    middleware.append(Middleware(WriteRuleMiddleware, rule=rule))
    app = GatewayApp(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            *servings.routes(gw),
            *job_routes.routes(gw),
            *openai_api.routes(gw),
        ],
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={**HANDLERS, Exception: internal_error},
    )
    # POST .../dispatch skips the stack: FastDispatch checks the token and counts it itself.
    app.fast = FastDispatch(gw, metrics, tenants)
    app.fast.rule = rule
    app.own_middleware = len(middleware)
    app.state.gateway = gw
    app.state.tenants = tenants
    return app


def _reload_on_sighup(tenants: Tenants, gw: Gateway) -> bool:
    """Reload ``tenants`` from its file on SIGHUP, and tell the workers their weights; False
    where no handler can be installed (an app run off the main thread, or on Windows): said
    once."""
    loop = asyncio.get_running_loop()

    def reload() -> None:
        if tenants.reload():
            gw.keep(loop.create_task(gw.declare_tenants(tenants)))

    try:
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        log.warning("gateway: SIGHUP will not reload the tenants file here: %s", e)
        return False
    return True


async def internal_error(request: Request, exc: Exception) -> Response:
    return error_response(internal(exc))
