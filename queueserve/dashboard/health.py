"""A serving's health as the dashboard tells it: its figures over the last minutes (from the
figures each partition's heartbeat carries per serving, wire/figures.py) and a status from
rules written down in docs/operations.md ("Dashboard: status"), in the order they are tried:

1. ``no worker`` (bad): items wait and no worker of the serving beat within ALIVE_WITHIN_S;
2. ``failing`` (bad): more than ERROR_RATE of the items answered over the window failed
   (FAILURE_KINDS: the batch function raised, or a request was dead-lettered);
3. ``waiting long`` (warn): the oldest request not answered has waited longer than the
   serving's ``max_latency`` when it has one, else OLDEST_WAITING_S;
4. ``dead letters growing`` (warn): the dead-letter stream holds more than at the window's
   start;
5. ``busy`` (ok): items were answered over the window or wait; else ``idle``.

The first that holds is the status; every one that holds is a reason shown beside it. The
figures are differences between samples the dashboard takes while it is read (one every
SAMPLE_EVERY_S at most), so they start when the page is first opened.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from queueserve.wire.figures import Figures, quantile

SAMPLE_EVERY_S = 2.0
HISTORY_S = 600.0  # the charts' span: the last ten minutes
WINDOW_S = 60.0  # error rate, latency and dead letters growing: over the last minute
ERROR_RATE = 0.05
OLDEST_WAITING_S = 30.0
MAX_KEPT = 300  # servings whose samples are kept: three pages of the dashboard
LEVELS = {  # status -> level, which the page shows in colour
    "no worker": "bad",
    "failing": "bad",
    "waiting long": "warn",
    "dead letters growing": "warn",
    "busy": "ok",
    "idle": "idle",
}


@dataclass(slots=True)
class Sample:
    at: float  # unix seconds
    figures: dict[str, Figures]  # alive consumer -> its figures of this serving
    dead_letters: int


@dataclass(slots=True)
class Step:
    """What the serving's partitions did between two samples."""

    at: float
    span: float
    done: Figures
    dead_before: int


def delta(before: Sample, after: Sample) -> Figures:
    """What the consumers in both samples did between them (a consumer whose figures went
    back is not the same partition's, or forged: left out; a restarted partition is a new
    consumer, counted from its second sample)."""
    out = Figures()
    for consumer, now in after.figures.items():
        old = before.figures.get(consumer)
        if old is not None and now.covers(old):
            out.add(now.minus(old))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def point(step: Step) -> dict[str, Any]:
    """A chart's point: items per second, mean batch size, error rate, queue-time p99 and
    end-to-end p99 (milliseconds) of one step."""
    done = step.done
    return {
        "at": step.at,
        "items_per_s": done.items / step.span if step.span > 0 else 0.0,
        "batch_size": done.items / done.batches if done.batches else None,
        "error_rate": done.failures / done.items if done.items else None,
        "queue_p99_ms": _ms(quantile(0.99, done.queue_time)),
    }


@dataclass(slots=True)
class Recent:
    """One serving's samples as the dashboard read them: the last one, the steps of the last
    WINDOW_S whole, and one chart point per step of the last HISTORY_S."""

    last: Sample | None = None
    steps: deque[Step] = field(default_factory=deque)
    points: deque[dict[str, Any]] = field(default_factory=deque)

    def add(self, sample: Sample) -> None:
        last = self.last
        if last is not None and sample.at - last.at < SAMPLE_EVERY_S:
            return
        self.last = sample
        if last is None:
            return
        step = Step(sample.at, sample.at - last.at, delta(last, sample), last.dead_letters)
        self.steps.append(step)
        self.points.append(point(step))
        while self.steps and sample.at - (self.steps[0].at - self.steps[0].span) > WINDOW_S:
            self.steps.popleft()
        while self.points and sample.at - self.points[0]["at"] > HISTORY_S:
            self.points.popleft()

    def window(self) -> tuple[Figures, float, int | None]:
        """(what was done over the steps kept, over how many seconds, dead letters at their
        start; None with no step yet)."""
        done = Figures()
        for step in self.steps:
            done.add(step.done)
        span = sum(step.span for step in self.steps)
        return done, span, self.steps[0].dead_before if self.steps else None


class Histories:
    """The Recent of the MAX_KEPT servings sampled last, for the Board's threads: a page read
    once and left keeps nothing for good (paging through thousands of servings would)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, Recent] = OrderedDict()

    def sampled(self, name: str, sample: Sample) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Keep ``sample``; (the chart points, the figures of the window)."""
        with self._lock:
            recent = self._by_name.pop(name, None) or Recent()
            self._by_name[name] = recent
            while len(self._by_name) > MAX_KEPT:
                self._by_name.popitem(last=False)
            recent.add(sample)
            done, span, dead_before = recent.window()
            points = list(recent.points)
        return points, figures(done, span, dead_before, points)


def figures(
    done: Figures, span: float, dead_before: int | None, points: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "window_s": round(span, 1),
        "items_per_s": points[-1]["items_per_s"] if points else None,
        "items": done.items,
        "failures": done.failures,
        "error_rate": done.failures / done.items if done.items else None,
        "queue_p50_ms": _ms(quantile(0.5, done.queue_time)),
        "queue_p99_ms": _ms(quantile(0.99, done.queue_time)),
        "end_to_end_p99_ms": _ms(quantile(0.99, done.end_to_end)),
        "dead_letters_before": dead_before,
    }


def status(
    window: dict[str, Any],
    *,
    queued: int,
    workers_alive: int,
    oldest_ms: int,
    dead_letters: int,
    max_latency_s: float,
) -> dict[str, Any]:
    """The status of a serving by the rules above, with the reasons that hold, in words."""
    reasons: list[tuple[str, str]] = []
    if queued and not workers_alive:
        reasons.append(("no worker", f"{queued} items wait and no worker is alive"))
    rate = window["error_rate"]
    if rate is not None and rate > ERROR_RATE:
        reasons.append(
            (
                "failing",
                f"{rate:.0%} of the {window['items']} items of the last "
                f"{window['window_s']:g} s failed (over {ERROR_RATE:.0%})",
            )
        )
    limit_s = max_latency_s if max_latency_s > 0 else OLDEST_WAITING_S
    if oldest_ms > limit_s * 1000:
        said = "its max_latency" if max_latency_s > 0 else "the dashboard's threshold"
        reasons.append(
            (
                "waiting long",
                f"the oldest request has waited {oldest_ms / 1000:.1f} s, past {said} "
                f"({limit_s:g} s)",
            )
        )
    before = window["dead_letters_before"]
    if before is not None and dead_letters > before:
        reasons.append(
            (
                "dead letters growing",
                f"{dead_letters - before} more dead letters in the last {window['window_s']:g} s",
            )
        )
    if not reasons:
        word = "busy" if window["items"] or queued else "idle"
        reasons.append((word, "items answered or waiting" if word == "busy" else "no work"))
    word = reasons[0][0]
    return {"status": word, "level": LEVELS[word], "reasons": [why for _, why in reasons]}


def max_latency_of(options: dict[str, str]) -> float:
    """The ``max_latency`` a serving's workers declared (seconds; 0: none, or not a number)."""
    try:
        value = float(options.get("max_latency", "0")[:30])
    except ValueError:
        return 0.0
    return value if 0 < value < 1e9 else 0.0
