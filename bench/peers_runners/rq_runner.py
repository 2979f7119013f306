"""rq, one job per item: ``python -m bench.peers_runners.rq_runner --variant fork``.

Variants: ``fork``, rq's default ``Worker``, which forks a work horse per job (measured here:
about 6.5 ms from dequeue to the job's start, most of an idle round trip), and ``simple``,
its ``SimpleWorker``, which runs jobs in the worker process itself (rq documents it for tests
and for jobs that need no isolation). The producer calls ``queue.enqueue`` per item, then waits
for every job's result (``latest_result(timeout)``, which blocks on the job's result stream).
"""

from __future__ import annotations

import sys
from typing import Any

from . import _measure

QUEUE = "peers"
VARIANTS = ("fork", "simple")


def main() -> None:
    args = _measure.parse_args(__doc__ or "", variants=VARIANTS)
    try:
        import redis
        from rq import Queue

        from .rq_tasks import identity
    except ImportError:
        _measure.skip("rq")
    queue = Queue(QUEUE, connection=redis.Redis.from_url(args.redis_url))

    def result(job: Any) -> Any:
        latest = job.latest_result(timeout=int(_measure.WAIT_S))
        if latest is None or latest.type != latest.Type.SUCCESSFUL:
            raise RuntimeError(f"rq job {job.id} gave no successful result: {latest!r}")
        return latest.return_value

    def run_window(part: range) -> list[Any]:
        jobs = [queue.enqueue(identity, x) for x in part]
        return [result(job) for job in jobs]

    def call(x: int) -> Any:
        return result(queue.enqueue(identity, x))

    argv = [sys.executable, "-m", "rq.cli", "worker", "--url", args.redis_url, "--quiet", QUEUE]
    if args.variant == "simple":
        argv[-1:-1] = ["--worker-class", "rq.worker.SimpleWorker"]
    with _measure.WorkerProcess(argv) as worker:
        run_window(range(min(args.window, 32)))
        worker.alive()
        meter = _measure.cpu_meter(args.redis_url, worker.proc.pid)
        rate = _measure.rate(run_window, args.items, args.window, args.repeats, args.seconds, meter)
        worker.alive()
        lat = _measure.latency(call, args.rt_calls, args.rt_warmup, args.seconds)
        worker.alive()
    setup = (
        "one worker (default Worker: a forked work horse per job)"
        if args.variant == "fork"
        else "one SimpleWorker (jobs run in the worker process, no fork)"
    )
    _measure.emit({"versions": _measure.versions("rq", "redis"), "setup": setup, **rate, **lat})


if __name__ == "__main__":
    main()
