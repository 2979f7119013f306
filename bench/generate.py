"""Generation: continuous batching vs static generator batching, and the prefix cache.

    python -m bench.generate [--requests 80] [--rate 30] [--seed 0] [--repeat 3]
                             [--saturating-requests 160] [--saturating-rate 300]

One worker process (one partition; charlm sets one torch thread) serves the character-level GRU
(``tasks.charlm``) three ways: ``charlm`` (StepServing, continuous batching, prefix cache on),
``charlm_static`` (the same model and steps as a generator serving: static batching) and
``charlm_cold`` (continuous, cache off: what the mixed loads are compared with, so that only
the batching differs). All share a private redis-server.

0. The model alone, no Redis: the same requests all at once, run through the static schedule
   (batches of 16 to their longest end) and the continuous one (a sequence joins as soon as a
   slot frees), CPU seconds of this one thread: what scheduling alone can gain here; and the
   decode calls each schedule makes, with the sequences per call.
1. Mixed load, sent with the same arrivals (Poisson, ``--rate`` per second) and the same
   requests to the static serving, then to the continuous one, ``--repeat`` such pairs
   (the median pair's ratio is the figure: other work on the machine moves a pair alike,
   single runs vary widely on a shared 2-core machine): prompts of 10..200
   characters of stdlib docstrings, outputs of 4..400 characters (log-uniform: most short, a
   few long), greedy. Each request is its own ``client.stream`` caller. Reported: generated
   characters per second over the run, time to first character p50/p99, time per output
   character (mean over requests of (last - first) / (n - 1)), and the CPU each process
   (callers, worker, Redis) spent per generated character. The offered load is printed
   too: a serving that keeps up generates what arrives, so at a rate both keep up with their
   chars/s are the offered load's, not their capacity.
2. The same mix (other prompts: seed + 1), saturating: ``--saturating-requests`` arriving at
   ``--saturating-rate``, more than either serving keeps up with, so chars/s is what each can
   do.
3. Prefix cache: 60 requests sharing one 200-character prefix (a different 10..30-character
   question after it, 8 characters out), one after another, to the cold and the cached serving
   in turn (each first warmed by 22 requests with other prompts of 20..230 characters).
   charlm reads prompts inside its decode steps, so prefill time is, per request, its share of
   the decode calls up to and including the one that gave its first character (one request at
   a time: the whole of those calls), from the worker's metrics; the callers' time to first
   character, cold and cached, is printed beside it.

Budgets (issue 14): continuous >= 2x static tokens/s, TTFT p99 <= 1/3 of static's, and the
cache saves >= 80% of prefill time.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import queueserve as qs
from bench._harness import (
    CpuMeter,
    RedisServer,
    free_port,
    percentile,
    spawn_module,
    stop_process,
)
from tasks.charlm import CharLM

charlm_cold = CharLM(name="charlm_cold", prefix_cache_bytes=0)

PREFIX = "bench-generate"
SLOTS = CharLM.max_slots


@dataclass
class Sent:
    """One request's timings (perf_counter seconds)."""

    sent: float
    first: float = 0.0
    last: float = 0.0
    n: int = 0


def workload(count: int, rate: float, seed: int) -> list[tuple[float, dict[str, object]]]:
    """(arrival offset, item) pairs: prompts cut from docstrings, wide output lengths."""
    from tasks.corpus import stdlib_passages

    rng = random.Random(seed)
    texts = [p.text for p in stdlib_passages(limit=400) if len(p.text) >= 200]
    at = 0.0
    load = []
    for _ in range(count):
        at += rng.expovariate(rate)
        text = rng.choice(texts)
        prompt_len = rng.randint(10, 200)
        start = rng.randint(0, len(text) - prompt_len)
        max_new = round(4 * 100 ** rng.random())  # log-uniform over 4..400
        load.append((at, {"prompt": text[start : start + prompt_len], "max_new": max_new}))
    return load


def run_load(client: qs.Client, serving: str, load: list[tuple[float, dict[str, object]]]
             ) -> tuple[list[Sent], float]:
    """Send every request at its arrival time as a stream of its own; (timings, seconds)."""
    sent = [Sent(0.0) for _ in load]
    started = time.perf_counter()

    def one(i: int, item: dict[str, object]) -> None:
        record = sent[i]
        record.sent = time.perf_counter()
        for event in client.stream(serving, [item], timeout=600):
            if isinstance(event, qs.Output):
                now = time.perf_counter()
                if record.n == 0:
                    record.first = now
                record.last = now
                record.n += len(event.results)

    threads = []
    for i, (at, item) in enumerate(load):
        delay = started + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, item), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return sent, time.perf_counter() - started


def summarize(name: str, sent: list[Sent], seconds: float) -> dict[str, float]:
    ttft = sorted(s.first - s.sent for s in sent)
    tpot = [(s.last - s.first) / (s.n - 1) for s in sent if s.n > 1]
    tokens = sum(s.n for s in sent)
    figures = {
        "tokens_s": tokens / seconds,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot": sum(tpot) / len(tpot),
    }
    print(f"{name:<11} {tokens:>6} chars in {seconds:6.2f}s  {figures['tokens_s']:7.0f} chars/s  "
          f"TTFT p50 {1000 * figures['ttft_p50']:7.1f} ms  p99 {1000 * figures['ttft_p99']:7.1f} "
          f"ms  per output char {1000 * figures['tpot']:6.2f} ms")
    return figures


def model_alone(load: list[tuple[float, dict[str, object]]]) -> None:
    """Static vs continuous schedules of the same requests, all at once, no Redis: CPU seconds
    of one thread (steady however busy the machine; wall time is not), and what each schedule
    asks of the model: decode calls and sequences per call (a static batch's first call reads
    its 16 prompts together, one GRU position after another)."""
    import torch

    from tasks.charlm import State, StaticCharLM

    torch.set_num_threads(1)
    items = [item for _, item in load]
    static = StaticCharLM()
    static.setup(qs.Partition())
    cont = CharLM()
    cont.setup(qs.Partition())
    started = time.process_time()
    static_calls = static_rows = 0
    for b in range(0, len(items), SLOTS):
        for row in static.lm.static_steps(items[b : b + SLOTS]):
            static_calls += 1
            static_rows += sum(out is not qs.END for out in row)
    static_s = time.process_time() - started
    started = time.process_time()
    waiting: list[dict[str, object]] = list(items)
    running: list[State] = []
    cont_calls = cont_rows = 0
    while waiting or running:
        free = SLOTS - len(running)
        running += cont.prefill(waiting[:free])
        waiting = waiting[free:]
        outs = cont.decode(running)
        cont_calls, cont_rows = cont_calls + 1, cont_rows + len(running)
        running = [st for st, out in zip(running, outs, strict=True) if out is not qs.END]
    cont_s = time.process_time() - started
    chars = sum(int(str(item["max_new"])) for item in items)
    print(f"model alone, {len(items)} requests at once, CPU s of one thread: static "
          f"{static_s:.2f}s ({chars / static_s:.0f} chars/s), continuous {cont_s:.2f}s "
          f"({chars / cont_s:.0f} chars/s): {static_s / cont_s:.2f}x")
    print(f"  decode calls: static {static_calls} ({static_rows / static_calls:.1f} sequences "
          f"per call, prompts read in {len(items) // SLOTS} of them), continuous {cont_calls} "
          f"({cont_rows / cont_calls:.1f} per call)")


def offered(load: list[tuple[float, dict[str, object]]]) -> str:
    chars = sum(int(str(item["max_new"])) for _, item in load)
    return (f"{len(load)} requests over {load[-1][0]:.1f}s ({chars} chars out, offered "
            f"{chars / load[-1][0]:.0f} chars/s)")


def compare(client: qs.Client, cpu: CpuMeter, load: list[tuple[float, dict[str, object]]],
            repeat: int) -> list[tuple[dict[str, float], dict[str, float]]]:
    """``repeat`` interleaved (static, continuous) pairs: the machine's other work moves both
    of a pair alike, and the median pair's ratio is the figure. Each run also prints the CPU
    its processes spent per generated character (``cpu``: the callers, the worker with its
    partition, Redis): where the time goes, since two cores serve all three."""
    pairs = []
    for _ in range(repeat):
        runs = []
        # Continuous without the prefix cache: only the batching differs (and a load
        # repeated, or sharing prompts with an earlier one, would find them cached).
        for name, serving in (("static", "charlm_static"), ("continuous", "charlm_cold")):
            cpu.start()
            sent, seconds = run_load(client, serving, load)
            spent = cpu.stop()
            runs.append(summarize(name, sent, seconds))
            chars = sum(s.n for s in sent)
            print(f"{'':11} CPU µs per char: callers {1e6 * spent['callers'] / chars:.0f}, "
                  f"worker {1e6 * spent['worker'] / chars:.0f}, Redis "
                  f"{1e6 * spent['redis'] / chars:.0f}")
        pairs.append((runs[0], runs[1]))
    return pairs


def median_ratio(pairs: list[tuple[dict[str, float], dict[str, float]]], key: str) -> float:
    ratios = sorted(cont[key] / static[key] for static, cont in pairs)
    return ratios[len(ratios) // 2] if len(ratios) % 2 else (
        ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2


def ratios(pairs: list[tuple[dict[str, float], dict[str, float]]], key: str) -> str:
    return ", ".join(f"{cont[key] / static[key]:.2f}x" for static, cont in pairs)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def metric(text: str, name: str, serving: str) -> float:
    """The sum of ``name``'s samples for ``serving`` in a /metrics ``text``. None at all is an
    error, never 0: a metric renamed or not exported yet would print as a cost of nothing (a
    100% saving)."""
    pattern = rf'^{re.escape(name)}\{{[^}}]*serving="{re.escape(serving)}"[^}}]*\}} (\S+)$'
    values = re.findall(pattern, text, re.M)
    if not values:
        raise RuntimeError(f"the worker's /metrics has no sample of {name} for serving "
                           f"{serving!r}: renamed, or not exported yet? Nothing is measured "
                           "without it")
    return sum(float(v) for v in values)


def cache_run(client: qs.Client, port: int, seed: int, count: int = 60) -> None:
    from tasks.corpus import stdlib_passages

    rng = random.Random(seed)
    long_texts = [p.text for p in stdlib_passages(limit=400) if len(p.text) >= 200]
    prefix = rng.choice(long_texts)[:200]
    questions = [" " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ")
                               for _ in range(rng.randint(10, 30))) for _ in range(count)]
    others = [t for t in long_texts if not t.startswith(prefix)]
    servings = ("charlm_cold", "charlm")
    for serving in servings:
        # Both servings warmed alike first (prompts of every length, none sharing the prefix):
        # first calls of new shapes cost more, and would be charged to whichever runs first.
        for length in range(20, 240, 10):
            client.dispatch(serving, {"prompt": rng.choice(others)[:length], "max_new": 8},
                            timeout=60)
    time.sleep(1.5)  # the worker's metrics files are read by the supervisor per scrape
    text = scrape(port)
    before = {s: metric(text, "queueserve_prefill_seconds_total", s) for s in servings}
    ttft: dict[str, list[float]] = {s: [] for s in servings}
    for q in questions:  # interleaved: a change in the machine's load moves both alike
        for serving in servings:
            sent, first = time.perf_counter(), 0.0
            for event in client.stream(serving, [{"prompt": prefix + q, "max_new": 8}],
                                       timeout=60):
                if isinstance(event, qs.Output) and not first:
                    first = time.perf_counter()
            ttft[serving].append(first - sent)
    time.sleep(1.5)
    text = scrape(port)
    seconds = {s: metric(text, "queueserve_prefill_seconds_total", s) - before[s]
               for s in servings}
    hits = metric(text, "queueserve_prefix_cache_lookups_total", "charlm")
    saved = metric(text, "queueserve_prefix_cache_saved_tokens_total", "charlm")
    cold, warm = seconds["charlm_cold"], seconds["charlm"]
    print(f"prefix cache: {count} requests sharing a 200-character prefix, one after another")
    print(f"  prefill without cache {1000 * cold / count:6.2f} ms/request, with cache "
          f"{1000 * warm / count:6.2f} ms/request: {100 * (1 - warm / cold):.0f}% saved "
          f"({hits:.0f} lookups, {saved:.0f} prompt characters not recomputed)")
    print(f"  time to first character (caller's view) p50: without cache "
          f"{1000 * percentile(sorted(ttft['charlm_cold']), 50):.2f} ms, with cache "
          f"{1000 * percentile(sorted(ttft['charlm']), 50):.2f} ms")
    print(f"  budget: >= 80% saved: {'met' if warm <= 0.2 * cold else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=30.0, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--saturating-requests", type=int, default=160)
    parser.add_argument("--saturating-rate", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=3,
                        help="interleaved static/continuous pairs per load (the median counts)")
    args = parser.parse_args()
    load = workload(args.requests, args.rate, args.seed)
    saturating = workload(args.saturating_requests, args.saturating_rate, args.seed + 1)
    model_alone(saturating)
    port = free_port()
    specs = ["tasks.charlm:charlm", "tasks.charlm:charlm_static", "bench.generate:charlm_cold"]
    with charlm_worker(specs, ["charlm", "charlm_static", "charlm_cold"],
                       "--metrics-port", str(port)) as (client, worker, redis_server):
        assert redis_server.proc is not None
        cpu = CpuMeter({"callers": os.getpid(), "worker": worker.pid,
                        "redis": redis_server.proc.pid}, trees=frozenset({"worker"}))
        print(f"mixed load: {offered(load)}; {SLOTS} slots / batch size, prompts 10..200 "
              f"chars, outputs 4..400 chars (log-uniform); {args.repeat} pairs")
        pairs = compare(client, cpu, load, args.repeat)
        ttft = median_ratio(pairs, "ttft_p99")
        print(f"continuous / static: chars/s {ratios(pairs, 'tokens_s')}; TTFT p99 "
              f"{ratios(pairs, 'ttft_p99')} of static's: median {ttft:.2f}x (budget <= 0.33x: "
              f"{'met' if ttft <= 1 / 3 else 'NOT met'})")
        print(f"saturating: {offered(saturating)}; {args.repeat} pairs")
        pairs = compare(client, cpu, saturating, args.repeat)
        speedup = median_ratio(pairs, "tokens_s")
        print(f"continuous / static: chars/s {ratios(pairs, 'tokens_s')}: median "
              f"{speedup:.2f}x (budget >= 2x: {'met' if speedup >= 2 else 'NOT met'}); TTFT "
              f"p99 {ratios(pairs, 'ttft_p99')} of static's")
        cache_run(client, port, args.seed)


@contextmanager
def charlm_worker(
    specs: Sequence[str], names: Sequence[str], *worker_args: str
) -> Iterator[tuple[qs.Client, subprocess.Popen[bytes], RedisServer]]:
    """A private redis-server, one worker process (one partition) serving ``specs``
    (module:attr), and a client under PREFIX, with the servings ``names`` loaded and
    answering; all stopped on the way out."""
    redis_server = RedisServer().start()
    worker = spawn_module("queueserve", "worker", *specs, "--redis-url", redis_server.url,
                          "--prefix", PREFIX, "--partitions", "1", *worker_args)
    client = qs.Client(redis_server.url, prefix=PREFIX)
    try:
        for name in names:
            client.dispatch(name, {"prompt": "warm up", "max_new": 4}, timeout=120)
        yield client, worker, redis_server
    finally:
        client.close()
        stop_process(worker, timeout=30)
        redis_server.stop()


if __name__ == "__main__":
    main()
