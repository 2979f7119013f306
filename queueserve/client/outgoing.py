"""What a client sends: each request as an ``Outgoing``, grouped per serving and shard into
enqueue script calls, and what enqueue.lua answered applied to the calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from queueserve.client.calls import Call, CallTable
from queueserve.client.targets import Target
from queueserve.errors import QueueFull
from queueserve.wire.cache import HIT
from queueserve.wire.cache import shard_of as shard_of_item
from queueserve.wire.keys import Keys
from queueserve.wire.once import shard_of_key
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
) -> tuple[list[tuple[Call, bytes]], list[Call]]:
    """Record what enqueue.lua answered: an entry id per admitted request, QueueFull for the
    rest, and the cached results enqueue.lua answered cached requests with. Returns the
    keyed requests it answered from their keys' records instead (client/once.py applies
    those answers), and the requests cancelled while on their way, which the sender must
    withdraw now that they have an entry (their cancel found none to name)."""
    target = group[0].target
    calls: dict[int, int] = {}  # a call of several requests refused: its items, all of them
    keyed: list[tuple[Call, bytes]] = []
    cancelled: list[Call] = []
    for (_, _, call, _, _), entry_id in zip(group, ids, strict=True):
        if entry_id == 0:
            table.forget(call)
            n = call.n
            if call.group:
                if call.group not in calls:
                    calls[call.group] = sum(o.call.n for o in group if o.call.group == call.group)
                n = calls[call.group]
            call.fail(QueueFull(full_message(target, limit, queued, n, call.keys.shard)))
        elif call.once is not None and not entry_id[:1].isdigit():
            keyed.append((call, entry_id))
        elif call.cache is not None and entry_id[:1] == HIT:
            table.answer_cached(call, entry_id)
        else:
            call.entry_id = entry_id
            if call.state == "cancelled":
                cancelled.append(call)
    return keyed, cancelled


def send_window(batch: list[Outgoing]) -> float:
    """How long sending ``batch`` may keep retrying: RECONNECT_WITHIN_S, or less when a
    request's deadline comes sooner (its caller is owed an answer by then, even an error)."""
    deadlines = [o.call.deadline for o in batch if o.call.deadline is not None]
    if not deadlines:
        return RECONNECT_WITHIN_S
    return max(0.0, min(RECONNECT_WITHIN_S, min(deadlines) - time.time()))


def enqueue_groups(
    batch: list[Outgoing],
) -> Iterator[tuple[list[Outgoing], Keys, list[Any], int, bool, list[tuple[int, int]]]]:
    """Per serving and shard: the requests of ``batch``, the keys of the shard they go to,
    enqueue arguments, max_queue (per shard), whether the enqueue must wait for a replica,
    and the runs of requests of one call among them (admitted together or not at all).

    Each is one script call (one Cluster slot). A small send of a serving goes whole to the
    shard this client has sent the fewest items; a large one is spread over the shards
    (``ShardSpread``)."""
    for group in by_serving(batch):
        target = group[0].target
        for shard, outs in _by_shard(target, group):
            requests: list[Any] = []
            together: list[tuple[int, int]] = []  # (first request, how many)
            for _, key, call, h, p in outs:
                call.keys = shard  # where the request lives: cancel finds it there
                if call.group:  # its call's requests came one after another
                    first, count = together[-1] if together else (-1, 0)
                    if first + count == len(requests) and outs[first].call.group == call.group:
                        together[-1] = (first, count + 1)
                    else:
                        together.append((len(requests), 1))
                requests.append((key, call.n, h, p, call.priority))
            together = [run for run in together if run[1] > 1]
            yield outs, shard, requests, target.max_queue, target.durable, together


def _by_shard(target: Target, group: list[Outgoing]) -> list[tuple[Keys, list[Outgoing]]]:
    """One send's requests of a serving by the shard they go to; with one shard (the common
    case) all to its keys, without per-request work on the client's hot path. The requests
    of one call (``Call.group``) go to one shard, where they are admitted together."""
    if len(target.shards) <= 1:
        return [(target.keys, group)]
    calls: list[list[Outgoing]] = []
    for out in group:
        if (
            out.call.group
            and out.call.cache is None  # (each cached item goes to its own shard)
            and calls
            and calls[-1][0].call.group == out.call.group
        ):
            calls[-1].append(out)
        else:
            calls.append([out])
    per_shard: dict[int, tuple[Keys, list[Outgoing]]] = {}
    sizes = [sum(o.call.n for o in outs) for outs in calls]
    for outs, shard in zip(calls, target.place(sizes), strict=True):
        once = outs[0].call.once
        if once is not None:  # a keyed request: where its key's record is
            shard = target.shards[shard_of_key(once[0], len(target.shards))]
        elif outs[0].call.cache is not None:  # a cached item: where its result is cached
            shard = target.shards[shard_of_item(outs[0].call.cache, len(target.shards))]
        per_shard.setdefault(shard.shard, (shard, []))[1].extend(outs)
    return list(per_shard.values())


def full_message(target: Target, limit: int, queued: int, n: int, shard: int = 0) -> str:
    where = (
        f" (shard {shard} of {len(target.shards)}; max_queue counts per shard)"
        if (len(target.shards) > 1)
        else ""
    )
    return (
        f"serving {target.keys.name!r} is full{where}: {queued} items queued, "
        f"max_queue={limit}, this call has {n}; retry later, add workers, or raise "
        "max_queue"
    )
