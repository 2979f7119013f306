"""Celery, one task per item: ``python -m bench.peers_runners.celery_runner --variant solo``.

Variants: ``solo`` (the solo pool: one process, one task at a time), ``prefork`` (Celery's
default pool at its default concurrency, one child per CPU), ``batches`` (celery-batches on
the prefork pool). The producer calls ``delay(x)`` per item and ``get()`` for every result.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

from . import _measure

VARIANTS = ("solo", "prefork", "batches")


def main() -> None:
    """Automatic garbage collection is off while the producer runs: Celery 5.6's Redis result
    consumer deadlocks when a collection finalizes an ``AsyncResult`` inside a pub/sub call
    (its ``__del__`` re-enters redis-py's ``PubSub`` lock; celery/celery#10477, fixed after
    5.6.3). The producer collects between windows instead."""
    gc.disable()
    args = _measure.parse_args(__doc__ or "", variants=VARIANTS)
    os.environ["PEERS_REDIS_URL"] = args.redis_url
    batches = args.variant == "batches"
    try:
        if batches:
            from .celery_batches_app import identity_batch as task
        else:
            from .celery_app import identity as task
    except ImportError as e:
        _measure.skip("celery-batches" if batches and "celery_batches" in str(e) else "celery")
    pool = "solo" if args.variant == "solo" else "prefork"
    concurrency = 1 if pool == "solo" else os.cpu_count() or 1
    app_module = f"{__package__}.{'celery_batches_app' if batches else 'celery_app'}"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app_module,
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--loglevel",
        "WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with _measure.WorkerProcess(argv) as worker:

        def call(x: int) -> Any:
            return task.delay(x).get(timeout=_measure.WAIT_S)

        def run_window(part: range) -> list[Any]:
            pending = [task.delay(x) for x in part]
            results = [r.get(timeout=_measure.WAIT_S) for r in pending]
            del pending
            gc.collect()  # here, where no pub/sub call is under way (see main's docstring)
            return results

        run_window(range(args.window))  # the worker is up once these come back
        worker.alive()
        meter = _measure.cpu_meter(args.redis_url, worker.proc.pid)
        rate = _measure.rate(run_window, args.items, args.window, args.repeats, args.seconds, meter)
        worker.alive()
        lat = _measure.latency(call, args.rt_calls, args.rt_warmup, args.seconds)
        worker.alive()
        gc.collect()  # finalize the last results now, not at interpreter exit
    names = ("celery", "kombu", "redis") + (("celery-batches",) if batches else ())
    setup = f"pool {pool}, concurrency {concurrency}" + (
        ", flush_every 256, flush_interval 10 ms, prefetch multiplier 0"
        if batches
        else ", prefetch multiplier 4 (default)"
    )
    _measure.emit({"versions": _measure.versions(*names), "setup": setup, **rate, **lat})


if __name__ == "__main__":
    main()
