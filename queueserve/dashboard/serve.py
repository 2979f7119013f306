"""``queueserve dashboard``: the app under uvicorn (the CLI imports this only for that
command, so the rest of the CLI works without the ``dashboard`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os

import uvicorn

from queueserve.dashboard.app import create_app
from queueserve.gateway.connections import (
    ConnectionGuard,
    GuardedHttp,
    Limits,
    describe,
    fitted,
    guarded,
    limits_of,
)
from queueserve.gateway.crosssite import origins_of
from queueserve.gateway.serve import TESTED_UVICORN

log = logging.getLogger("queueserve.dashboard")

TOKEN_ENV = "QUEUESERVE_DASHBOARD_TOKEN"  # a token in argv shows in `ps`; the environment does not
READ_TOKEN_ENV = "QUEUESERVE_DASHBOARD_READ_TOKEN"
ENV = "QUEUESERVE_DASHBOARD"  # QUEUESERVE_DASHBOARD_HEADER_TIMEOUT, ..._ALLOW_ORIGIN
# An operator's page, from a browser or two: fewer connections than the gateway's callers.
LIMITS = Limits(keep_alive_timeout=5.0, max_connections=1_000, max_connections_per_client=100)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what --host was given) is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def dashboard_command(args: argparse.Namespace) -> int:
    limits = fitted(limits_of(vars(args), ENV, LIMITS), "dashboard")
    origins = origins_of(args.allow_origin, f"{ENV}_ALLOW_ORIGIN")
    read_token = args.read_token or os.environ.get(READ_TOKEN_ENV) or None
    if read_token is None and not is_loopback(args.host):
        log.warning(
            "dashboard: listening on %s without a read token: anyone who reaches it reads "
            "every serving's options, workers (hosts, pids), queues and dead letters; set "
            "%s (or --read-token) to require one",
            args.host,
            READ_TOKEN_ENV,
        )
    app = create_app(
        args.redis_url,
        prefix=args.prefix,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
        read_token=read_token,
        allow_origins=origins,
    )
    release = ".".join(uvicorn.__version__.split(".")[:2])
    if release in TESTED_UVICORN:
        http = guarded(GuardedHttp, ConnectionGuard(limits, "dashboard"))
        log.info("dashboard: connections: %s", describe(limits))
    else:  # GuardedHttp builds on uvicorn's protocol class, which is not its public API
        http = "auto"
        log.warning(
            "dashboard: uvicorn %s is not one of %s: no deadline on request heads and bodies "
            "nor connection caps",
            uvicorn.__version__,
            ", ".join(TESTED_UVICORN),
        )
    # uvicorn logs the address it bound (with --port 0, the port it was given) at INFO.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
        http=http,
    )
    return 0
