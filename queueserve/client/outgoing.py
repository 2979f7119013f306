"""What a client sends: each request as an ``Outgoing``, grouped per serving and shard into
enqueue script calls, and what enqueue.lua answered applied to the calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from queueserve.client.calls import Call, CallTable
from queueserve.client.targets import Target
from queueserve.errors import QueueFull
from queueserve.wire import protocol as P
from queueserve.wire.timing import RECONNECT_WITHIN_S


class Outgoing(NamedTuple):
    """One request, encoded and checked: what the sender sends."""

    target: Target
    batch_key: str
    call: Call
    header: bytes
    payload: bytes


def by_serving(batch: list[Outgoing]) -> list[list[Outgoing]]:
    """Requests grouped per serving: one enqueue script call each (one Cluster slot)."""
    if len(batch) == 1:  # a lone dispatch: no grouping to do
        return [batch]
    groups: dict[str, list[Outgoing]] = {}
    for out in batch:
        groups.setdefault(out.target.keys.name, []).append(out)
    return list(groups.values())


def admitted(
    table: CallTable, group: list[Outgoing], limit: int, queued: int, ids: list[Any]
) -> None:
    """Record what enqueue.lua answered: an entry id per admitted request, QueueFull for the
    rest."""
    target = group[0].target
    for (_, _, call, _, _), entry_id in zip(group, ids, strict=True):
        if entry_id == 0:
            table.forget(call)
            call.fail(QueueFull(full_message(target, limit, queued, call.n, call.keys.shard)))
        else:
            call.entry_id = entry_id


def send_window(batch: list[Outgoing]) -> float:
    """How long sending ``batch`` may keep retrying: RECONNECT_WITHIN_S, or less when a
    request's deadline comes sooner (its caller is owed an answer by then, even an error)."""
    deadlines = [o.call.deadline for o in batch if o.call.deadline is not None]
    if not deadlines:
        return RECONNECT_WITHIN_S
    return max(0.0, min(RECONNECT_WITHIN_S, min(deadlines) - time.time()))


def enqueue_groups(
    batch: list[Outgoing],
) -> Iterator[tuple[list[Outgoing], P.Keys, list[Any], int, bool]]:
    """Per serving and shard: the requests of ``batch``, the keys of the shard they go to,
    enqueue arguments, max_queue (per shard) and whether the enqueue must wait for a replica.

    Each is one script call (one Cluster slot). A small send of a serving goes whole to the
    shard this client has sent the fewest items; a large one is spread over the shards
    (``ShardSpread``)."""
    for group in by_serving(batch):
        target = group[0].target
        for shard, outs in _by_shard(target, group):
            requests = []
            for _, key, call, h, p in outs:
                call.keys = shard  # where the request lives: cancel finds it there
                requests.append((key, call.n, h, p, call.priority))
            yield outs, shard, requests, target.max_queue, target.durable


def _by_shard(target: Target, group: list[Outgoing]) -> list[tuple[P.Keys, list[Outgoing]]]:
    """One send's requests of a serving by the shard they go to; with one shard (the common
    case) all to its keys, without per-request work on the client's hot path."""
    if len(target.shards) <= 1:
        return [(target.keys, group)]
    per_shard: dict[int, tuple[P.Keys, list[Outgoing]]] = {}
    for out, shard in zip(group, target.place([o.call.n for o in group]), strict=True):
        per_shard.setdefault(shard.shard, (shard, []))[1].append(out)
    return list(per_shard.values())


def full_message(target: Target, limit: int, queued: int, n: int, shard: int = 0) -> str:
    where = (
        f" (shard {shard} of {len(target.shards)}; max_queue counts per shard)"
        if (len(target.shards) > 1)
        else ""
    )
    return (
        f"serving {target.keys.name!r} is full{where}: {queued} items queued, "
        f"max_queue={limit}, this request has {n}; retry later, add workers, or raise "
        "max_queue"
    )
