"""What the step executor (step_executor.py) calls of a step serving, and what it makes of what
comes back: measuring requests, prefix-cache lookups and offers, prefill and decode calls with
failures isolated to their culprits, a step's output events and a finished request's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from queueserve.hooks import END, NO_OUTPUT
from queueserve.steps import Resume, StepServing
from queueserve.wire.error import error_body
from queueserve.wire.event import output_event
from queueserve.wire.kinds import ERR_BAD_REQUEST, ERROR, RESULTS, STEPS
from queueserve.worker.pipeline.batch_context import event_rows
from queueserve.worker.pipeline.batching import Request
from queueserve.worker.pipeline.execute import Row, _free_device_memory, is_out_of_memory
from queueserve.worker.stepping.joins import Limits, StepRecord, Waiting, split_runs, too_large
from queueserve.worker.stepping.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

Outcome = Any  # a value, or an error body (list[str]) wrapped in Failed


class _ContractError(ValueError):
    """prefill or decode returned other than one entry per sequence."""


@dataclass(frozen=True, slots=True)
class Failed:
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


class StepCalls:
    """One step serving's calls, with its prefix cache (None without one)."""

    def __init__(self, serving: StepServing, cache: PrefixCache | None) -> None:
        self.serving = serving
        self.cache = cache
        # Default answers are the step lists themselves: sent as STEPS, a caller's stream can
        # rebuild steps lost on the way from them. Custom results come as a final Output.
        self.custom_result = not serving.answers_outputs()

    def measure(self, w: Waiting) -> None:
        """``tokens`` (and, with a prefix cache, ``prompt_tokens``) of each item of ``w``;
        ValueError naming the method and the item's problem (the caller learns which of its
        calls failed, and nothing the serving returned reaches the cache unchecked)."""
        budget = prompt = 0
        for item in w.piece.items:
            got = self._call("tokens", item)
            if (
                not isinstance(got, tuple | list)
                or len(got) != 2
                or not all(isinstance(n, int) and n >= 0 for n in got)
            ):
                raise ValueError(
                    f"{type(self.serving).__name__}.tokens(item) returned {short(got)}; "
                    "return (prompt tokens, most generated tokens) as ints >= 0"
                )
            budget, prompt = budget + got[0] + got[1], prompt + got[0]
        if self.cache is not None:
            w.prompts = [self._prompt(item) for item in w.piece.items]
        w.budget, w.prompt = budget, prompt

    def measure_all(
        self, waiting: list[Waiting], limits: Limits
    ) -> tuple[list[Row], list[Waiting]]:
        """``measure`` each slice (outside the lock: serving code): the rows answering those
        whose items cannot be measured, or that can never fit, with BadRequest, and those."""
        rows: list[Row] = []
        bad: list[Waiting] = []
        for w in waiting:
            try:
                self.measure(w)
                reason = too_large(w, limits)
                if reason is not None:
                    raise ValueError(reason)
            except Exception as e:  # serving code, or what it returned: this request's error
                body = error_body(e, ERR_BAD_REQUEST)
                rows.append((w.piece.request, w.piece.offset, w.slots, ERROR, body))
                bad.append(w)
        return rows, bad

    def look_up(self, waiting: Iterable[Waiting], trie: Callable[[str], str]) -> None:
        """What the prefix cache covers of each waiting prompt, looked up again whenever the
        cache changed; ``trie``: whose entries a request's key may use (key_loads.py)."""
        cache = self.cache
        assert cache is not None
        for w in waiting:
            if w.measured and w.looked != cache.version:
                w.cached, w.looked = self.cached_tokens(w, trie(w.key)), cache.version

    def _call(self, method: str, item: Any) -> Any:
        try:
            return getattr(self.serving, method)(item)
        except Exception as e:
            raise ValueError(
                f"{type(self.serving).__name__}.{method}(item) failed for this item: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _prompt(self, item: Any) -> tuple[Hashable, ...]:
        """The item's prompt tokens as the cache's trie keys them: hashable, or ValueError."""
        tokens = self._call("prompt_tokens", item)
        if tokens is None:
            return ()
        try:
            key = tuple(tokens)
            hash(key)  # every token, once: the trie's lookups and puts hash each of them
        except Exception as e:
            raise ValueError(
                f"{type(self.serving).__name__}.prompt_tokens(item) returned "
                f"{short(tokens)}, which cannot key the prefix cache ({type(e).__name__}: "
                f"{e}); return a sequence of hashable tokens (ints, strs, tuples), or None"
            ) from None
        return key

    def cached_tokens(self, w: Waiting, key: str = "") -> int:
        assert self.cache is not None and w.prompts is not None
        return sum(self.cache.lookup(tokens, key)[0] for tokens in w.prompts if tokens)

    def offered(self, resumes: list[Resume], key: str = "") -> None:
        """Put the states offered with ``Resume.keep`` (in prefill, or in decode while a
        sequence reads its prompt there) into ``key``'s trie of the cache."""
        for r in resumes:
            if r.kept:
                if self.cache is not None:
                    for length, state, nbytes in r.kept:
                        self.cache.put(r.tokens, length, state, nbytes, key)
                r.kept.clear()

    def resume(self, tokens: tuple[Hashable, ...], record: Tally, key: str = "") -> Resume:
        if self.cache is None or not tokens:
            return Resume(tokens)
        start, state = self.cache.lookup(tokens, key)
        if start:
            record.cache_hits += 1
            record.cache_saved_tokens += start
        else:
            record.cache_misses += 1
        return Resume(tokens, start, state)

    def decode(self, seqs: list[tuple[Member, int]], pos: list[int]) -> list[Any]:
        return self.serving.decode([seqs[j][0].states[seqs[j][1]] for j in pos])

    def events(self, seqs: list[tuple[Member, int]], outcomes: list[Outcome]) -> list[Row]:
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
                    if not isinstance(out, Failed) and out is not END and out is not NO_OUTPUT:
                        rows += event_rows(m.request, output_event([out], m.offset))
                else:
                    rows += self._member_events(m, seqs[k:end], outcomes[k:end])
            k = end
        return rows

    def _member_events(
        self, m: Member, seqs: list[tuple[Member, int]], outcomes: list[Outcome]
    ) -> list[Row]:
        n = len(m.states)
        values: list[Any] = [None] * n
        present = [False] * n
        for (_, i), out in zip(seqs, outcomes, strict=True):
            if not isinstance(out, Failed) and out is not END and out is not NO_OUTPUT:
                values[i], present[i] = out, True
        return [
            row
            for start, run in split_runs(values, present)
            for row in event_rows(m.request, output_event(run, m.offset + start))
        ]

    def answer(self, m: Member) -> list[Row]:
        """The answer of a slice whose items all ended: runs of results, and the errors."""
        n = len(m.states)
        results: list[Any] = []
        kind = RESULTS if self.custom_result else STEPS
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
                rows.append((m.request, m.offset + i, 1, ERROR, error))
        return rows

    def isolated(
        self,
        call: Callable[[list[int]], list[Any]],
        pos: list[int],
        what: str,
        key: str,
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
            if (
                len(pos) == 1
                or isinstance(e, _ContractError)
                or (self.serving.on_error == "fail" and not oom)
            ):
                log.warning(
                    "serving %s key %s: %s of %d sequences failed: %r",
                    self.serving.name,
                    key,
                    what,
                    len(pos),
                    e,
                )
                return [Failed(error_body(e))] * len(pos)
            if oom:
                _free_device_memory()
            mid = len(pos) // 2
            return self.isolated(call, pos[:mid], what, key) + self.isolated(
                call, pos[mid:], what, key
            )


@dataclass(slots=True)
class Tally:
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
    first_outputs: list[bytes] = field(default_factory=list)  # entry ids: a first output each

    def freeze(self, batch_tokens: int) -> StepRecord:
        return StepRecord(
            self.slots,
            batch_tokens,
            self.joined,
            self.prefill_tokens,
            self.left,
            self.generated,
            self.prefill_seconds,
            self.decode_seconds,
            self.cache_hits,
            self.cache_misses,
            self.cache_saved_tokens,
            self.reading,
            tuple(self.first_outputs),
        )


def short(value: Any, most: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."
