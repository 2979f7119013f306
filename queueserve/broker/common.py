"""What the sync and asyncio brokers share: script text, command arguments, reply parsing.

No I/O here; each broker sends the commands these build and hands the replies back here.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import hiredis
from redis.connection import HiredisRespSerializer
from redis.exceptions import NoScriptError

from queueserve.broker.urls import redact_url
from queueserve.wire.cache import lookup_spec
from queueserve.wire.job_record import placings
from queueserve.wire.keys import (
    GROUP,
    MAX_LISTED_SERVINGS,
    Keys,
    is_serving_name,
    serving_of,
    servings_key,
)
from queueserve.wire.once import once_spec
from queueserve.wire.priority import PRIORITY_AGE_MS
from queueserve.wire.timing import DURABLE_WAIT_MS, SERVINGS_FORGET_S

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
Request = tuple[str, int, bytes, bytes, int]  # batch key, items, header, payload, priority
# Requests of one call admitted together or not at all: the first one's index, how many
Together = tuple[int, int]
Enqueued = tuple[int, int, list[bytes | int]]  # limit, queued after, entry id or 0 per request
# A keyed request (wire/once.py): its index, its record's key, its digest, the id of the job it
# becomes, and the TTL (ms) of its record when the meta hash declares none
OnceAt = tuple[int, str, str, str, int]
# A cached request (wire/cache.py): its index, its item's cache entry, its digest (16 bytes)
CacheAt = tuple[int, str, bytes]
INBOX_READ_COUNT = 512


def pack_fast(args: tuple[Any, ...]) -> list[bytes] | None:
    """RESP of one command straight through hiredis, or None when redis-py must pack it (a
    command name with a space, such as "XINFO GROUPS", or an argument of a type only
    redis-py knows how to refuse)."""
    name = args[0]
    if (b" " if isinstance(name, bytes) else " ") in name:
        return None
    try:
        return [hiredis.pack_command(args)]
    except TypeError:
        return None


class HiredisPacker:
    """Packs commands for sync connections (their ``command_packer``).

    redis-py's own hiredis serializer walks every argument in Python before handing the tuple
    to hiredis; where one enqueue call carries four arguments per request and one ack two per
    entry, that walk cost more than the packing itself (2.8 vs 0.5 µs per enqueued request,
    measured on the development machine)."""

    def __init__(self) -> None:
        self._general = HiredisRespSerializer()  # type: ignore[no-untyped-call, unused-ignore]

    def pack(self, *args: Any) -> list[bytes]:
        return pack_fast(args) or self._general.pack(*args)


def text(value: bytes | str, errors: str = "strict") -> str:
    return value.decode(errors=errors) if isinstance(value, bytes) else value


def consumer_name(name: str) -> bytes:
    """A consumer's name as Redis holds it. Names read from a group are decoded with
    surrogateescape (anyone may XREADGROUP under a name that is not UTF-8, and the entries
    it holds must still be reclaimed): this gives back their bytes."""
    return name.encode("utf-8", "surrogateescape")


def names(raw: Iterable[bytes]) -> list[str]:
    """Members of a sorted set anyone may write that can be names queueserve wrote (stream or
    consumer names, UTF-8): one that is not UTF-8 is nobody's, and is skipped, not fatal."""
    out = []
    for value in raw:
        with contextlib.suppress(UnicodeDecodeError):
            out.append(value.decode())
    return out


def load_script(name: str) -> str:
    return resources.files("queueserve.broker").joinpath("lua", name).read_text()


def enqueue_arguments(
    keys: Keys,
    requests: Sequence[Request],
    max_queue: int,
    jobs: Sequence[tuple[int, str, str, int]] = (),
    together: Sequence[Together] = (),
    again: bool = False,
    onces: Sequence[OnceAt] = (),
    caches: Sequence[CacheAt] = (),
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of enqueue.lua for these requests: each stream's batch key and priority
    once, then four values per request (the first of ``together`` requests with its item
    count as 'N:R': admitted with the R-1 after it or refused with them); then, for ``jobs``
    (broker/job_store.py's JobAt), their record groups' keys and what enqueue.lua writes there
    (not on a cluster: the groups are in other slots); ``again``: the send was tried before,
    so a job's field may be there already, or ended; ``onces``: the keyed requests, whose
    records enqueue.lua reads and writes (after the groups' keys); ``caches``: the cached
    requests, whose entries enqueue.lua answers from (after the records, with the stats
    hash). The per-priority counter
    goes last of all KEYS (enqueue.lua knows it by its name, so callers that predate it
    still work)."""
    streams: dict[tuple[str, int], int] = {}
    per_request: list[Any] = []
    for batch_key, n, header, payload, priority in requests:
        index = streams.get((batch_key, priority))
        if index is None:
            index = streams[batch_key, priority] = len(streams) + 1
        per_request += (index, n, header, payload)
    for first, count in together:
        per_request[4 * first + 1] = f"{requests[first][1]}:{count}"
    args: list[Any] = [max_queue, GROUP, PRIORITY_AGE_MS, len(streams)]
    for batch_key, priority in streams:
        args += (batch_key, priority)
    script_keys = [keys.queued, keys.seen, keys.meta, keys.ready, keys.wake, keys.depth]
    script_keys += [keys.stream(key, priority) for key, priority in streams]
    if jobs:
        groups: dict[str, list[Any]] = {}
        for index, key, rid, keep_ms in jobs:
            at = groups.get(key)
            if at is None:
                at = groups[key] = []
            at += (index + 1, rid, keep_ms)
        script_keys += groups
        per_request.append(placings(keys.name, list(groups.values()), again))
    out = args + per_request
    if onces or caches:
        _add_keyed(keys, onces, caches, script_keys, out)
    script_keys.append(keys.pdepth)
    return script_keys, out


def _add_keyed(
    keys: Keys,
    onces: Sequence[OnceAt],
    caches: Sequence[CacheAt],
    script_keys: list[str],
    args: list[Any],
) -> None:
    """enqueue.lua's KEYS and last ARGVs for keyed requests (their records and once_spec),
    then for cached ones (their entries and the stats hash, and their digests), and ARGV[4]
    'S:O' or 'S:O:C' saying how many of each."""
    args[3] = f"{args[3]}:{len(onces)}" + (f":{len(caches)}" if caches else "")
    if onces:
        script_keys += [record for _, record, _, _, _ in onces]
        args.append(once_spec(onces))
    if caches:
        script_keys += [entry for _, entry, _ in caches]
        script_keys.append(keys.cache_stats())
        args.append(lookup_spec([(i + 1, d) for i, _, d in caches]))


def ack_arguments(
    keys: Keys, stream: str, runs: Mapping[int, Sequence[bytes]]
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ack.lua for entries of ``stream`` (a stream of shard ``keys``), given
    as runs of entries admitted with the same item count: count -> entry ids."""
    args: list[Any] = [GROUP, *keys.parse_stream(stream)]  # batch key, priority
    for admitted, ids in runs.items():
        args += (admitted, len(ids), *ids)
    return [stream, keys.queued, keys.depth, keys.active, keys.pdepth], args


def not_replicated_message(keys: Keys, url: str) -> str:
    return (
        f"serving {keys.name!r} is durable, and its request was queued on the primary of "
        f"{redact_url(url)}, but no replica acknowledged it within {DURABLE_WAIT_MS} ms, so a "
        "failover now could lose it; it may still run. Check the replicas (INFO replication: "
        "connected_slaves), then resend it if running it twice is harmless"
    )


def enqueue_and_wait_commands(
    sha: str, script_keys: list[str], args: list[Any]
) -> list[tuple[Any, ...]]:
    """A durable enqueue: enqueue.lua then ``WAIT 1``, to be sent on one connection (WAIT
    counts the replicas holding that connection's writes; on a cluster, a connection to the
    shard's master). The sync and asyncio producers both send these."""
    return [("EVALSHA", sha, len(script_keys), *script_keys, *args), ("WAIT", 1, DURABLE_WAIT_MS)]


def durable_replies(out: Sequence[Any], first_try: bool) -> tuple[Any, int] | None:
    """enqueue.lua's reply and the replica count of ``enqueue_and_wait_commands``' replies
    (errors as values); None after a NOSCRIPT on the first try: load the script, send again."""
    reply, replicas = out
    if isinstance(reply, NoScriptError) and first_try:
        return None
    if isinstance(reply, Exception):
        raise reply
    if isinstance(replicas, Exception):
        # UNBLOCKED: the master turned replica while WAIT waited (a failover took its slot
        # or service): transient, so the send is retried on the new master (the entry went
        # with the old master's writes, or it runs twice and its caller keeps one answer).
        # Never int() of it: that killed the sender thread, and its callers waited for
        # their timeout.
        raise replicas
    return reply, int(replicas)


def enqueued(reply: list[Any]) -> Enqueued:
    return int(reply[0]), int(reply[1]), list(reply[2:])


def cancel_arguments(
    keys: Keys, stream: str, entry_id: bytes, n: int, rid: int, inbox: str
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of cancel.lua: request ``rid`` of ``n`` items, sent by the client of
    ``inbox``, as entry ``entry_id`` of ``stream`` (withdrawn only if its header says so, or
    a request of the pack there says so)."""
    batch_key, priority = keys.parse_stream(stream)
    return (
        [stream, keys.queued, keys.cancel, keys.depth, keys.pdepth, keys.withdrawn],
        [GROUP, entry_id, n, batch_key, priority, rid, inbox],
    )


def inbox_command(inbox: str, timeout: float) -> tuple[Any, ...]:
    """BLMPOP of up to INBOX_READ_COUNT replies, waiting up to ``timeout`` seconds."""
    return ("BLMPOP", timeout, 1, inbox, "LEFT", "COUNT", INBOX_READ_COUNT)


def inbox_messages(reply: Any) -> list[bytes]:
    return [] if reply is None else list(reply[1])


def texts(raw: Mapping[Any, Any], errors: str = "strict") -> dict[str, str]:
    """A hash as text; ``errors="replace"`` for hashes anyone may write, whose fields are
    validated after (a field that is not UTF-8 then fails its check instead of the read)."""
    return {text(k, errors): text(v, errors) for k, v in raw.items()}


def since_ms(within: float) -> int:
    """The score (unix ms) a heartbeat must reach to count as within the last ``within`` s."""
    return int(time.time() * 1000) - int(within * 1000)


def pubsub_data(message: Mapping[str, Any] | None) -> tuple[bool, bytes | None]:
    """(is a subscription confirmation, the published data) of one pub/sub message."""
    if message is None:
        return False, None
    if message["type"] == "subscribe":
        return True, None
    return False, message["data"] if message["type"] == "message" else None


def declared_names(keys: Iterable[bytes | str]) -> list[str]:
    """Serving names from meta hash keys; a shard's (``S#i``) is its serving's already."""
    names = {serving_of(text(key, "replace")) for key in keys}
    return sorted(name for name in names if name is not None)


# --- the servings registry (P:servings): what every listing of servings reads ----------------
FORGET_MS = int(SERVINGS_FORGET_S * 1000)


def register_servings(pipe: Any, keys_list: Sequence[Keys], now_ms: int) -> int:
    """Add to ``pipe`` the registry's refresh for these servings (shard 0's name each) and the
    drop of entries nobody refreshed for SERVINGS_FORGET_S. Returns how many commands were
    added (0: no serving of shard 0 among them)."""
    names = {keys.name: now_ms for keys in keys_list if keys.shard == 0}
    if not names:
        return 0
    key = servings_key(keys_list[0].prefix)
    pipe.zadd(key, names)
    pipe.zremrangebyscore(key, "-inf", now_ms - FORGET_MS)
    return 2


def add_listing(pipe: Any, prefix: str, now_ms: int, limit: int = MAX_LISTED_SERVINGS) -> None:
    """Add to ``pipe`` (sync or asyncio) the registry's read: the entries refreshed within
    SERVINGS_FORGET_S (scores as far in the future are forged: skipped), newest first, at
    most ``limit`` with their scores (``listed`` reads them), then how many there are in
    that window without the limit (ZCOUNT)."""
    low, high = now_ms - FORGET_MS, now_ms + FORGET_MS
    key = servings_key(prefix)
    pipe.zrange(
        key, high, low, desc=True, byscore=True, offset=0, num=max(1, limit), withscores=True
    )
    pipe.zcount(key, low, high)


def listed(reply: Any) -> dict[str, int]:
    """Serving name -> last refresh (unix ms) of ``add_listing``'s first reply (pairs, or a
    flat list). Anyone may write the registry: a member that is not
    a name a serving can have is skipped, and a reply of another type (WRONGTYPE) is empty."""
    if not isinstance(reply, list):
        return {}
    pairs = (
        reply
        if not reply or isinstance(reply[0], (list, tuple))
        else list(zip(reply[::2], reply[1::2], strict=False))
    )
    found: dict[str, int] = {}
    for member, score in pairs:
        try:
            name = member.decode() if isinstance(member, bytes) else str(member)
            at = float(score)
        except (UnicodeDecodeError, ValueError, TypeError):
            continue
        if is_serving_name(name) and math.isfinite(at):
            found.setdefault(name, int(at))
    return found


def listing(replies: Sequence[Any]) -> tuple[dict[str, int], int]:
    """(serving -> last refresh, how many entries the window holds) of ``add_listing``'s two
    replies, read with ``raise_on_error=False``: a registry of another type lists none."""
    entries, total = replies
    found = listed(entries)
    return found, max(len(found), total if isinstance(total, int) else 0)
