"""queueserve next to the systems users choose between: one item per call, Redis as broker.

    scripts/bench-peers                       # makes .venv-peers, then runs the line below
    python -m bench.peers --docs              # measure all, write docs/img/peers.png + the table
    python -m bench.peers --quick --only rq   # a smoke run of some systems (no chart unless --png)
    python -m bench.peers --from-json r.json --png out.png   # redraw from a saved run

Every system gets the same two measurements (bench/peers_runners/_measure.py), each on a
private redis-server of its own, started and stopped here:

- items/s for one item per call with many calls in flight: one producer makes ``--window``
  calls, fetches every result, then the next window;
- p50/p99 of one call on an idle system (one call at a time).

queueserve (single-item ``submit``, and the packed ``map`` as a separate bar) and the
hand-written redis-py loop of bench/baseline.py run in this process; Celery (solo and prefork
pools), celery-batches, arq and rq (default and SimpleWorker) each run in a subprocess of
``.venv-peers``'s python (their pins clash with queueserve's venv), which starts the peer's
worker, measures, stops the worker and prints one JSON line. A runner that outlives its time
bound is killed with every process under it. The work is the identity function on a small int
everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ._harness import REPO_ROOT, RedisServer, process_tree, spawn_module, stop_process, wait_until
from .peers_runners import _measure

PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
CHART = REPO_ROOT / "docs" / "img" / "peers.png"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"
COMMAND = "scripts/bench-peers"
PREFIX = "qspeers"
SERVING = "noop"
LOOP_STREAM = "bl:stream"
GRACE_S = 60.0  # beyond a runner's two measurement bounds: startup, warm-up, worker shutdown


@dataclass(frozen=True)
class System:
    key: str
    label: str
    runner: str = ""  # module run by .venv-peers's python; empty: measured in this process
    variant: str = ""


SYSTEMS = (
    System("queueserve", "queueserve submit"),
    System("queueserve-map", "queueserve map (256/request)"),
    System("loop", "hand-written redis-py loop"),
    System("celery-solo", "Celery (solo pool)", "bench.peers_runners.celery_runner", "solo"),
    System(
        "celery-prefork", "Celery (prefork pool)", "bench.peers_runners.celery_runner", "prefork"
    ),
    System("celery-batches", "celery-batches", "bench.peers_runners.celery_runner", "batches"),
    System("arq", "arq", "bench.peers_runners.arq_runner"),
    System("rq", "rq (default worker, fork per job)", "bench.peers_runners.rq_runner", "fork"),
    System("rq-simple", "rq (SimpleWorker)", "bench.peers_runners.rq_runner", "simple"),
)
KEYS = tuple(s.key for s in SYSTEMS)


# -- measuring ------------------------------------------------------------------------------------
def measure_queueserve(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The no-op serving (batch_size 256, batch_timeout 0) in one ``queueserve worker``."""
    import queueserve as qs

    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.servings:noop",
        "--redis-url",
        url,
        "--prefix",
        PREFIX,
        "--log-level",
        "WARNING",
    )
    client: qs.Client | None = None
    try:
        import redis

        probe = redis.Redis.from_url(url)
        try:
            wait_until(
                lambda: probe.zcard(f"{PREFIX}:{{{SERVING}}}:workers") > 0,
                30,
                "the queueserve worker to register",
            )
        finally:
            probe.close()
        client = qs.Client(url, prefix=PREFIX)
        c = client

        def run_window(part: range) -> list[Any]:
            tickets = [c.submit(SERVING, [x], timeout=_measure.WAIT_S) for x in part]
            return [t.result(_measure.WAIT_S)[0] for t in tickets]

        def run_map(part: range) -> list[Any]:
            return list(c.map(SERVING, part, chunk_size=256, timeout=_measure.WAIT_S))

        def call(x: int) -> Any:
            return c.dispatch(SERVING, x, timeout=_measure.WAIT_S)

        run_window(range(args.window * 4))  # warm-up
        versions = {"queueserve": metadata.version("queueserve"), "redis": redis.__version__}
        meter = _measure.cpu_meter(url, worker.pid)
        single = _measure.rate(
            run_window, args.fast_items, args.window, args.repeats, args.seconds, meter
        )
        packed = _measure.rate(
            run_map, args.map_items, args.map_items, args.repeats, args.seconds, meter
        )
        lat = _measure.latency(call, args.rt_calls, args.rt_warmup, args.seconds)
        if worker.poll() is not None:
            raise RuntimeError(f"the queueserve worker exited with code {worker.returncode}")
    finally:
        if client is not None:
            client.close()
        stop_process(worker)
    return [
        {
            "key": "queueserve",
            "versions": versions,
            **single,
            **lat,
            "setup": "one worker, noop serving, batch_size 256, batch_timeout 0; one submit per "
            "item",
        },
        {
            "key": "queueserve-map",
            "versions": versions,
            **packed,
            "setup": f"client.map over {args.map_items:,} items, chunk_size 256, max_in_flight 16",
        },
    ]


def measure_loop(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """bench/baseline.py: XADD per item, a consumer process replying per (client, batch)."""
    import hiredis
    import msgpack
    import redis

    from .baseline import BaselineClient

    consumer = spawn_module("bench.baseline", url, LOOP_STREAM)
    client: BaselineClient | None = None
    try:
        probe = redis.Redis.from_url(url)
        try:
            wait_until(lambda: probe.exists(LOOP_STREAM), 30, "the baseline consumer's group")
        finally:
            probe.close()
        client = BaselineClient(url, LOOP_STREAM)
        c = client

        def run_window(part: range) -> list[Any]:
            # The reference shape of docs/design.md §8: an entry per item, a window's XADDs in
            # one pipeline (one round trip per item would measure the producer's latency only).
            return [w.wait() for w in c.submit_window(part)]

        run_window(range(args.window * 4))
        rate = _measure.rate(
            run_window,
            args.fast_items,
            args.window,
            args.repeats,
            args.seconds,
            _measure.cpu_meter(url, consumer.pid),
        )
        lat = _measure.latency(c.call, args.rt_calls, args.rt_warmup, args.seconds)
        if consumer.poll() is not None:
            raise RuntimeError(f"the baseline consumer exited with code {consumer.returncode}")
    finally:
        if client is not None:
            client.close()
        stop_process(consumer)
    versions = {
        "redis": redis.__version__,
        "hiredis": hiredis.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    return [
        {
            "key": "loop",
            "versions": versions,
            **rate,
            **lat,
            "setup": "bench/baseline.py: an XADD per item, a window's XADDs in one pipeline; "
            "one consumer process, XREADGROUP COUNT 256, one RPUSH per (client, batch)",
        }
    ]


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and every process under it (a runner's worker and that worker's pool)."""
    for pid in reversed(process_tree(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_peer(system: System, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One runner in .venv-peers; its last line of stdout is the result."""
    python = Path(args.peers_python)
    if not python.exists():
        return {
            "key": system.key,
            "skipped": f"{python} does not exist: run {COMMAND} "
            f"(it makes .venv-peers from bench/peers-requirements.txt)",
        }
    argv = [
        str(python),
        "-m",
        system.runner,
        "--redis-url",
        url,
        "--items",
        str(args.items),
        "--window",
        str(args.window),
        "--repeats",
        str(args.repeats),
        "--rt-calls",
        str(args.rt_calls),
        "--rt-warmup",
        str(args.rt_warmup),
        "--seconds",
        str(args.seconds),
    ]
    if system.variant:
        argv += ["--variant", system.variant]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        out, _ = proc.communicate(timeout=2 * args.seconds + GRACE_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise RuntimeError(
            f"{system.key}: the runner took over {2 * args.seconds + GRACE_S:g}s"
            f" and was killed with its workers"
        ) from None
    finally:
        if proc.poll() is None:  # interrupted here: take the runner's worker down with it
            kill_tree(proc)
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{system.key}: {' '.join(argv)} exited with code {proc.returncode}; "
            f"its stderr is above"
        )
    return {"key": system.key, **json.loads(lines[-1])}


def measure(systems: Sequence[System], args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    done: set[str] = set()
    for system in systems:
        if system.key in done:
            continue
        server = RedisServer().start()
        try:
            if system.key.startswith("queueserve"):
                got = measure_queueserve(server.url, args)
            elif system.key == "loop":
                got = measure_loop(server.url, args)
            else:
                try:
                    got = [run_peer(system, server.url, args)]
                except RuntimeError as e:  # one broken peer does not cost the others' figures
                    got = [{"key": system.key, "failed": str(e)}]
        finally:
            server.stop()
        for r in got:
            if r["key"] in {s.key for s in systems}:
                done.add(r["key"])
                results.append(r)
                print(line(r), flush=True)
    return results


# -- reporting ------------------------------------------------------------------------------------
LABELS = {s.key: s.label for s in SYSTEMS}


def label(result: dict[str, Any]) -> str:
    return LABELS.get(result["key"], result["key"])


def versions_text(result: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())


def line(result: dict[str, Any]) -> str:
    """One system's result as a console line."""
    if "items_per_s" not in result:
        return f"{label(result):<30} {not_measured(result)}"
    lat = (
        f"  p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms"
        if "p50_ms" in result
        else ""
    )
    return (
        f"{label(result):<30} {result['items_per_s']:>10,} items/s{lat}  CPU µs/item "
        f"{cpu_text(result)}  ({versions_text(result)})"
    )


def not_measured(result: dict[str, Any]) -> str:
    """Why a system has no figures: not installed (with how to install it), or it failed."""
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    return f"failed: {result.get('failed', 'no figures')}"


def measured(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results that have figures, fastest first."""
    return sorted((r for r in results if "items_per_s" in r), key=lambda r: -r["items_per_s"])


def cpu_text(result: dict[str, Any]) -> str:
    cpu = result.get("cpu_us_per_item")
    if not cpu:
        return "—"
    return " / ".join(f"{cpu[name]:,.1f}" for name in ("client", "worker", "redis"))


def cell(text: str) -> str:
    """``text`` made safe for one cell of a markdown table row."""
    return text.replace("\n", " ").replace("|", "\\|")


def table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per system, fastest first; skipped systems last, with the reason."""
    rows = [
        "| system | items/s | p50 ms | p99 ms | CPU µs/item: client / worker / Redis "
        "| versions | setup |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in measured(results):
        p50 = f"{r['p50_ms']:.2f}" if "p50_ms" in r else "—"
        p99 = f"{r['p99_ms']:.2f}" if "p99_ms" in r else "—"
        rows.append(
            f"| {label(r)} | {r['items_per_s']:,} | {p50} | {p99} | {cpu_text(r)} | "
            f"{versions_text(r)} | {cell(r.get('setup', ''))} |"
        )
    for r in results:
        if "items_per_s" not in r:
            rows.append(f"| {label(r)} | — | — | — | — | — | {cell(not_measured(r))} |")
    return "\n".join(rows)


def docs_block(results: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The generated part of docs/benchmarks.md's Peers section."""
    return "\n".join(
        [
            BEGIN,
            f"Run of {meta['date']}, {meta['cores']} cores ({meta['platform']}), Python "
            f"{meta['python']}, Redis {meta['redis_server']} on loopback, load average "
            f"{meta['loadavg'][0]:.1f} at the start, commit `{meta['git']}`; "
            f"`{meta['command']}`. Throughput: {meta['items']:,} items per run for the peers, "
            f"{meta['fast_items']:,} for queueserve submit and the loop, "
            f"{meta['map_items']:,} for map; {meta['window']} calls in flight; median of up to "
            f"{meta['repeats']} runs. Latency: {meta['rt_calls']} calls one at a time.",
            "",
            table(results),
            END,
        ]
    )


def replace_block(doc: str, block: str) -> str:
    """``doc`` with the text between the peers markers replaced by ``block`` (markers
    included); a doc without them gets a Peers section at its end."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start == -1 or end == -1 or end < start:
        return doc.rstrip("\n") + "\n\n## Peers\n\n" + block + "\n"
    return doc[:start] + block + doc[end + len(END) :]


def chart_rows(
    results: Sequence[dict[str, Any]],
) -> list[tuple[str, float, float | None, float | None]]:
    """(label, items/s, p50 ms, p99 ms) per measured system, fastest first."""
    return [
        (label(r), float(r["items_per_s"]), r.get("p50_ms"), r.get("p99_ms"))
        for r in measured(results)
    ]


def color(name: str) -> str:
    if name.startswith("queueserve"):
        return "#1b7f79"
    if name.startswith("hand-written"):
        return "#8c8c8c"
    return "#d9822b"


def render_chart(results: Sequence[dict[str, Any]], path: Path, subtitle: str) -> None:
    """Two panels sharing the systems: items/s (log) and one-call latency p50 with p99 (log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "matplotlib is missing: pip install -c constraints.txt -e '.[peers]' "
            "(scripts/bench-peers does)"
        ) from None
    rows = chart_rows(results)
    if not rows:
        raise ValueError("no measured system to chart: every one was skipped")
    names = [r[0] for r in rows]
    ys = list(range(len(rows)))
    colors = [color(n) for n in names]
    fig, (left, right) = plt.subplots(
        1,
        2,
        figsize=(11, 0.55 * len(rows) + 1.8),
        sharey=True,
        gridspec_kw={"width_ratios": [1.25, 1]},
    )
    rates = [r[1] for r in rows]
    left.barh(ys, rates, color=colors)
    left.set_xscale("log")
    left.set_xlim(min(rates) / 2, max(rates) * 6)
    left.set_xlabel("items/s, one item per call (log scale; more is better)")
    for y, v in zip(ys, rates, strict=True):
        left.text(v * 1.1, y, f"{v:,.0f}", va="center", fontsize=9)
    left.set_yticks(ys, names)
    left.invert_yaxis()
    lat = [(y, r[2], r[3]) for y, r in zip(ys, rows, strict=True) if r[2] is not None]
    if lat:
        p50s = [p for _, p, _ in lat]
        p99s = [p99 if p99 is not None else p for _, p, p99 in lat]
        right.barh([y for y, _, _ in lat], p50s, color=[colors[y] for y, _, _ in lat])
        right.scatter(p99s, [y for y, _, _ in lat], marker="|", s=200, color="black", zorder=3)
        right.set_xscale("log")
        right.set_xlim(min(p50s) / 2, max(p99s) * 8)
        for (y, p, _), p99 in zip(lat, p99s, strict=True):
            right.text(p99 * 1.15, y, f"{p:.2f} / {p99:.2f} ms", va="center", fontsize=9)
    for y, r in zip(ys, rows, strict=True):
        if r[2] is None:
            right.text(
                0.02,
                y,
                "(one call: as submit)",
                va="center",
                fontsize=8,
                color="#666666",
                transform=right.get_yaxis_transform(),
            )
    right.set_xlabel("one idle call, ms: p50 bar, p99 tick (log; less is better)")
    for ax in (left, right):
        ax.grid(axis="x", which="major", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle("queueserve and its peers, Redis as broker: one item per call", fontsize=12)
    fig.text(0.5, 0.005, subtitle, ha="center", fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def subtitle(meta: dict[str, Any]) -> str:
    return (
        f"{meta['date'][:10]}, {meta['cores']} cores (shared, noisy), Redis "
        f"{meta['redis_server']}, one worker per system, {meta['window']} calls in flight; "
        f"regenerate: {meta['command']}"
    )


# -- the run --------------------------------------------------------------------------------------
def git_state() -> str:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+dirty" if git("status", "--porcelain", "queueserve", "bench") else ""
    )


def machine(args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer().start()
    try:
        redis_version = server.version()
    finally:
        server.stop()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_server": redis_version,
        "loadavg": os.getloadavg(),
        "git": git_state(),
        "command": COMMAND,
        "items": args.items,
        "fast_items": args.fast_items,
        "map_items": args.map_items,
        "window": args.window,
        "repeats": args.repeats,
        "rt_calls": args.rt_calls,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", action="append", choices=KEYS, help="this system (repeatable)")
    p.add_argument("--quick", action="store_true", help="10x fewer items, one run (smoke)")
    p.add_argument("--items", type=int, help="items per run for the peers (default 5,000)")
    p.add_argument(
        "--fast-items",
        type=int,
        help="items per run for queueserve submit and the loop (default 50,000)",
    )
    p.add_argument("--map-items", type=int, help="items per map run (default 1,000,000)")
    p.add_argument("--window", type=int, default=256, help="calls in flight (default 256)")
    p.add_argument("--repeats", type=int, help="throughput runs (default 3, 1 with --quick)")
    p.add_argument("--rt-calls", type=int, help="timed one-at-a-time calls (default 500)")
    p.add_argument("--rt-warmup", type=int, default=20)
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="time bound of each measurement of each system (default 60)",
    )
    p.add_argument(
        "--peers-python",
        default=str(PEERS_PYTHON),
        help="the python of the peers' venv (default .venv-peers/bin/python)",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--from-json", type=Path, help="report a saved run instead of measuring")
    p.add_argument(
        "--png",
        type=Path,
        help=f"the chart (default {CHART.relative_to(REPO_ROOT)}, except with --quick or --only)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help=f"replace the table in {DOCS.relative_to(REPO_ROOT)}'s Peers section",
    )
    args = p.parse_args(argv)
    scale = 10 if args.quick else 1
    args.items = args.items or 5_000 // scale
    args.fast_items = args.fast_items or 50_000 // scale
    args.map_items = args.map_items or 1_000_000 // scale
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.rt_calls = args.rt_calls or 500 // scale
    if args.png is None and not (args.quick or args.only):
        args.png = CHART
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        meta, results = doc["machine"], doc["results"]
    else:
        meta = machine(args)
        systems = [s for s in SYSTEMS if not args.only or s.key in args.only]
        print(
            f"peers benchmark, {meta['cores']} cores, Redis {meta['redis_server']}, load "
            f"average {meta['loadavg'][0]:.1f}; a private redis-server per system",
            flush=True,
        )
        started = time.perf_counter()
        results = measure(systems, args)
        print(f"({time.perf_counter() - started:.0f} s)")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"machine": meta, "results": results}, indent=2) + "\n")
    if args.png:
        render_chart(results, args.png, subtitle(meta))
        print(f"chart: {args.png}")
    if args.docs:
        DOCS.write_text(replace_block(DOCS.read_text(), docs_block(results, meta)))
        print(f"table: {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
