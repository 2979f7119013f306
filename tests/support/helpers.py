"""What every test folder shares: waiting on conditions, the repository root, the environment of
the processes a test starts, and the name of a request stream.

Worker processes import modules of this package too (``tests.support.fault_app`` imports
``wait_until``), so nothing here imports pytest or touches Redis at import time.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import msgpack
import redis

import queueserve as qs

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]

# How long any wait may take before the test fails. A wait returns as soon as its condition
# holds, so this only bounds how long a broken test takes to say so; it is generous because the
# fault tests restart processes and Redis on a small, shared machine.
WAIT_S = 60.0
POLL_S = 0.005  # polling interval, not synchronisation


class Watched(Protocol):
    """A process a test started, with its log: what ``wait_until(..., process=)`` watches."""

    proc: subprocess.Popen[bytes]

    def output(self) -> str: ...


def wait_until(
    condition: Callable[[], T],
    what: str,
    *,
    timeout: float = WAIT_S,
    process: Watched | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Fails naming ``what`` (and the last value seen) once ``timeout`` seconds passed, or at once
    when ``process`` exits meanwhile; either way with ``process``'s output, if one is given.
    For waiting on conditions, never for time.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(
                f"process {process.proc.pid} exited with code {process.proc.returncode} while "
                f"waiting for {what}; its output:\n{process.output()}"
            )
        if time.monotonic() >= deadline:
            extra = f"; process output:\n{process.output()}" if process is not None else ""
            raise AssertionError(f"waited {timeout:g}s for {what}; last value: {value!r}{extra}")
        time.sleep(POLL_S)


def items_waiting(worker: qs.Worker) -> int:
    """Items an in-process worker (``Worker.start()``) has taken in and not batched yet. Redis
    shows entries pending as soon as they are read; they join the batcher a moment later, so a
    test that lets a held executor go must wait for this too, or a batch may form without them."""
    host = worker._host
    return 0 if host is None else host.runners[0].assembler.buffered


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this checkout's ``queueserve`` and ``tests``
    importable, no stray ``QUEUESERVE_*`` settings of the caller's, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUESERVE_")}
    if "QUEUESERVE_WAIT_FOR_WORKER" in os.environ:  # the suite's own (tests/conftest.py)
        env["QUEUESERVE_WAIT_FOR_WORKER"] = os.environ["QUEUESERVE_WAIT_FOR_WORKER"]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def stream_key(prefix: str, serving: str, batch_key: str = "default") -> str:
    """The request stream of one (serving, batch key) under ``prefix``."""
    return f"{prefix}:{{{serving}}}:in:{batch_key}"


def entry_headers(fields: dict[bytes, bytes]) -> list[bytes]:
    """The request headers of one stream entry: one, or a pack's (several requests in one
    entry, enqueue.lua)."""
    if b"k" in fields:
        return [member[0] for member in msgpack.unpackb(fields[b"k"], raw=True)]
    return [fields[b"h"]]


def requests_in(r: redis.Redis, stream: str, ids: list[bytes] | None = None) -> int:
    """Requests held by the entries of ``stream`` (those of ``ids`` only, when given): a pack
    counts each of its requests."""
    entries = r.xrange(stream) if ids is None else [e for i in ids for e in r.xrange(stream, i, i)]
    return sum(len(entry_headers(fields)) for _, fields in entries)


def pending_requests(r: redis.Redis, stream: str) -> int:
    """Requests in entries workers read and have not acked yet."""
    try:
        pending = r.xpending_range(stream, "qs", "-", "+", 100_000)
    except redis.ResponseError as e:  # no stream or no group yet: nothing was read
        if "NOGROUP" in str(e):
            return 0
        raise
    return requests_in(r, stream, [p["message_id"] for p in pending])


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name{labels}`` in a Prometheus scrape ``text``; 0 when absent."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if (
            line.startswith(name + "{")
            and sorted(line[len(name) + 1 : line.index("}")].split(",")) == want
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
