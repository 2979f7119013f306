"""``queueserve dashboard``: the app under uvicorn (the CLI imports this only for that
command, so the rest of the CLI works without the ``dashboard`` extra)."""

from __future__ import annotations

import ipaddress
import logging

import uvicorn

from queueserve.dashboard.app import create_app
from queueserve.door.connections import (
    TESTED_UVICORN,
    ConnectionGuard,
    GuardedHttp,
    describe,
    fitted,
    guarded,
    limits_of,
    run,
)
from queueserve.options.servers import DashboardOptions

log = logging.getLogger("queueserve.dashboard")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what --host was given) is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def serve_dashboard(options: DashboardOptions, redis_url: str | None, prefix: str | None) -> int:
    """Serve until SIGTERM."""
    limits = fitted(limits_of(options), "dashboard")
    read_token = options.read_token or None
    if read_token is None and not is_loopback(options.host):
        log.warning(
            "dashboard: listening on %s without a read token: anyone who reaches it reads "
            "every serving's options, workers (hosts, pids), queues and dead letters; set "
            "%s (or --read-token) to require one",
            options.host,
            DashboardOptions.variable("read_token"),
        )
    app = create_app(
        redis_url,
        prefix=prefix,
        token=options.token or None,
        read_token=read_token,
        allow_origins=list(options.allow_origin),
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
    run(app, options, limits, http)
    return 0
