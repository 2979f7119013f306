"""Redis key names: the one place that knows them (the messages are wire/protocol.py's).

Key layout (``P`` is the configurable prefix, default ``qs``; ``S`` the serving name; ``K`` a batch
key). Every key of one serving shard shares one hash tag, so a shard lives in one Redis Cluster
slot and the Lua scripts (broker/lua/) may touch all of its keys atomically. A serving with
``shards=N`` has N tags: ``{S}`` for shard 0 (the layout of an unsharded serving) and ``{S#i}`` or
``{S#i.k}`` for shard i (``shard_tags``: chosen to spread the shards evenly over the slots),
each with the keys below; ``meta``, ``config`` and ``workers`` are read from shard 0 only
(the last shard's ``meta`` holds ``shards`` alone: clients trust a count both declare)::

    P:{S}:in:K        stream   requests of priority 0 (fields h, p, a); consumer group "qs"
    P:{S}:pN:K        stream   requests of priority N (1..9), same fields and group
    P:{S}:seen        zset     batch key -> last enqueue, unix ms (keys idle past the serving's
                               key_idle_ttl are forgotten: their streams deleted)
    P:{S}:ready       zset     "<N><K>" for each stream holding entries no worker read yet;
                               score = when it became ready or was last served, unix ms, minus
                               PRIORITY_AGE_MS per priority level (lowest is read first), and
                               59,999.5 less for a quiet key until its first read (a lead:
                               the .5 marks it; enqueue.lua, read.lua)
    P:{S}:active      zset     streams that may hold pending entries, which reclaim watches
                               (read.lua adds; ack.lua and sweep.lua take out emptied ones)
    P:{S}:wake        stream   one entry each time a stream becomes ready (MAXLEN ~ 100): idle
                               workers block on it instead of on every stream
    P:{S}:depth       hash     batch key -> items admitted and not yet acked
    P:{S}:pdepth      hash     priority (0..9) -> items admitted and not yet acked, every key
                               (deleted whole when ``queued`` reaches 0: drift goes with it)
    P:{S}:keys        set      (before wire 1 with priorities) batch keys; adopted into seen
    P:{S}:queued      string   items admitted and not yet acked (admission counter, max_queue)
    P:{S}:meta        hash     the serving's options in force, as workers declared them
                               (with ``shards``: how many tags its requests spread over)
    P:{S}:config      hash     options changed at run time (`queueserve config set`)
    P:{S}:workers     zset     consumer name -> last heartbeat, unix ms (TTL)
    P:{S}:dead        stream   dead letters: requests that could not be served, with the reason
    P:{S}:cancel      channel  "stream\nentry id" of requests cancelled after a worker read them;
                               "stream\nentry id/request id" for one request of a pack
    P:{S}:withdrawn   hash     "stream\nentry id" -> "rid,rid,...": the requests of a pack no
                               worker read yet that their callers cancelled (cancel.lua writes,
                               read.lua takes it with the pack, in the same script; at most
                               MAX_WITHDRAWN fields)
    P:{S}:once:I      string   the record of idempotency key I: "<digest of the request>:<job
                               id>" (wire/once.py), written with the request's entry in one
                               script (enqueue.lua); TTL: the serving's idempotency_ttl
    P:{S}:cached:D    string   the cached result of the item of digest D (wire/cache.py),
                               written by workers, read by enqueue.lua; TTL: cache_ttl
    P:{S}:cachestats  hash     the result cache's counts: hits, misses (enqueue.lua), stored,
                               bytes, too_big (workers); TTL: a week past the last count
    P:inbox:C         list     replies for client C, one element per (client, batch) (TTL)
    P:events:C        channel  streamed events (hooks, generator steps) for client C
    P:worker:W        hash     registry record of worker process W (TTL), with a field
                               figures:S per serving it runs (wire/figures.py), and held:S,
                               the batch keys whose state it holds, one per line, per serving
                               with load_key (worker/pipeline/affinity.py)
    P:servings        zset     serving name -> last declaration or heartbeat of a worker serving
                               it, unix ms: the servings list (GET /v1/models, the dashboard,
                               admin listings), read a bounded page at a time, never by SCAN;
                               entries not refreshed for SERVINGS_FORGET_S are dropped
    P:tenants         hash     tenant name -> its weight (a decimal number, 0 < w <= 1000): the
                               gateways' tenants (gateway/tenants.py), read by workers with the
                               run-time config to share service between tenants' lanes
                               (wire/tenants.py; at most MAX_TENANT_WEIGHTS fields are read)
    P:jobkey          string   32 random bytes: the key of the HMAC that makes the job ids a
                               gateway hands out unguessable and binds each to its tenant
                               (gateway/job_ids.py; made once by the first gateway, SET NX)
    P:jobs:C:G        hash     the records of client C's jobs with request ids G*64 to G*64+63:
                               where each waits, its kept answers, how it ended (wire/job_record.py;
                               TTL: a week while one is live, then the last keep of them)

A key of a serving's shard 0 names its serving between the braces of its tag
(``serving_of``); scans of every serving's keys of one kind use ``tagged_pattern``.
"""

from __future__ import annotations

import functools
import re
from typing import Final

from queueserve.wire.priority import MAX_PRIORITY
from queueserve.wire.shards import shard_tag, shard_tags

GROUP: Final = "qs"  # the consumer group of every request stream

# The key layout above, machine-readable: (kind, Redis type) for each row of the docstring's
# table, the kind being the name's first part after the prefix and hash tag (``pN`` for the
# priority streams). tests/faults/fuzz/surfaces.py must attack each one: a new key or channel
# goes here, in the table, and in the fuzzer (tests/unit/test_fuzz_registry.py checks all three).
LAYOUT: Final = (
    ("in", "stream"),
    ("pN", "stream"),
    ("seen", "zset"),
    ("ready", "zset"),
    ("active", "zset"),
    ("wake", "stream"),
    ("depth", "hash"),
    ("pdepth", "hash"),
    ("keys", "set"),
    ("queued", "string"),
    ("meta", "hash"),
    ("config", "hash"),
    ("workers", "zset"),
    ("dead", "stream"),
    ("cancel", "channel"),
    ("withdrawn", "hash"),
    ("once", "string"),
    ("cached", "string"),
    ("cachestats", "hash"),
    ("inbox", "list"),
    ("events", "channel"),
    ("worker", "hash"),
    ("servings", "zset"),
    ("tenants", "hash"),
    ("jobkey", "string"),
    ("jobs", "hash"),
)
# Fields P:{S}:withdrawn may hold (one per queued pack with a cancelled request): cancel.lua
# prunes fields that name no queued pack once it is full, and past that records no more (its
# MAX_WITHDRAWN; a cancel then withdraws nothing, as before packs could be withdrawn from).
MAX_WITHDRAWN: Final = 10_000


class Keys:
    """Key names of one shard of one serving under one prefix (shard 0 unless ``shard``)."""

    __slots__ = (
        "_priority_prefix",
        "_shards",
        "_stream_prefix",
        "_tag",
        "active",
        "cancel",
        "config",
        "dead",
        "depth",
        "keys",
        "meta",
        "name",
        "pdepth",
        "prefix",
        "queued",
        "ready",
        "seen",
        "servings",
        "shard",
        "wake",
        "withdrawn",
        "workers",
    )

    def __init__(self, prefix: str, serving: str, shard: int = 0, tag: str | None = None) -> None:
        if "{" in serving or "}" in serving or ":" in serving or "#" in serving:
            raise ValueError(
                f"serving name {serving!r} may not contain '{{', '}}', ':' or '#'; "
                "use letters, digits, '-', '_' or '.'"
            )
        tag = f"{prefix}:{{{tag or serving}}}"
        self._tag = tag + ":"
        # Shards found by their tag (``shard_of``), filled by ``sharded``.
        self._shards: dict[str, Keys] = {self._tag: self}
        self.prefix = prefix
        self.name = serving
        self.shard = shard
        self.keys = f"{tag}:keys"
        self.queued = f"{tag}:queued"
        self.meta = f"{tag}:meta"
        self.workers = f"{tag}:workers"
        self.dead = f"{tag}:dead"
        self.cancel = f"{tag}:cancel"
        self.config = f"{tag}:config"
        self.seen = f"{tag}:seen"
        self.ready = f"{tag}:ready"
        self.active = f"{tag}:active"
        self.wake = f"{tag}:wake"
        self.depth = f"{tag}:depth"
        self.pdepth = f"{tag}:pdepth"
        self.servings = servings_key(prefix)  # the prefix's, not the shard's: no hash tag
        self.withdrawn = f"{tag}:withdrawn"
        self._stream_prefix = f"{tag}:in:"
        self._priority_prefix = f"{tag}:p"

    @property
    def stream_prefixes(self) -> tuple[str, str]:
        """What stream names start with: priority 0, and priority N before ``N:``."""
        return self._stream_prefix, self._priority_prefix

    def stream(self, batch_key: str, priority: int = 0) -> str:
        if priority == 0:
            return self._stream_prefix + batch_key
        return f"{self._priority_prefix}{priority}:{batch_key}"

    def once(self, key: str) -> str:
        """The record of idempotency key ``key`` (wire/once.py), in this shard's slot."""
        return f"{self._tag}once:{key}"

    def cached(self, digest_hex: str) -> str:
        """The cached result of the item of digest ``digest_hex`` (wire/cache.py)."""
        return f"{self._tag}cached:{digest_hex}"

    def cache_stats(self) -> str:
        """The result cache's counts of this shard (wire/cache.py)."""
        return f"{self._tag}cachestats"

    def streams(self, batch_key: str) -> list[str]:
        """The streams of one batch key, one per priority."""
        return [self.stream(batch_key, p) for p in range(MAX_PRIORITY + 1)]

    def sharded(self, shards: int) -> list[Keys]:
        """The keys of every shard of this serving, shard 0 first; ``shard_of`` knows them
        from then on."""
        found = [self] if self.shard == 0 else [Keys(self.prefix, self.name)]
        for i, tag in enumerate(shard_tags(self.name, shards)[1:], start=1):
            keys = Keys(self.prefix, self.name, i, tag)
            found.append(self._shards.setdefault(keys._tag, keys))
        for keys in found:
            self._shards.setdefault(keys._tag, keys)
        return [self._shards[k._tag] for k in found]

    def last_shard(self, shards: int) -> Keys:
        """The keys of the last of ``shards`` shards alone (only its tag is computed), where
        workers confirm the count they declared."""
        return Keys(self.prefix, self.name, shards - 1, shard_tag(self.name, shards, shards - 1))

    def shard_of(self, stream: str) -> Keys:
        """The keys of the shard ``stream`` belongs to (this one, or one made by ``sharded``);
        ValueError for any other key."""
        if stream.startswith(self._tag):
            return self
        end = stream.find("}:")
        found = self._shards.get(stream[: end + 2]) if end > 0 else None
        if found is None:
            raise ValueError(f"{stream!r} is not a key of serving {self.name!r}'s shards")
        return found

    def parse_stream(self, stream: str) -> tuple[str, int]:
        """(batch key, priority) of one of this serving's request streams, of any shard."""
        if not stream.startswith(self._tag):
            return self.shard_of(stream).parse_stream(stream)
        if stream.startswith(self._stream_prefix):
            return stream[len(self._stream_prefix) :], 0
        rest = stream[len(self._priority_prefix) :]
        if (
            not stream.startswith(self._priority_prefix)
            or rest[1:2] != ":"
            or not (rest[:1].isascii() and rest[:1].isdigit())
        ):
            raise ValueError(f"{stream!r} is not a request stream of serving {self.name!r}")
        return rest[2:], int(rest[0])

    def batch_key_of(self, stream: str) -> str:
        return self.parse_stream(stream)[0]


# A client id as clients make them (16 hex digits), with room for other clients' own schemes;
# never ':' or a hash tag, so an address can only name this prefix's inboxes and channels.
CLIENT_ID: Final = r"[A-Za-z0-9_.-]{1,64}"


def is_inbox(prefix: str, name: str) -> bool:
    """Whether ``name`` is an inbox of this prefix: the only keys a worker may reply to.

    Reply addresses come from stream entries, which anyone with write access can forge; a reply
    sent to any other key would write into (and set a TTL on) a key the worker does not own.
    """
    return _address(prefix, "inbox").fullmatch(name) is not None


def is_events_channel(prefix: str, name: str) -> bool:
    """Whether ``name`` is a client's events channel of this prefix."""
    return _address(prefix, "events").fullmatch(name) is not None


@functools.cache
def _address(prefix: str, kind: str) -> re.Pattern[str]:
    return re.compile(re.escape(f"{prefix}:{kind}:") + CLIENT_ID)


def inbox_key(prefix: str, client_id: str) -> str:
    return f"{prefix}:inbox:{client_id}"


def split_inbox(inbox: str) -> tuple[str, str]:
    """(prefix, client id) of an inbox key ``inbox_key`` made (the worker checked it:
    ``is_inbox``)."""
    prefix, _, client_id = inbox.rpartition(":inbox:")
    return prefix, client_id


def events_channel(prefix: str, client_id: str) -> str:
    return f"{prefix}:events:{client_id}"


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{worker_id}"


def tenants_key(prefix: str) -> str:
    """The tenants' weights of ``prefix`` (wire/tenants.py)."""
    return f"{prefix}:tenants"


def job_id_key(prefix: str) -> str:
    """The HMAC key of the job ids gateways of ``prefix`` hand out (gateway/job_ids.py)."""
    return f"{prefix}:jobkey"


def servings_key(prefix: str) -> str:
    """The servings registry of ``prefix`` (a zset: serving name -> last refresh, unix ms)."""
    return f"{prefix}:servings"


# What a reader of the servings registry takes from it (anyone may write it): at most this
# many entries per read (the most recently refreshed), and names a serving can have, of at
# most MAX_SERVING_NAME characters; other members are skipped.
MAX_LISTED_SERVINGS: Final = 10_000
MAX_SERVING_NAME: Final = 200


def is_serving_name(name: str) -> bool:
    """Whether ``name`` can be a serving's name as the registry lists it: not empty, at most
    MAX_SERVING_NAME characters, none of the separators Keys refuses."""
    return (
        0 < len(name) <= MAX_SERVING_NAME
        and name.isprintable()
        and not any(c in name for c in "{}:#")
    )


def tagged_pattern(prefix: str, kind: str) -> str:
    """SCAN pattern of every serving's key of ``kind`` under ``prefix`` (every shard's)."""
    return f"{prefix}:{{*}}:{kind}"


def serving_of(key: str) -> str | None:
    """The serving a key of its shard 0 belongs to (the name between its tag's braces), or
    None for a key of another shard (a tag ``S#i``: its serving's shard 0 names it already)."""
    name = key[key.index("{") + 1 : key.rindex("}")]
    return None if "#" in name else name
