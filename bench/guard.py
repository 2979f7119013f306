"""A regression guard for the hot path: two checkouts' quick throughput runs, alternating.

    python -m bench.guard BASE [HEAD] [--pairs 3] [--repeats N] [--out DIR]
    python -m bench.guard BASE .          # HEAD = this working tree, uncommitted changes too

BASE and HEAD (default: the commit checked out here) are commits; each gets a detached git
worktree in a temporary folder, removed at the end. ``.`` as HEAD measures this working tree
as it is. Every run is ``python -m bench.throughput --quick --json FILE`` of that checkout,
with this interpreter (the one venv), the checkout as working directory and as PYTHONPATH, so
its queueserve and its bench are imported, in its worker processes too (they are started from
the same directory, with the same environment). The runs go in pairs, alternating BASE and
HEAD and the order within a pair (B H, H B, B H ...), so that a machine growing busier or
quieter weighs on both alike.

The single-item shapes and the idle round trip are taken as ratios to the hand-written
loop's same figure in the same run (as docs/design.md §8 states the single-item budgets), so
that a machine busier in one run than in the next moves both sides of the ratio; the packed
map, which has no loop, in items/s. Per figure the guard prints HEAD/BASE for each pair, their
median and spread, as a Markdown table, then ``guard: ok`` or ``guard: REGRESSION in ...``. A
judged (hot-path) figure is a regression when the median ratio is more than 5% worse (lower
for a throughput, higher for a latency) and the pairs agree: as many pairs worse as noise
alone, a coin toss per pair, reaches at most one time in 8 (every pair of 3 to 5, all but
one of 6 to 8). The loop's own figures are the control: the same code on both sides, so what
they move is the machine's noise, and a note says so when that exceeds 5%.

Exit status: 0 ok, 1 a regression, 2 no verdict (a run failed or lacks a figure, a commit
does not resolve, interrupted): a failed run never passes. A benchmark, never part of the
test suite; docs/benchmarks.md says when to run it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._harness import REPO_ROOT

LIMIT = 0.05  # a hot figure worse by more than this (median of the pairs) fails
MIN_PAIRS = 3
BENCH = ("-m", "bench.throughput", "--quick")
RUN_TIMEOUT_S = 600.0
WORKING_TREE = "."


# -- the figures ----------------------------------------------------------------------------------
def _rate(name: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda results: float(results[name]["median"])


def _per_loop(name: str, loop: str, key: str = "median") -> Callable[[Mapping[str, Any]], float]:
    return lambda results: results[name][key] / results[loop][key]


def _ms(name: str, key: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda results: float(results[name][key])


def _rt_cpu(process: str) -> Callable[[Mapping[str, Any]], float]:
    return lambda results: float(results["rt_qs"]["run_us_per_call"][process])


@dataclass(frozen=True)
class Figure:
    """One figure of a bench.throughput run, read from its JSON ``results``."""

    label: str
    unit: str  # "x loop": per the hand-written loop's same figure in the same run
    read: Callable[[Mapping[str, Any]], float]
    higher_is_better: bool = True  # a throughput; a latency is lower is better
    hot: bool = True  # judged; the others show what else moved
    control: bool = False  # the hand-written loop's: the same code in both, so noise alone
    # shown only when every run has it: a figure a checkout's bench did not yet measure
    optional: bool = False

    @property
    def name(self) -> str:
        return f"{self.label} ({self.unit})"

    def show(self, value: float) -> str:
        if self.unit == "items/s":
            return f"{value:,.0f}"
        if self.unit == "µs":
            return f"{value:.1f}"
        return f"{value:.3f}" if self.unit == "ms" else f"{value:.2f}"


FIGURES = (
    Figure("submit window", "x loop", _per_loop("qs_submit_window", "baseline")),
    Figure("dispatch-64", "x loop", _per_loop("qs_dispatch_64", "baseline_dispatch_64")),
    Figure(
        "asyncio dispatch-64",
        "x loop",
        _per_loop("qs_dispatch_async_64", "baseline_dispatch_async_64"),
    ),
    Figure("packed map, 16 in flight", "items/s", _rate("qs_map_256_mif16")),
    Figure("round trip p50", "x loop", _per_loop("rt_qs", "rt_baseline", "p50_ms"), False),
    Figure("round trip p99", "x loop", _per_loop("rt_qs", "rt_baseline", "p99_ms"), False),
    # not judged: the raw figures behind the ratios, and the machine's speed
    Figure(
        "submit keep=60",
        "x submit",
        _per_loop("qs_submit_keep_window", "qs_submit_window"),
        hot=False,
    ),
    Figure("submit window", "items/s", _rate("qs_submit_window"), hot=False),
    Figure("packed map, 4 in flight", "items/s", _rate("qs_map_256_mif4"), hot=False),
    Figure("packed map, 64 in flight", "items/s", _rate("qs_map_256_mif64"), hot=False),
    Figure("round trip p50", "ms", _ms("rt_qs", "p50_ms"), False, hot=False),
    Figure("round trip p99", "ms", _ms("rt_qs", "p99_ms"), False, hot=False),
    # CPU per idle round trip, to the ns: a steadier sign of the path's cost than its latency
    # on a shared machine (bench.throughput's run_us_per_call; a first form of it counted
    # clock ticks under another key, and is never compared with it)
    *(
        Figure(f"round trip CPU, {shown}", "µs", _rt_cpu(process), False, False, optional=True)
        for shown, process in (("caller", "bench"), ("worker", "consumer"), ("Redis", "redis"))
    ),
    Figure("control: loop, 8 thr x 512", "items/s", _rate("baseline"), hot=False, control=True),
    Figure(
        "control: loop round trip p50",
        "ms",
        _ms("rt_baseline", "p50_ms"),
        False,
        hot=False,
        control=True,
    ),
)


def extract(results: Mapping[str, Any], figures: Sequence[Figure] = FIGURES) -> dict[str, float]:
    """The figures a run's ``results`` hold; one it lacks is left out (``judge`` fails it)."""
    found = {}
    for figure in figures:
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            found[figure.name] = figure.read(results)
    return found


# -- the verdict (pure) ---------------------------------------------------------------------------
Run = Mapping[str, float]  # Figure.name -> value
Pair = tuple[Run, Run]  # (BASE, HEAD)


def agreement(pairs: int) -> int:
    """How many pairs must be worse for the pairs to agree: the fewest that noise alone (each
    pair a coin toss) reaches at most one time in 8, as 3 of 3 do. Every pair of 3 to 5, all
    but one of 6 to 8; from fewer than 3 pairs no verdict of change can come."""
    for k in range(pairs + 1):
        if sum(math.comb(pairs, i) for i in range(k, pairs + 1)) * 8 <= 2**pairs:
            return k
    return pairs + 1


class FailedRun(Exception):
    """A run lacks a figure or holds one that cannot be compared: there is no verdict."""


@dataclass(frozen=True)
class Comparison:
    figure: Figure
    base: tuple[float, ...]
    head: tuple[float, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """HEAD/BASE of each pair."""
        return tuple(h / b for b, h in zip(self.base, self.head, strict=True))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def worse(self, ratio: float) -> float:
        """How much worse than BASE a ratio is, as a fraction (negative: better)."""
        return 1 - ratio if self.figure.higher_is_better else ratio - 1

    @property
    def agreeing(self) -> int:
        """Pairs in which HEAD did worse than BASE, by any amount."""
        return sum(self.worse(r) > 0 for r in self.ratios)

    @property
    def needed(self) -> int:
        return agreement(len(self.ratios))

    @property
    def regression(self) -> bool:
        """More than LIMIT worse, the pairs agreeing, and judged."""
        worse = self.worse(self.median) > LIMIT and self.agreeing >= self.needed
        return worse and self.figure.hot

    @property
    def status(self) -> str:
        worse, n = self.worse(self.median), len(self.ratios)
        if worse > LIMIT:
            if self.agreeing < self.needed:
                return f"worse, pairs disagree ({self.agreeing} of {n} worse)"
            return "REGRESSION" if self.figure.hot else "worse (not judged)"
        if -worse > LIMIT:
            better = sum(self.worse(r) < 0 for r in self.ratios)
            return (
                "better"
                if better >= self.needed
                else f"better, pairs disagree ({better} of {n} better)"
            )
        return f"within {LIMIT:.0%}"


def _value(run: Run, figure: Figure, where: str) -> float:
    value = run.get(figure.name)
    if value is None:
        raise FailedRun(f"{where} has no figure '{figure.name}'")
    if not value > 0 or value == float("inf"):
        raise FailedRun(f"{where} has '{figure.name}' = {value!r}, not a positive number")
    return value


def compare(pairs: Sequence[Pair], figures: Sequence[Figure] = FIGURES) -> list[Comparison]:
    """Each figure across the pairs; FailedRun when a run lacks one or holds a non-positive."""
    if not pairs:
        raise FailedRun("no pairs were run")
    out = []
    for figure in figures:
        if figure.optional and any(figure.name not in run for pair in pairs for run in pair):
            continue
        base = tuple(
            _value(b, figure, f"BASE run of pair {i}") for i, (b, _) in enumerate(pairs, 1)
        )
        head = tuple(
            _value(h, figure, f"HEAD run of pair {i}") for i, (_, h) in enumerate(pairs, 1)
        )
        out.append(Comparison(figure, base, head))
    return out


@dataclass(frozen=True)
class Verdict:
    code: int  # the exit status: 0 ok, 1 regression, 2 no verdict
    line: str
    comparisons: tuple[Comparison, ...]

    @property
    def noise(self) -> float:
        """How far the control figures' HEAD/BASE strayed from 1 in any pair."""
        controls = [r for c in self.comparisons if c.figure.control for r in c.ratios]
        return max((abs(r - 1) for r in controls), default=0.0)

    @property
    def note(self) -> str | None:
        """A warning when the machine's noise alone exceeds the limit of the verdict."""
        if self.noise <= LIMIT:
            return None
        return (
            f"guard: noisy: the hand-written loop, the same code in every run, moved by up to "
            f"{self.noise:.0%} within a pair; a change of {LIMIT:.0%} may show or hide in noise "
            f"like that. Confirm with more pairs (--pairs 6) or on a quieter machine."
        )


def judge(pairs: Sequence[Pair], figures: Sequence[Figure] = FIGURES) -> Verdict:
    try:
        comparisons = compare(pairs, figures)
    except FailedRun as e:
        return Verdict(2, f"guard: FAILED, no verdict: {e}", ())
    bad = [c.figure.name for c in comparisons if c.regression]
    if bad:
        return Verdict(1, f"guard: REGRESSION in {', '.join(bad)}", tuple(comparisons))
    return Verdict(0, "guard: ok", tuple(comparisons))


def schedule(pairs: int) -> list[str]:
    """The order of the runs: B H, H B, B H ..."""
    order = []
    for i in range(pairs):
        order += ["base", "head"] if i % 2 == 0 else ["head", "base"]
    return order


def markdown(comparisons: Sequence[Comparison]) -> str:
    lines = [
        "| figure | better | BASE | HEAD | HEAD/BASE per pair | median | spread | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(comparisons, key=lambda c: not c.figure.hot):
        f = c.figure
        name = f"**{f.label}** ({f.unit})" if f.hot else f.name
        lines.append(
            f"| {name} | {'higher' if f.higher_is_better else 'lower'}"
            f" | {f.show(statistics.median(c.base))} | {f.show(statistics.median(c.head))}"
            f" | {', '.join(f'{r:.3f}' for r in c.ratios)} | {c.median:.3f}"
            f" | {min(c.ratios):.3f} .. {max(c.ratios):.3f} | {c.status} |"
        )
    return "\n".join(lines)


# -- checkouts and runs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkout:
    name: str  # as given: a commit, or "."
    sha: str  # the commit; for the working tree, the commit it is on
    root: Path

    @property
    def title(self) -> str:
        if self.name == WORKING_TREE:
            return f"`{self.sha[:7]}` + uncommitted changes"
        return f"`{self.sha[:7]}`"


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve(rev: str) -> str:
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except RuntimeError:
        raise RuntimeError(
            f"{rev!r} names no commit here; give a commit, a branch or HEAD~n"
        ) from None


@contextlib.contextmanager
def checkouts(base: str, head: str) -> Iterator[tuple[Checkout, Checkout]]:
    """A detached worktree of each commit (the working tree itself for ``.``), removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="qs-guard-"))
    made: list[Path] = []
    try:
        sides = []
        for side, name in (("base", base), ("head", head)):
            if name == WORKING_TREE:
                sides.append(Checkout(name, resolve("HEAD"), REPO_ROOT))
                continue
            sha, root = resolve(name), tmp / side
            git("worktree", "add", "--detach", str(root), sha)
            made.append(root)
            sides.append(Checkout(name, sha, root))
        yield sides[0], sides[1]
    finally:
        for root in made:
            try:
                git("worktree", "remove", "--force", str(root))
            except RuntimeError as e:
                print(f"guard: warning: {e}; remove {root} by hand", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)


def child_env(root: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")


def check_imports(checkout: Checkout) -> None:
    """The checkout's queueserve and bench are the ones its runs import, not this tree's."""
    probe = "import queueserve, bench._harness as h; print(queueserve.__file__); print(h.REPO_ROOT)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=checkout.root,
        env=child_env(checkout.root),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    root = checkout.root.resolve()
    if not Path(out[0]).resolve().is_relative_to(root) or Path(out[1]).resolve() != root:
        raise RuntimeError(f"{checkout.name}: a run would import {out[0]} and {out[1]}, not {root}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT lets bench.throughput stop its Redis and workers; its process group goes after."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: the bench and what it started
    proc.wait()


def run_once(checkout: Checkout, out: Path, options: Options) -> dict[str, Any]:
    """One bench.throughput run of a checkout; its JSON document. RuntimeError if it failed."""
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, *BENCH, *options.bench_args, "--json", str(out)],
            cwd=checkout.root,
            env=child_env(checkout.root),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own, which stop() can end as a whole
        )
        try:
            code = proc.wait(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            msg = f"{checkout.name}: the bench ran past {options.timeout:g} s"
            raise RuntimeError(msg) from None
        finally:
            stop(proc)  # on an interrupt or a timeout, and whatever the bench left running
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{checkout.name}: bench exited {code}:\n  " + "\n  ".join(tail))
    doc: dict[str, Any] = json.loads(out.read_text())
    measured = doc.get("machine", {}).get("git", "").split("+")[0]
    if checkout.name != WORKING_TREE and measured and not checkout.sha.startswith(measured):
        raise RuntimeError(f"{checkout.name}: the run measured {measured}, not {checkout.sha}")
    return doc


@dataclass(frozen=True)
class Options:
    pairs: int
    repeats: int | None  # bench.throughput's --repeats; None: its own (1 with --quick)
    out_dir: Path
    timeout: float

    @property
    def bench_args(self) -> list[str]:
        return [] if self.repeats is None else ["--repeats", str(self.repeats)]


def measure(base: Checkout, head: Checkout, options: Options) -> tuple[list[Pair], list[float]]:
    """The runs in ``schedule`` order; (BASE, HEAD) figures per pair and each run's load."""
    sides = {"base": base, "head": head}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    loads = []
    order = schedule(options.pairs)
    for i, side in enumerate(order, 1):
        checkout = sides[side]
        t0 = time.monotonic()
        doc = run_once(checkout, options.out_dir / f"{i:02d}-{side}.json", options)
        loads.append(doc["machine"]["loadavg_at_start"][0])
        runs[side].append(extract(doc["results"]))
        missing = [f.name for f in FIGURES if f.name not in runs[side][-1] and not f.optional]
        if missing:  # judge() would say so too, after all the runs
            raise RuntimeError(f"{checkout.name}: its run has no {', '.join(missing)}")
        print(
            f"guard: run {i}/{len(order)} {side.upper()} {checkout.title}: "
            f"{time.monotonic() - t0:.0f} s, load {loads[-1]:.2f}",
            file=sys.stderr,
        )
    return list(zip(runs["base"], runs["head"], strict=True)), loads


def header(base: Checkout, head: Checkout, options: Options, loads: Sequence[float]) -> str:
    bench = " ".join(("python", *BENCH, *options.bench_args))
    return (
        f"BASE {base.title}, HEAD {head.title}: `{bench}`, {options.pairs} pairs "
        f"(B H, H B, ...), {os.cpu_count()} cores, load average "
        f"{min(loads):.1f} .. {max(loads):.1f}. Bold: judged; a regression is more than "
        f"{LIMIT:.0%} worse with at least {agreement(options.pairs)} of {options.pairs} pairs "
        "worse."
    )


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"interrupted by signal {signum}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.guard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", help="the commit to compare against (the last landed one)")
    parser.add_argument(
        "head", nargs="?", default="HEAD", help="a commit, or '.' for this working tree"
    )
    parser.add_argument("--pairs", type=int, default=MIN_PAIRS, help="BASE/HEAD pairs (>= 3)")
    parser.add_argument(
        "--repeats", type=int, help="bench.throughput's runs per throughput figure (default 1)"
    )
    parser.add_argument("--out", type=Path, help="keep each run's JSON and log here")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds a run")
    args = parser.parse_args(argv)
    if args.pairs < MIN_PAIRS:
        parser.error(f"--pairs {args.pairs}: at least {MIN_PAIRS} pairs are needed")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if args.base == WORKING_TREE:
        parser.error("BASE is a commit; '.' (the working tree) can only be HEAD")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # remove the worktrees on a plain kill too
    scratch = Path(tempfile.mkdtemp(prefix="qs-guard-runs-"))
    options = Options(args.pairs, args.repeats, args.out or scratch, args.timeout)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with checkouts(args.base, args.head) as (base, head):
            for checkout in (base, head):
                check_imports(checkout)
            pairs, loads = measure(base, head, options)
    except (RuntimeError, subprocess.CalledProcessError, KeyboardInterrupt) as e:
        print(f"guard: FAILED, no verdict: {e or 'interrupted'}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    verdict = judge(pairs)
    if verdict.comparisons:
        print(header(base, head, options, loads) + "\n")
        print(markdown(verdict.comparisons) + "\n")
    if verdict.note:
        print(verdict.note)
    print(verdict.line)
    return verdict.code


if __name__ == "__main__":
    sys.exit(main())
