"""``queueserve gateway``: the app under uvicorn (the CLI imports this only for that command,
so the rest of the CLI works without the ``gateway`` extra)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import uvicorn

from queueserve.broker.urls import redact_url
from queueserve.door.connections import (
    TESTED_UVICORN,
    ConnectionGuard,
    describe,
    fitted,
    guarded,
    limits_of,
    run,
)
from queueserve.gateway.app import create_app
from queueserve.gateway.tenants import Tenants
from queueserve.options.servers import GatewayOptions
from queueserve.settings import Settings

log = logging.getLogger("queueserve.gateway")

YOUNG_GC_THRESHOLD = 50_000
TOKEN_ENV = GatewayOptions.variable("token")  # a token in argv shows in `ps`; the environment not
TENANTS_ENV = GatewayOptions.variable("tenants")


def models_of(pairs: list[str]) -> dict[str, str]:
    models = {}
    for pair in pairs:
        alias, sep, serving = pair.partition("=")
        if not sep or not alias or not serving:
            raise ValueError(f"--model takes MODEL=SERVING, got {pair!r}")
        models[alias] = serving
    return models


def http_protocol(guard: ConnectionGuard | None = None) -> Any:
    """The gateway's HTTP protocol for ``uvicorn.run(http=...)``: one write per response and
    the dispatch route without uvicorn's ASGI cycle (dispatch_http.py), its connections
    bounded by ``guard`` (connections.py), on a uvicorn release it was tested with; uvicorn's
    own elsewhere (the same answers, at more CPU per request, and only uvicorn's keep-alive
    timeout: no deadline on heads and bodies, no connection caps)."""
    release = ".".join(uvicorn.__version__.split(".")[:2])
    if release in TESTED_UVICORN:
        try:
            from queueserve.gateway.dispatch_http import DispatchHttp

            return DispatchHttp if guard is None else guarded(DispatchHttp, guard)
        except ImportError as e:  # a build of that release without what they use
            reason = str(e)
    else:
        reason = f"uvicorn {uvicorn.__version__} is not one of {', '.join(TESTED_UVICORN)}"
    log.warning(
        "gateway: uvicorn's own HTTP protocol, not queueserve's faster one, and no deadline "
        "on request heads and bodies nor connection caps: %s",
        reason,
    )
    return "auto"


def log_start(
    redis_url: str | None, prefix: str | None, token_from: str | None, tenants: Tenants | None
) -> None:
    """One line of where the gateway's servings are and whether it asks for a token: a wrong
    Redis, prefix or missing token is seen at start, not from the first 404 or 401."""
    settings = Settings()
    if redis_url:
        source = "given"
    elif "redis_url" in settings.model_fields_set:
        source = "from QUEUESERVE_REDIS_URL"
    else:
        source = "the default: pass --redis-url or set QUEUESERVE_REDIS_URL"
    if tenants is not None:
        auth = f"on: tenants {', '.join(tenants.names())} from {tenants.path} (SIGHUP reloads)"
    elif token_from is not None:
        auth = f"on (bearer token from {token_from})"
    else:
        auth = f"off: every route is open (set {TOKEN_ENV} or --token to require one)"
    log.info(
        "gateway: Redis %s (%s), prefix %r, auth %s",
        redact_url(redis_url or settings.redis_url),
        source,
        prefix or settings.prefix,
        auth,
    )


def serve_gateway(
    options: GatewayOptions, redis_url: str | None, prefix: str | None, token_flag: bool
) -> int:
    """Serve until SIGTERM; ``token_flag``: the token came from --token, not its variable
    (the start line says which)."""
    settings = Settings()
    token = options.token or None
    if options.tenants is not None and token is not None:
        raise ValueError(
            f"--tenants ({TENANTS_ENV}) and --token ({TOKEN_ENV}) were both given: a tenants "
            "file names every token; give one of them"
        )
    tenants = Tenants.from_file(options.tenants) if options.tenants is not None else None
    models = models_of(list(options.models))
    limits = fitted(limits_of(options), "gateway")
    origins = list(options.allow_origin)
    log_start(
        redis_url, prefix, ("--token" if token_flag else TOKEN_ENV) if token else None, tenants
    )
    log.info(
        "gateway: connections: %s; writes from browser pages: the gateway's own origin%s",
        describe(limits),
        "".join(f", {o}" for o in origins),
    )
    app = create_app(
        redis_url or settings.redis_url,
        prefix=prefix or settings.prefix,
        token=token,
        tenants=tenants,
        max_body_bytes=options.max_body_bytes,
        models=models,
        allow_origins=origins,
    )
    # Everything loaded so far lives as long as the process: frozen, the cyclic collector's full
    # passes stop walking it (bench/gateway.py: a fifth of the CPU per HTTP request before).
    gc.collect()
    gc.freeze()
    # The default young-generation threshold (700 container objects net) is passed by what 64
    # requests in flight hold alive at any time, so collections ran every few requests, each
    # walking and promoting them: 9% of the CPU per request (bench/gateway.py). Cycles made
    # per request are still collected, a few thousand requests later.
    gc.set_threshold(YOUNG_GC_THRESHOLD, 20, 20)
    run(
        app,
        options,
        limits,
        # uvicorn's own protocol (httptools when installed, as uvicorn[standard] does; uvloop
        # is uvicorn's default loop then), writing each response in one send (writes.py),
        # and answering POST .../dispatch without uvicorn's ASGI cycle (dispatch_http.py).
        http_protocol(ConnectionGuard(limits, "gateway")),
        # annotated int, used as seconds by asyncio.wait_for: a fraction is kept
        timeout_graceful_shutdown=options.shutdown_timeout,
        # X-Forwarded-* rewrite the client's address, which the gateway never uses: a layer
        # less per request.
        proxy_headers=False,
        # "server: uvicorn" on every response: bytes and header checks per request, for nothing.
        server_header=False,
    )
    return 0
