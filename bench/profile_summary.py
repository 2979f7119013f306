"""Summarise a py-spy ``--format raw`` recording (collapsed stacks) by function.

    python -m bench.profile_summary worker_submit_window.txt [--top 25]

py-spy samples only threads that are running (not blocked in a syscall or on a lock) unless
``--idle`` was given, so the shares below approximate CPU time. Printed per file: samples per
thread, then the top functions by self time (the sampled frame itself) and by total time (the
function anywhere on the stack), as a percentage of all samples, and self time per source area.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

_LINE_NO = re.compile(r":\d+\)$")
_PROCESS = re.compile(r'process \d+:"[^"]*";')  # a command line may hold ';'


def function(frame: str) -> str:
    """``Client.submit (queueserve/client.py:147)`` -> ``Client.submit (queueserve/client.py)``."""
    return _LINE_NO.sub(")", frame.strip())


def area(frame: str) -> str:
    """Where a frame's code lives: queueserve, redis, threading, ... (for the self-time split)."""
    m = re.search(r"\(([^)]*)\)$", frame)
    path = m.group(1) if m else frame
    if "/" not in path:
        return path.split(".")[0] or "?"
    head = path.split("/")[0]
    return head.removesuffix(".py")


def parse(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = _PROCESS.sub("", line).rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def gil_busy(path: Path, samples: int) -> str:
    """How busy the GIL was, from the profile.json that ``bench.throughput --profile`` writes
    beside its recordings (``--gil`` samples only while some thread holds the GIL)."""
    meta_path = path.parent / "profile.json"
    if not meta_path.exists():
        return ""
    meta = json.loads(meta_path.read_text())
    shape = next((s for s in meta["seconds"] if path.stem.endswith(s)), None)
    if shape is None:
        return ""
    possible = meta["rate_hz"] * meta["seconds"][shape]
    return f" (GIL held {100 * samples / possible:.0f}% of {meta['seconds'][shape]:.1f} s)"


def summarise(path: Path, top: int) -> str:
    stacks = parse(path)
    total = sum(c for _, c in stacks) or 1
    threads: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    total_time: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    for frames, count in stacks:
        thread = next((f for f in frames if f.startswith("thread ")), "?")
        threads[re.sub(r"\(\d+\)", "", thread).removeprefix("thread").strip(" :")] += count
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not code:
            continue
        leaf = function(code[-1])
        self_time[leaf] += count
        areas[area(leaf)] += count
        for name in {function(f) for f in code}:
            total_time[name] += count

    def pct(n: int) -> str:
        return f"{100 * n / total:5.1f}%"

    out = [f"== {path.name}: {total} samples{gil_busy(path, total)}"]
    out.append("-- by thread")
    out += [f"  {pct(n)}  {name}" for name, n in threads.most_common()]
    out.append("-- self time by area")
    out += [f"  {pct(n)}  {name}" for name, n in areas.most_common(12)]
    out.append(f"-- top {top} functions by self time")
    out += [f"  {pct(n)}  {name}" for name, n in self_time.most_common(top)]
    out.append(f"-- top {top} functions by total time")
    skip = ("Thread.", "_bootstrap", "<module>", "run_threads", "target (bench")
    ranked = [(n, c) for n, c in total_time.most_common() if not n.startswith(skip)]
    out += [f"  {pct(c)}  {name}" for name, c in ranked[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_summary", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.files:
        print(summarise(path, args.top))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
