"""Verdicts a benchmark prints, and the rule that they stand on completed, checked work only.

A benchmark's worker threads run under :class:`Threads`: the first error of any of them, or a
thread still running at its deadline, fails the run (:class:`WorkFailed`), never a figure.
Every answer a figure counts is checked first (against the model alone, the cold run, the
items sent) and a wrong or missing one is a :class:`WorkFailed` too. A :class:`Verdict` is
judged from a measured value only: a value that is not a finite number, or (for times and
ratios of them) not above 0, meets no budget, so a stream that never answered cannot pass
as a time to first output of 0.

A benchmark's ``main`` runs under :func:`run`: its exit status is 0 when every budget judged
was met, 1 when one was MISSED, 2 when the work failed (the message says what failed).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

EXIT_MET = 0
EXIT_MISSED = 1
EXIT_FAILED = 2


class WorkFailed(RuntimeError):
    """The work a figure would count did not all complete, or an answer was wrong."""


@dataclass(frozen=True)
class Verdict:
    """One budget against what was measured. ``judged=False``: printed, not counted in the
    exit status (a budget of another device, say), with ``note`` saying why."""

    budget: str
    measured: str
    met: bool
    judged: bool = True
    note: str = ""

    def line(self) -> str:
        word = "met" if self.met else "MISSED"
        note = f" ({self.note})" if self.note else ""
        return f"verdict: {self.budget}: {self.measured}: {word}{note}"


def _usable(value: float, positive: bool) -> bool:
    return math.isfinite(value) and (value > 0 or not positive)


def at_most(
    budget: str,
    value: float,
    bound: float,
    *,
    fmt: str = "{:.2f}",
    positive: bool = True,
    judged: bool = True,
    note: str = "",
) -> Verdict:
    """Met when ``value <= bound``; with ``positive`` (times, ratios of times) only above 0."""
    met = _usable(value, positive) and value <= bound
    return Verdict(budget, fmt.format(value), met, judged, note)


def at_least(
    budget: str,
    value: float,
    bound: float,
    *,
    fmt: str = "{:.2f}",
    positive: bool = True,
    judged: bool = True,
    note: str = "",
) -> Verdict:
    """Met when ``value >= bound`` (a finite value; with ``positive``, above 0)."""
    met = _usable(value, positive) and value >= bound
    return Verdict(budget, fmt.format(value), met, judged, note)


def within(
    budget: str,
    value: float,
    low: float,
    high: float,
    *,
    fmt: str = "{:.2f}",
    judged: bool = True,
    note: str = "",
) -> Verdict:
    """Met when ``low <= value <= high`` (a finite value)."""
    met = math.isfinite(value) and low <= value <= high
    return Verdict(budget, fmt.format(value), met, judged, note)


def exit_status(verdicts: Iterable[Verdict]) -> int:
    return EXIT_MISSED if any(v.judged and not v.met for v in verdicts) else EXIT_MET


def report(verdicts: Iterable[Verdict]) -> int:
    """Prints each verdict's line; the exit status they give."""
    verdicts = list(verdicts)
    for verdict in verdicts:
        print(verdict.line(), flush=True)
    return exit_status(verdicts)


def run(body: Callable[[], int]) -> int:
    """``body()``'s exit status; 2 with what failed when it raised (a failed thread, a wrong
    answer, a server that would not start), with the traceback above it."""
    try:
        return body()
    except Exception as e:  # the run failed: say so, not a figure
        traceback.print_exc()
        print(f"FAILED: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED


class Threads:
    """Worker threads whose failures are the run's: ``join`` raises :class:`WorkFailed` from
    the first error any of them raised (as soon as it is raised), or when one is still
    running at the deadline. Daemon threads: one stuck in a call does not hold the exit."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._finished = 0
        self._cond = threading.Condition()

    def start(self, target: Callable[..., object], *args: object) -> None:
        thread = threading.Thread(target=self._body, args=(target, args), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _body(self, target: Callable[..., object], args: tuple[object, ...]) -> None:
        try:
            target(*args)
        except BaseException as e:  # the joining thread raises it
            with self._cond:
                self._errors.append(e)
        finally:
            with self._cond:
                self._finished += 1
                self._cond.notify_all()

    def check(self) -> None:
        """Raises WorkFailed now if a thread has failed so far (for a caller that polls)."""
        with self._cond:
            errors = list(self._errors)
        self._raise(errors)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._errors and self._finished < len(self._threads):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            errors, finished = list(self._errors), self._finished
        self._raise(errors)
        total = len(self._threads)
        if finished < total:
            raise WorkFailed(
                f"{self.what}: {total - finished} of {total} threads still running after "
                f"{timeout:g} s"
            )

    def _raise(self, errors: list[BaseException]) -> None:
        if errors:
            raise WorkFailed(
                f"{self.what}: {len(errors)} of {len(self._threads)} threads failed; the "
                f"first: {type(errors[0]).__name__}: {errors[0]}"
            ) from errors[0]
