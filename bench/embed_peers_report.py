"""What ``python -m bench.embed_peers`` reports: medians over the rounds, the table, the verdicts
and the generated block of docs/benchmarks.md, from the figures alone (no measuring here).

A system's figures come as one dict per round (``rounds``), or it has ``skipped`` (not
installed: how to install it) or ``failed`` (what failed) instead. Its lowest cosine against
sentence-transformers over every vector it answered decides whether its figures are shown at
all: at or below :data:`MIN_COSINE` they are withheld, and no verdict stands on them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._verdict import Verdict, WorkFailed, at_least, at_most

MIN_COSINE = 0.999
BEGIN, END = "<!-- embed-peers:begin -->", "<!-- embed-peers:end -->"


@dataclass(frozen=True)
class System:
    key: str
    label: str
    path: str


SYSTEMS = (
    System("model", "model alone (`encode`, sorted by length)", "in-process"),
    System("qs-client", "queueserve", "AsyncClient: `dispatch`; `map(chunk_size=32)`"),
    System("qs-gateway", "queueserve", "gateway `/v1/embeddings`"),
    # not judged: the serving set as Infinity runs, no wait for a batch to fill
    System("qs-nowait", "queueserve", "AsyncClient, `batch_timeout=0` (no wait, as Infinity)"),
    System("infinity", "infinity-emb", "HTTP"),
    System("litserve", "LitServe", "HTTP"),
    System("ray", "Ray Serve `@serve.batch`", "HTTP"),
)
KEYS = tuple(s.key for s in SYSTEMS)
QUEUESERVE = ("qs-client", "qs-gateway")
PEERS = ("infinity", "litserve", "ray")
# (figure, words, "more" or "less" is better)
SHAPES = (
    ("callers_s", "32 callers x 1 text", "more"),
    ("chunks_s", "requests of 32 texts", "more"),
    ("open_p99_ms", "p99 at 70% of its max", "less"),
)


def system(key: str) -> System:
    return next(s for s in SYSTEMS if s.key == key)


def label(key: str, result: dict[str, Any]) -> str:
    """The system's name with the version measured, e.g. ``LitServe 0.2.19``."""
    version = result.get("version")
    return f"{system(key).label} {version}" if version else system(key).label


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of the rounds' values."""
    return statistics.median(values), min(values), max(values)


def summary(result: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Each figure's (median, lowest, highest) over the rounds that measured it."""
    names = {name for r in result.get("rounds", []) for name in r}
    return {
        name: spread([r[name] for r in result["rounds"] if name in r])
        for name in sorted(names)
        if name != "min_cos"
    }


def min_cosine(result: dict[str, Any]) -> float:
    """The lowest cosine over all rounds (NaN when a vector was not a number, or none came)."""
    values = [r.get("min_cos", math.nan) for r in result.get("rounds", [])]
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return min(values)


def shown(result: dict[str, Any]) -> bool:
    """Whether the system's figures stand: measured, every vector checked above 0.999."""
    complete = "failed" not in result and "skipped" not in result
    return complete and bool(result.get("rounds")) and min_cosine(result) > MIN_COSINE


def why_not(result: dict[str, Any]) -> str:
    """Why a system has no figures in the table."""
    if "skipped" in result:
        return f"not installed: {result['skipped']}"
    if "failed" in result:
        return f"failed: {result['failed']}"
    return f"withheld: lowest cosine {min_cosine(result):.6f}, not above {MIN_COSINE}"


def figure(stats: dict[str, tuple[float, float, float]], name: str, fmt: str) -> str:
    """``median (lowest-highest)``, or the median alone for one round, or a dash."""
    if name not in stats:
        return "-"
    mid, lo, hi = stats[name]
    if lo == hi:
        return fmt.format(mid)
    return f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})"


def ratio_text(stats: dict[str, tuple[float, float, float]], name: str, limit: float) -> str:
    if name not in stats:
        return "-"
    text = figure(stats, name, "{:.1f}")
    return f"{text}; {stats[name][0] / limit:.2f}x" if limit > 0 else text


def limit_of(results: dict[str, dict[str, Any]]) -> float:
    """The model alone's texts/s (median), the limit every system is divided by; 0 if none."""
    model = results.get("model", {})
    if not shown(model):
        return 0.0
    return summary(model).get("chunks_s", (0.0, 0.0, 0.0))[0]


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: a row per system in SYSTEMS order; texts/s with its ratio to the model alone."""
    limit = limit_of(results)
    rows = [
        "| system | path | 32 callers x 1 text, texts/s | requests of 32 texts, texts/s "
        "| 1 caller p50 / p99 ms | p99 ms at 70% of its max (offered/s) "
        "| p99 ms at one rate for all (offered/s) | lowest cosine |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in SYSTEMS:
        if s.key not in results:
            continue
        r = results[s.key]
        if not shown(r):
            rows.append(f"| {label(s.key, r)} | {s.path} | {cell(why_not(r))} | | | | | |")
            continue
        stats = summary(r)
        latency = (
            f"{figure(stats, 'p50_ms', '{:.0f}')} / {figure(stats, 'p99_ms', '{:.0f}')}"
            if "p50_ms" in stats
            else "-"
        )
        open_p99 = (
            f"{figure(stats, 'open_p99_ms', '{:.0f}')} ({stats['open_per_s'][0]:.1f}/s)"
            if "open_p99_ms" in stats
            else "-"
        )
        same_p99 = (
            f"{figure(stats, 'same_p99_ms', '{:.0f}')} ({stats['same_per_s'][0]:.1f}/s)"
            if "same_p99_ms" in stats
            else "-"
        )
        rows.append(
            f"| {label(s.key, r)} | {s.path} | {ratio_text(stats, 'callers_s', limit)} | "
            f"{ratio_text(stats, 'chunks_s', limit)} | {latency} | {open_p99} | {same_p99} | "
            f"{min_cosine(r):.6f} |"
        )
    return "\n".join(rows)


def cell(text: str) -> str:
    return text.replace("\n", " ").replace("|", "\\|")


def best_peer(results: dict[str, dict[str, Any]], name: str, better: str) -> tuple[str, float]:
    """The peer with the best median of figure ``name`` among those shown; ("", nan) if none."""
    found = [
        (label(k, results[k]), summary(results[k])[name][0])
        for k in PEERS
        if k in results and shown(results[k]) and name in summary(results[k])
    ]
    if not found:
        return "", math.nan
    pick = max if better == "more" else min
    return pick(found, key=lambda f: f[1])


def verdicts(results: dict[str, dict[str, Any]]) -> list[Verdict]:
    """queueserve through its client and through its gateway against the best peer on each
    figure: throughput at least the best peer's, p99 at 70% load at most. Raises WorkFailed
    when queueserve has no checked figures (then no verdict can stand)."""
    out = []
    for key in QUEUESERVE:
        if key not in results:
            continue  # not asked for (--only)
        r = results[key]
        if not shown(r):
            raise WorkFailed(f"{system(key).path}: {why_not(r)}")
        stats = summary(r)
        for name, words, better in SHAPES:
            peer, best = best_peer(results, name, better)
            mine = stats[name][0]
            unit = "/s" if better == "more" else " ms"
            budget = f"queueserve {system(key).path}, {words} {'≥' if better == 'more' else '≤'}"
            if not peer:
                out.append(
                    Verdict(f"{budget} best peer", f"{mine:.1f}{unit}", False, False, "no peer")
                )
                continue
            budget = f"{budget} best peer's ({peer}: {best:.1f}{unit})"
            fmt = f"{mine:.1f}{unit} = {{:.2f}}x"
            judge = at_least if better == "more" else at_most
            out.append(judge(budget, mine / best, 1.0, fmt=fmt))
    return out


def docs_block(
    results: dict[str, dict[str, Any]], verdict_lines: Sequence[str], meta: dict[str, Any]
) -> str:
    """The generated part of docs/benchmarks.md's embedding peers section."""
    return "\n".join(
        [
            BEGIN,
            f"Run of {meta['date']}, commit `{meta['git']}`, {meta['cores']} cores (1-minute "
            f"load average {meta['loadavg']}), Python "
            f"{meta['python']}, torch {meta['torch']}; `{meta['command']}`. "
            f"{meta['passages']:,} passages, {meta['rounds']} rounds with the systems in "
            f"alternating order; each round: {meta['seconds']:g} s of 32 callers, "
            f"{meta['chunk_texts']:,} texts in requests of 32 ({meta['in_flight']} in flight), "
            f"{meta['calls']} calls one at a time, {meta['seconds']:g} s of Poisson arrivals at "
            f"70% of the system's 32-caller rate that round, {meta['seconds']:g} s of Poisson "
            "arrivals at one rate for all (half the model alone's rate on the whole corpus). "
            "Figures: median over the rounds "
            f"(lowest-highest); x: divided by the model alone.",
            "",
            table(results),
            "",
            *(f"    {line}" for line in verdict_lines),
            END,
        ]
    )


def replace_block(doc: str, block: str, heading: str) -> str:
    """``doc`` with the text between the markers replaced by ``block``; a doc without them gets
    a section ``heading`` at its end holding it."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start == -1 or end == -1 or end < start:
        return doc.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    return doc[:start] + block + doc[end + len(END) :]


def chart_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, float]]]:
    """(name, median of each figure) per system shown, in SYSTEMS order."""
    rows = []
    for s in SYSTEMS:
        r = results.get(s.key)
        if r is None or not shown(r):
            continue
        name = label(s.key, r) if not s.key.startswith("qs-") else f"queueserve {s.key[3:]}"
        rows.append((name.replace("`", ""), {k: v[0] for k, v in summary(r).items()}))
    return rows
