"""The result cache as clients use it (wire/cache.py): a call to a serving with a cache sends
each item as a request of its own, named by its digest, and enqueue.lua answers the items
whose results are cached in the place of their entry ids, enqueuing only the others, in the
same round trip. The answers are put back in the caller's order as any call's requests are.

Keyed calls (an idempotency key), jobs (``keep=``) and streamed calls are sent as ever: their
answer is a job's or an event stream's, which no cache entry holds.
"""

from __future__ import annotations

from typing import Any

from queueserve.client.once import mark_keyed
from queueserve.client.outgoing import Outgoing
from queueserve.client.targets import Part, Target
from queueserve.wire import cache as C
from queueserve.wire.keys import Keys

# broker/common.py's CacheAt: index, the item's cache entry, its digest (16 bytes)
CacheAt = tuple[int, str, bytes]


def cache_version(target: Target) -> str | None:
    """The serving's cache_version when it caches results (the Serving object's options, else
    what its workers declared), else None: its calls are sent as ever."""
    serving = target.serving
    if serving is not None:
        return serving.cache_version if serving.cache_ttl > 0 else None
    if target.cache_ttl:
        return target.cache_version or ""
    return None


def cached_plan(
    target: Target, parts: list[Part], keep_ms: int, keyed: bool
) -> tuple[list[Part], str | None]:
    """A call's requests (``call_plan``'s) and, for a call whose items are cached, each item
    as a request of its own and the serving's cache_version (else None: sent as planned)."""
    if keep_ms or keyed or target.hooks:
        return parts, None
    version = cache_version(target)
    return (parts, None) if version is None else (per_item(parts), version)


def per_item(parts: list[Part]) -> list[Part]:
    """``parts`` as one request per item (each cached on its own), positions kept."""
    if all(len(p.items) == 1 for p in parts):
        return parts
    out = []
    for part in parts:
        positions = part.positions if part.positions is not None else range(len(part.items))
        out += [
            Part(part.batch_key, [at], [item])
            for at, item in zip(positions, part.items, strict=True)
        ]
    return out


def mark_cached(outgoing: list[Outgoing], version: str) -> None:
    """Give each request its item's digest (its batch key is its tenant's lane, as the worker
    that caches its result sees it)."""
    for out in outgoing:
        out.call.cache = C.digest(version, out.batch_key, out.payload)


def marked(
    outgoing: list[Outgoing],
    onces: tuple[list[str], int] | None,
    tenant: str | None,
    cached: str | None,
) -> list[Outgoing]:
    """The requests of one call marked: each with its idempotency key (``onces``: keyed
    requests go each on its own), or each with its item's digest (``cached``: the serving's
    cache_version); several requests of a call that is not keyed are admitted together or
    not at all (``Call.group``)."""
    if onces is not None:
        mark_keyed(outgoing, onces, tenant)
        return outgoing
    if cached is not None:
        mark_cached(outgoing, cached)
    if len(outgoing) > 1:
        for o in outgoing:
            o.call.group = outgoing[0].call.rid
    return outgoing


def declared_cache(declared: dict[str, Any]) -> tuple[float | None, str | None]:
    """(cache_ttl, cache_version) as a serving's workers declared them (None: not)."""
    return declared.get("cache_ttl"), declared.get("cache_version")


def caches_at(keys: Keys, group: list[Outgoing]) -> list[CacheAt]:
    """The cached requests of one enqueue script call (its group, on shard ``keys``)."""
    found: list[CacheAt] = []
    for i, out in enumerate(group):
        digest = out.call.cache
        if digest is not None:
            found.append((i, keys.cached(digest.hex()), digest))
    return found
