"""The options of a serving and of a step serving, with their bounds: the one declaration
that ``qs.Serving(...)``, ``qs.StepServing(...)``, ``queueserve config set`` and every value
read from the config and meta hashes in Redis are checked against (docs/operations.md).

The bounds keep a value written by anyone (run-time config in Redis) from overflowing what is
computed from it: read counts sent to Redis (exact integers in Lua up to 2**53),
Condition.wait timeouts, TTLs in ms. Each is far beyond any useful setting: batch_size counts
cost units too (tokens, pixels).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from queueserve.options.units import Flag, checked_by, count, duration, number, problem
from queueserve.wire.cache import check_version
from queueserve.wire.codec import get_codec
from queueserve.wire.shards import check_shards
from queueserve.wire.timing import CALLER_GONE_AFTER_S

MAX_BATCH_SIZE = 10**9
MAX_QUEUE = 10**12
MAX_DELIVERIES = 1000
# Redis refuses a bulk string over 512 MiB (proto-max-bulk-len); a payload cannot be larger.
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
# Replies stay well under Redis's 512 MiB.
REPLY_BYTES_CEILING = 256 * 1024 * 1024
MAX_BATCH_TIMEOUT_S = 3600.0
MAX_KEY_IDLE_TTL_S = 366 * 86400.0
MAX_IDEMPOTENCY_TTL_S = 30 * 86400.0  # a job's longest keep (wire/job_record.py MAX_KEEP_MS)
MAX_CACHE_TTL_S = 30 * 86400.0
MAX_CACHE_ENTRY_BYTES = REPLY_BYTES_CEILING
MAX_LOADED_KEYS = 100_000
MAX_LOADED_BYTES = 2**53  # exact in Lua and JSON

OnError = Literal["isolate", "fail"]
M = TypeVar("M", bound=BaseModel)


def _on_error(value: Any) -> OnError:
    if value == "isolate" or value == "fail":
        return "isolate" if value == "isolate" else "fail"
    raise ValueError(f"on_error must be 'isolate' or 'fail', got {value!r:.60}")


MAX_KEY_WEIGHT = 1000.0
MAX_WEIGHTED_KEYS = 10_000


class KeyWeights(dict[str, float]):
    """Batch key -> weight; written (``config set``, the meta hash) as ``key=w,key2=w2``."""

    def __str__(self) -> str:
        return ",".join(f"{key}={weight:g}" for key, weight in self.items())


def key_weights(value: Any) -> KeyWeights:
    """``batch_key_weights`` from a mapping or from ``key=w,key2=w2`` text ("" for none)."""
    if isinstance(value, str):
        pairs = [part.partition("=") for part in value.split(",") if part]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(
                f"batch_key_weights must be key=weight pairs separated by commas "
                f"(for example interactive=4,bulk=1), got {value!r:.60}"
            )
        value = {key: weight for key, _, weight in pairs}
    if not isinstance(value, Mapping):
        raise ValueError(f"batch_key_weights must be a dict of key -> weight, got {value!r:.60}")
    if len(value) > MAX_WEIGHTED_KEYS:
        raise ValueError(f"batch_key_weights names at most {MAX_WEIGHTED_KEYS} keys")
    out = KeyWeights()
    for key, weight in value.items():
        try:
            number_ = float(weight)
        except (TypeError, ValueError):
            number_ = float("nan")
        if not isinstance(key, str) or not key or "," in key or "=" in key:
            raise ValueError(f"batch_key_weights: {key!r:.60} is not a batch key without , or =")
        if not 0 < number_ <= MAX_KEY_WEIGHT:
            raise ValueError(
                f"batch_key_weights: the weight of {key!r:.60} must be a number above 0 and at "
                f"most {MAX_KEY_WEIGHT:g}, got {weight!r:.60}"
            )
        out[key] = number_
    return out


class ServingOptions(BaseModel):
    """A serving's batching options (``qs.Serving(...)`` keywords or class attributes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: Annotated[int, count(1, MAX_BATCH_SIZE, type_error=True)] = Field(
        32, description="Most items (or cost units) in one batch."
    )
    batch_timeout: Annotated[float, duration(MAX_BATCH_TIMEOUT_S)] = Field(
        0.01, description="How long a batch waits to fill, e.g. 10ms."
    )
    max_queue: Annotated[int, count(0, MAX_QUEUE, says=f"from 0 (unlimited) to {MAX_QUEUE}")] = (
        Field(0, description="Requests waiting per batch key before QueueFull; 0: no limit.")
    )
    codec: Annotated[str, checked_by(lambda v: get_codec(v).name)] = Field(
        "msgpack", description="How items and results are encoded."
    )
    on_error: Annotated[OnError, PlainValidator(_on_error)] = Field(
        "isolate", description="'isolate': a failed batch is retried on halves; 'fail'."
    )
    max_deliveries: Annotated[int, count(1, MAX_DELIVERIES)] = Field(
        3, description="Runs of a request before it is dead-lettered."
    )
    max_payload_bytes: Annotated[int, count(1, MAX_PAYLOAD_BYTES)] = Field(
        16 * 1024 * 1024, description="Largest request the client sends."
    )
    max_reply_bytes: Annotated[
        int,
        count(
            1024,
            REPLY_BYTES_CEILING,
            says=f"from 1024 to {REPLY_BYTES_CEILING} (Redis refuses values over 512 MiB)",
        ),
    ] = Field(64 * 1024 * 1024, description="Largest reply a worker sends.")
    key_idle_ttl: Annotated[float, duration(MAX_KEY_IDLE_TTL_S)] = Field(
        3600.0,
        description="Time without a request before a batch key is forgotten; 0: "
        "never (a forgotten key comes back with its next request).",
    )
    shards: Annotated[int, checked_by(check_shards)] = Field(
        1,
        description="Hash tags the requests spread over (Redis Cluster only); max_queue "
        "applies per shard.",
    )
    durable: Flag = Field(
        False, description="Each enqueue waits until a replica holds the request (WAIT 1)."
    )
    prepare_concurrency: Annotated[int, count(1)] = Field(
        1, description="Threads running prepare_batch ahead of the device."
    )
    priority_age: Annotated[float, duration(MAX_BATCH_TIMEOUT_S)] = Field(
        1.0,
        description="Waiting worth one priority level: low priorities age into high ones "
        "(0: strict priorities, which may starve low ones).",
    )
    batch_key_weights: Annotated[KeyWeights, checked_by(key_weights)] = Field(
        default_factory=KeyWeights,
        description="Batch key -> weight (key=w,key2=w2): while keys have work, a key of "
        "weight w comes round w times as often as a key of weight 1 (about w times the batches).",
    )
    max_latency: Annotated[float, duration(MAX_BATCH_TIMEOUT_S)] = Field(
        0.0,
        description="Latency target, e.g. 50ms: a batch closes when waiting longer would "
        "push its oldest item's expected answer past it (batch_timeout stays the upper "
        "bound); 0: off.",
    )
    idempotency_ttl: Annotated[float, duration(MAX_IDEMPOTENCY_TTL_S)] = Field(
        86400.0,
        description="How long an idempotency key's record (and its job's answer) lives: "
        "calls with the same key within it get the first call's job and answer.",
    )
    cache_ttl: Annotated[float, duration(MAX_CACHE_TTL_S)] = Field(
        0.0,
        description="How long a cached result lives, e.g. 10m: a repeat of an item that "
        "succeeded within it is answered from Redis without reaching a worker; 0: no cache.",
    )
    cache_version: Annotated[str, checked_by(check_version)] = Field(
        "",
        description="Part of every cache entry's name: change it when the model changes, "
        "and no result of the old one is answered.",
    )
    cache_max_bytes: Annotated[int, count(1, MAX_CACHE_ENTRY_BYTES)] = Field(
        1024 * 1024,
        description="Largest cached result (its encoded bytes): a bigger one is not cached.",
    )
    max_loaded_keys: Annotated[int, count(1, MAX_LOADED_KEYS)] = Field(
        4,
        description="Batch keys whose state (load_key) one partition holds at once; the "
        "least recently used is evicted (unload_key) to load another.",
    )
    max_loaded_bytes: Annotated[
        int, count(0, MAX_LOADED_BYTES, says=f"from 0 (no bound) to {MAX_LOADED_BYTES}")
    ] = Field(
        0,
        description="Bytes of key states (state_bytes) one partition holds at most; 0: no bound.",
    )


class StepOptions(BaseModel):
    """A step serving's own options (``qs.StepServing``; docs in its docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_slots: Annotated[int, count(1)] = 8
    max_batch_tokens: Annotated[int, count(1)] = 4096
    max_prefill_tokens: Annotated[int, count(1)] = 1024
    waiting_served_ratio: Annotated[float, number(above_zero=False, says="a number >= 0")] = 0.3
    max_waiting_steps: Annotated[int, count(1)] = 20
    prefix_cache_bytes: Annotated[int, count(0)] = 0
    caller_gone_after: (
        Annotated[
            float,
            number(
                above_zero=True,
                says="a number of seconds > 0, or None to never look",
            ),
        ]
        | None
    ) = CALLER_GONE_AFTER_S


# Options an operator may change at run time (``queueserve config set``, ``P:{S}:config``).
RUNTIME = (
    "batch_size",
    "batch_timeout",
    "max_queue",
    "max_deliveries",
    "max_payload_bytes",
    "max_reply_bytes",
    "key_idle_ttl",
    "priority_age",
    "batch_key_weights",
    "max_latency",
    "idempotency_ttl",
    "cache_ttl",
)


# Fields of the declaration (``P:{S}:meta``) that follow from an option, each from its option.
# Workers of this version read packs (several requests in one entry), and clients pack up to
# pack_items items (enqueue.lua): the batch_size a worker declares.
FOLLOWERS = {"pack_items": "batch_size"}


def followers(options: Mapping[str, Any]) -> dict[str, Any]:
    """The declared fields that follow from ``options`` (``{"pack_items": 64}`` for
    ``{"batch_size": 64}``): a worker declares them with its options, and ``queueserve config
    set`` writes them with the options it changes, so that neither finds the other's value
    stale."""
    return {field: options[option] for field, option in FOLLOWERS.items() if option in options}


def validated(model: type[M], values: Mapping[str, Any]) -> M:
    """``model`` of ``values``; a ValueError saying what was wrong (a TypeError for a value of
    the wrong type where the field says so)."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ValueError(problem(e)) from None


def resolve(model: type[M], owner: type, given: Mapping[str, Any]) -> M:
    """The options of an instance of ``owner``: each ``given`` one, else ``owner``'s class
    attribute of that name (a subclass may set options so), else the model's default.

    A refused value's error names where the user wrote it (pydantic's own frames are no
    help): the line that built the serving, or the class that set the option."""
    values = {
        name: given[name] if name in given else getattr(owner, name)
        for name in model.model_fields
        if name in given or hasattr(owner, name)
    }
    try:
        return validated(model, values)
    except (TypeError, ValueError) as e:
        refused = [k for k, v in values.items() if k not in given and _refused(model, k, v)]
        where = _defined_at(owner, refused[0]) if refused else _built_at()
        if where is None:
            raise
        raise (ValueError if isinstance(e, ValueError) else TypeError)(f"{e} ({where})") from None


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # queueserve/, with the separator


def _built_at() -> str | None:
    """``made at FILE, line N``: the innermost frame of the stack outside queueserve (the
    user's ``qs.Serving(...)``, ``@qs.serving(...)`` or ``super().__init__(...)``)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return None
    return f"in the serving made at {frame.f_code.co_filename}, line {frame.f_lineno}"


def _refused(model: type[BaseModel], name: str, value: Any) -> bool:
    try:
        validated(model, {name: value})
    except (TypeError, ValueError):
        return True
    return False


def _defined_at(owner: type, name: str) -> str | None:
    """``set on class C at FILE, line N``: the line of the class (of ``owner``'s, itself or a
    base) that sets option ``name``, else the class's first line."""
    cls = next((c for c in owner.__mro__ if name in vars(c)), owner)
    try:
        file = inspect.getsourcefile(cls)
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    sets = re.compile(rf"\s*{re.escape(name)}\s*(:[^=]*)?=")
    line = next((first + i for i, text in enumerate(lines) if sets.match(text)), first)
    return f"set on class {cls.__qualname__} at {file}, line {line}"
