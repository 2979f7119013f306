"""``queueserve gateway``: the app under uvicorn (the CLI imports this only for that command,
so the rest of the CLI works without the ``gateway`` extra)."""

from __future__ import annotations

import argparse
import os

import uvicorn

from queueserve.gateway.app import create_app

TOKEN_ENV = "QUEUESERVE_GATEWAY_TOKEN"  # a token in argv shows in `ps`; the environment does not


def models_of(pairs: list[str]) -> dict[str, str]:
    models = {}
    for pair in pairs:
        alias, sep, serving = pair.partition("=")
        if not sep or not alias or not serving:
            raise ValueError(f"--model takes MODEL=SERVING, got {pair!r}")
        models[alias] = serving
    return models


def gateway_command(args: argparse.Namespace) -> int:
    app = create_app(args.redis_url, prefix=args.prefix,
                     token=args.token or os.environ.get(TOKEN_ENV) or None,
                     max_body_bytes=args.max_body_bytes, models=models_of(args.models))
    # uvicorn logs the address it bound (with --port 0, the port it was given) at INFO.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=False, lifespan="on", timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
