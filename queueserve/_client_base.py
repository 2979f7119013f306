"""What the sync and async clients share: naming, request planning and error wording."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from . import protocol as P
from ._calls import Call, CallTable, outcome
from .codec import Codec, get_codec
from .errors import BadRequest, QueueFull, QueueServeError
from .serving import Serving
from .settings import Settings

# A worker is alive when its last heartbeat is this recent (workers beat every second).
ALIVE_WITHIN = 10.0
# How long a send keeps retrying while Redis is unreachable before the caller gets the error.
RECONNECT_WITHIN = 30.0


ServingRef = str | Serving


@dataclass(slots=True)
class Target:
    """Where and how requests to one serving go."""

    keys: P.Keys
    codec: Codec
    serving: Serving | None  # given when the caller passed the Serving object
    max_queue: int  # admission limit to use until a worker has declared the serving
    max_payload_bytes: int | None  # known from the Serving object or the workers' declaration
    batch_size: int | None = None  # likewise; a streamed request holds at most this many items
    hooks: bool = False  # the serving streams hook events: its requests are never split

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


class ClientBase:
    def __init__(self, url: str | None, prefix: str | None) -> None:
        settings = Settings()
        self.url = url or settings.redis_url
        self.prefix = prefix or settings.prefix
        self.client_id = uuid.uuid4().hex[:16]
        self.inbox = P.inbox_key(self.prefix, self.client_id)
        self.table = CallTable()
        self._targets: dict[str, Target] = {}

    def cached(self, serving: ServingRef) -> Target | None:
        return self._targets.get(serving) if isinstance(serving, str) else None

    def remember(self, serving: ServingRef, meta: dict[str, str]) -> Target:
        """The target for ``serving``, given the options its workers declared (maybe none)."""
        target = self._target_for(serving, meta.get("codec"))
        if target.serving is not None:
            target.batch_size = target.serving.batch_size
            target.hooks = target.serving.hooks is not None
        elif meta:
            target.max_payload_bytes = int(meta.get("max_payload_bytes") or 0) or None
            target.batch_size = int(meta.get("batch_size") or 0) or None
            target.hooks = meta.get("streaming") == "True"
        if isinstance(serving, str) and "codec" in meta:
            self._targets[serving] = target
        self.table.accept(target.codec)
        return target

    def _target_for(self, serving: ServingRef, meta_codec: str | None) -> Target:
        if isinstance(serving, Serving):
            return Target(
                P.Keys(self.prefix, serving.name),
                get_codec(serving.codec),
                serving,
                serving.max_queue,
                serving.max_payload_bytes,
            )
        if not isinstance(serving, str):
            raise TypeError(f"serving must be a name or a qs.Serving, got {serving!r}")
        return Target(
            P.Keys(self.prefix, serving), get_codec(meta_codec or "msgpack"), None, 0, None
        )

    @staticmethod
    def plan(target: Target, items: list[Any], batch_key: str | None) -> list[Part]:
        """Apply the serving's map_inputs and group items by batch key (one request per key)."""
        if not items:
            return []  # nothing to send; the caller gets [] at once
        serving = target.serving
        if serving is None:
            return [Part(batch_key or "default", None, items)]
        if serving.has_client_maps:
            items = [serving.prepare_item(x) for x in items]
        if batch_key is not None or not callable(serving.batch_key):
            return [Part(serving.key_for(None, batch_key), None, items)]
        groups: dict[str, Part] = {}
        for i, item in enumerate(items):
            key = serving.key_for(item, None)
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

    @staticmethod
    def stream_parts(
        target: Target, items: list[Any], batch_key: str | None
    ) -> list[tuple[int, Part]]:
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

    @staticmethod
    def full_message(target: Target, limit: int, queued: int, n: int) -> str:
        return (
            f"serving {target.keys.name!r} is full: {queued} items queued, max_queue={limit}, "
            f"this request has {n}; retry later, add workers, or raise max_queue"
        )

    @staticmethod
    def timeout_message(target: Target, timeout: float | None, alive: int | None) -> str:
        waited = f"within {timeout:g}s" if timeout is not None else "before its deadline"
        head = f"no answer from serving {target.keys.name!r} {waited}"
        if alive is None:
            return f"{head}; Redis could not be asked whether any worker is alive"
        if alive == 0:
            return (
                f"{head}; no worker is alive for it (none sent a heartbeat in the last "
                f"{ALIVE_WITHIN:g}s): start one with `queueserve worker module:attr`"
            )
        return (
            f"{head}; {alive} worker(s) alive for it, so the queue is long or the batch slow: "
            "raise timeout or add workers"
        )


Outgoing = tuple[Target, str, Call, bytes, bytes]  # target, batch key, call, header, payload


def by_serving(batch: list[Outgoing]) -> list[list[Outgoing]]:
    """Requests grouped per serving: one enqueue script call each (one Cluster slot)."""
    groups: dict[str, list[Outgoing]] = {}
    for out in batch:
        groups.setdefault(out[0].keys.name, []).append(out)
    return list(groups.values())


def admitted(
    table: CallTable, group: list[Outgoing], limit: int, queued: int, ids: list[Any]
) -> None:
    """Record what enqueue.lua answered: an entry id per admitted request, QueueFull for the
    rest."""
    target = group[0][0]
    for (_, _, call, _, _), entry_id in zip(group, ids, strict=True):
        if entry_id == 0:
            table.forget(call)
            call.fail(QueueFull(ClientBase.full_message(target, limit, queued, call.n)))
        else:
            call.entry_id = entry_id


def send_window(batch: list[Outgoing]) -> float:
    """How long sending ``batch`` may keep retrying: RECONNECT_WITHIN, or less when a request's
    deadline comes sooner (its caller is owed an answer by then, even if it is an error)."""
    deadlines = [c.deadline for _, _, c, _, _ in batch if c.deadline is not None]
    if not deadlines:
        return RECONNECT_WITHIN
    return max(0.0, min(RECONNECT_WITHIN, min(deadlines) - time.time()))


def collect(
    target: Target, parts: list[Part], calls: list[Call], return_exceptions: bool
) -> list[Any]:
    """Results of finished calls, back in the caller's item order, through map_results."""
    if len(calls) == 1 and parts[0].positions is None:  # one request: results as they came
        results = outcome(calls[0], return_exceptions)
    else:
        results = [None] * sum(len(p.items) for p in parts)
        for part, call in zip(parts, calls, strict=True):
            assert part.positions is not None
            for pos, r in zip(part.positions, outcome(call, return_exceptions), strict=True):
                results[pos] = r
    serving = target.serving
    if serving is not None and serving.has_client_maps:
        return [r if isinstance(r, QueueServeError) else serving.finish_result(r) for r in results]
    return results
