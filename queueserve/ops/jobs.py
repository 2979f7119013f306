"""`queueserve job show|wait|cancel ID`: a job (``submit(..., keep=...)``) from the shell, as
JSON on stdout (docs/usage.md, "Jobs")."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from queueserve.client.sync import Client
from queueserve.errors import QueueServeError, Timeout
from queueserve.settings import Settings
from queueserve.worker.worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE


def add_job_parser(sub: Any, url_help: str, prefix_help: str) -> None:
    j: argparse.ArgumentParser = sub.add_parser(
        "job", help="show, wait for or cancel a job by its id (submit(..., keep=...))"
    )
    j.add_argument("action", choices=("show", "wait", "cancel"))
    j.add_argument("id", help="the job's id (ticket.id)")
    j.add_argument(
        "--timeout", type=float, default=None, help="wait: give up after this many seconds"
    )
    j.add_argument("--redis-url", help=url_help)
    j.add_argument("--prefix", help=prefix_help)
    j.add_argument("--log-level", default="WARNING")


def job_command(args: argparse.Namespace) -> int:
    settings = Settings()
    try:
        client = Client(args.redis_url or settings.redis_url, prefix=args.prefix)
    except ValueError as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        job = client.job(args.id)
    except ValueError as e:
        client.close()
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        out, code = _run(args.action, job, args.timeout)
    except QueueServeError as e:
        out, code = {"id": job.id, "error": str(e)}, EXIT_ERROR
    finally:
        client.close()
    print(json.dumps(out, default=repr))
    return code


def _run(action: str, job: Any, timeout: float | None) -> tuple[dict[str, Any], int]:
    if action == "cancel":
        cancelled = job.cancel()
        return {"id": job.id, "cancelled": cancelled, "status": job.status()}, EXIT_OK
    shown: dict[str, Any] = {"id": job.id, "status": job.status()}
    if shown["status"] != "expired":
        done, total, hook = job.progress()
        shown["progress"] = {"done": done, "total": total}
        if hook is not None:
            shown["progress"]["hook"] = {"name": hook.name, "payload": hook.payload}
    if action == "show":
        return shown, EXIT_OK
    try:
        shown["result"] = job.result(timeout=timeout, return_exceptions=True)
    except Timeout as e:
        shown["error"] = str(e)
        return shown, EXIT_ERROR
    shown["status"] = job.status()
    shown["progress"] = {"done": len(shown["result"]), "total": len(shown["result"])}
    return shown, EXIT_OK
