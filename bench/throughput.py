"""Throughput and round-trip benchmark of queueserve against a hand-written redis-py loop.

    python -m bench.throughput [--quick] [--json out.json] [--profile DIR] [--only rt]

Everything is measured in one run, on one private ``redis-server`` (loopback, no persistence),
so the ratios of docs/design.md §8 compare like with like on a shared, noisy machine:

1. ``baseline``: the hand-written loop of ``bench/baseline.py``; 8 caller threads, each sending
   windows of 512 items as one XADD pipeline and waiting for each item. This is the reference
   of the single-item budget (submit window >= 1.0x, issue 39).
2. ``single-item``: the no-op serving ``bench.servings:noop`` (batch_size 256, batch_timeout 0)
   in a ``queueserve worker`` process; in this process one ``qs.Client`` and
   ``submit-window``: 8 threads, each submitting 512 one-item tickets, then collecting them;
   ``dispatch-64``: 64 threads, each calling ``dispatch`` one item at a time, held to the
   hand-written loop in the same shape (64 threads, one XADD and a wait per item);
   ``dispatch-async-64``: 64 coroutines of one event loop, each awaiting ``AsyncClient.dispatch``
   one item at a time, held to the hand-written ``redis.asyncio`` loop in the same shape.
3. ``packed``: ``client.map(noop, range(N), chunk_size=256)``, for several ``max_in_flight``.
4. ``round trip``: one ``dispatch`` at a time against an idle worker, next to one XADD + BLPOP
   of the hand-written loop, alternating blocks of 250 calls; p50/p99 after a warm-up.

Throughput runs are repeated (interleaved: baseline, then queueserve) and the median is the
figure. Per run, CPU seconds of this process, the consumer (with its children) and
redis-server are recorded per item, and Redis's commandstats tell how many items each enqueue
call, read and reply carried. ``--profile DIR`` adds py-spy recordings of the worker and of
this process during extra single-item runs (not timed); ``python -m bench.profile_summary
DIR/*.txt`` summarises them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import redis

import queueserve as qs

from ._harness import (
    REPO_ROOT,
    CpuMeter,
    GcClock,
    Rate,
    RedisServer,
    RunTimeMeter,
    percentile,
    spawn_module,
    stop_process,
    wait_until,
)
from .baseline import AsyncBaselineClient, BaselineClient

PREFIX = "qsbench"
SERVING = "noop"
BASELINE_STREAM = "bl:stream"

# Issue 39's targets (docs/design.md §8), each against the loop's figure in the same run: the
# machines are shared, so an absolute time says more about the neighbours than the code.
BUDGET_SUBMIT_RATIO = 1.0  # submit window, x the hand-written loop
BUDGET_DISPATCH_RATIO = 0.8  # dispatch from 64 threads, x the loop in that shape
BUDGET_ASYNC_RATIO = 1.0  # dispatch from 64 coroutines, x the redis.asyncio loop in that shape
BUDGET_KEEP_RATIO = 0.85  # submit with keep (a job) against plain submit, same shape
BUDGET_PACKED = 550_000
BUDGET_RT_P50_RATIO = 1.3  # an idle dispatch's round trip, x the loop's XADD + BLPOP
BUDGET_RT_P99_RATIO = 1.2
PROFILE_RATE = 250
SECTIONS = ("single", "packed", "rt")
T = TypeVar("T")
WAIT_S = 60.0  # a result that takes longer means the benchmark is broken: fail, never hang
# Commands queueserve only ever calls from its Lua scripts (counted inside EVALSHA's time).
SCRIPT_INNER = frozenset(
    {"xadd", "xack", "xdel", "sadd", "incrby", "decrby", "get", "hget", "xpending"}
)


# -- load shapes ----------------------------------------------------------------------------------
def run_threads(count: int, body: Callable[[int], None]) -> float:
    """Run ``body(i)`` in ``count`` threads released together; wall seconds until all finish."""
    start = threading.Barrier(count + 1)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        start.wait()
        try:
            body(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def shares(n: int, count: int) -> list[range]:
    """``range(n)`` cut into ``count`` contiguous parts."""
    step = -(-n // count)
    return [range(i * step, min(n, (i + 1) * step)) for i in range(count)]


def check(results: list[Any], expected: range) -> None:
    if not expected:
        return
    if len(results) != len(expected) or results[0] != expected[0] or results[-1] != expected[-1]:
        raise AssertionError(f"wrong results for items {expected}: {results[:3]}...")


def baseline_windows(client: BaselineClient, n: int, threads: int, window: int) -> float:
    parts = shares(n, threads)

    def body(i: int) -> None:
        part = parts[i]
        for lo in range(part.start, part.stop, window):
            items = range(lo, min(part.stop, lo + window))
            check([w.wait() for w in client.submit_window(items)], items)

    return run_threads(threads, body)


def baseline_dispatch(client: BaselineClient, n: int, threads: int) -> float:
    parts = shares(n, threads)

    def body(i: int) -> None:
        part = parts[i]
        check([client.dispatch(x) for x in part], part)

    return run_threads(threads, body)


def qs_windows(
    client: qs.Client, n: int, threads: int, window: int, keep: float | None = None
) -> float:
    """``keep``: each ticket a job, whose answer stays in Redis (docs/usage.md, "Jobs")."""
    parts = shares(n, threads)

    def body(i: int) -> None:
        part = parts[i]
        for lo in range(part.start, part.stop, window):
            items = range(lo, min(part.stop, lo + window))
            tickets = [client.submit(SERVING, [x], keep=keep) for x in items]
            check([t.result(WAIT_S)[0] for t in tickets], items)

    return run_threads(threads, body)


def qs_dispatch(client: qs.Client, n: int, threads: int) -> float:
    parts = shares(n, threads)

    def body(i: int) -> None:
        part = parts[i]
        check([client.dispatch(SERVING, x, timeout=WAIT_S) for x in part], part)

    return run_threads(threads, body)


async def dispatch_from_tasks(
    dispatch: Callable[[int], Awaitable[Any]], n: int, tasks: int
) -> float:
    """``tasks`` coroutines, each awaiting ``dispatch`` one item at a time; wall seconds."""
    parts = shares(n, tasks)

    async def body(part: range) -> None:
        check([await dispatch(x) for x in part], part)

    t0 = time.perf_counter()
    await asyncio.gather(*(body(part) for part in parts))
    return time.perf_counter() - t0


def qs_map(client: qs.Client, n: int, chunk_size: int, max_in_flight: int) -> float:
    t0 = time.perf_counter()
    count = last = 0
    for result in client.map(
        SERVING, range(n), chunk_size=chunk_size, max_in_flight=max_in_flight, timeout=WAIT_S
    ):
        count += 1
        last = result
    elapsed = time.perf_counter() - t0
    if count != n or last != n - 1:
        raise AssertionError(f"map returned {count} results ending in {last}, wanted {n}")
    return elapsed


def round_trips(call: Callable[[int], Any], n: int, warmup: int) -> list[float]:
    """Seconds of ``n`` sequential calls, after ``warmup`` untimed ones; sorted."""
    for i in range(warmup):
        call(i)
    times = []
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        result = call(i)
        times.append(clock() - t0)
        if result != i:
            raise AssertionError(f"round trip {i} returned {result!r}")
    times.sort()
    return times


def interleaved_round_trips(
    calls: dict[str, tuple[Callable[[int], Any], RunTimeMeter]],
    n: int,
    warmup: int,
    block: int = 250,
) -> dict[str, tuple[list[float], dict[str, float]]]:
    """``round_trips`` of each call, alternating blocks of ``block`` calls, so that noise from
    other processes on the machine falls on all of them alike; per name, the sorted seconds
    and the CPU seconds its meter's processes spent in its blocks (summed)."""
    out: dict[str, tuple[list[float], dict[str, float]]] = {name: ([], {}) for name in calls}
    for call, _ in calls.values():
        round_trips(call, warmup, 0)
    for start in range(0, n, block):
        for name, (call, meter) in calls.items():
            times, cpu = out[name]
            meter.start()
            times += round_trips(call, min(block, n - start), 0)
            for process, seconds in meter.stop().items():
                cpu[process] = cpu.get(process, 0.0) + seconds
    for times, _ in out.values():
        times.sort()
    return out


def redis_calls(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and µs per command since the last CONFIG RESETSTAT (script-internal calls too)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in stats.items()}


def per_item(calls: dict[str, tuple[int, int]], items: int) -> dict[str, float]:
    """Where Redis time goes per item, and how many items each round trip carried.

    enqueue.lua SADDs once per call and stream, so queueserve's enqueue calls = SADD calls;
    replies = RPUSH calls (one per client and batch); reads = XREADGROUP calls (empty ones too).
    ``redis_exec_us`` counts top-level commands only: an EVALSHA's time includes the commands its
    script calls, which commandstats lists again under their own names (``us_xadd`` ...).
    """

    def count(cmd: str) -> int:
        return calls.get(cmd, (0, 0))[0]

    scripted = SCRIPT_INNER if "evalsha" in calls else frozenset()
    top_level = sum(us for cmd, (_, us) in calls.items() if cmd not in scripted)
    out = {"redis_exec_us": top_level / items}
    for label, cmd in (
        ("per_enqueue_call", "sadd"),
        ("per_read", "xreadgroup"),
        ("per_reply", "rpush"),
    ):
        if count(cmd):
            out[f"items_{label}"] = items / count(cmd)
    out |= {f"us_{cmd}": us / items for cmd, (_, us) in calls.items() if us / items >= 0.05}
    return out


# -- the run --------------------------------------------------------------------------------------
class Bench:
    """The processes of one benchmark run and the measurements taken on them."""

    def __init__(self, quick: bool, repeats: int) -> None:
        scale = 10 if quick else 1
        self.n_single = 200_000 // scale
        self.n_packed = 2_000_000 // scale
        self.n_rt = 5_000 // scale
        self.rt_warmup = 500 // scale
        self.repeats = repeats
        self.max_in_flight = (4, 16, 64)
        self.results: dict[str, Any] = {}
        self.server = RedisServer().start()
        self.url = self.server.url
        self.worker = spawn_module(
            "queueserve",
            "worker",
            "bench.servings:noop",
            "--redis-url",
            self.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "WARNING",
        )
        self.consumer = spawn_module("bench.baseline", self.url, BASELINE_STREAM)
        self.redis = redis.Redis.from_url(self.url)
        workers_key = f"{PREFIX}:{{{SERVING}}}:workers"
        wait_until(lambda: self.redis.zcard(workers_key) > 0, 30, "the queueserve worker")
        wait_until(lambda: self._has_group(BASELINE_STREAM), 30, "the baseline consumer")
        self.client = qs.Client(self.url, prefix=PREFIX)
        self.baseline = BaselineClient(self.url, BASELINE_STREAM)
        # An event loop that runs for the whole benchmark, as an asyncio service's does: the
        # clients' reader tasks keep reading between runs.
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(
            target=self.loop.run_forever, name="bench-asyncio", daemon=True
        )
        self.loop_thread.start()
        self.aclient, self.abaseline = self.in_loop(self._async_clients())
        assert self.server.proc is not None
        self.pids = {"bench": os.getpid(), "redis": self.server.proc.pid}

    async def _async_clients(self) -> tuple[qs.AsyncClient, AsyncBaselineClient]:
        return (
            qs.AsyncClient(self.url, prefix=PREFIX),
            AsyncBaselineClient(self.url, BASELINE_STREAM),
        )

    def in_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def async_dispatch(self, n: int) -> float:
        dispatch = functools.partial(self.aclient.dispatch, SERVING, timeout=WAIT_S)
        return self.in_loop(dispatch_from_tasks(dispatch, n, 64))

    def async_baseline_dispatch(self, n: int) -> float:
        return self.in_loop(dispatch_from_tasks(self.abaseline.dispatch, n, 64))

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=5)
        self.loop.close()

    def _has_group(self, stream: str) -> bool:
        try:
            return bool(self.redis.xinfo_groups(stream))
        except redis.ResponseError:
            return False

    def close(self) -> None:
        for closer in (
            self.client.close,
            self.baseline.close,
            self.redis.close,
            lambda: self.in_loop(self.aclient.aclose()),
            lambda: self.in_loop(self.abaseline.close()),
            self._stop_loop,
        ):
            try:
                closer()
            except Exception as e:  # keep stopping the processes
                print(f"warning: {e!r}", file=sys.stderr)
        stop_process(self.worker)
        stop_process(self.consumer)
        self.server.stop()

    def meter(self, consumer: subprocess.Popen[bytes]) -> CpuMeter:
        return CpuMeter({**self.pids, "consumer": consumer.pid}, trees=frozenset({"consumer"}))

    def run_time_meter(self, consumer: subprocess.Popen[bytes]) -> RunTimeMeter:
        pids = {**self.pids, "consumer": consumer.pid}
        return RunTimeMeter(pids, trees=frozenset({"consumer"}))

    def timed(
        self, name: str, consumer: subprocess.Popen[bytes], items: int, run: Callable[[], float]
    ) -> None:
        """One measured run: items/s, and CPU µs per item of each process."""
        if consumer.poll() is not None:
            raise RuntimeError(f"{consumer.args!r} exited with code {consumer.returncode}")
        meter = self.meter(consumer)
        self.redis.config_resetstat()
        collections = GcClock()
        meter.start()
        collections.start()
        seconds = run()
        cpu = {**meter.stop(), "bench_gc": collections.stop()}
        calls = redis_calls(self.redis)
        entry = self.results.setdefault(
            name, {"runs": [], "cpu_us_per_item": [], "redis_per_item": []}
        )
        entry["runs"].append(items / seconds)
        entry["cpu_us_per_item"].append({k: v * 1e6 / items for k, v in cpu.items()})
        entry["redis_per_item"].append(per_item(calls, items))
        entry["redis_calls_last_run"] = {cmd: c for cmd, (c, _) in sorted(calls.items())}

    def warm_up(self) -> None:
        n = max(2_000, self.n_single // 20)
        baseline_windows(self.baseline, n, 8, 512)
        baseline_dispatch(self.baseline, n, 64)
        qs_windows(self.client, n, 8, 512)
        qs_dispatch(self.client, n, 64)
        self.async_baseline_dispatch(n)
        self.async_dispatch(n)
        qs_map(self.client, n * 4, 256, 16)

    def single_item(self) -> None:
        n = self.n_single
        k = n // 4  # one call per item in flight: the dispatch shapes are slow, a quarter
        bl, w = self.consumer, self.worker
        for _ in range(self.repeats):
            self.timed("baseline", bl, n, lambda: baseline_windows(self.baseline, n, 8, 512))
            self.timed("qs_submit_window", w, n, lambda: qs_windows(self.client, n, 8, 512))
            self.timed(
                "qs_submit_keep_window", w, n, lambda: qs_windows(self.client, n, 8, 512, 60)
            )
            self.timed("qs_dispatch_64", w, n, lambda: qs_dispatch(self.client, n, 64))
            self.timed(
                "baseline_dispatch_64", bl, k, lambda: baseline_dispatch(self.baseline, k, 64)
            )
            self.timed("baseline_dispatch_async_64", bl, k, lambda: self.async_baseline_dispatch(k))
            self.timed("qs_dispatch_async_64", w, k, lambda: self.async_dispatch(k))

    def packed(self) -> None:
        n = self.n_packed
        for _ in range(self.repeats):
            for m in self.max_in_flight:
                self.timed(
                    f"qs_map_256_mif{m}", self.worker, n, lambda m=m: qs_map(self.client, n, 256, m)
                )  # type: ignore[misc]

    def round_trip(self) -> None:
        time.sleep(0.5)  # let the worker go idle
        # Each round trip runs one process after another (caller, Redis, consumer, Redis,
        # caller), so its latency is close to the CPU they spend on it: the split says where
        # queueserve's extra time over the loop goes.
        rts = interleaved_round_trips(
            {
                "rt_qs": (
                    lambda i: self.client.dispatch(SERVING, i, timeout=WAIT_S),
                    self.run_time_meter(self.worker),
                ),
                "rt_baseline": (self.baseline.call, self.run_time_meter(self.consumer)),
            },
            self.n_rt,
            self.rt_warmup,
        )
        for name, (times, cpu) in rts.items():
            self.results[name] = (
                {f"p{q}_ms": round(percentile(times, q) * 1e3, 4) for q in (50, 90, 99, 99.9)}
                | {"mean_ms": round(sum(times) / len(times) * 1e3, 4), "calls": len(times)}
                | {
                    "run_us_per_call": {
                        process: round(seconds * 1e6 / len(times), 1)
                        for process, seconds in cpu.items()
                    }
                }
            )

    def profile(self, directory: Path) -> None:
        """py-spy the worker (its partition process) and this process while single-item runs
        repeat (not timed). ``--gil`` samples only the thread holding the GIL, so a file's
        shares are of the process's Python CPU time, and its sample count over
        ``PROFILE_RATE`` x seconds is how busy the GIL was."""
        directory.mkdir(parents=True, exist_ok=True)
        n = self.n_single
        shapes: dict[str, Callable[[], float]] = {
            "submit_window": lambda: qs_windows(self.client, n, 8, 512),
            "submit_keep_window": lambda: qs_windows(self.client, n, 8, 512, 60),
            "dispatch_64": lambda: qs_dispatch(self.client, n, 64),
        }
        spy = str(Path(sys.executable).parent / "py-spy")
        seconds: dict[str, float] = {}
        for shape, run in shapes.items():
            targets: list[tuple[str, int, list[str]]] = [
                ("worker", self.worker.pid, ["--subprocesses"]),  # the partition is a child
                ("client", os.getpid(), []),
            ]
            spies = [
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        str(PROFILE_RATE),
                        "--format",
                        "raw",
                        "--threads",
                        "--gil",
                        "--nonblocking",
                        *extra,
                        "-o",
                        str(directory / f"{who}_{shape}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for who, pid, extra in targets
            ]
            time.sleep(1.0)  # attach
            t0 = time.perf_counter()
            for _ in range(2):
                run()
            seconds[shape] = time.perf_counter() - t0
            for p in spies:
                p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            for p in spies:
                p.wait(timeout=30)
        meta = {"rate_hz": PROFILE_RATE, "seconds": seconds, "items_per_shape": 2 * n}
        (directory / "profile.json").write_text(json.dumps(meta, indent=2) + "\n")


# -- reporting ------------------------------------------------------------------------------------
def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for run in runs for k in run})
    return {k: round(statistics.median(run.get(k, 0.0) for run in runs), 2) for k in keys}


def summarise(bench: Bench) -> dict[str, Any]:
    res = bench.results
    out: dict[str, Any] = {}
    for name, entry in res.items():
        if "runs" not in entry:
            out[name] = entry
            continue
        out[name] = Rate(entry["runs"]).as_json() | {
            "cpu_us_per_item": medians(entry["cpu_us_per_item"]),
            "redis_per_item": medians(entry["redis_per_item"]),
            "redis_calls_last_run": entry["redis_calls_last_run"],
        }
    if "baseline" in out:
        base = out["baseline"]["median"]
        for name in ("qs_submit_window", "qs_dispatch_64", "qs_submit_keep_window"):
            out[name]["ratio_to_baseline"] = round(out[name]["median"] / base, 3)
        out["qs_submit_keep_window"]["ratio_to_submit"] = round(
            out["qs_submit_keep_window"]["median"] / out["qs_submit_window"]["median"], 3
        )
        for shape in ("dispatch_64", "dispatch_async_64"):
            out[f"qs_{shape}"][f"ratio_to_baseline_{shape}"] = round(
                out[f"qs_{shape}"]["median"] / out[f"baseline_{shape}"]["median"], 3
            )
    return out


def checks(out: dict[str, Any], max_in_flight: tuple[int, ...]) -> dict[str, bool]:
    """docs/design.md §8 budgets, for the sections that ran."""
    ok: dict[str, bool] = {}
    if "baseline" in out:
        ok[f"submit window >= {BUDGET_SUBMIT_RATIO}x the loop"] = (
            out["qs_submit_window"]["ratio_to_baseline"] >= BUDGET_SUBMIT_RATIO
        )
        ok[f"submit with keep >= {BUDGET_KEEP_RATIO}x submit"] = (
            out["qs_submit_keep_window"]["ratio_to_submit"] >= BUDGET_KEEP_RATIO
        )
        # 64 blocking callers keep 64 requests in flight, the windowed loop 4,096: the
        # dispatch shapes are held to the loop in that same shape.
        for shape, budget in (
            ("dispatch_64", BUDGET_DISPATCH_RATIO),
            ("dispatch_async_64", BUDGET_ASYNC_RATIO),
        ):
            ok[f"qs_{shape} >= {budget}x the loop in its shape"] = (
                out[f"qs_{shape}"][f"ratio_to_baseline_{shape}"] >= budget
            )
    if "qs_map_256_mif16" in out:
        best = max(out[f"qs_map_256_mif{m}"]["median"] for m in max_in_flight)
        ok[f"packed (default max_in_flight) >= {BUDGET_PACKED:,}/s"] = (
            out["qs_map_256_mif16"]["median"] >= BUDGET_PACKED
        )
        ok[f"packed (best max_in_flight) >= {BUDGET_PACKED:,}/s"] = best >= BUDGET_PACKED
    if "rt_qs" in out:
        for q, budget in (("p50", BUDGET_RT_P50_RATIO), ("p99", BUDGET_RT_P99_RATIO)):
            ratio = out["rt_qs"][f"{q}_ms"] / out["rt_baseline"][f"{q}_ms"]
            ok[f"round trip {q} <= {budget}x the loop's ({ratio:.2f}x)"] = ratio <= budget
    return ok


def _cpu(out: dict[str, Any], name: str) -> str:
    c = out[name]["cpu_us_per_item"]
    return f"{c['bench']:6.1f} ({c['bench_gc']:4.1f}) {c['consumer']:6.1f} {c['redis']:5.1f}"


def _rate(out: dict[str, Any], name: str) -> str:
    r = out[name]
    return f"{r['median']:>10,.0f}  [{r['min']:>9,.0f} .. {r['max']:>9,.0f}]"


def _throughput_lines(out: dict[str, Any], max_in_flight: tuple[int, ...]) -> list[str]:
    lines = [
        "throughput (items/s, median [min .. max])      CPU µs/item: client (its GC) worker redis"
    ]
    if "baseline" in out:
        lines.append(
            f"  {'baseline (hand-written, 8 thr x 512)':<37}  {_rate(out, 'baseline')}"
            f"   {_cpu(out, 'baseline')}"
        )
        for name, label in (
            ("qs_submit_window", "submit, 8 thr x 512 window"),
            ("qs_submit_keep_window", "submit keep=60 (jobs), same shape"),
            ("qs_dispatch_64", "dispatch, 64 threads"),
        ):
            ratio = out[name]["ratio_to_baseline"]
            lines.append(
                f"  {label:<37}  {_rate(out, name)}   {_cpu(out, name)}   {ratio:.2f}x baseline"
            )
        ratio = out["qs_dispatch_64"]["ratio_to_baseline_dispatch_64"]
        lines.append(
            f"  {'baseline, 64 thr x 1 XADD':<37}  "
            f"{_rate(out, 'baseline_dispatch_64')}   "
            f"{_cpu(out, 'baseline_dispatch_64')}   (dispatch-64 = {ratio:.2f}x this)"
        )
        ratio = out["qs_dispatch_async_64"]["ratio_to_baseline_dispatch_async_64"]
        lines.append(
            f"  {'baseline, 64 coroutines x 1 XADD':<37}  "
            f"{_rate(out, 'baseline_dispatch_async_64')}   "
            f"{_cpu(out, 'baseline_dispatch_async_64')}"
        )
        lines.append(
            f"  {'dispatch, 64 coroutines (asyncio)':<37}  "
            f"{_rate(out, 'qs_dispatch_async_64')}   "
            f"{_cpu(out, 'qs_dispatch_async_64')}   {ratio:.2f}x the line above"
        )
    for m in max_in_flight:
        name = f"qs_map_256_mif{m}"
        if name in out:
            label = f"map chunk 256, max_in_flight {m}"
            lines.append(f"  {label:<37}  {_rate(out, name)}   {_cpu(out, name)}")
    lines.append(
        "round trips carried (items per ...)   enqueue call    read   reply   Redis exec µs/item"
    )
    for name in (
        "baseline",
        "qs_submit_window",
        "qs_dispatch_64",
        "baseline_dispatch_64",
        "qs_dispatch_async_64",
        "baseline_dispatch_async_64",
        "qs_map_256_mif16",
    ):
        if name not in out:
            continue
        r = out[name]["redis_per_item"]
        enq = r.get("items_per_enqueue_call")
        lines.append(
            f"  {name:<36} {'-' if enq is None else f'{enq:,.1f}':>12}"
            f"  {r.get('items_per_read', 0):6.1f}  {r.get('items_per_reply', 0):6.1f}"
            f"   {r['redis_exec_us']:6.2f}"
        )
    return lines


def table(out: dict[str, Any], ok: dict[str, bool], max_in_flight: tuple[int, ...]) -> str:
    lines = []
    if any("runs" in v for v in out.values()):
        lines += _throughput_lines(out, max_in_flight)
    if "rt_qs" in out:
        lines.append(
            "round trip (ms)            p50     p90     p99   p99.9"
            "   CPU µs per call: caller consumer redis"
        )
        for name, label in (("rt_qs", "queueserve dispatch"), ("rt_baseline", "XADD + BLPOP")):
            r = out[name]
            cpu = r.get("run_us_per_call", {})  # (absent from files written before it)
            split = "  ".join(f"{cpu.get(p, 0):6.1f}" for p in ("bench", "consumer", "redis"))
            lines.append(
                f"  {label:<22} {r['p50_ms']:6.3f}  {r['p90_ms']:6.3f}"
                f"  {r['p99_ms']:6.3f}  {r['p99.9_ms']:6.3f}                    {split}"
            )
    lines.append("budgets (docs/design.md §8, issue 39)")
    lines += [f"  [{'ok' if passed else 'MISS'}] {name}" for name, passed in ok.items()]
    return "\n".join(lines)


def machine(bench: Bench) -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_server": bench.server.version(),
        "redis_py": redis.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "loadavg_at_start": os.getloadavg(),
        "git": git_state(),
    }


def git_state() -> str:
    """The commit measured, marked dirty when queueserve/ has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "queueserve") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10x fewer items (smoke run)")
    parser.add_argument(
        "--repeats", type=int, help="runs per throughput figure (default 3, 1 with --quick)"
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="also py-spy the worker and client during single-item runs",
    )
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="run only this section (repeatable); default: all",
    )
    args = parser.parse_args(argv)
    sections = args.only or list(SECTIONS)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    bench = Bench(args.quick, repeats)
    try:
        info = machine(bench)
        bench.warm_up()
        if "single" in sections:
            bench.single_item()
        if "packed" in sections:
            bench.packed()
        if "rt" in sections:
            bench.round_trip()
        if args.profile:
            bench.profile(args.profile)
    finally:
        bench.close()
    out = summarise(bench)
    ok = checks(out, bench.max_in_flight)
    print(table(out, ok, bench.max_in_flight))
    print(
        f"({time.perf_counter() - started:.0f} s, {info['cores']} cores, {info['git']}, "
        f"Redis {info['redis_server']}, loadavg at start {info['loadavg_at_start'][0]:.2f})"
    )
    if args.json:
        doc = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": info,
            "params": {
                "quick": args.quick,
                "repeats": repeats,
                "sections": sections,
                "single_items": bench.n_single,
                "packed_items": bench.n_packed,
                "round_trips": bench.n_rt,
            },
            "results": out,
            "budgets": ok,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
