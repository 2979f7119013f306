"""What tracing costs the single-item path: tracing off against tracing on, in one run.

    python -m bench.tracing [--items 40000] [--repeats 3]

Issue 27's budget: with the ``otel`` extra installed and a no-op exporter, single items reach
at least 0.9x of tracing off. One private ``redis-server`` serves every run; each run starts
its own worker (``queueserve worker bench.tracing:noop``) and a client process doing the
``submit-window`` shape of bench/throughput.py (8 threads, windows of 512 one-item tickets).
The two modes alternate, so a noisy machine slows both alike:

- ``off``: opentelemetry hidden from both processes (``PYTHONPATH`` to an empty
  ``opentelemetry`` package: ``queueserve.tracing.AVAILABLE`` is False), as without the extra;
- ``on``: both processes set an SDK TracerProvider whose BatchSpanProcessor hands every span to
  an exporter that drops it, and each window is sent inside a span of its own, so every
  request carries trace context and the worker's span of each batch links to it.

Per mode, the median items/s and CPU µs per item of the client, the worker and Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import queueserve as qs

from ._harness import REPO_ROOT, CpuMeter, RedisServer, stop_process, wait_until
from .throughput import SERVING, WAIT_S, check, run_threads, shares

MODES = ("off", "on")
BUDGET = 0.9  # tracing on / off, single items (issue 27)


def _traced() -> Any:
    """A tracer of an SDK provider exporting to nowhere (None without opentelemetry)."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )
    except ImportError:
        return None

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    return trace.get_tracer("bench.tracing")


# The worker imports this module to serve ``noop``: its provider is set on import.
TRACER = _traced()
noop = qs.Serving(lambda xs: xs, name=SERVING, batch_size=256, batch_timeout=0)


def submit_windows(url: str, prefix: str, n: int) -> float:
    """bench/throughput.py's submit-window shape, each window in a span when tracing is on."""
    parts = shares(n, 8)
    with qs.Client(url, prefix=prefix) as client:
        client.dispatch(SERVING, 0, timeout=WAIT_S)  # connected, and the worker is up

        def body(i: int) -> None:
            part = parts[i]
            for lo in range(part.start, part.stop, 512):
                items = range(lo, min(part.stop, lo + 512))
                span = TRACER.start_as_current_span("window") if TRACER else nullcontext()
                with span:
                    tickets = [client.submit(SERVING, [x]) for x in items]
                check([t.result(WAIT_S)[0] for t in tickets], items)

        return run_threads(8, body)


def _env(mode: str, hidden: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if mode == "off":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hidden), env.get("PYTHONPATH")]))
    return env


def one_run(server: RedisServer, mode: str, hidden: Path, n: int, run: int) -> dict[str, Any]:
    prefix = f"qstrace{run}{mode}"
    env = _env(mode, hidden)
    serve = ["worker", "bench.tracing:noop", "--redis-url", server.url, "--prefix", prefix]
    worker = subprocess.Popen(
        [sys.executable, "-m", "queueserve", *serve, "--log-level", "WARNING"],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    code = (
        "import json, sys, time\n"
        "from bench.tracing import submit_windows\n"
        "url, prefix, n = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
        "cpu = time.process_time()\n"
        "seconds = submit_windows(url, prefix, n)\n"
        "print(json.dumps({'seconds': seconds, 'cpu': time.process_time() - cpu}))\n"
    )
    try:
        wait_until(lambda: _has_worker(server, prefix), 30, "the worker")
        client = subprocess.Popen(
            [sys.executable, "-c", code, server.url, prefix, str(n)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
        )
        assert server.proc is not None
        meter = CpuMeter({"worker": worker.pid, "redis": server.proc.pid}, frozenset({"worker"}))
        meter.start()
        out, _ = client.communicate(timeout=300)
        cpu = meter.stop()
        if client.returncode != 0:
            raise RuntimeError(f"the {mode} client exited with code {client.returncode}")
        measured = json.loads(out)
    finally:
        stop_process(worker)
    cpu["client"] = measured["cpu"]  # (user and system, with the client's start-up check)
    return {"items_per_s": n / measured["seconds"], **{k: v * 1e6 / n for k, v in cpu.items()}}


def _has_worker(server: RedisServer, prefix: str) -> bool:
    import redis

    with redis.Redis.from_url(server.url) as r:
        return bool(r.zcard(f"{prefix}:{{{SERVING}}}:workers"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="qs-no-otel-") as hidden:
        (Path(hidden) / "opentelemetry").mkdir()
        (Path(hidden) / "opentelemetry" / "__init__.py").write_text("")
        server = RedisServer().start()
        started = time.time()
        try:
            for run in range(args.repeats):
                for mode in MODES:
                    results[mode].append(one_run(server, mode, Path(hidden), args.items, run))
        finally:
            server.stop()
    print(f"single items, submit-window shape ({args.items} items, {args.repeats} runs per mode)")
    print("  mode   items/s (median; runs)              CPU µs/item: client  worker  redis")
    medians = {}
    for mode in MODES:
        runs = results[mode]
        medians[mode] = statistics.median(r["items_per_s"] for r in runs)
        cpu = {k: statistics.median(r[k] for r in runs) for k in ("client", "worker", "redis")}
        shown = ", ".join(f"{r['items_per_s']:,.0f}" for r in runs)
        print(
            f"  {mode:<5} {medians[mode]:>9,.0f}  ({shown})".ljust(48)
            + f"{cpu['client']:>12.1f} {cpu['worker']:>7.1f} {cpu['redis']:>6.1f}"
        )
    ratio = medians["on"] / medians["off"]
    verdict = "ok" if ratio >= BUDGET else "MISS"
    print(f"  [{verdict}] tracing on / off = {ratio:.2f} (budget >= {BUDGET})")
    load = os.getloadavg()[0]
    print(f"({time.time() - started:.0f} s, {os.cpu_count()} cores, loadavg {load:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
