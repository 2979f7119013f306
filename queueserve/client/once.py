"""Idempotency keys as clients send them (wire/once.py): the plan of a keyed call, the records
its enqueue reads and writes, and what a keyed request answered from its key's record becomes.

A keyed request is a job (client/job_sends.py) that keeps its answer as long as its key's
record lives, so that a call of the same key from any process, sent while the first is queued,
running or done, follows the first one's job (client/following.py) instead of running again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from queueserve.client.calls import Call, CallTable
from queueserve.client.job_sends import job_plan
from queueserve.client.outgoing import Outgoing
from queueserve.client.targets import Part, Target, in_batches, plan
from queueserve.errors import IdempotencyConflict, QueueServeError
from queueserve.options.serving_options import ServingOptions
from queueserve.wire import once as O
from queueserve.wire.job_record import check_job_id
from queueserve.wire.keys import Keys
from queueserve.wire.tenants import lane_key

IdempotencyKey = str | Callable[[Any], str]
# broker/common.py's OnceAt: index, record key, digest, job id, TTL (ms)
OnceAt = tuple[int, str, str, str, int]
_DEFAULT_TTL_S: float = ServingOptions.model_fields["idempotency_ttl"].default


def ttl_ms(target: Target) -> int:
    """The serving's idempotency_ttl as this client knows it (the Serving object, else what its
    workers declared, else the default), in ms; enqueue.lua prefers what the meta hash says."""
    if target.serving is not None:
        seconds = target.serving.idempotency_ttl
    else:
        seconds = _DEFAULT_TTL_S if target.idempotency_ttl is None else target.idempotency_ttl
    return max(1, int(seconds * 1000))


def map_key(key: object) -> Callable[[Any], str] | None:
    """``map``'s idempotency_key: a function of an item (each item is a request of its own);
    one key for a whole map would name every chunk's request."""
    if key is None or callable(key):
        return key
    raise TypeError(
        f"map's idempotency_key must be a function of an item (its key), got {key!r:.80}"
    )


def keyed_plan(
    target: Target,
    items: list[Any],
    parts: list[Part],
    key: IdempotencyKey,
    keep: float | None,
) -> tuple[list[Part], list[str], int, int]:
    """The requests of a call with ``idempotency_key=key``, their keys, the keep of the job
    each one is and their records' TTL (both ms). A key (str) names the call's one request;
    a function of an item makes each item a request of its own, keyed by what it returns for
    it."""
    if callable(key):
        named = [O.check_key(key(item)) for item in items]
        split = []
        for part in parts:
            positions: Iterable[int] = (
                part.positions if part.positions is not None else range(len(part.items))
            )
            for position, item in zip(positions, part.items, strict=True):
                split.append(Part(part.batch_key, [position], [item]))
        keys = [named[p.positions[0]] for p in split if p.positions is not None]
        parts = split
    else:
        keys = [O.check_key(key)] if parts else []
        if len(parts) > 1:
            raise ValueError(
                f"an idempotency key names one request, and these items go as {len(parts)} "
                "(one per batch key the serving's batch_key function gave): send one call per "
                "batch key, or give idempotency_key a function of the item"
            )
    ttl = ttl_ms(target)
    # the job keeps its answer while its key's record lives, at least (enqueue.lua raises the
    # keep to the TTL the meta hash declares)
    keep_ms = max(job_plan(target, parts[:1], keep), ttl) if parts else 0
    return parts, keys, keep_ms, ttl


def mark_keyed(outgoing: list[Outgoing], onces: tuple[list[str], int], tenant: str | None) -> None:
    """Give each request of a call its idempotency key (a tenant's keys apart from another's:
    in its lane's name), its digest and its record's TTL (ms)."""
    keys, ttl = onces
    for out, key in zip(outgoing, keys, strict=True):
        named = key if tenant is None else lane_key(key, tenant)
        out.call.once = (named, O.request_digest(out.batch_key, out.payload), ttl)


def call_plan(
    target: Target,
    items: list[Any],
    batch_key: str | None,
    keep: float | None,
    key: IdempotencyKey | None,
) -> tuple[list[Part], int, tuple[list[str], int] | None]:
    """A call's requests (``plan``, cut in batches unless they are jobs), the keep of the
    job each one is (ms; 0: none) and, with an idempotency key, each one's key and their
    records' TTL (ms)."""
    parts = plan(target, items, batch_key)
    onces = None
    if key is None:
        keep_ms = job_plan(target, parts, keep)
    else:
        parts, keys, keep_ms, ttl = keyed_plan(target, items, parts, key, keep)
        onces = keys, ttl
    return in_batches(target, parts, job=keep_ms > 0), keep_ms, onces


def onces_at(client_id: str, keys: Keys, group: list[Outgoing]) -> list[OnceAt]:
    """The keyed requests of one enqueue script call (its group, on shard ``keys``)."""
    found: list[OnceAt] = []
    for i, out in enumerate(group):
        once = out.call.once
        if once is not None:
            found.append((i, keys.once(once[0]), once[1], f"{client_id}-{out.call.rid}", once[2]))
    return found


def answered(table: CallTable, client_id: str, answers: list[tuple[Call, bytes]]) -> list[Call]:
    """Apply what enqueue.lua answered in the place of keyed requests' entry ids (wire/once.py):
    a conflict or a forged record fails its call; the calls that take the answer of another
    request's job are returned (its caller's client follows them). Each is forgotten by the
    caller's table first: no answer of its own comes to the inbox."""
    follow = []
    for call, answer in answers:
        assert call.once is not None
        call.entry_id = answer  # placed: a ticket's id need not wait for it
        code, job_id = answer[0], answer[1:].decode(errors="replace")
        try:
            check_job_id(job_id)  # (a record's job id is a stranger's: it names a key)
        except ValueError:
            code = O.FORGED
        if code == O.SAME and job_id == f"{client_id}-{call.rid}":
            # A send tried again (its reply lost) finds the record its first try wrote: its
            # entry is queued, under an id this client never learnt (a cancel ends the job)
            call.entry_id = b""
            continue
        if code == O.SAME:
            call.follows = job_id
            table.forget(call)
            follow.append(call)
            continue
        if code == O.CONFLICT:
            error: QueueServeError = IdempotencyConflict(
                O.conflict_message(call.keys.name, call.once[0], job_id)
            )
        else:
            error = QueueServeError(
                O.forged_message(call.keys.name, call.once[0], call.keys.once(call.once[0]))
            )
        table.forget(call)
        call.fail(error)
    return follow
