"""Pipeline benchmark: does a CPU preparation stage keep the device busy? (issue 13)

A serving whose preparation takes P per batch on a pool of ``prepare_concurrency`` (c) threads
and whose device takes T per batch runs in a real worker process under a load that always has
more than a batch queued. With the stages overlapping, the slower of them sets the pace: the
ideal is ``batch / max(T, P / c)`` items/s, and the ratio to it is the budget (>= 0.9 for
P < T, P = T and P > T). Run in series, as before the preparation stage, a batch would take
P + T. The device's busy fraction is read from the worker's metrics
(``queueserve_partition_busy_seconds_total``: time in handle_batch alone).

    python -m bench.pipeline [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import queueserve as qs

from ._harness import RedisServer, free_port, spawn_module, stop_process
from .overlap import _busy_seconds

CASES = [  # (P seconds, T seconds, prepare_concurrency, batch)
    (0.010, 0.020, 1, 64),  # P < T: the device sets the pace
    (0.020, 0.020, 1, 64),  # P = T: both stages busy all the time
    (0.060, 0.020, 2, 64),  # P > T, two preparers: preparation sets the pace (P/c = 30 ms)
    (0.060, 0.020, 4, 64),  # P > T, four preparers: the device again (P/c = 15 ms)
]


def run_case(url: str, p: float, t: float, c: int, batch: int, batches: int) -> dict[str, float]:
    os.environ.update(
        QS_BENCH_P=str(p), QS_BENCH_T=str(t), QS_BENCH_PREP=str(c), QS_BENCH_BATCH=str(batch)
    )
    port = free_port()
    prefix = f"pl{int(p * 1000)}-{int(t * 1000)}-{c}"
    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.pipeline_servings:Staged",
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--partitions",
        "1",
        "--metrics-port",
        str(port),
        "--log-level",
        "WARNING",
    )
    client = qs.Client(url, prefix=prefix)
    try:
        assert client.dispatch("staged", 0, timeout=120) == 0  # warm: the worker is reading
        busy0, ran0 = _busy_seconds(port, "staged")
        items = batches * batch
        started = time.perf_counter()
        for _ in client.map(
            "staged", range(items), chunk_size=max(1, batch // 4), max_in_flight=64
        ):
            pass
        wall = time.perf_counter() - started
        busy1, ran1 = _busy_seconds(port, "staged")
    finally:
        client.close()
        stop_process(worker, timeout=60)
    rate = items / wall
    ideal = batch / max(t, p / c)
    return {
        "P_ms": p * 1000,
        "T_ms": t * 1000,
        "prepare_concurrency": c,
        "batch_size": batch,
        "items_per_s": rate,
        "ideal": ideal,
        "ratio": rate / ideal,
        "serial": batch / (p + t),
        "device_busy": (busy1 - busy0) / wall,
        "mean_batch": items / max(ran1 - ran0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, for a smoke run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    batches = 30 if args.quick else 150
    server = RedisServer().start()
    results = []
    try:
        for p, t, c, batch in CASES:
            r = run_case(server.url, p, t, c, batch, batches)
            results.append(r)
            print(
                f"P={r['P_ms']:4.0f} ms  T={r['T_ms']:4.0f} ms  c={c}  batch={batch}  "
                f"{r['items_per_s']:7.0f} items/s  ideal {r['ideal']:7.0f}  "
                f"ratio {r['ratio']:.3f} (budget >= 0.9)  in series {r['serial']:6.0f}  "
                f"device busy {r['device_busy']:.3f}  mean batch {r['mean_batch']:.1f}",
                flush=True,
            )
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "pipeline": results,
                    "batches": batches,
                    "loadavg": os.getloadavg(),
                    "cores": os.cpu_count(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
