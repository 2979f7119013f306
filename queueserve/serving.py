"""Servings: a named batch function plus its batching options."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from queueserve import hooks
from queueserve.hooks import END, NO_OUTPUT
from queueserve.key_states import KeyStates, has_key_states, holding
from queueserve.options.serving_options import (
    KeyWeights,
    OnError,
    ServingOptions,
    followers,
    resolve,
)
from queueserve.results import BatchResults
from queueserve.wire.key_rules import META_FIELD, LengthBuckets
from queueserve.wire.keys import Keys
from queueserve.wire.request import FIELDS

F = TypeVar("F", bound=Callable[..., Any])

BatchFn = Callable[[list[Any]], Any]
FinishFn = Callable[[list[Any], Any], Any]


@dataclass(frozen=True)
class Partition:
    """One executor of a serving, bound to one device (``cpu`` or ``cuda:i``)."""

    index: int = 0
    device: str = "cpu"
    count: int = 1


class Batch(list[Any]):
    """The items of one batch, in order; a list, plus the batch key and partition it runs on,
    what ``prepare_batch`` made of it (``prepared``; None for a serving without one) and the
    key's state (``state``: what the serving's ``load_key`` returned for ``key``, else None)."""

    __slots__ = ("key", "partition", "prepared", "state")

    def __init__(
        self,
        items: Iterable[Any],
        key: str = "default",
        partition: Partition | None = None,
        prepared: Any = None,
        state: Any = None,
    ) -> None:
        super().__init__(items)
        self.key = key
        self.partition = partition or Partition()
        self.prepared = prepared
        self.state = state


def _check_optional_callable(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {value!r}")
    return value


def _name(cls: type, fn: BatchFn | None, given: str | None) -> str:
    default = getattr(fn, "__name__", "") if fn else cls.__name__.lower()
    name = given or getattr(cls, "name", "") or default
    if not name or name == "<lambda>":
        raise ValueError("a serving made from a lambda needs a name: Serving(fn, name='...')")
    Keys("qs", name)  # validates the name
    return name


class Serving:
    """A batch function and how to batch it.

    >>> serving = qs.Serving(square, name="square", batch_size=10, batch_timeout=0.1)
    >>> serving.inline(3)
    9

    Stateful servings subclass it: ``setup(self, partition)`` runs once per partition (load the
    model onto ``partition.device`` there) and ``handle_batch(self, batch)`` runs each batch.
    Options may be given as class attributes of the subclass or as keyword arguments.

    A batch runs in three stages, so that the device never waits on the CPU:
    ``prepare_batch(batch)`` (CPU work: tokenize, collate, build tensors; on a pool of
    ``prepare_concurrency`` threads, ahead of the device), ``handle_batch(batch)`` (the device;
    what prepare returned is ``batch.prepared``) and ``finish_batch(batch, output)`` (device-to-
    host copies, conversion; on the replier thread, off the device's). Function servings get
    the same with ``prepare=fn(batch)`` and ``finish=fn(batch, output)``:

    >>> def collate(batch):
    ...     return np.stack(batch)
    >>> def model(batch):
    ...     return batch.prepared * 2
    >>> qs.Serving(model, prepare=collate, prepare_concurrency=2).inline(np.ones(3))
    array([2., 2., 2.])
    """

    # The options, with their defaults and bounds, are declared in options/serving_options.py
    # (ServingOptions); a subclass may set any of them as a class attribute.
    name: str = ""
    batch_size: int
    batch_timeout: float
    max_queue: int
    # A subclass may define cost / batch_key as methods ``def cost(self, item)``.
    cost: Callable[[Any], float] | None = None
    batch_key: str | Callable[[Any], str] | None = None
    codec: str
    on_error: OnError
    max_deliveries: int
    max_payload_bytes: int
    max_reply_bytes: int
    input_model: type[BaseModel] | None = None
    key_idle_ttl: float
    shards: int
    durable: bool
    prepare_concurrency: int
    priority_age: float
    batch_key_weights: KeyWeights
    max_latency: float
    idempotency_ttl: float
    cache_ttl: float  # the result cache (wire/cache.py): cache_version, cache_max_bytes
    cache_version: str
    cache_max_bytes: int
    max_loaded_keys: int  # with load_key(self, key): many models (key_states.py)
    max_loaded_bytes: int

    def __init__(
        self,
        fn: BatchFn | None = None,
        *,
        name: str | None = None,
        batch_size: int | None = None,
        batch_timeout: float | str | None = None,
        cost: Callable[[Any], float] | None = None,
        batch_key: str | Callable[[Any], str] | None = None,
        max_queue: int | None = None,
        codec: str | None = None,
        on_error: OnError | None = None,
        max_deliveries: int | None = None,
        max_payload_bytes: int | None = None,
        max_reply_bytes: int | None = None,
        input_model: type[BaseModel] | None = None,
        key_idle_ttl: float | str | None = None,
        shards: int | None = None,
        durable: bool | None = None,
        prepare: BatchFn | None = None,
        finish: FinishFn | None = None,
        prepare_concurrency: int | None = None,
        priority_age: float | str | None = None,
        batch_key_weights: Mapping[str, float] | str | None = None,
        max_latency: float | str | None = None,
        idempotency_ttl: float | str | None = None,
        cache_ttl: float | str | None = None,
        cache_version: str | None = None,
        cache_max_bytes: int | None = None,
        max_loaded_keys: int | None = None,
        max_loaded_bytes: int | None = None,
    ) -> None:
        cls = type(self)
        if fn is None and cls.handle_batch is Serving.handle_batch:
            raise TypeError("Serving needs a batch function, or a subclass defining handle_batch()")
        self.fn = _check_optional_callable("fn", fn)
        self.prepare_fn: BatchFn | None = _check_optional_callable("prepare", prepare)
        self.finish_fn: FinishFn | None = _check_optional_callable("finish", finish)
        self.name = _name(cls, fn, name)
        # The options given as keywords (each parameter is named as its ServingOptions field)
        given = {k: v for k, v in locals().items() if k in ServingOptions.model_fields}
        # Plain attributes: the hot path reads them per batch, validated once here.
        vars(self).update(
            resolve(ServingOptions, cls, {k: v for k, v in given.items() if v is not None})
        )
        # Given as arguments they shadow the class's; a subclass's own cost()/batch_key()
        # methods are found through the class, so nothing bound is stored on the instance.
        if cost is not None:
            self.cost = cost
        _check_optional_callable("cost", self.cost)
        if batch_key is not None:
            self.batch_key = batch_key
        _check_batch_key(self.batch_key)
        self.input_model = _check_input_model(
            cls.input_model if input_model is None else input_model
        )
        self.hooks: frozenset[str] | None = None  # set by streaming()
        self._input_maps: list[Callable[[Any], Any]] = []
        self._result_maps: list[Callable[[Any], Any]] = []
        self._inline_lock = threading.Lock()
        self._inline_ready = False
        self._inline_states: KeyStates | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Servings travel to partition processes; the inline lock and state stay behind.
        state = self.__dict__.copy()
        del state["_inline_lock"]
        state["_inline_ready"], state["_inline_states"] = False, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._inline_lock = threading.Lock()

    # -- subclass hooks ---------------------------------------------------------------------
    def setup(self, partition: Partition) -> None:
        """Runs once per partition before its first batch; load models onto partition.device."""

    def prepare_batch(self, batch: Batch) -> Any:
        """CPU work for one batch before the device runs it (tokenize, collate, build and pin
        tensors, start host-to-device copies on a side stream); runs on a pool of
        ``prepare_concurrency`` threads ahead of the device. What it returns is
        ``batch.prepared`` in ``handle_batch``. It must release the GIL to overlap (numpy,
        torch and fast tokenizers do)."""
        return None if self.prepare_fn is None else self.prepare_fn(batch)

    def handle_batch(self, batch: Batch) -> Any:
        """Runs one batch; returns one result per item (or a batched array/tensor/dict)."""
        assert self.fn is not None
        return self.fn(batch)

    def finish_batch(self, batch: Batch, output: Any) -> Any:
        """Turns what ``handle_batch`` returned into the batch's results (one per item, or a
        batched array): device-to-host copies, conversion to numpy. Runs on the replier
        thread, so the device's thread is already running the next batch."""
        return output if self.finish_fn is None else self.finish_fn(batch, output)

    @property
    def has_prepare(self) -> bool:
        """Whether batches go through a preparation stage (a prepare_batch or prepare= fn)."""
        return self.prepare_fn is not None or type(self).prepare_batch is not Serving.prepare_batch

    @property
    def has_finish(self) -> bool:
        return self.finish_fn is not None or type(self).finish_batch is not Serving.finish_batch

    def streaming(self, hooks: Iterable[str] = ()) -> Serving:
        """Mark the serving as streaming hook events: ``qs.emit(name, payload)`` inside the batch
        function reaches callers of ``client.stream`` for the hooks listed here. Requests of a
        streaming serving are never split across batches (chainable)."""
        names = [hooks] if isinstance(hooks, str) else list(hooks)
        if not all(isinstance(h, str) and h for h in names):
            raise TypeError(f"hooks must be non-empty strings, got {names!r}")
        self.hooks = frozenset(names)
        return self

    # -- client-side mapping ----------------------------------------------------------------
    def map_inputs(self, fn: Callable[[Any], Any]) -> Serving:
        """Transform each item in the caller before it is sent (chainable)."""
        self._input_maps.append(fn)
        return self

    def map_results(self, fn: Callable[[Any], Any]) -> Serving:
        """Transform each result in the caller after it arrives (chainable)."""
        self._result_maps.append(fn)
        return self

    def prepare_item(self, item: Any) -> Any:
        for fn in self._input_maps:
            item = fn(item)
        return item

    def finish_result(self, result: Any) -> Any:
        for fn in self._result_maps:
            result = fn(result)
        return result

    @property
    def has_client_maps(self) -> bool:
        return bool(self._input_maps or self._result_maps)

    def key_for(self, item: Any, explicit: str | None) -> str:
        if explicit is not None:
            return explicit
        if self.batch_key is None:
            return "default"
        if isinstance(self.batch_key, str):
            return self.batch_key
        return str(self.batch_key(item))

    # -- execution ---------------------------------------------------------------------------
    def validate_item(self, item: Any) -> Any:
        """The item as the serving's ``input_model`` accepts it (a model instance), or raises
        ValueError saying what was wrong."""
        if self.input_model is None:
            return item
        try:
            return self.input_model.model_validate(item)
        except ValidationError as e:
            raise ValueError(f"item does not match {self.input_model.__name__}: {e}") from None

    def item_cost(self, item: Any) -> float:
        return 1.0 if self.cost is None else float(self.cost(item))

    def run_batch(self, batch: Batch) -> BatchResults | Iterator[Any]:
        """Run one batch through all its stages in this thread and check that it returned one
        result per item; a generator batch function's steps are returned for the caller to
        drive. (A worker runs the stages on different threads.)"""
        if self.has_prepare:
            batch.prepared = self.prepare_batch(batch)
        out = self.handle_batch(batch)
        if isinstance(out, types.GeneratorType):
            return out
        return self.results(batch, out)

    def results(self, batch: Batch, output: Any) -> BatchResults:
        """``finish_batch``'s results of ``output``, checked: one per item."""
        if self.has_finish:
            output = self.finish_batch(batch, output)
        return BatchResults(output, len(batch), self.name)

    def inline(self, item: Any) -> Any:
        """Run one item in this process (no Redis), through the same batch function."""
        return self.inline_many([item])[0]

    def inline_many(self, items: Iterable[Any]) -> list[Any]:
        """Run items in this process, split into batches of at most batch_size."""
        _ensure_inline_setup(self)
        prepared = [self.validate_item(self.prepare_item(x)) for x in items]
        by_key: dict[str, list[int]] = {}  # batch keys never share a batch
        for i, item in enumerate(prepared):
            by_key.setdefault(self.key_for(item, None), []).append(i)
        out: list[Any] = [None] * len(prepared)
        for key, positions in by_key.items():
            done = 0
            for chunk in capacity_chunks(self, [prepared[i] for i in positions]):
                # (qs.emit has no callers to reach here)
                with hooks.running(None), holding(self._inline_states, key) as state:
                    ran = self.run_batch(Batch(chunk, key, state=state))
                    results = (
                        ran.as_list()
                        if isinstance(ran, BatchResults)
                        else collect_steps(ran, len(chunk), self.name)
                    )
                for pos, result in zip(positions[done : done + len(chunk)], results, strict=True):
                    out[pos] = result
                done += len(chunk)
        return [self.finish_result(r) for r in out]

    def options(self) -> dict[str, Any]:
        """The options workers publish for clients and operators."""
        own = {name: getattr(self, name) for name in ServingOptions.model_fields}
        return {
            **own,
            "cost": self.cost is not None,
            "hooks": ",".join(sorted(self.hooks)) if self.hooks is not None else "",
            "streaming": self.hooks is not None,
            **followers(own),  # pack_items: the batch_size (options/serving_options.py)
            # They read the header's optional fields: clients send trace context only then
            # (docs/architecture.md, "Wire versions").
            "header_fields": ",".join(FIELDS),
            # A rule every client applies, knowing the serving by name (wire/key_rules.py)
            META_FIELD: self.batch_key.text() if isinstance(self.batch_key, LengthBuckets) else "",
        }

    def __repr__(self) -> str:
        return (
            f"<Serving {self.name!r} batch_size={self.batch_size} "
            f"batch_timeout={self.batch_timeout:g}s>"
        )


def _ensure_inline_setup(serving: Serving) -> None:
    if serving._inline_ready:
        return
    with serving._inline_lock:
        if not serving._inline_ready:
            serving.setup(Partition())
            if has_key_states(serving):
                serving._inline_states = KeyStates.of(serving)
            serving._inline_ready = True


def collect_steps(steps: Iterator[Any], size: int, serving: str) -> list[list[Any]]:
    """Per-item step values of a generator batch function run to its end (``END`` ends an
    item, ``NO_OUTPUT`` adds nothing)."""
    values: list[list[Any]] = [[] for _ in range(size)]
    ended = [False] * size
    for step in steps:
        for i, v in enumerate(BatchResults(step, size, serving).as_list()):
            if ended[i] or v is END:
                ended[i] = True
            elif v is not NO_OUTPUT:
                values[i].append(v)
        if all(ended):
            break
    return values


def serving(fn: BatchFn | None = None, **options: Any) -> Callable[[BatchFn], Serving] | Serving:
    """Decorator form: ``@qs.serving(name="square", batch_size=10)`` over a batch function."""

    def wrap(f: BatchFn) -> Serving:
        return Serving(f, **options)

    return wrap(fn) if fn is not None else wrap


def capacity_chunks(serving: Serving, items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    """Cut items into batches that fit the capacity (batch_size items or cost units)."""
    if serving.cost is None:
        for i in range(0, len(items), serving.batch_size):
            yield items[i : i + serving.batch_size]
        return
    start, used = 0, 0.0
    for i, item in enumerate(items):
        c = serving.item_cost(item)
        if c > serving.batch_size:
            raise ValueError(
                f"item {i} costs {c:g}, more than the capacity of serving {serving.name!r} "
                f"(batch_size={serving.batch_size}); split the item or raise batch_size"
            )
        if used + c > serving.batch_size:
            yield items[start:i]
            start, used = i, 0.0
        used += c
    if start < len(items):
        yield items[start:]


def _check_batch_key(batch_key: object) -> None:
    if batch_key is not None and not (isinstance(batch_key, str) or callable(batch_key)):
        raise TypeError(f"batch_key must be a str or a callable(item) -> str, got {batch_key!r}")


def _check_input_model(model: object) -> type[BaseModel] | None:
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"input_model must be a pydantic BaseModel subclass, got {model!r}")
    return model
