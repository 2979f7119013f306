"""``queueserve dashboard``: the app under uvicorn (the CLI imports this only for that
command, so the rest of the CLI works without the ``dashboard`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os

import uvicorn

from queueserve.dashboard.app import create_app

log = logging.getLogger("queueserve.dashboard")

TOKEN_ENV = "QUEUESERVE_DASHBOARD_TOKEN"  # a token in argv shows in `ps`; the environment does not
READ_TOKEN_ENV = "QUEUESERVE_DASHBOARD_READ_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what --host was given) is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def dashboard_command(args: argparse.Namespace) -> int:
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
    )
    # uvicorn logs the address it bound (with --port 0, the port it was given) at INFO.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="on",
    )
    return 0
