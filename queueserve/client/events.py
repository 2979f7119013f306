"""The caller's side of ``client.stream``: events of one request, in order, and complete.

Events arrive over pub/sub (fast, not durable) and the request's answer over the inbox
(durable). Each event carries a sequence number and the answer says how many events preceded
it, so events are yielded in the order the worker produced them; generator steps lost on the
way are rebuilt from the answer, which holds every item's steps. A lost hook event is lost.

A request can run more than once: its worker dies (or stalls, and comes back) mid-stream and
another runs it again from the start, and with sampling the new run says other things. A
replay announces itself with ``["r", run]`` (its event 0) and tags its events and its answer
with ``run``, a token of its own. The stream follows one run at a time: the first, until a
replay announces itself; then that one (a ``qs.Restart`` tells the caller to discard what the
run it followed had streamed). Events of any other run are dropped, a stalled run's that
resumed included. When the answer comes from a run the stream did not follow, the stream
restarts too, and its steps are rebuilt from the answer: what a caller keeps always adds up
to the answer it gets.
"""

from __future__ import annotations

from typing import Any

from queueserve.client.calls import Call
from queueserve.errors import QueueServeError
from queueserve.hooks import Event, Hook, Output, Restart
from queueserve.wire.kinds import STEPS


class RequestStream:
    """Orders one request's events and completes them from its durable answer."""

    def __init__(self, call: Call, offset: int) -> None:
        self.call = call
        self.offset = offset  # position of the request's first item among the caller's items
        self.next_seq = 0
        self.held: dict[int, list[Any]] = {}
        self.steps_seen = [0] * call.n  # step values received per item, from events
        self.run = 0  # the run whose events are followed: 0 the first, else a replay's token
        self.shown = False  # events of that run were yielded

    def add(self, seq: int, body: list[Any]) -> list[Event]:
        """Take event ``seq``; returns the events now ready, in order."""
        if body[0] == "r":
            return [] if body[1] == self.run else self._follow(body[1], next_seq=1)
        if (body[5] if len(body) == 6 else 0) != self.run:
            return []  # another run's: one this stream left, or one it never heard announced
        if seq >= self.next_seq:
            self.held[seq] = body
        ready: list[Event] = []
        while self.next_seq in self.held:
            ready.append(self._event(self.held.pop(self.next_seq)))
            self.next_seq += 1
        return ready

    def _follow(self, run: int, next_seq: int) -> list[Event]:
        """Follow run ``run`` from its event ``next_seq`` on; a Restart for the caller when
        the run followed so far showed anything."""
        restart: list[Event] = [Restart(self.offset, self.call.n)] if self.shown else []
        self.run, self.next_seq, self.shown = run, next_seq, False
        self.held.clear()
        self.steps_seen = [0] * self.call.n
        return restart

    @property
    def waiting_for_events(self) -> bool:
        """Events the answer says were sent have not all arrived yet."""
        return self.call.run == self.run and self.next_seq < self.call.events_total

    def complete(self) -> tuple[list[Event], QueueServeError | None]:
        """After the answer (and a grace period for stragglers): the remaining events and the
        results, and the error to raise after them (the request's, or its first item's)."""
        call = self.call
        ready = [] if call.run == self.run else self._follow(call.run, call.events_total)
        held = [self.held[s] for s in sorted(self.held)]
        self.held.clear()
        if call.error is not None:
            return ready + [self._event(b) for b in held], call.error
        error = next((r for r in call.results if isinstance(r, QueueServeError)), None)
        if call.kind == STEPS:
            # Steps held behind a gap would come out of order: every step not yet yielded is
            # rebuilt from the answer instead, in step order.
            ready += [self._event(b) for b in held if b[0] == "h"]
            return ready + self._lost_steps(call.results), error
        ready += [self._event(b) for b in held]
        if error is None:
            ready.append(Output(call.results, self.offset, call.n))
        return ready, error

    def _event(self, body: list[Any]) -> Event:
        self.shown = True
        if body[0] == "h":
            _, name, payload, start, size = body[:5]
            return Hook(name, payload, start, size)
        _, _kind, values, first, count = body[:5]
        for i in range(first, first + count):
            self.steps_seen[i] += 1
        return Output(values, self.offset + first, count)

    def _lost_steps(self, results: list[Any]) -> list[Event]:
        """Generator steps the answer has but no event brought: per step, contiguous runs."""
        lost: list[Event] = []
        longest = max((len(r) for r in results if isinstance(r, list)), default=0)
        for k in range(longest):
            run: list[Any] = []
            run_start = 0
            for i, steps in enumerate(results):
                missing = isinstance(steps, list) and len(steps) > k and self.steps_seen[i] <= k
                if missing:
                    if not run:
                        run_start = i
                    run.append(steps[k])
                elif run:
                    lost.append(Output(run, self.offset + run_start, len(run)))
                    run = []
            if run:
                lost.append(Output(run, self.offset + run_start, len(run)))
        return lost
