"""The executor thread of a step serving: continuous batching on one partition.

Each cycle, between two decode steps:

1. withdraw what must leave: waiting or running requests whose callers cancelled or went away
   (answered ``DROP``, their slots free for this very boundary; a streaming caller is gone
   when its client's event channel has had no subscriber for ``caller_gone_after``, looked at
   every ``CALLER_CHECK_EVERY_S``) or whose deadline passed (``Timeout``);
2. measure newly waiting requests (``tokens``, ``prompt_tokens``; errors answer the request),
   look their prompts up in the prefix cache, and let the ``Scheduler`` pick who joins;
3. prefill the joiners (one call per batch key, resuming from cached prefixes), then decode one
   step of every running sequence (one call per batch key: keys never share a call);
4. stream each step's outputs as events (``qs.NO_OUTPUT``: none for that sequence this step),
   take the prefix states that decode offered (a serving may read prompts inside its decode
   steps), and answer every request whose items all ended.

With ``load_key`` (stepping/key_loads.py), each call runs with its key's state
(``serving.key_state``); a key is pinned while its sequences run or join, a key not held is
loaded by a loader thread while the others step on, and its requests join once it is there.

Rows go to the runner's replier like a batch executor's, so replies, acks and events travel the
usual way. A failed prefill or decode answers the sequences of that call with the error — after
bisecting to find the culprit under ``on_error="isolate"`` — and the others go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from queueserve.broker.consumer import Consumer
from queueserve.broker.retry import RedisFailure
from queueserve.hooks import END, NO_OUTPUT
from queueserve.key_states import KeyStates
from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire.error import EXPIRED_GENERATING
from queueserve.wire.kinds import DROP, ERROR
from queueserve.wire.tenants import split_lane
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batching import Request
from queueserve.worker.pipeline.execute import Row
from queueserve.worker.pipeline.ledger import Ledger, cancel_key
from queueserve.worker.pipeline.replies import ReplyQueue
from queueserve.worker.stepping.callers import GoneCallers
from queueserve.worker.stepping.calls import Failed, Member, StepCalls, Tally
from queueserve.worker.stepping.joins import (
    Limits,
    Scheduler,
    StepQueue,
    Waiting,
)
from queueserve.worker.stepping.key_loads import KeyLoads, Keys
from queueserve.worker.stepping.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # how often an idle executor looks whether it should stop


class StepExecutor:
    """Runs one step serving's running set; the runner's only executor for that serving."""

    def __init__(
        self,
        serving: Serving,
        queue: StepQueue,
        ledger: Ledger,
        outbox: ReplyQueue,
        broker: Consumer,
        consumer: str,
        partition: Partition,
        middleware: Middleware,
        *,
        reading: Callable[[], bool],
    ) -> None:
        if not isinstance(serving, StepServing):
            raise TypeError(f"StepExecutor runs StepServings, got {type(serving).__name__}")
        self.serving: StepServing = serving  # the runner's copy: run-time config changes it
        self.ledger = ledger
        self.cond = ledger.cond
        self.outbox = outbox
        self.broker = broker
        self.consumer = consumer
        self.partition = partition
        self.middleware = middleware
        self.reading = reading  # False once the partition stopped reading and all is in
        self.queue = queue
        self.scheduler = Scheduler(Limits.of(serving))
        self.running: list[Member] = []
        self.cache = PrefixCache(serving.prefix_cache_bytes) if serving.prefix_cache_bytes else None
        self.calls = StepCalls(serving, self.cache)
        self.callers = GoneCallers(serving.name, broker, serving.caller_gone_after)
        self.keys = Keys()  # with load_key: KeyLoads (hold())
        # _withdraw looks at every request only when something may leave: a cancel, a caller
        # gone, the earliest deadline it saw passed, or a request arrived since.
        self._next_deadline = 0.0
        self._arrived_seen = -1

    def hold(self, states: KeyStates) -> None:
        """Run the steps with the batch keys' states of ``states`` (the partition's LRU of a
        serving with load_key): pinned while their sequences run or join, loaded off the loop."""
        self.keys = KeyLoads(states, self.cond, self.serving.name, self.cache)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while self._cycle():
                pass
        finally:
            self.keys.stop()
            self.outbox.put(None)

    def _idle(self) -> bool:
        """Wait until something runs or may join (caller holds cond); False once nothing will."""
        while not self.running and (not self.queue.waiting or self.keys.loading(self.queue)):
            if not self.queue.waiting and not self.reading():
                return False
            if not self.cond.wait(IDLE_WAIT_S) and self.queue.waiting:
                break  # a load takes a while: look at what waits for it meanwhile
        return True

    def _cycle(self) -> bool:
        with self.cond:
            if not self._idle():
                return False
            watched = self.callers.watched(self.running, self.queue.waiting)
            departed = self.queue.departed
        gone = self.callers.gone(watched)
        with self.cond:
            self._follow_config()
            rows, left = self._withdraw(gone)
            unmeasured = [w for w in self.queue.waiting if not w.measured]
        rows += self._measure(unmeasured)
        with self.cond:
            failed, release = self.keys.follow(self.queue, self.running)
            rows += failed
            if self.cache is not None:
                self.calls.look_up(self.queue.waiting, self.keys.trie)
            joiners = self.queue.take(self.scheduler, time.monotonic())
            if self.queue.departed != departed:
                # Room for the reader (waiting while a running set's worth waits). Only then:
                # a reader woken for nothing reads Redis again, a round trip per step.
                self.cond.notify_all()
        self.keys.release(release)  # (outside cond: the LRU's lock is taken under none)
        if rows:
            self.outbox.put(rows)
        record = Tally(left=left)
        rows = self._join(joiners, record)
        rows += self._step(record)
        if record.slots or record.joined:
            self.middleware.step(
                self.serving,
                self.partition,
                record.freeze(self.scheduler.tokens + record.released_tokens),
            )
        if rows:
            self.outbox.put(rows)
        return True

    def _follow_config(self) -> None:
        """Take up limits changed at run time (`queueserve config set NAME batch_size=N`
        resizes the slots; caller holds cond). What waits was measured against the old ones:
        a request larger than the new slots would never join, and everything behind it would
        wait for ever. So what the reader would now split is split, and everything waiting is
        measured again: what can never fit now gets BadRequest (``_measure``)."""
        if self.scheduler.limits.hold_for(self.serving):
            return
        self.scheduler.limits = Limits.of(self.serving)
        self.queue.refit()
        for w in self.queue.waiting:
            w.budget = -1

    # -- leaving -------------------------------------------------------------------------------
    def _withdraw(self, gone_callers: set[str]) -> tuple[list[Row], int]:
        """Rows for cancelled, abandoned and expired requests, waiting or running (caller
        holds cond), and how many running sequences left."""
        now = time.time()
        cancelled = self.ledger.cancelled
        if (
            not cancelled
            and not gone_callers
            and now < self._next_deadline
            and self.queue.arrived == self._arrived_seen
        ):
            return [], 0  # nothing cancelled, gone, expired or new since the last look
        self._arrived_seen = self.queue.arrived
        self._next_deadline = math.inf

        def leaving(request: Request) -> tuple[int, Any] | None:
            """(kind, body) of the row that withdraws ``request``, or None: it stays."""
            if (cancelled and cancel_key(request) in cancelled) or request.events in gone_callers:
                return DROP, None
            if request.deadline:
                if request.deadline <= now:
                    return ERROR, EXPIRED_GENERATING
                self._next_deadline = min(self._next_deadline, request.deadline)
            return None

        rows: list[Row] = []
        gone: list[Waiting] = []
        for w in self.queue.waiting:
            why = leaving(w.piece.request)
            if why is not None:
                rows.append((w.piece.request, w.piece.offset, w.slots, *why))
                gone.append(w)
        self.queue.remove(gone)
        left = 0
        for m in list(self.running):
            why = leaving(m.request)
            if why is not None:
                rows.append((m.request, m.offset, len(m.states), *why))
                left += len(m.live())
                self._leave(m)
        return rows, left

    def _leave(self, m: Member) -> None:
        self.running.remove(m)
        self.scheduler.left(m.waiting)

    # -- measuring and joining -----------------------------------------------------------------
    def _measure(self, waiting: list[Waiting]) -> list[Row]:
        """Measure newly waiting slices; those that cannot be, or never fit, are answered."""
        rows, bad = self.calls.measure_all(waiting, self.scheduler.limits)
        if bad:
            with self.cond:
                self.queue.remove(bad)
        return rows

    def _join(self, joiners: list[Waiting], record: Tally) -> list[Row]:
        if not joiners:
            return []
        rows: list[Row] = []
        for w in joiners:
            request = w.piece.request
            if request.redelivered and not request.counted:  # what max_deliveries counts
                request.counted = True
                self._count_delivery(request)
        started = time.perf_counter()
        by_key: dict[str, list[Waiting]] = {}
        for w in joiners:  # tenants' lanes of a key share its calls: the serving sees the key
            by_key.setdefault(split_lane(w.key)[0], []).append(w)
        for key, group in by_key.items():
            rows += self._prefill(key, group, record)
        record.prefill_seconds += time.perf_counter() - started
        return rows

    def _prefill(self, key: str, group: list[Waiting], record: Tally) -> list[Row]:
        items = [item for w in group for item in w.piece.items]
        prompts = [p for w in group for p in (w.prompts or [()] * w.slots)]
        ckey = self.keys.trie(key)
        resumes = [self.calls.resume(tokens, record, ckey) for tokens in prompts]
        with self.keys.calling(self.serving, key):
            outcomes = self.calls.isolated(
                lambda pos: self.serving.prefill_from(
                    [items[i] for i in pos], [resumes[i] for i in pos]
                ),
                list(range(len(items))),
                "prefill",
                key,
            )
        record.joined += len(items)
        record.prefill_tokens += sum(w.prompt for w in group) - sum(r.start for r in resumes)
        self.calls.offered(resumes, ckey)
        rows: list[Row] = []
        pos = 0
        for w in group:
            n = w.slots
            got = outcomes[pos : pos + n]
            pos += n
            m = Member(
                key,
                w,
                [None if isinstance(o, Failed) else o for o in got],
                [[] for _ in range(n)],
                [isinstance(o, Failed) for o in got],
                [o.error if isinstance(o, Failed) else None for o in got],
                resumes[pos - n : pos],
            )
            self.running.append(m)
            if all(m.ended):
                rows += self._finish(m)
        return rows

    def _count_delivery(self, request: Request) -> None:
        try:
            self.broker.count_delivery(request.stream, self.consumer, request.entry_id)
        except RedisFailure as e:  # a reply error (OOM, READONLY) too: never the stepper's end
            log.warning("serving %s: could not count a redelivery: %s", self.serving.name, e)

    def _finish(self, m: Member) -> list[Row]:
        """The answer of a slice whose items all ended, which leaves the running set."""
        self._leave(m)
        with self.keys.calling(self.serving, m.key):
            return self.calls.answer(m)

    # -- one decode step -----------------------------------------------------------------------
    def _step(self, record: Tally) -> list[Row]:
        started = time.perf_counter()
        rows: list[Row] = []
        by_key: dict[str, list[tuple[Member, int]]] = {}
        for m in self.running:  # each member's sequences together, in item order
            ended = m.ended
            if len(ended) == 1:  # most requests: one item
                if not ended[0]:
                    seqs = by_key.get(m.key)
                    if seqs is None:
                        by_key[m.key] = [(m, 0)]
                    else:
                        seqs.append((m, 0))
            elif not all(ended):
                by_key.setdefault(m.key, []).extend((m, i) for i in m.live())
        if not by_key:
            return rows
        for key, seqs in by_key.items():
            rows += self._step_key(key, seqs, record)
        self.scheduler.stepped()
        record.decode_seconds = time.perf_counter() - started
        for m in list(self.running):
            if all(m.ended):
                rows += self._finish(m)
                record.released_tokens += m.waiting.budget
        return rows

    def _step_key(self, key: str, seqs: list[tuple[Member, int]], record: Tally) -> list[Row]:
        """One decode call for the running sequences of ``key``; its rows to send."""
        pieces = [m.waiting.piece for m, _ in seqs]
        self.middleware.batch_opened(self.serving, key, self.partition, pieces)
        self.middleware.batch_started(self.serving, key, self.partition, len(seqs), 0.0)
        call_started = time.perf_counter()
        with self.keys.calling(self.serving, key):
            outcomes = self.calls.isolated(
                partial(self.calls.decode, seqs), list(range(len(seqs))), "decode", key
            )
        call_seconds = time.perf_counter() - call_started
        self.middleware.batch_finished(self.serving, key, self.partition, len(seqs), call_seconds)
        record.slots += len(seqs)
        reading = 0  # sequences still reading their prompts in this call, or finishing it
        for (m, i), out in zip(seqs, outcomes, strict=True):
            if isinstance(out, Failed):
                m.ended[i], m.errors[i] = True, out.error
            elif out is END:
                m.ended[i] = True
            elif out is NO_OUTPUT:
                reading += 1
            else:
                if not m.outputs[i]:
                    reading += 1
                    record.first_outputs.append(m.waiting.piece.request.entry_id)
                m.outputs[i].append(out)
                record.generated += 1
        # A sequence's share of the calls up to its first output is its prompt's reading:
        # prefill time, when a serving reads prompts in decode (what the prefix cache saves).
        record.reading += reading
        record.prefill_seconds += call_seconds * reading / len(seqs)
        if self.cache is not None:
            self.calls.offered([m.resumes[i] for m, i in seqs], self.keys.trie(key))
        return self.calls.events(seqs, outcomes)
