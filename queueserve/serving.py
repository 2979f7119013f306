"""Servings: a named batch function plus its batching options."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from queueserve import hooks
from queueserve._durations import parse_duration
from queueserve.hooks import END, NO_OUTPUT
from queueserve.results import BatchResults
from queueserve.wire.codec import get_codec
from queueserve.wire.protocol import Keys, check_shards

F = TypeVar("F", bound=Callable[..., Any])

BatchFn = Callable[[list[Any]], Any]
FinishFn = Callable[[list[Any], Any], Any]
OnError = Literal["isolate", "fail"]


@dataclass(frozen=True)
class Partition:
    """One executor of a serving, bound to one device (``cpu`` or ``cuda:i``)."""

    index: int = 0
    device: str = "cpu"
    count: int = 1


class Batch(list[Any]):
    """The items of one batch, in order; a list, plus the batch key and partition it runs on,
    and what ``prepare_batch`` made of it (``prepared``; None for a serving without one)."""

    __slots__ = ("key", "partition", "prepared")

    def __init__(
        self, items: Iterable[Any], key: str = "default", partition: Partition | None = None,
        prepared: Any = None,
    ) -> None:
        super().__init__(items)
        self.key = key
        self.partition = partition or Partition()
        self.prepared = prepared


# Upper bounds of the options, so that a value written by anyone (run-time config in Redis,
# docs/operations.md) can never overflow what is computed from it: read counts sent to Redis
# (exact integers in Lua up to 2**53), Condition.wait timeouts, TTLs in ms. Each is far
# beyond any useful setting: batch_size counts cost units too (tokens, pixels).
MAX_BATCH_SIZE = 10**9
MAX_QUEUE = 10**12
MAX_DELIVERIES = 1000
# Redis refuses a bulk string over 512 MiB (proto-max-bulk-len); a payload cannot be larger.
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
MAX_BATCH_TIMEOUT_S = 3600.0
MAX_KEY_IDLE_TTL_S = 366 * 86400.0


def _check_batch_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"batch_size must be an int >= 1, got {value!r} ({type(value).__name__})")
    if not 1 <= value <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be an int from 1 to {MAX_BATCH_SIZE}, got {value}")
    return value


def _check_positive(name: str, value: object, ceiling: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if ceiling is not None and value > ceiling:
        raise ValueError(f"{name} must be an int from 1 to {ceiling}, got {value!r}")
    return value


def _check_duration(what: str, value: str | float | int, ceiling: float) -> float:
    """``parse_duration`` of ``value``, finite and at most ``ceiling`` seconds."""
    seconds = parse_duration(value, what=what)
    if not seconds <= ceiling:  # also inf: 400 digits parse as float('inf')
        raise ValueError(
            f"{what} must be a duration from 0 to {ceiling:.0f}s, got {value!r:.60}"
        )
    return seconds


# Redis refuses a bulk string over 512 MiB (proto-max-bulk-len); stay well under it.
REPLY_BYTES_CEILING = 256 * 1024 * 1024


def _check_reply_bytes(value: object) -> int:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not 1024 <= value <= REPLY_BYTES_CEILING):
        raise ValueError(
            f"max_reply_bytes must be an int from 1024 to {REPLY_BYTES_CEILING} (Redis refuses "
            f"values over 512 MiB), got {value!r}"
        )
    return value


def _check_max_queue(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUEUE:
        raise ValueError(
            f"max_queue must be an int from 0 (unlimited) to {MAX_QUEUE}, got {value!r}"
        )
    return value


def _check_optional_callable(name: str, value: object) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {value!r}")
    return value


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

    name: str = ""
    batch_size: int = 32
    batch_timeout: float = 0.01
    max_queue: int = 0
    # A subclass may define cost / batch_key as methods ``def cost(self, item)``.
    cost: Callable[[Any], float] | None = None
    batch_key: str | Callable[[Any], str] | None = None
    codec: str = "msgpack"
    on_error: OnError = "isolate"
    max_deliveries: int = 3
    max_payload_bytes: int = 16 * 1024 * 1024
    max_reply_bytes: int = 64 * 1024 * 1024
    input_model: type[BaseModel] | None = None
    key_idle_ttl: float = 3600.0  # seconds without a request before a batch key is forgotten
    # Hash tags the requests spread over: on Redis Cluster each shard may live on another
    # node; max_queue applies per shard. Only for a cluster: one server gains nothing by it.
    shards: int = 1
    # Each enqueue waits until a replica holds the request (WAIT 1): acknowledged requests
    # survive a failover. Costs a replica round trip per enqueue.
    durable: bool = False
    prepare_concurrency: int = 1

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
    ) -> None:
        cls = type(self)
        if fn is None and cls.handle_batch is Serving.handle_batch:
            raise TypeError("Serving needs a batch function, or a subclass defining handle_batch()")
        _check_optional_callable("fn", fn)
        self.fn = fn
        self.prepare_fn: BatchFn | None = _check_optional_callable("prepare", prepare)
        self.finish_fn: FinishFn | None = _check_optional_callable("finish", finish)
        self.prepare_concurrency = _check_positive(
            "prepare_concurrency",
            cls.prepare_concurrency if prepare_concurrency is None else prepare_concurrency,
        )
        default_name = getattr(fn, "__name__", "") if fn else cls.__name__.lower()
        resolved = name or cls.name or default_name
        if not resolved or resolved == "<lambda>":
            raise ValueError("a serving made from a lambda needs a name: Serving(fn, name='...')")
        Keys("qs", resolved)  # validates the name
        self.name = resolved
        self.batch_size = _check_batch_size(cls.batch_size if batch_size is None else batch_size)
        self.batch_timeout = _check_duration(
            "batch_timeout", cls.batch_timeout if batch_timeout is None else batch_timeout,
            MAX_BATCH_TIMEOUT_S,
        )
        # Given as arguments they shadow the class's; a subclass's own cost()/batch_key()
        # methods are found through the class, so nothing bound is stored on the instance.
        if cost is not None:
            self.cost = _check_optional_callable("cost", cost)
        _check_optional_callable("cost", self.cost)
        if batch_key is not None:
            self.batch_key = batch_key
        if self.batch_key is not None and not (
            isinstance(self.batch_key, str) or callable(self.batch_key)
        ):
            raise TypeError(
                f"batch_key must be a str or a callable(item) -> str, got {self.batch_key!r}"
            )
        self.max_queue = _check_max_queue(cls.max_queue if max_queue is None else max_queue)
        self.codec = get_codec(cls.codec if codec is None else codec).name
        self.on_error: OnError = cls.on_error if on_error is None else on_error
        if self.on_error not in ("isolate", "fail"):
            raise ValueError(f"on_error must be 'isolate' or 'fail', got {self.on_error!r}")
        self.max_deliveries = _check_positive(
            "max_deliveries", cls.max_deliveries if max_deliveries is None else max_deliveries,
            MAX_DELIVERIES,
        )
        self.max_payload_bytes = _check_positive(
            "max_payload_bytes",
            cls.max_payload_bytes if max_payload_bytes is None else max_payload_bytes,
            MAX_PAYLOAD_BYTES,
        )
        self.max_reply_bytes = _check_reply_bytes(
            cls.max_reply_bytes if max_reply_bytes is None else max_reply_bytes
        )
        # 0 = never forget; a forgotten key comes back with its next request
        self.key_idle_ttl = _check_duration(
            "key_idle_ttl", cls.key_idle_ttl if key_idle_ttl is None else key_idle_ttl,
            MAX_KEY_IDLE_TTL_S,
        )
        self.shards = check_shards(cls.shards if shards is None else shards)
        self.durable = cls.durable if durable is None else durable
        if not isinstance(self.durable, bool):
            raise TypeError(f"durable must be True or False, got {self.durable!r}")
        model = cls.input_model if input_model is None else input_model
        if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"input_model must be a pydantic BaseModel subclass, got {model!r}")
        self.input_model = model
        self.hooks: frozenset[str] | None = None  # set by streaming()
        self._input_maps: list[Callable[[Any], Any]] = []
        self._result_maps: list[Callable[[Any], Any]] = []
        self._inline_lock = threading.Lock()
        self._inline_ready = False

    def __getstate__(self) -> dict[str, Any]:
        # Servings travel to partition processes; the inline lock and state stay behind.
        state = self.__dict__.copy()
        del state["_inline_lock"]
        state["_inline_ready"] = False
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

    def chunks(self, items: Sequence[Any]) -> Iterable[Sequence[Any]]:
        """Cut items into batches that fit the capacity (batch_size items or cost units)."""
        if self.cost is None:
            for i in range(0, len(items), self.batch_size):
                yield items[i : i + self.batch_size]
            return
        start, used = 0, 0.0
        for i, item in enumerate(items):
            c = self.item_cost(item)
            if c > self.batch_size:
                raise ValueError(
                    f"item {i} costs {c:g}, more than the capacity of serving {self.name!r} "
                    f"(batch_size={self.batch_size}); split the item or raise batch_size"
                )
            if used + c > self.batch_size:
                yield items[start:i]
                start, used = i, 0.0
            used += c
        if start < len(items):
            yield items[start:]

    def _ensure_inline_setup(self) -> None:
        if self._inline_ready:
            return
        with self._inline_lock:
            if not self._inline_ready:
                self.setup(Partition())
                self._inline_ready = True

    def inline(self, item: Any) -> Any:
        """Run one item in this process (no Redis), through the same batch function."""
        return self.inline_many([item])[0]

    def inline_many(self, items: Iterable[Any]) -> list[Any]:
        """Run items in this process, split into batches of at most batch_size."""
        self._ensure_inline_setup()
        prepared = [self.validate_item(self.prepare_item(x)) for x in items]
        by_key: dict[str, list[int]] = {}  # batch keys never share a batch
        for i, item in enumerate(prepared):
            by_key.setdefault(self.key_for(item, None), []).append(i)
        out: list[Any] = [None] * len(prepared)
        for key, positions in by_key.items():
            done = 0
            for chunk in self.chunks([prepared[i] for i in positions]):
                with hooks.running(None):  # qs.emit has no callers to reach here
                    ran = self.run_batch(Batch(chunk, key))
                    results = (
                        ran.as_list() if isinstance(ran, BatchResults)
                        else collect_steps(ran, len(chunk), self.name)
                    )
                for pos, result in zip(positions[done : done + len(chunk)], results, strict=True):
                    out[pos] = result
                done += len(chunk)
        return [self.finish_result(r) for r in out]

    def options(self) -> dict[str, Any]:
        """The options workers publish for clients and operators."""
        return {
            "batch_size": self.batch_size,
            "batch_timeout": self.batch_timeout,
            "max_queue": self.max_queue,
            "codec": self.codec,
            "on_error": self.on_error,
            "cost": self.cost is not None,
            "max_deliveries": self.max_deliveries,
            "max_payload_bytes": self.max_payload_bytes,
            "max_reply_bytes": self.max_reply_bytes,
            "key_idle_ttl": self.key_idle_ttl,
            "hooks": ",".join(sorted(self.hooks)) if self.hooks is not None else "",
            "streaming": self.hooks is not None,
            "shards": self.shards,
            "durable": self.durable,
            "prepare_concurrency": self.prepare_concurrency,
            # Workers of this version read packs (several requests in one entry); clients
            # pack up to this many items (enqueue.lua).
            "pack_items": self.batch_size,
        }

    def __repr__(self) -> str:
        return (
            f"<Serving {self.name!r} batch_size={self.batch_size} "
            f"batch_timeout={self.batch_timeout:g}s>"
        )


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


def serving(
    fn: BatchFn | None = None, **options: Any
) -> Callable[[BatchFn], Serving] | Serving:
    """Decorator form: ``@qs.serving(name="square", batch_size=10)`` over a batch function."""

    def wrap(f: BatchFn) -> Serving:
        return Serving(f, **options)

    return wrap(fn) if fn is not None else wrap
