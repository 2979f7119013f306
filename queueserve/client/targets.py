"""Where a client's requests go: a serving's target (keys, codec, limits, shards), the parts a
call's items are planned into, and how sends spread over a serving's shards."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queueserve.errors import BadRequest
from queueserve.serving import Serving
from queueserve.wire.codec import Codec
from queueserve.wire.key_rules import LengthBuckets
from queueserve.wire.keys import Keys
from queueserve.wire.shards import check_shards

log = logging.getLogger("queueserve.client")


# A send of more items than this is split over the shards (one script call per shard it
# reaches); a smaller one goes whole to one shard, in one script call.
SPLIT_SEND_ABOVE = 128


class ShardSpread:
    """The items one client has sent to each shard of one serving, and where the next send
    goes: the shard with the fewest (ties taken in turn, from a random one: many clients
    that each started at shard 0 would load it most in short bursts).

    Counted here, so it costs no round trip (asking queue depths would cost one per send),
    and every worker reads every shard, so no shard waits without workers. Items, not sends,
    and a large send split: one send carries whatever its callers queued meanwhile, from 1 to
    hundreds of requests, and with one shard per send (in turn, or even the emptiest) a short
    run of large sends left one master with 45% of the items (bench/cluster.py). A send of up
    to SPLIT_SEND_ABOVE items stays one script call on one shard; a larger one costs one
    script call per shard, which its own size dwarfs."""

    def __init__(self, keys: Keys, count: int) -> None:
        self.shards = keys.sharded(count)
        self.sent = [0] * count
        self._turn = random.randrange(count)
        self._lock = threading.Lock()  # the async client's sends and a sync one's may overlap

    def _fewest(self, items: int) -> int:
        count = len(self.shards)
        i = min(range(count), key=lambda s: (self.sent[s], (s - self._turn) % count))
        self.sent[i] += items
        self._turn = (i + 1) % count
        return i

    def place(self, sizes: list[int]) -> list[int]:
        """The shard (index) of each request of one send, ``sizes`` being their items."""
        with self._lock:
            if sum(sizes) <= SPLIT_SEND_ABOVE:
                return [self._fewest(sum(sizes))] * len(sizes)
            return [self._fewest(n) for n in sizes]


@dataclass(slots=True)
class Target:
    """Where and how requests to one serving go."""

    keys: Keys
    codec: Codec
    serving: Serving | None  # given when the caller passed the Serving object
    max_queue: int  # admission limit to use until a worker has declared the serving
    max_payload_bytes: int | None  # known from the Serving object or the workers' declaration
    batch_size: int | None = None  # likewise; a streamed request holds at most this many items
    hooks: bool = False  # the serving streams hook events: its requests are never split
    durable: bool = False  # each enqueue waits for a replica (the serving's durable option)
    traced: bool = False  # its requests carry the caller's trace context (tracing.py)
    # Whether its workers declared that they keep jobs (``job`` among the header fields they
    # read); None: not known (no worker declared it yet, or the caller passed the object)
    keeps_jobs: bool | None = None
    # Its idempotency_ttl as its workers declared it (None: not known; client/once.py)
    idempotency_ttl: float | None = None
    # Its cache_ttl and cache_version as its workers declared them (client/caching.py)
    cache_ttl: float | None = None
    cache_version: str | None = None
    # The batch-key rule its workers declared (wire/key_rules.py): a caller that names the
    # serving groups items by it as one passing the Serving object does by its batch_key
    key_rule: LengthBuckets | None = None
    # Where its requests go: the serving's shards, shared by every Target of the serving
    # in this client (a caller passing the Serving object gets a new Target per call).
    spread: ShardSpread | None = None

    @property
    def shards(self) -> list[Keys]:
        return self.spread.shards if self.spread is not None else []

    def place(self, sizes: list[int]) -> list[Keys]:
        """The shard of each request of one send (``ShardSpread.place``)."""
        if self.spread is None or len(self.spread.shards) <= 1:
            return [self.keys] * len(sizes)
        return [self.spread.shards[i] for i in self.spread.place(sizes)]

    def check_payload(self, payload: bytes, n: int) -> None:
        """Refuse, before sending, a payload the workers would refuse."""
        if self.hooks and self.batch_size is not None and n > self.batch_size:
            raise BadRequest(
                f"serving {self.keys.name!r} streams events, so a request always runs in one "
                f"batch; this one has {n} items, more than batch_size={self.batch_size}: send "
                "smaller requests, or use client.stream, which chunks them"
            )
        limit = self.max_payload_bytes
        if limit is not None and len(payload) > limit:
            raise BadRequest(
                f"request of {n} items encodes to {len(payload)} bytes, over max_payload_bytes="
                f"{limit} of serving {self.keys.name!r}; send fewer or smaller items"
            )


@dataclass(slots=True)
class Part:
    """Items of one request: the caller's positions and the batch key they share."""

    batch_key: str
    positions: list[int] | None  # None = all items, in order
    items: list[Any]


def claimed_shards(meta: dict[str, str]) -> int:
    """The shard count ``meta`` claims, unchecked but for being one (``remember`` logs a bad
    one); 1 when it claims none."""
    try:
        return check_shards(int(meta.get("shards") or 1))
    except ValueError:
        return 1


def confirmed_shards(keys: Keys, count: int, confirmation: dict[str, str]) -> int:
    """``count`` when the last shard's meta hash says the same; else 1, with a warning.

    A count that no worker declared would send requests to shards no worker reads, where
    they wait for ever; one write to shard 0's meta hash (a stray HSET, a script, a test
    against the wrong Redis) would be enough. Workers declare the count on their last shard
    too (ServingRunner.start), and a client sends to the shards only when both agree: shard 0
    alone is always safe, as every worker reads it.
    """
    if count <= 1 or confirmation.get("shards") == str(count):
        return count
    log.warning(
        "serving %s: its meta hash %s says shards=%d, but the last shard's (%s) says %r, so "
        "no worker declared it; sending to shard 0 only (a live worker of the serving writes "
        "its declaration back within a second; with none running, start one)",
        keys.name,
        keys.meta,
        count,
        keys.last_shard(count).meta,
        confirmation.get("shards"),
    )
    return 1


def plan(target: Target, items: list[Any], batch_key: str | None) -> list[Part]:
    """Apply the serving's map_inputs and group items by batch key (one request per key)."""
    if not items:
        return []  # nothing to send; the caller gets [] at once
    serving = target.serving
    if serving is None:
        if batch_key is not None or target.key_rule is None:
            return [Part(batch_key or "default", None, items)]
        return _grouped(items, target.key_rule)
    if serving.has_client_maps:
        items = [serving.prepare_item(x) for x in items]
    if batch_key is not None or not callable(serving.batch_key):
        return [Part(serving.key_for(None, batch_key), None, items)]
    return _grouped(items, lambda item: serving.key_for(item, None))


def _grouped(items: list[Any], key_of: Callable[[Any], str]) -> list[Part]:
    """One part per batch key, each with its items' positions (none: all, in order)."""
    groups: dict[str, Part] = {}
    for i, item in enumerate(items):
        key = key_of(item)
        part = groups.get(key)
        if part is None:
            part = groups[key] = Part(key, [], [])
        assert part.positions is not None
        part.positions.append(i)
        part.items.append(item)
    if len(groups) == 1:
        only = next(iter(groups.values()))
        return [Part(only.batch_key, None, only.items)]
    return list(groups.values())


def in_batches(target: Target, parts: list[Part], *, job: bool) -> list[Part]:
    """``parts`` with each one of more than batch_size items cut into requests of at most a
    batch, results put back by position: a worker holds a request whole once read, so one big
    request would keep its key's turn for its whole size while other keys wait; requests of a
    batch each keep their place in the round in Redis (docs/usage.md, "Keys and priorities").
    A job is one request (its id reaches all of it), and requests of a serving that streams
    events run whole (check_payload holds them to a batch); ``batch_size`` unknown (no worker
    declared the serving yet): sent as they are."""
    size = target.batch_size
    if size is None or job or target.hooks:
        return parts
    if len(parts) == 1 and len(parts[0].items) <= size:  # a dispatch, or any small call
        return parts
    cut: list[Part] = []
    for part in parts:
        n = len(part.items)
        if n <= size:
            cut.append(part)
            continue
        positions = part.positions if part.positions is not None else range(n)
        for start in range(0, n, size):
            end = start + size
            cut.append(Part(part.batch_key, list(positions[start:end]), part.items[start:end]))
    return cut


def stream_parts(target: Target, items: list[Any], batch_key: str | None) -> list[tuple[int, Part]]:
    """Requests for ``stream``: runs of consecutive items with one batch key, at most
    batch_size each (streamed requests are never split), with their input offsets."""
    serving = target.serving
    if serving is not None and serving.has_client_maps:
        items = [serving.prepare_item(x) for x in items]
    size = target.batch_size or max(1, len(items))
    parts: list[tuple[int, Part]] = []
    for i, item in enumerate(items):
        key = serving.key_for(item, batch_key) if serving else batch_key or "default"
        last = parts[-1][1] if parts else None
        if last is None or last.batch_key != key or len(last.items) >= size:
            parts.append((i, Part(key, None, [])))
        parts[-1][1].items.append(item)
    return parts
