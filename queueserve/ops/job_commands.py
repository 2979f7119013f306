"""`queueserve job show|wait|cancel ID`: a job (``submit(..., keep=...)``) from the shell, as
JSON on stdout (docs/usage.md, "Jobs").

``wait`` exits 0 with the results of a job that is done, EXIT_JOB_FAILED with each item's
result or error of one that failed, and 1 with no results (cancelled, no record, not ended
within ``--timeout``, Redis unreachable), so a shell script can tell them apart.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

from queueserve.client.sync import Client
from queueserve.errors import QueueServeError, RemoteError, Timeout
from queueserve.settings import Settings
from queueserve.worker.worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE

EXIT_JOB_FAILED = 5  # wait: the job ended failed (an item's answer is an error)


def add_job_parser(sub: Any, url_help: str, prefix_help: str) -> None:
    j: argparse.ArgumentParser = sub.add_parser(
        "job", help="show, wait for or cancel a job by its id (submit(..., keep=...))"
    )
    j.add_argument("action", choices=("show", "wait", "cancel"))
    j.add_argument("id", help="the job's id (ticket.id)")
    j.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="wait: give up after this many seconds (exit 1); a job that failed exits "
        f"{EXIT_JOB_FAILED}, one that is done 0",
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
    print(json.dumps(out, default=_plain))
    return code


def _plain(value: Any) -> Any:
    """What JSON holds for a result it has no type for: an array's or tensor's list, bytes as
    base64 text (as the gateway answers them); anything else its repr."""
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    return repr(value)


def item_error(error: QueueServeError) -> dict[str, Any]:
    """A failed item's place in ``result``: its error's type and message; for an error the
    batch function raised, the remote type (``ValueError``) and its message."""
    if isinstance(error, RemoteError):
        return {"error": {"type": error.remote_type, "message": error.remote_message}}
    return {"error": {"type": type(error).__name__, "message": str(error)}}


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
        results = job.result(timeout=timeout, return_exceptions=True)
    except Timeout as e:
        shown["error"] = str(e)
        return shown, EXIT_ERROR
    except QueueServeError as e:  # cancelled, gone: no results; or its record says it failed
        if job.status() != "failed":
            raise
        shown.update(status="failed", error=str(e))
        return shown, EXIT_JOB_FAILED
    failed = any(isinstance(r, QueueServeError) for r in results)
    shown["status"] = job.status()
    shown["progress"] = {"done": len(results), "total": len(results)}
    shown["result"] = [item_error(r) if isinstance(r, QueueServeError) else r for r in results]
    return shown, EXIT_JOB_FAILED if failed else EXIT_OK
