"""``queueserve dashboard``: the app under uvicorn (the CLI imports this only for that
command, so the rest of the CLI works without the ``dashboard`` extra)."""

from __future__ import annotations

import argparse
import os

import uvicorn

from queueserve.dashboard.app import create_app

TOKEN_ENV = "QUEUESERVE_DASHBOARD_TOKEN"  # a token in argv shows in `ps`; the environment does not


def dashboard_command(args: argparse.Namespace) -> int:
    app = create_app(
        args.redis_url, prefix=args.prefix, token=args.token or os.environ.get(TOKEN_ENV) or None
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
