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

Rows go to the runner's replier like a batch executor's, so replies, acks and events travel the
usual way. A failed prefill or decode answers the sequences of that call with the error — after
bisecting to find the culprit under ``on_error="isolate"`` — and the others go on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from queueserve.broker.consumer import Consumer
from queueserve.errors import RedisCommandError, RedisUnavailable
from queueserve.hooks import END, NO_OUTPUT
from queueserve.serving import Partition, Serving
from queueserve.steps import Resume, StepServing
from queueserve.wire import protocol as P
from queueserve.wire.error import EXPIRED_GENERATING, error_body
from queueserve.wire.event import output_event
from queueserve.wire.timing import CALLER_CHECK_EVERY_S
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batch_context import event_rows
from queueserve.worker.pipeline.batching import Request
from queueserve.worker.pipeline.execute import Row, _free_device_memory, is_out_of_memory
from queueserve.worker.pipeline.ledger import Ledger
from queueserve.worker.pipeline.prefix_cache import PrefixCache
from queueserve.worker.pipeline.replies import ReplyQueue
from queueserve.worker.pipeline.stepping import (
    CallerWatch,
    Limits,
    Scheduler,
    StepQueue,
    StepRecord,
    Waiting,
    split_runs,
    too_large,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # how often an idle executor looks whether it should stop

Outcome = Any  # a value, or an error body (list[str]) wrapped in _Failed


class _ContractError(ValueError):
    """prefill or decode returned other than one entry per sequence."""


@dataclass(frozen=True, slots=True)
class _Failed:
    error: list[str]


@dataclass(eq=False, slots=True)
class Member:
    """One waiting slice that joined: its items are sequences of the running set."""

    key: str
    waiting: Waiting
    states: list[Any]
    outputs: list[list[Any]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    errors: list[list[str] | None] = field(default_factory=list)
    resumes: list[Resume] = field(default_factory=list)  # per item: its prefix-cache offers

    @property
    def request(self) -> Request:
        return self.waiting.piece.request

    @property
    def offset(self) -> int:
        return self.waiting.piece.offset

    def live(self) -> list[int]:
        return [i for i, done in enumerate(self.ended) if not done]


class StepExecutor:
    """Runs one step serving's running set; the runner's only executor for that serving."""

    def __init__(
        self, serving: Serving, queue: StepQueue, ledger: Ledger, outbox: ReplyQueue,
        broker: Consumer, consumer: str, partition: Partition, middleware: Middleware, *,
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
        # Default answers are the step lists themselves: sent as STEPS, a caller's stream can
        # rebuild steps lost on the way from them. Custom results come as a final Output.
        self.custom_result = not serving.answers_outputs()
        gone_after = serving.caller_gone_after
        self.callers = (None if gone_after is None
                        else CallerWatch(gone_after, min(CALLER_CHECK_EVERY_S, gone_after)))
        # _withdraw looks at every request only when something may leave: a cancel, a caller
        # gone, the earliest deadline it saw passed, or a request arrived since.
        self._next_deadline = 0.0
        self._arrived_seen = -1

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while self._cycle():
                pass
        finally:
            self.outbox.put(None)

    def _cycle(self) -> bool:
        with self.cond:
            while not self.running and not self.queue.waiting:
                if not self.reading():
                    return False
                self.cond.wait(IDLE_WAIT_S)
            watched = self._watched()
            departed = self.queue.departed
        gone = self._gone(watched)
        with self.cond:
            self._follow_config()
            rows, left = self._withdraw(gone)
            unmeasured = [w for w in self.queue.waiting if not w.measured]
        rows += self._measure(unmeasured)
        with self.cond:
            if self.cache is not None:
                for w in self.queue.waiting:
                    if w.measured and w.looked != self.cache.version:
                        w.cached, w.looked = self._cached_tokens(w), self.cache.version
            joiners = self.queue.take(self.scheduler)
            if self.queue.departed != departed:
                # Room for the reader (waiting while a running set's worth waits). Only then:
                # a reader woken for nothing reads Redis again, a round trip per step.
                self.cond.notify_all()
        if rows:
            self.outbox.put(rows)
        record = _Tally(left=left)
        rows = self._join(joiners, record)
        rows += self._step(record)
        if record.slots or record.joined:
            self.middleware.step(self.serving, self.partition, record.freeze(
                self.scheduler.tokens + record.released_tokens))
        if rows:
            self.outbox.put(rows)
        return True

    def _follow_config(self) -> None:
        """Take up limits changed at run time (`queueserve config set NAME batch_size=N`
        resizes the slots; caller holds cond). What waits was measured against the old ones:
        a request larger than the new slots would never join, and everything behind it would
        wait for ever. So what the reader would now split is split, and everything waiting is
        measured again: what can never fit now gets BadRequest (``_measure``)."""
        limits = Limits.of(self.serving)
        if limits == self.scheduler.limits:
            return
        self.scheduler.limits = limits
        self.queue.refit()
        for w in self.queue.waiting:
            w.budget = -1

    # -- leaving -------------------------------------------------------------------------------
    def _watched(self) -> set[str] | None:
        """The event channels of streaming callers, when it is time to look whether they are
        still there (caller holds cond); None otherwise."""
        if self.callers is None or not self.callers.due(time.monotonic()):
            return None
        requests = [m.request for m in self.running] + [w.piece.request
                                                        for w in self.queue.waiting]
        return {r.events for r in requests if r.events}

    def _gone(self, channels: set[str] | None) -> set[str]:
        """The channels among ``channels`` whose callers went away (one PUBSUB NUMSUB)."""
        if channels is None or self.callers is None:
            return set()
        try:
            counts: dict[str, int] | None = self.broker.subscribers(sorted(channels))
        except (RedisUnavailable, RedisCommandError) as e:
            log.debug("serving %s: could not count subscribers: %s", self.serving.name, e)
            counts = None
        gone = self.callers.looked(time.monotonic(), counts)
        if gone:
            log.info("serving %s: %d streaming caller(s) gone (no subscriber for %gs): their "
                     "requests leave", self.serving.name, len(gone), self.callers.gone_after)
        return gone

    def _withdraw(self, gone_callers: set[str]) -> tuple[list[Row], int]:
        """Rows for cancelled, abandoned and expired requests, waiting or running (caller
        holds cond), and how many running sequences left."""
        now = time.time()
        cancelled = self.ledger.cancelled
        if (not cancelled and not gone_callers and now < self._next_deadline
                and self.queue.arrived == self._arrived_seen):
            return [], 0  # nothing cancelled, gone, expired or new since the last look
        self._arrived_seen = self.queue.arrived
        self._next_deadline = math.inf

        def leaving(request: Request) -> tuple[int, Any] | None:
            """(kind, body) of the row that withdraws ``request``, or None: it stays."""
            if request.ref in cancelled or request.events in gone_callers:
                return P.DROP, None
            if request.deadline:
                if request.deadline <= now:
                    return P.ERROR, EXPIRED_GENERATING
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
        self.scheduler.left(m.waiting.slots, m.waiting.budget, m.request.alone)

    # -- measuring and joining -----------------------------------------------------------------
    def _measure(self, waiting: list[Waiting]) -> list[Row]:
        """Set each slice's budget, prompt size and prompt tokens (outside the lock: serving
        code); a slice whose items cannot be measured, or that can never fit, is answered
        with BadRequest and removed."""
        rows: list[Row] = []
        bad: list[Waiting] = []
        limits = self.scheduler.limits
        for w in waiting:
            try:
                self._measure_one(w)
                reason = too_large(w, limits)
                if reason is not None:
                    raise ValueError(reason)
            except Exception as e:  # serving code, or what it returned: this request's error
                rows.append((w.piece.request, w.piece.offset, w.slots, P.ERROR,
                             error_body(e, P.ERR_BAD_REQUEST)))
                bad.append(w)
        if bad:
            with self.cond:
                self.queue.remove(bad)
        return rows

    def _measure_one(self, w: Waiting) -> None:
        """``tokens`` (and, with a prefix cache, ``prompt_tokens``) of each item of ``w``;
        ValueError naming the method and the item's problem (the caller learns which of its
        calls failed, and nothing the serving returned reaches the cache unchecked)."""
        budget = prompt = 0
        for item in w.piece.items:
            got = self._serving_call("tokens", item)
            if (not isinstance(got, tuple | list) or len(got) != 2
                    or not all(isinstance(n, int) and n >= 0 for n in got)):
                raise ValueError(
                    f"{type(self.serving).__name__}.tokens(item) returned {_short(got)}; "
                    "return (prompt tokens, most generated tokens) as ints >= 0"
                )
            budget, prompt = budget + got[0] + got[1], prompt + got[0]
        if self.cache is not None:
            w.prompts = [self._prompt(item) for item in w.piece.items]
        w.budget, w.prompt = budget, prompt

    def _serving_call(self, method: str, item: Any) -> Any:
        try:
            return getattr(self.serving, method)(item)
        except Exception as e:
            raise ValueError(
                f"{type(self.serving).__name__}.{method}(item) failed for this item: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _prompt(self, item: Any) -> tuple[Hashable, ...]:
        """The item's prompt tokens as the cache's trie keys them: hashable, or ValueError."""
        tokens = self._serving_call("prompt_tokens", item)
        if tokens is None:
            return ()
        try:
            key = tuple(tokens)
            hash(key)  # every token, once: the trie's lookups and puts hash each of them
        except Exception as e:
            raise ValueError(
                f"{type(self.serving).__name__}.prompt_tokens(item) returned "
                f"{_short(tokens)}, which cannot key the prefix cache ({type(e).__name__}: "
                f"{e}); return a sequence of hashable tokens (ints, strs, tuples), or None"
            ) from None
        return key

    def _cached_tokens(self, w: Waiting) -> int:
        assert self.cache is not None and w.prompts is not None
        return sum(self.cache.lookup(tokens)[0] for tokens in w.prompts if tokens)

    def _join(self, joiners: list[Waiting], record: _Tally) -> list[Row]:
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
        for w in joiners:
            by_key.setdefault(w.key, []).append(w)
        for key, group in by_key.items():
            rows += self._prefill(key, group, record)
        record.prefill_seconds += time.perf_counter() - started
        return rows

    def _prefill(self, key: str, group: list[Waiting], record: _Tally) -> list[Row]:
        items = [item for w in group for item in w.piece.items]
        prompts = [p for w in group for p in (w.prompts or [()] * w.slots)]
        resumes = [self._resume(tokens, record) for tokens in prompts]
        outcomes = self._isolated(
            lambda pos: self.serving.prefill_from([items[i] for i in pos],
                                                  [resumes[i] for i in pos]),
            list(range(len(items))), "prefill", key,
        )
        record.joined += len(items)
        record.prefill_tokens += sum(w.prompt for w in group) - sum(r.start for r in resumes)
        self._offered(resumes)
        rows: list[Row] = []
        pos = 0
        for w in group:
            n = w.slots
            got = outcomes[pos:pos + n]
            pos += n
            m = Member(key, w, [None if isinstance(o, _Failed) else o for o in got],
                       [[] for _ in range(n)], [isinstance(o, _Failed) for o in got],
                       [o.error if isinstance(o, _Failed) else None for o in got],
                       resumes[pos - n:pos])
            self.running.append(m)
            if all(m.ended):
                rows += self._finish(m)
        return rows

    def _offered(self, resumes: list[Resume]) -> None:
        """Put the states offered with ``Resume.keep`` (in prefill, or in decode while a
        sequence reads its prompt there) into the cache."""
        for r in resumes:
            if r.kept:
                if self.cache is not None:
                    for length, state, nbytes in r.kept:
                        self.cache.put(r.tokens, length, state, nbytes)
                r.kept.clear()

    def _resume(self, tokens: tuple[Hashable, ...], record: _Tally) -> Resume:
        if self.cache is None or not tokens:
            return Resume(tokens)
        start, state = self.cache.lookup(tokens)
        if start:
            record.cache_hits += 1
            record.cache_saved_tokens += start
        else:
            record.cache_misses += 1
        return Resume(tokens, start, state)

    def _count_delivery(self, request: Request) -> None:
        try:
            self.broker.count_delivery(request.stream, self.consumer,
                                              request.entry_id)
        except RedisUnavailable as e:
            log.warning("serving %s: could not count a redelivery: %s", self.serving.name, e)

    # -- one decode step -----------------------------------------------------------------------
    def _step(self, record: _Tally) -> list[Row]:
        started = time.perf_counter()
        rows: list[Row] = []
        by_key: dict[str, list[tuple[Member, int]]] = {}
        for m in self.running:  # each member's sequences together, in item order
            seqs = by_key.setdefault(m.key, [])
            if len(m.ended) == 1:
                if not m.ended[0]:
                    seqs.append((m, 0))
            else:
                seqs += [(m, i) for i in m.live()]
        for key in [key for key, seqs in by_key.items() if not seqs]:
            del by_key[key]
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

    def _step_key(self, key: str, seqs: list[tuple[Member, int]], record: _Tally) -> list[Row]:
        """One decode call for the running sequences of ``key``; its rows to send."""
        self.middleware.batch_started(
            self.serving, key, self.partition, len(seqs), 0.0)
        call_started = time.perf_counter()
        outcomes = self._isolated(
            partial(self._decode, seqs), list(range(len(seqs))), "decode", key)
        call_seconds = time.perf_counter() - call_started
        self.middleware.batch_finished(
            self.serving, key, self.partition, len(seqs), call_seconds)
        record.slots += len(seqs)
        reading = 0  # sequences still reading their prompts in this call, or finishing it
        for (m, i), out in zip(seqs, outcomes, strict=True):
            if isinstance(out, _Failed):
                m.ended[i], m.errors[i] = True, out.error
            elif out is END:
                m.ended[i] = True
            elif out is NO_OUTPUT:
                reading += 1
            else:
                reading += not m.outputs[i]
                m.outputs[i].append(out)
                record.generated += 1
        # A sequence's share of the calls up to its first output is its prompt's reading:
        # prefill time, when a serving reads prompts in decode (what the prefix cache saves).
        record.reading += reading
        record.prefill_seconds += call_seconds * reading / len(seqs)
        if self.cache is not None:
            self._offered([m.resumes[i] for m, i in seqs])
        return self._stream(seqs, outcomes)

    def _decode(self, seqs: list[tuple[Member, int]], pos: list[int]) -> list[Any]:
        return self.serving.decode([seqs[j][0].states[seqs[j][1]] for j in pos])

    def _stream(self, seqs: list[tuple[Member, int]], outcomes: list[Outcome]) -> list[Row]:
        """This step's output events, per request: one per run of consecutive items."""
        rows: list[Row] = []
        k, count = 0, len(seqs)
        while k < count:  # a member's sequences are consecutive in seqs (see _step)
            m = seqs[k][0]
            end = k + 1
            while end < count and seqs[end][0] is m:
                end += 1
            if m.request.events:
                if len(m.states) == 1:  # most requests: one item, one value or none
                    out = outcomes[k]
                    if not isinstance(out, _Failed) and out is not END and out is not NO_OUTPUT:
                        rows += event_rows(m.request, output_event([out], m.offset))
                else:
                    rows += self._member_events(m, seqs[k:end], outcomes[k:end])
            k = end
        return rows

    def _member_events(self, m: Member, seqs: list[tuple[Member, int]],
                       outcomes: list[Outcome]) -> list[Row]:
        n = len(m.states)
        values: list[Any] = [None] * n
        present = [False] * n
        for (_, i), out in zip(seqs, outcomes, strict=True):
            if not isinstance(out, _Failed) and out is not END and out is not NO_OUTPUT:
                values[i], present[i] = out, True
        return [row for start, run in split_runs(values, present)
                for row in event_rows(m.request, output_event(run, m.offset + start))]

    def _finish(self, m: Member) -> list[Row]:
        """The answer of a slice whose items all ended: runs of results, and the errors."""
        self._leave(m)
        n = len(m.states)
        results: list[Any] = []
        kind = P.RESULTS if self.custom_result else P.STEPS
        for i in range(n):
            if m.errors[i] is not None:
                results.append(None)
                continue
            if not self.custom_result:
                results.append(m.outputs[i])
                continue
            try:
                results.append(self.serving.result(m.states[i], m.outputs[i]))
            except Exception as e:
                m.errors[i] = error_body(e)
                results.append(None)
        rows: list[Row] = []
        ok = [e is None for e in m.errors]
        for start, run in split_runs(results, ok):
            rows.append((m.request, m.offset + start, len(run), kind, run))
        for i, error in enumerate(m.errors):
            if error is not None:
                rows.append((m.request, m.offset + i, 1, P.ERROR, error))
        return rows

    # -- failures ------------------------------------------------------------------------------
    def _isolated(
        self, call: Callable[[list[int]], list[Any]], pos: list[int], what: str, key: str,
    ) -> list[Outcome]:
        """``call`` over positions ``pos``: one outcome each. When it raises, under
        on_error="isolate" (or out of device memory) retry on halves, so only the culprits
        get the error."""
        try:
            out = call(pos)
            if not isinstance(out, list | tuple) or len(out) != len(pos):
                got = len(out) if isinstance(out, list | tuple) else type(out).__name__
                raise _ContractError(
                    f"{type(self.serving).__name__}.{what} returned {got} for {len(pos)} "
                    f"sequences; return a list with one entry per sequence"
                )
            return list(out)
        except Exception as e:
            oom = is_out_of_memory(e)
            # A broken contract is the call's, not one sequence's: bisecting would not help.
            if len(pos) == 1 or isinstance(e, _ContractError) or (
                    self.serving.on_error == "fail" and not oom):
                log.warning("serving %s key %s: %s of %d sequences failed: %r",
                            self.serving.name, key, what, len(pos), e)
                return [_Failed(error_body(e))] * len(pos)
            if oom:
                _free_device_memory()
            mid = len(pos) // 2
            return (self._isolated(call, pos[:mid], what, key)
                    + self._isolated(call, pos[mid:], what, key))


@dataclass(slots=True)
class _Tally:
    """A step's figures as they are gathered (frozen into a StepRecord)."""

    left: int = 0
    slots: int = 0
    joined: int = 0
    prefill_tokens: int = 0
    generated: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_saved_tokens: int = 0
    reading: int = 0
    released_tokens: int = 0  # budgets of requests that finished after this step

    def freeze(self, batch_tokens: int) -> StepRecord:
        return StepRecord(
            self.slots, batch_tokens, self.joined, self.prefill_tokens, self.left,
            self.generated, self.prefill_seconds, self.decode_seconds, self.cache_hits,
            self.cache_misses, self.cache_saved_tokens, self.reading,
        )


def _short(value: Any, most: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."
