"""Step servings: generation served by continuous batching (TGI's router, ai00's slots).

A step serving runs a *running set* of sequences on its partition, one decode step at a time.
Between two steps, finished, cancelled, expired and abandoned sequences (a streaming caller
gone: ``caller_gone_after``) leave, and waiting requests join (their prompts are prefilled)
while slots and token budgets allow. Each item of a request is one sequence with a slot of its
own; every step's output streams to ``client.stream`` callers, and a request's answer is the
list of its items' results.

>>> import queueserve as qs
>>> class Countdown(qs.StepServing):
...     name = "countdown"
...     max_slots = 4
...     def prefill(self, items):
...         return [{"left": n} for n in items]
...     def decode(self, states):
...         out = []
...         for s in states:
...             s["left"] -= 1
...             out.append(qs.END if s["left"] < 0 else s["left"])
...         return out
>>> Countdown().inline_many([2, 0])
[[1, 0], []]

A prefix state cache (``prefix_cache_bytes``) lets a request resume from the state of its
longest cached prompt prefix: the serving says what its prompt is (``prompt_tokens``), offers
states to keep while it prefills (``Resume.keep``) and starts from the one it is given
(``prefill_from``). See docs/generation.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

from queueserve.options.serving_options import StepOptions, resolve
from queueserve.serving import Batch, Serving
from queueserve.static_steps import static_results, static_steps

_calling = threading.local()  # .states: id(serving) -> its key's state, around each call


@contextlib.contextmanager
def keyed(serving: StepServing, state: Any) -> Iterator[None]:
    """Run the block with ``serving.key_state`` set to ``state`` in this thread (the step
    executor around each call of one key's sequences; ``handle_batch`` in inline runs)."""
    states: dict[int, Any] = _calling.__dict__.setdefault("states", {})
    outer = states.get(id(serving))
    states[id(serving)] = state
    try:
        yield
    finally:
        if outer is None:
            del states[id(serving)]
        else:
            states[id(serving)] = outer


@dataclass(slots=True)
class Resume:
    """One item's prefill, as the prefix cache sees it (given to ``prefill_from``).

    ``tokens`` is the item's prompt as ``prompt_tokens`` returned it (``()`` when it has none);
    ``start`` tokens of it are already covered by ``state``, a cached state (``None``, start 0:
    nothing cached). The cached state is shared: read it, never change it in place.
    """

    tokens: tuple[Hashable, ...]
    start: int = 0
    state: Any = None
    kept: list[tuple[int, Any, int]] = field(default_factory=list)

    def keep(self, length: int, state: Any, nbytes: int) -> None:
        """Offer the state after the first ``length`` prompt tokens to the cache (a copy the
        serving will not change again; ``nbytes`` is its size, for the cache's bound). Does
        nothing when the item is not cached (no cache, or no ``prompt_tokens``)."""
        if not self.tokens:
            return
        if not 0 < length <= len(self.tokens):
            raise ValueError(
                f"keep(length={length}) is outside the prompt's {len(self.tokens)} tokens; "
                "offer states for prefixes of the prompt that prompt_tokens() returned"
            )
        self.kept.append((length, state, nbytes))


class StepServing(Serving):
    """A serving that generates step by step, under continuous batching.

    Subclass it and define ``prefill`` and ``decode`` (``setup(partition)`` loads the model):

    - ``prefill(items) -> states``: one state per joining item (a batch of joiners);
    - ``decode(states) -> outputs``: one step for every running sequence, one output per state,
      ``qs.END`` when that sequence is finished, or ``qs.NO_OUTPUT`` when it goes on without an
      output this step (say, it read prompt positions inside the batched step, so a join
      costs the running set one cheap row instead of a pause); the serving owns and updates
      its states;
    - ``result(state, outputs)``: an item's answer (default: the list of its outputs);
    - ``tokens(item) -> (prompt, most generated)``: what the item costs the token budgets.

    Many models (docs/usage.md, "Many models behind one serving"): a step serving may define
    ``load_key(key)`` (and ``unload_key``, ``state_bytes``, ``max_loaded_keys``,
    ``max_loaded_bytes``) as a ``qs.Serving`` does. Each ``prefill``/``prefill_from``,
    ``decode`` and ``result`` call then runs the sequences of one batch key, and
    ``self.key_state`` is what ``load_key`` returned for that key (a key with a sequence
    running or joining is never evicted; a key is loaded off the step loop while other keys'
    sequences step on). ``tokens`` and ``prompt_tokens`` measure a request before its key is
    loaded: ``key_state`` is None there, as it is in every call without ``load_key``.

    Options (class attributes or keyword arguments; defaults in brackets):

    - ``max_slots`` [8]: sequences in the running set (the step serving's batch size);
    - ``max_batch_tokens`` [4096]: prompt plus generation budget of the running set, summed
      over its sequences (TGI's ``max_batch_total_tokens``): a sequence joins only when its
      whole budget fits, so a running set never outgrows it;
    - ``max_prefill_tokens`` [1024]: prompt tokens prefilled in one join (after the cache);
    - ``waiting_served_ratio`` [0.3] and ``max_waiting_steps`` [20]: the join policy. While
      sequences run, joining pauses them for a prefill, so waiting requests join only when at
      least ``waiting_served_ratio`` x running of them can join at once, or when
      ``max_waiting_steps`` steps passed since the last join (TGI's ``waiting_served_ratio``
      and ``max_waiting_tokens``). An idle serving admits at once;
    - ``prefix_cache_bytes`` [0 = off]: bound of the prefix state cache, per partition;
    - ``caller_gone_after`` [10.0 s; None: never]: a ``client.stream`` caller whose client has
      not been subscribed to its event channel for this long (its process died, or it closed
      its client) is gone: its requests leave, waiting or running, and their slots are reused.
      Looked at every second between steps, so a slot is freed within ``caller_gone_after``
      + 1 s + one step. Requests sent without streaming carry no such signal and run on.

    Requests join whole and in arrival order; one that can never fit (more items than
    ``max_slots``, a budget over ``max_batch_tokens``, a prompt over ``max_prefill_tokens``) is
    answered with an error at once. ``batch_timeout`` does not apply: requests join at the next
    step boundary. ``max_latency`` is refused (TypeError): nothing waits for a batch to close,
    and a sequence's time depends on what it generates (docs/generation.md).
    ``on_error="isolate"`` (default) retries a failed prefill or decode on halves to find the
    culprit, so decode must compute a step before it changes any state.
    """

    # Defaults and bounds: StepOptions in options/serving_options.py.
    max_slots: int
    max_batch_tokens: int
    max_prefill_tokens: int
    waiting_served_ratio: float
    max_waiting_steps: int
    prefix_cache_bytes: int
    caller_gone_after: float | None

    def __init__(
        self,
        *,
        max_slots: int | None = None,
        max_batch_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        waiting_served_ratio: float | None = None,
        max_waiting_steps: int | None = None,
        prefix_cache_bytes: int | None = None,
        caller_gone_after: float | EllipsisType | None = ...,  # ...: the class's
        **options: Any,
    ) -> None:
        if "batch_size" in options:
            raise TypeError("a StepServing's batch size is max_slots: pass max_slots=")
        # The options given as keywords (each parameter is named as its StepOptions field)
        given = {k: v for k, v in locals().items() if k in StepOptions.model_fields}
        chosen = {k: v for k, v in given.items() if v is not None and v is not ...}
        if caller_gone_after is None:  # a value here: never look (...: the class's)
            chosen["caller_gone_after"] = None
        step = resolve(StepOptions, type(self), chosen)
        super().__init__(batch_size=step.max_slots, **options)
        if self.max_latency:
            raise TypeError(
                f"max_latency is not an option of a StepServing (got {self.max_latency:g} s): "
                "a request joins the running set at the next step, never waiting for a batch to "
                "close, and how long it runs depends on what it generates; bound its wait to "
                "join with max_waiting_steps and waiting_served_ratio"
            )
        vars(self).update(step)

    @property
    def key_state(self) -> Any:
        """What ``load_key`` returned for the batch key whose sequences the current
        ``prefill``, ``prefill_from``, ``decode`` or ``result`` call runs (None outside those
        calls, and without ``load_key``).

        >>> class Adapters(qs.StepServing):
        ...     max_loaded_keys = 2
        ...     def load_key(self, key):
        ...         return {"step": len(key)}  # a model, an adapter...
        ...     def prefill(self, items):
        ...         return [{"left": n} for n in items]
        ...     def decode(self, states):
        ...         out = []
        ...         for s in states:
        ...             s["left"] -= self.key_state["step"]
        ...             out.append(qs.END if s["left"] < 0 else s["left"])
        ...         return out
        >>> Adapters(batch_key=lambda item: "ab").inline(5)
        [3, 1]
        """
        return getattr(_calling, "states", {}).get(id(self))

    # -- what a subclass defines -------------------------------------------------------------
    def prefill(self, items: list[Any]) -> list[Any]:
        """States for joining ``items``, one per item (the prompt read, nothing generated)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define prefill(self, items) -> states "
            "(or prefill_from(self, items, resumes))"
        )

    def decode(self, states: list[Any]) -> list[Any]:
        """One step of every state in ``states``: an output each, ``qs.END`` (finished) or
        ``qs.NO_OUTPUT`` (goes on, nothing to show this step)."""
        raise NotImplementedError(f"{type(self).__name__} must define decode(self, states)")

    def result(self, state: Any, outputs: list[Any]) -> Any:
        """An item's answer once it ended (default: its outputs, one per step)."""
        return outputs

    def tokens(self, item: Any) -> tuple[int, int]:
        """(prompt tokens, most tokens it may generate) of ``item``, for the budgets.
        Default: ``len(item)`` (1 when it has none) and 256."""
        try:
            prompt = len(item)
        except TypeError:
            prompt = 1
        return prompt, 256

    def answers_outputs(self) -> bool:
        """True when an item's answer is its outputs (``result`` is not overridden)."""
        return type(self).result is StepServing.result

    # -- prefix cache (optional) -------------------------------------------------------------
    def prompt_tokens(self, item: Any) -> Sequence[Hashable] | None:
        """The item's prompt as tokens, to look its prefixes up in the prefix cache; ``None``
        (default) keeps the item out of the cache."""
        return None

    def prefill_from(self, items: list[Any], resumes: list[Resume]) -> list[Any]:
        """``prefill`` resuming each item from its cached prefix state (``resumes[i].start``
        tokens done), offering states to keep with ``resumes[i].keep``. Default: the cache is
        ignored and ``prefill(items)`` runs."""
        return self.prefill(items)

    # -- the same steps, run statically (inline runs, and a static baseline) ---------------
    def static_steps(self, items: list[Any]) -> Generator[list[Any], None, list[Any]]:
        """Static generator batching of the same steps: prefill ``items`` together, then decode
        until every one ended, yielding each step (``qs.END`` in the place of ended items,
        ``qs.NO_OUTPUT`` where decode gave none) and finally returning the states. No item
        joins or leaves early (static_steps.py)."""
        return static_steps(self, items)

    def handle_batch(self, batch: Batch) -> list[Any]:
        """Run ``batch`` statically to its end and return each item's ``result`` (what
        ``inline``/``inline_many`` give; workers run the continuous executor instead), with
        ``key_state`` set to ``batch.state``."""
        with keyed(self, batch.state):
            return static_results(self, list(batch))

    def options(self) -> dict[str, Any]:
        step = {name: getattr(self, name) for name in StepOptions.model_fields}
        return {**super().options(), "step": True, **step}

    def __repr__(self) -> str:
        return (
            f"<StepServing {self.name!r} max_slots={self.max_slots} "
            f"max_batch_tokens={self.max_batch_tokens}>"
        )


class _FunctionSteps(StepServing):
    """A step serving made of functions (``qs.step_serving``)."""

    def __init__(
        self,
        decode: Callable[[list[Any]], list[Any]],
        *,
        prefill: Callable[[list[Any]], list[Any]],
        result: Callable[[Any, list[Any]], Any] | None = None,
        tokens: Callable[[Any], tuple[int, int]] | None = None,
        **options: Any,
    ) -> None:
        options.setdefault("name", getattr(decode, "__name__", ""))
        self._prefill_fn = prefill
        self._decode_fn = decode
        self._result_fn = result
        self._tokens_fn = tokens
        super().__init__(**options)

    def prefill(self, items: list[Any]) -> list[Any]:
        return self._prefill_fn(items)

    def decode(self, states: list[Any]) -> list[Any]:
        return self._decode_fn(states)

    def result(self, state: Any, outputs: list[Any]) -> Any:
        return outputs if self._result_fn is None else self._result_fn(state, outputs)

    def answers_outputs(self) -> bool:
        return self._result_fn is None

    def tokens(self, item: Any) -> tuple[int, int]:
        return super().tokens(item) if self._tokens_fn is None else self._tokens_fn(item)


def step_serving(
    *, prefill: Callable[[list[Any]], list[Any]], **options: Any
) -> Callable[[Callable[[list[Any]], list[Any]]], StepServing]:
    """Decorator form: the decorated function is ``decode``; ``prefill`` (and optionally
    ``result``, ``tokens``) and the options are keyword arguments.

    >>> @qs.step_serving(prefill=lambda items: [[n] for n in items], max_slots=4)
    ... def countdown(states):
    ...     return [qs.END if s[0] == 0 else s.__setitem__(0, s[0] - 1) or s[0] for s in states]
    >>> countdown.inline(2)
    [1, 0]
    """

    def wrap(decode: Callable[[list[Any]], list[Any]]) -> StepServing:
        return _FunctionSteps(decode, prefill=prefill, **options)

    return wrap
