"""arq, one job per item: ``python -m bench.peers_runners.arq_runner``.

The producer (asyncio) awaits ``enqueue_job`` per item, then ``job.result()`` for every job,
polling for it every 5 ms (arq's default is 0.5 s); the worker settings are in arq_worker.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from . import _measure


def main() -> None:
    args = _measure.parse_args(__doc__ or "")
    os.environ["PEERS_REDIS_URL"] = args.redis_url
    try:
        from arq import create_pool
        from arq.connections import RedisSettings

        from .arq_worker import MAX_JOBS, POLL_DELAY_S
    except ImportError:
        _measure.skip("arq")
    loop = asyncio.new_event_loop()
    pool = loop.run_until_complete(create_pool(RedisSettings.from_dsn(args.redis_url)))

    async def window(part: range) -> list[Any]:
        jobs = [await pool.enqueue_job("identity", x) for x in part]
        return [
            await job.result(timeout=_measure.WAIT_S, poll_delay=POLL_DELAY_S)
            for job in jobs
            if job is not None
        ]

    def run_window(part: range) -> list[Any]:
        return loop.run_until_complete(window(part))

    def call(x: int) -> Any:
        return run_window(range(x, x + 1))[0]

    argv = [sys.executable, "-m", "arq", "bench.peers_runners.arq_worker.WorkerSettings"]
    try:
        with _measure.WorkerProcess(argv) as worker:
            run_window(range(args.window))
            worker.alive()
            meter = _measure.cpu_meter(args.redis_url, worker.proc.pid)
            rate = _measure.rate(
                run_window, args.items, args.window, args.repeats, args.seconds, meter
            )
            worker.alive()
            lat = _measure.latency(call, args.rt_calls, args.rt_warmup, args.seconds)
            worker.alive()
    finally:
        loop.run_until_complete(pool.aclose())
        loop.close()
    setup = f"one worker, max_jobs {MAX_JOBS}, poll_delay {POLL_DELAY_S * 1e3:g} ms (tuned)"
    _measure.emit({"versions": _measure.versions("arq", "redis"), "setup": setup, **rate, **lat})


if __name__ == "__main__":
    main()
