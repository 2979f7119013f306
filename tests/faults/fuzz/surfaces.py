"""Every Redis key and channel queueserve reads, with the writers that attack it: the fuzzer's
registry (tests/faults/test_fuzz.py runs it; tests/unit/test_fuzz_registry.py checks that each
kind of ``wire/keys.py``'s LAYOUT, each field of a request entry (ENTRY_FIELDS, and those
the docstring and the Lua scripts write), each optional header field (``wire/request.py``'s
FIELDS) and each HTTP server of the worker has an entry here).

A new key, channel or entry field gets a row in the layout table, in LAYOUT, and a Surface
here in the same change; a new optional header field gets an entry in HEADER_ATTACKS. The
fields of the meta and config hashes and of a worker's record are not listed here: they are
read from what a worker declares (``Serving.options()``), from the options model (RUNTIME,
ServingOptions) and from what the dashboard reads and a live worker's heartbeat writes, so a
field added there is attacked without an edit here.

Writers of the valid servings' keys write what valid traffic must survive: junk entries,
members, fields and messages beside the real ones. Writers that replace a whole key with one of
another Redis type (``wrong_type``) attack the victim serving's keys (``fzx``), which valid
traffic does not use: replacing the admission counter or wake stream of a serving stops its
callers by design; the worker, and its other servings, must serve on.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from queueserve.client.job_handles import Job
from queueserve.dashboard import board
from queueserve.errors import QueueServeError
from queueserve.ops.deadletter import DeadLetters
from queueserve.options import serving_options as model
from queueserve.options.stored import parse_option
from queueserve.wire.job_record import group_key
from queueserve.wire.key_rules import META_FIELD as KEY_RULE
from queueserve.wire.key_rules import LengthBuckets
from queueserve.wire.keys import (
    GROUP,
    LAYOUT,
    MAX_SERVING_NAME,
    Keys,
    events_channel,
    inbox_key,
    job_id_key,
    servings_key,
    tenants_key,
    worker_key,
)
from queueserve.wire.kinds import ERROR, RESULTS
from queueserve.wire.priority import MAX_PRIORITY
from queueserve.worker.metrics_server import MAX_CONNECTIONS
from queueserve.worker.pipeline.affinity import HELD_FIELD
from tests.faults.fuzz import app
from tests.faults.fuzz.values import FAMILIES, NUMBERS, WRONG_TYPE, hostile_object
from tests.support.broker import RedisBroker

VALID = ("fz", "fzs", "fzt")  # servings with valid traffic (tests/faults/fuzz/app.py)
VICTIM = "fzx"
TYPES = dict(LAYOUT)


@dataclass
class Target:
    """What the writers attack, and what they left behind for the cleanup."""

    r: redis.Redis
    prefix: str
    rng: random.Random
    url: str = ""
    inboxes: list[str] = field(default_factory=list)  # the valid traffic's clients' inboxes
    channels: list[str] = field(default_factory=list)  # and their events channels
    created: set[str | bytes] = field(default_factory=set)  # keys the fuzzer made: deleted
    added: dict[str, set[bytes]] = field(default_factory=dict)  # key -> members/fields added
    # stream -> entries added to a stream of the layout (a wake stream keeps its last ~100)
    entries: dict[str, set[bytes]] = field(default_factory=dict)
    metrics_port: int | None = None  # the worker's /metrics port, when it serves one
    slow: list[socket.socket] = field(default_factory=list)  # slow clients of that port, held
    record_fields: set[bytes] = field(default_factory=set)  # what a live worker's record holds
    _broker: RedisBroker | None = None

    @property
    def broker(self) -> RedisBroker:
        """For the readers the operator's tools use (dead-letter replay)."""
        if self._broker is None:
            self._broker = RedisBroker(self.url)
        return self._broker

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()
        for held in self.slow:
            held.close()
        self.slow.clear()

    def clean(self, meta: dict[str, dict[bytes, bytes]]) -> None:
        """Take back what the fuzzer wrote: the keys it made, the members, fields and stream
        entries it added, and each serving's meta hash as its workers declared it (``meta``:
        serving -> hash)."""
        for key, members in self.added.items():
            kind = self.r.type(key).decode()
            remove = {"zset": self.r.zrem, "hash": self.r.hdel, "set": self.r.srem}.get(kind)
            if remove is not None:
                remove(key, *members)
        for stream, ids in self.entries.items():
            if self.r.type(stream) == b"stream":
                self.r.xdel(stream, *ids)
        # The traffic's clients are closed by now: junk pushed into their inboxes has nobody
        # to read it (an inbox lives until its TTL, which RPUSH does not set)
        self.r.delete(
            *self.created, *self.inboxes, self.junk_inbox, *(self.keys(s).meta for s in meta)
        )
        for serving, declared in meta.items():
            if declared:
                self.r.hset(self.keys(serving).meta, mapping=declared)  # type: ignore[arg-type]

    def keys(self, serving: str = "fz") -> Keys:
        return Keys(self.prefix, serving)

    @property
    def victim(self) -> Keys:
        return self.keys(VICTIM)

    @property
    def junk_inbox(self) -> str:
        """Where forged entries with a well-formed header ask to be answered."""
        return inbox_key(self.prefix, "fuzzjunk")

    def header(self, **replace: Any) -> bytes:
        fields: list[Any] = [1, self.rng.randrange(1 << 40), 1, self.junk_inbox, 0, "msgpack"]
        for position, value in replace.items():
            index = int(position.removeprefix("f"))
            fields.extend([0] * (index + 1 - len(fields)))
            fields[index] = value
        return bytes(msgpack.packb(fields))

    def stream(self, priority: int = 0) -> str:
        """A request stream of one of the servings, valid or victim, of a used or new key."""
        serving = self.rng.choice((*VALID, VICTIM))
        key = self.rng.choice(("default", "default", "fuzzk"))
        keys = self.keys(serving)
        name = keys.stream(key, priority)
        if key == "fuzzk":  # known as enqueue.lua would make it: the sweep marks it ready
            self.created.add(name)
            self.r.zadd(keys.seen, {key: int(self.r.time()[0]) * 1000})
            self.note(keys.seen, key)
        return name

    def note(self, key: str, member: bytes | str) -> None:
        self.added.setdefault(key, set()).add(
            member.encode() if isinstance(member, str) else member
        )

    def consumers(self) -> list[str]:
        """The live consumers of the plain serving (not the ghosts the fuzzer added)."""
        return [
            c.decode()
            for c in self.r.zrange(self.keys().workers, 0, -1)
            if not c.startswith(b"fuzz-ghost-")
        ]

    def replace(self, key: str, kind: str) -> None:
        """Make ``key`` a key of a Redis type other than its kind's."""
        wrong = [t for t in ("string", "list", "hash", "set", "zset", "stream") if t != TYPES[kind]]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        {
            "string": lambda: pipe.set(key, "wrong type"),
            "list": lambda: pipe.rpush(key, "wrong", "type"),
            "hash": lambda: pipe.hset(key, "wrong", "type"),
            "set": lambda: pipe.sadd(key, "wrong"),
            "zset": lambda: pipe.zadd(key, {"wrong": 1}),
            "stream": lambda: pipe.xadd(key, {"wrong": "type"}),
        }[self.rng.choice(wrong)]()
        pipe.execute()
        self.created.add(key)


Writer = Callable[[Target, bytes], None]


@dataclass(frozen=True)
class Attack:
    """One way to put a hostile value into a surface: ``write(target, value)`` with a value of
    each of ``families`` (``wrong_type`` writers ignore the value)."""

    name: str
    write: Writer
    families: tuple[str, ...] = tuple(FAMILIES)


@dataclass(frozen=True)
class Surface:
    # a kind of LAYOUT, "entry.<field>" for a field of a request entry, "header.<name>" for
    # an optional header field, "http.<module>" for an HTTP server of the worker
    kind: str
    reader: str  # who reads it, for reports
    attacks: tuple[Attack, ...]


def _wrong_type(kind: str, key: Callable[[Target], str]) -> Attack:
    return Attack("wrong_type", lambda t, _: t.replace(key(t), kind), (WRONG_TYPE,))


def _score(t: Target, value: bytes) -> float:
    try:
        return float(value)
    except ValueError:
        return t.rng.choice((float("inf"), float("-inf"), 1e308, -1.0, 0.0))


# --- request stream entries (every field of ENTRY_FIELDS) ------------------------------------
def _xadd(t: Target, fields: dict[Any, Any], priority: int) -> None:
    t.r.xadd(t.stream(priority), fields)


def _valid_payload() -> bytes:
    return bytes(msgpack.packb(["fuzz"]))


def entry_h(t: Target, value: bytes, priority: int = 0) -> None:
    _xadd(t, {"h": value, "p": _valid_payload()}, priority)


def entry_h_field(t: Target, value: bytes, priority: int = 0) -> None:
    """A header list whose one field (or a field past the known ones) is hostile."""
    position = t.rng.randrange(9)
    hostile = t.rng.choice((value, value.decode("latin-1"), hostile_object(t.rng)))
    _xadd(t, {"h": t.header(**{f"f{position}": hostile}), "p": _valid_payload()}, priority)


def entry_p(t: Target, value: bytes, priority: int = 0) -> None:
    _xadd(t, {"h": t.header(), "p": value}, priority)


def entry_a(t: Target, value: bytes, priority: int = 0) -> None:
    _xadd(t, {"h": t.header(), "p": _valid_payload(), "a": value}, priority)


def entry_extra(t: Target, value: bytes, priority: int = 0) -> None:
    """Fields no entry has, beside or instead of the real ones."""
    fields: dict[Any, Any] = {value[:64] or b"?": value}
    if t.rng.random() < 0.5:
        fields["h"] = t.header()
        fields["p"] = _valid_payload()
    _xadd(t, fields, priority)


def entry_k(t: Target, value: bytes, priority: int = 0) -> None:
    """A pack whose member list is the value itself, or holds it in a member's place."""
    member = [t.header(), _valid_payload(), b"1"]
    choice = t.rng.randrange(4)
    if choice == 0:
        k = value
    elif choice == 1:
        member[t.rng.randrange(3)] = value
        k = bytes(msgpack.packb([member, [t.header(), _valid_payload(), b"1"]]))
    elif choice == 2:  # a member of the wrong arity or shape
        k = bytes(msgpack.packb([member[: t.rng.randrange(3)], hostile_object(t.rng)]))
    else:  # many members in one pack
        k = bytes(msgpack.packb([member] * t.rng.choice((0, 1, 500, 5000))))
    _xadd(t, {"a": t.rng.choice((value, b"1", b"2")), "k": k}, priority)


def entry_r(t: Target, value: bytes, priority: int = 0) -> None:
    """The replay mark split.lua puts on each request of a reclaimed pack, forged (a worker
    looks only at whether it is there, whatever it holds): on a request, on a pack, on a
    request whose events go to a channel nobody reads (a replay announces itself there), or
    alone."""
    choice = t.rng.randrange(4)
    fields: dict[Any, Any]
    if choice == 0:
        fields = {"h": t.header(), "p": _valid_payload(), "r": value}
    elif choice == 1:
        member = [t.header(), _valid_payload(), b"1"]
        fields = {"a": b"1", "k": bytes(msgpack.packb([member])), "r": value}
    elif choice == 2:
        events = events_channel(t.prefix, "fuzzjunk")
        fields = {"h": t.header(f6=events), "p": _valid_payload(), "r": value}
    else:
        fields = {"r": value}
    _xadd(t, fields, priority)


def _forged_pack(t: Target, rid: int) -> dict[Any, Any]:
    """The fields of a pack of two requests answered to the junk inbox, the first with id
    ``rid``."""
    first = [t.header(f1=rid), _valid_payload(), b"1"]
    return {"a": b"2", "k": bytes(msgpack.packb([first, [t.header(), _valid_payload(), b"1"]]))}


def entry_w(t: Target, value: bytes, priority: int = 0) -> None:
    """The withdrawals read.lua adds to a pack it reads, stored with the entry instead: on a
    pack (naming one of its requests, or hostile), on a request alone, or alone. They concern
    that entry's own requests, nobody else's."""
    rid = t.rng.randrange(1 << 40)
    choice = t.rng.randrange(4)
    fields: dict[Any, Any]
    if choice == 0:
        fields = {**_forged_pack(t, rid), "w": t.rng.choice((value, str(rid).encode()))}
    elif choice == 1:
        fields = {**_forged_pack(t, rid), "w": f"{rid},{value.decode('latin-1')}"}
    elif choice == 2:
        fields = {"h": t.header(), "p": _valid_payload(), "w": value}
    else:
        fields = {"w": value}
    _xadd(t, fields, priority)


ENTRY_ATTACKS = {
    "h": (Attack("h", entry_h), Attack("h_field", entry_h_field)),
    "p": (Attack("p", entry_p),),
    "a": (Attack("a", entry_a),),
    "k": (Attack("k", entry_k), Attack("extra_field", entry_extra)),
    "r": (Attack("r", entry_r),),
    "w": (Attack("w", entry_w),),
}
ENTRY_READERS = {
    "r": "worker: intake (runs the request as a replay); dead-letter records",
    "w": "worker: intake (answers none of the pack's requests it names)",
}
ENTRY_WRITERS: tuple[Callable[[Target, bytes, int], None], ...] = (
    entry_h,
    entry_h_field,
    entry_p,
    entry_a,
    entry_k,
    entry_extra,
    entry_r,
    entry_w,
)


# --- the header's optional fields (every name of wire/request.py's FIELDS) --------------------
def _traceparent_like(t: Target, value: bytes) -> Any:
    """A W3C traceparent with one part hostile: ids of zeros or of the wrong length, upper
    case, the value in a part's place, or the right length (55) of anything."""
    trace_id, span_id = f"{t.rng.getrandbits(128):032x}", f"{t.rng.getrandbits(64):016x}"
    text = value.decode("latin-1")
    return t.rng.choice(
        (
            f"00-{trace_id}-{span_id}-01",
            f"00-{'0' * 32}-{span_id}-01",
            f"00-{trace_id}-{'0' * 16}-01",
            f"00-{trace_id.upper()}-{span_id}-01",
            f"ff-{trace_id}-{span_id}-ff",
            f"00-{text}-{span_id}-01",
            f"00-{trace_id}-{text}-01",
            (text * 55)[:55] if text else "-" * 55,
        )
    )


def _keep_like(t: Target, value: bytes) -> Any:
    """A job's keep (ms) that is no int from 1 to a week: the value read as a number."""
    try:
        number: Any = float(value)
        if number.is_integer() and -(2**63) <= number < 2**64:  # what msgpack can carry
            number = int(number)
    except (ValueError, OverflowError):
        number = t.rng.choice((0, -1, 10**13, 2**64 - 1, 1.5, True))
    return number


def header_field(name: str, near: Callable[[Target, bytes], Any] | None = None) -> Writer:
    """A request whose optional header field ``name`` is hostile: the value as bytes or text,
    an object of another type, or (``near``) one that looks like what the field holds."""

    def write(t: Target, value: bytes) -> None:
        shapes = [value, value.decode("latin-1"), hostile_object(t.rng)]
        if near is not None:
            shapes += [near(t, value), near(t, value)]
        fields = {name: t.rng.choice(shapes)}
        if t.rng.random() < 0.3:  # beside the other known fields, valid
            fields = {"trace": _traceparent_like(t, b"0"), "tenant": "t", **fields}
        rid = t.rng.randrange(128)
        if name == "job_keep":  # a keep taken writes the job's record: the cleanup takes it
            t.created.add(group_key(t.prefix, "fuzzjunk", rid))
        _xadd(t, {"h": t.header(f1=rid, f6="", f7=0, f8=fields), "p": _valid_payload()}, 0)

    return write


# An entry per name of FIELDS (tests/unit/test_fuzz_registry.py checks it): how a value that
# looks like the field's is made, if any.
HEADER_ATTACKS: dict[str, Callable[[Target, bytes], Any] | None] = {
    "trace": _traceparent_like,  # worker: remote_context, when a TracerProvider is set (app.py)
    "job_keep": _keep_like,  # worker: job_keep, then job.lua
    "tenant": None,  # read by no worker yet: one that starts to must take any value
}


def any_entry(t: Target, value: bytes) -> None:
    t.rng.choice(ENTRY_WRITERS)(t, value, 0)


def priority_entry(t: Target, value: bytes) -> None:
    t.rng.choice(ENTRY_WRITERS)(t, value, t.rng.randrange(1, MAX_PRIORITY + 1))


def stream_of_wrong_type(t: Target) -> str:
    """A batch key of the victim made known everywhere a reader looks, with a stream of
    another type."""
    keys = t.victim
    batch_key = f"fuzzwt{t.rng.randrange(4)}"
    priority = t.rng.choice((0, 0, 3))
    now = int(t.r.time()[0]) * 1000
    t.r.zadd(keys.seen, {batch_key: now})
    t.r.zadd(keys.ready, {f"{priority}{batch_key}": 0})
    t.r.zadd(keys.active, {keys.stream(batch_key, priority): now})
    t.note(keys.seen, batch_key)
    t.note(keys.ready, f"{priority}{batch_key}")
    t.note(keys.active, keys.stream(batch_key, priority))
    return keys.stream(batch_key, priority)


def hostile_batch_key(t: Target, value: bytes) -> None:
    """A request, well formed, in the stream of a batch key named by the value (no client
    would send it: anyone may XADD), made known as enqueue.lua would."""
    keys = t.keys(t.rng.choice(VALID))
    batch_key = value[:256]
    priority = t.rng.choice((0, 0, 4))
    stream = keys.stream("", priority).encode() + batch_key
    t.r.xadd(stream, {"h": t.header(), "p": _valid_payload()})
    t.r.zadd(keys.seen, {batch_key: int(t.r.time()[0]) * 1000})
    t.r.zadd(keys.ready, {str(priority).encode() + batch_key: 0})
    t.created.add(stream)
    t.note(keys.seen, batch_key)
    t.note(keys.ready, str(priority).encode() + batch_key)


def hostile_consumer(t: Target, value: bytes) -> None:
    """A consumer named by the value reads (and never acks) an entry of a serving's stream,
    a junk one or now and then a valid caller's: anyone may XREADGROUP in the group, so its
    name is in every pending summary, and what it took must be reclaimed from it."""
    keys = t.keys(t.rng.choice(VALID))
    stream = keys.stream("default" if t.rng.random() < 0.2 else "fuzzk")
    if stream.endswith("fuzzk"):
        t.created.add(stream)
        t.r.xadd(stream, {"h": t.header(), "p": _valid_payload()})
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP
            t.r.xgroup_create(stream, GROUP, id="0")
    t.r.xreadgroup(GROUP, value[:512] or b"?", {stream: ">"}, count=1)
    t.r.zadd(keys.active, {stream: int(t.r.time()[0]) * 1000})  # as a worker's read would


# --- the serving's sorted sets, hashes and set ------------------------------------------------
def _zadd(t: Target, key: str, member: bytes, value: bytes) -> None:
    try:
        t.r.zadd(key, {member: _score(t, value)})
    except redis.ResponseError:  # Redis refuses NaN scores itself
        return
    t.note(key, member)


def seen_member(t: Target, value: bytes) -> None:
    _zadd(t, t.keys(t.rng.choice(VALID)).seen, value, t.rng.choice(list(FAMILIES.values()))(t.rng))


def seen_score(t: Target, value: bytes) -> None:
    """A hostile score on a key of the valid traffic (its last enqueue time)."""
    t.r.zadd(t.keys(t.rng.choice(VALID)).seen, {"default": _score(t, value)}, xx=True)


def ready_member(t: Target, value: bytes) -> None:
    """A member no script wrote: ranked first, or with a lead (a score ending in .5, which
    read.lua weighs against the first member without one)."""
    shape = t.rng.randrange(4)
    member = (
        value,
        str(t.rng.randrange(10)).encode() + value,
        b"0default" + value,
        t.rng.choice((b"x", b"", b"-1", b"10", b"99")) + value,
    )[shape]
    score = t.rng.choice((b"-inf", b"-0.5", b"0.5", b"-1e15"))
    _zadd(t, t.keys(t.rng.choice(VALID)).ready, member, score)


def ready_score(t: Target, value: bytes) -> None:
    t.r.zadd(t.keys(t.rng.choice(VALID)).ready, {"0default": _score(t, value)}, xx=True)


def active_member(t: Target, value: bytes) -> None:
    keys = t.keys(t.rng.choice(VALID))
    member = t.rng.choice(
        (value, keys.stream("fuzz") + value.decode("latin-1"), keys.meta, keys.depth, keys.wake)
    )
    _zadd(t, keys.active, member.encode("latin-1") if isinstance(member, str) else member, b"0")


def wake_entry(t: Target, value: bytes) -> None:
    keys = t.keys(t.rng.choice(VALID))
    entry = t.r.xadd(
        keys.wake,
        t.rng.choice(({"k": value}, {value[:64] or b"?": value})),
        maxlen=100,
        approximate=True,
    )
    t.entries.setdefault(keys.wake, set()).add(entry)


def depth_field(t: Target, value: bytes) -> None:
    """A hostile count for a batch key without traffic, or a hostile field name."""
    keys = t.keys(t.rng.choice(VALID))
    name = t.rng.choice((b"fuzzk", b"fuzzd" + value[:32], value))
    t.r.hset(keys.depth, name, value)
    t.note(keys.depth, name)


def pdepth_field(t: Target, value: bytes) -> None:
    """A hostile count for a priority (with traffic or without), or a hostile field name."""
    keys = t.keys(t.rng.choice(VALID))
    name = t.rng.choice((b"0", str(t.rng.randrange(1, 10)).encode(), b"fuzzp" + value[:32], value))
    t.r.hset(keys.pdepth, name, value)
    t.note(keys.pdepth, name)


def legacy_key(t: Target, value: bytes) -> None:
    keys = t.keys(t.rng.choice(VALID))
    t.r.sadd(keys.keys, value)
    t.note(keys.keys, value)


def queued_value(t: Target, value: bytes) -> None:
    t.r.set(t.victim.queued, value)
    t.created.add(t.victim.queued)


def tenants_field(t: Target, value: bytes) -> None:
    """A hostile weight for a tenant, or a field no tenant can be named: the workers read
    P:tenants with the run-time config, and a weight they take (a decimal up to 1000) only
    changes how lanes share service, so every valid request is still answered."""
    key = tenants_key(t.prefix)
    name = t.rng.choice(("fuzz-tenant", "bad name", "x" * 65, "\x1f", ""))
    t.r.hset(key, name, value)
    t.note(key, name)


def job_id_key_value(t: Target, value: bytes) -> None:
    key = job_id_key(t.prefix)
    t.r.set(key, value)
    t.created.add(key)


def once_value(t: Target, value: bytes) -> None:
    """A hostile record of an idempotency key (wire/once.py) of a valid serving or the victim,
    beside the records keyed calls write: a keyed call of that key gets a clear error by
    design (tests/integration/test_idempotency.py), and every other call is answered."""
    keys = t.keys(t.rng.choice((*VALID, VICTIM)))
    key = keys.once(t.rng.choice(("fuzz", "fuzz-2", "")))
    t.r.set(key, value)
    t.created.add(key)


def cached_value(t: Target, value: bytes) -> None:
    """A hostile cached result (wire/cache.py) of a valid serving or the victim, under a
    digest-like name: enqueue.lua answers only from a value bound to the digest looked up,
    so a caching call gets a miss or a clear error (tests/integration/test_cache.py)."""
    keys = t.keys(t.rng.choice((*VALID, VICTIM)))
    key = keys.cached(t.rng.choice(("0" * 32, "f" * 32, "fuzz")))
    t.r.set(key, value)
    t.created.add(key)


def cache_stats_value(t: Target, value: bytes) -> None:
    """Hostile counts in a serving's cache stats: enqueue.lua and the workers start a count
    they cannot add to again; readers take decimal counts only."""
    keys = t.keys(t.rng.choice((*VALID, VICTIM)))
    field = t.rng.choice(("hits", "misses", "stored", "bytes", "too_big", "fuzz"))
    t.r.hset(keys.cache_stats(), field, value)
    t.created.add(keys.cache_stats())


def declared_fields() -> tuple[str, ...]:
    """Every field a worker writes to a meta hash: what the fuzz worker's servings declare
    (``Serving.options()``, and a step serving's own on top), asked when called, so a field
    added to ServingOptions or to ``options()`` is attacked without an edit here."""
    fields: dict[str, None] = {}
    for serving in (app.plain, app.steps, app.generate):
        fields.update(dict.fromkeys(serving.options()))
    return tuple(fields)


# The meta fields that take more than the rule of meta_field (a value its reader takes goes
# in spoilt, any other as it is), and why. tests/unit/test_fuzz_registry.py checks that each
# field a client or enqueue.lua reads is one the options model parses, or is here.
META_SPECIAL = {
    "codec": "attacked on the victim only (meta_codec): a client naming a serving refuses any "
    "codec but msgpack by design (docs/guarantees.md, 'codec choice belongs to the caller'), "
    "so any other value on a valid serving would fail its callers by design, not by a fault, "
    "and msgpack is what its workers declare",
    "shards": "half its numbers go in as 64 (issue 23's own example), a count clients take "
    "only when the last shard's hash confirms it; any other value they take goes in spoilt",
    "pack_items": "read by enqueue.lua alone, as decimal digits up to 10**12 (declared_count), "
    "not through the model: such a value goes in spoilt, as a value the model takes does",
    "header_fields": "any text is taken (the optional fields workers read); one without a "
    "field only keeps clients from sending it (trace context, a job's keep) until workers "
    "write theirs back: attacked as it is",
    KEY_RULE: "read by clients naming the serving through LengthBuckets.parse "
    "(wire/key_rules.py), not the options model: a rule it takes groups a call's items by it "
    "until the workers write theirs back, so it goes in spoilt, as a value the model takes does",
}


def meta_field(t: Target, value: bytes) -> None:
    """A hostile value for a field a worker declares (declared_fields), or one nobody knows.
    One that its reader takes reads as the workers' declaration, not an attack: clients act
    on those they parse (max_payload_bytes=1 refused every call, durable=True waits for a
    replica there is none of) until the workers write theirs back, so it goes in spoilt, as
    in the config hash. A field that the model does not know and that nothing acts on (hooks,
    cost, step and a step serving's options, shown by stats and the dashboard) takes any
    value. META_SPECIAL says what differs."""
    name = t.rng.choice((*(f for f in declared_fields() if f != "codec"), "fuzz-unknown"))
    keys = t.keys(t.rng.choice(VALID))
    if name == "shards" and value in NUMBERS and t.rng.random() < 0.5:
        value = b"64"  # more shards than any worker reads: issue 23's own example
    elif _taken(name, value):
        value = _spoilt(name, value, "meta")
    t.r.hset(keys.meta, name, value)
    t.note(keys.meta, name)


def meta_codec(t: Target, value: bytes) -> None:
    """A codec only the victim declares (any codec but msgpack is refused by name, by design:
    docs/guarantees.md, "codec choice belongs to the caller")."""
    t.r.hset(t.victim.meta, "codec", value)
    t.note(t.victim.meta, "codec")


def config_fields() -> tuple[str, ...]:
    """Every field a worker reads from a config hash: the run-time options (RUNTIME), then
    the model's other options (refused there by name: no run-time ones), asked when called."""
    runtime = model.RUNTIME
    return (*runtime, *(f for f in model.ServingOptions.model_fields if f not in runtime))


def config_field(t: Target, value: bytes) -> None:
    """A hostile value for a run-time option, or another option (refused there by name), or
    a field nobody knows. A run-time option's value that the options model takes (noise can
    spell " 3 ") is an operator's setting, not an attack: max_queue=3 throttles callers by
    design (values.py leaves small integers out for that reason), so it goes in spoilt."""
    name = t.rng.choice((*config_fields(), "fuzz-unknown"))
    keys = t.keys(t.rng.choice(VALID))
    if name in model.RUNTIME and _valid_setting(name, value):
        value = _spoilt(name, value, "config")
    t.r.hset(keys.config, name, value)
    t.created.add(keys.config)


def _valid_setting(name: str, value: bytes) -> bool:
    """Whether the options model takes ``value`` for ``name`` (never for a name it does not
    know)."""
    try:
        parse_option(name, value.decode())
    except (ValueError, TypeError, KeyError):
        return False
    return True


def _taken(name: str, value: bytes) -> bool:
    """Whether a reader of the meta hash takes ``value`` for field ``name``: enqueue.lua's
    counts as it reads them, any other field as the options model does."""
    if name == "pack_items":
        return re.fullmatch(rb"[0-9]{1,13}", value) is not None and int(value) <= model.MAX_QUEUE
    if name == KEY_RULE:
        try:
            LengthBuckets.parse(value.decode())
        except (UnicodeDecodeError, ValueError, TypeError):
            return False
        return True
    return _valid_setting(name, value)


def _spoilt(name: str, value: bytes, where: str) -> bytes:
    """``value`` made one that no reader takes for ``name``: prefixed with x (or x alone
    where that is still taken: x=3 is a batch key weight)."""
    spoilt = b"x" + value
    if _taken(name, spoilt):
        spoilt = b"x"
    print(f"fuzz: {where} {name}={value!r} is a valid setting; written as {spoilt!r}")
    return spoilt


def workers_member(t: Target, value: bytes) -> None:
    """A ghost consumer, alive for ever (+inf), long dead, or at a hostile time; live
    consumers' own scores are left to their heartbeats."""
    keys = t.keys(t.rng.choice(VALID))
    _zadd(t, keys.workers, b"fuzz-ghost-" + value[:128], value)


def servings_member(t: Target, value: bytes) -> None:
    """An entry of the prefix's servings registry at a hostile score: a name no serving can
    have (the value, one over MAX_SERVING_NAME characters, separators, not UTF-8), or a valid
    serving's (+inf, -inf, long ago: its workers' next beat writes it back). Readers (the
    gateway's /v1/models, the dashboard, the operator's listings) skip what is not a name."""
    member = t.rng.choice(
        (
            value[:100_000] or b"?",
            b"x" * (MAX_SERVING_NAME + 1),
            b"a:b{c}#d",
            b"\xff\xfe",
            t.rng.choice(VALID).encode(),
        )
    )
    _zadd(t, servings_key(t.prefix), member, value)


def servings_flood(t: Target, value: bytes) -> None:
    """2,000 entries at once, refreshed now: a read lists a bounded number of them."""
    now_ms = int(t.r.time()[0]) * 1000
    key = servings_key(t.prefix)
    members = {b"fuzz-flood-%d-" % i + value[:32]: now_ms for i in range(2000)}
    t.r.zadd(key, members)  # type: ignore[arg-type]
    for member in members:
        t.note(key, member)


def dead_record(t: Target, value: bytes) -> str:
    """A forged dead letter: fields of a record, one of them hostile; its header may claim
    10**12 items, name another key of the tag, or hold a hostile field of its own."""
    keys = t.keys()
    header = t.rng.choice(
        (
            t.header(),
            t.header(f2=10**12),
            t.header(f3=t.rng.choice((keys.wake, keys.meta))),
            t.header(**{f"f{t.rng.randrange(9)}": hostile_object(t.rng)}),
        )
    )
    fields: dict[Any, Any] = {
        "stream": t.rng.choice(
            (keys.stream("default"), keys.stream("default"), keys.wake, keys.meta, keys.queued)
        ),
        "entry_id": "1-0",
        "reason": "forged",
        "deliveries": "1",
        "at_ms": "0",
        "field:h": header,
        "field:p": _valid_payload(),
    }
    fields[t.rng.choice([*fields, "field:k", "field:r", value[:64] or "?"])] = value
    return str(t.r.xadd(t.keys().dead, fields).decode())


def dead_replayed(t: Target, value: bytes) -> None:
    """A forged dead letter, replayed as `queueserve dead-letter replay` would: refused with
    a message, or queued as a request that is then served or answered with an error."""
    dead_id = dead_record(t, value)
    with contextlib.suppress(KeyError, ValueError, QueueServeError):  # refused, as it says
        DeadLetters(t.broker, t.prefix, "fz").replay(dead_id)


def cancel_message(t: Target, value: bytes) -> None:
    keys = t.keys(t.rng.choice((*VALID, VICTIM)))
    stream = keys.stream("default").encode()
    message = t.rng.choice(
        (
            value,
            stream + b"\n" + value,
            value + b"\n1-0",
            b"\n".join((stream, value, value)),
            stream + value + b"\n1-0",
        )
    )
    t.r.publish(keys.cancel, message)


def withdrawn_field(t: Target, value: bytes) -> None:
    """A withdrawal forged into P:{S}:withdrawn: for a pack of the junk inbox's, written
    with it (read.lua hands it over with the pack: the worker parses it), naming a request of
    that pack or hostile; or a field naming no entry, or a hostile field name."""
    keys = t.keys(t.rng.choice(VALID))
    stream = keys.stream("default")
    choice = t.rng.randrange(3)
    if choice == 0:
        rid = t.rng.randrange(1 << 40)
        entry = t.r.xadd(stream, _forged_pack(t, rid))
        name = stream.encode() + b"\n" + entry
        value = t.rng.choice((value, str(rid).encode(), f"{rid},{rid}".encode()))
    elif choice == 1:
        name = stream.encode() + b"\n" + t.rng.choice((value[:64], b"1-0", b"99999999999999-0"))
    else:
        name = value[:200] or b"?"
    t.r.hset(keys.withdrawn, name, value)
    t.note(keys.withdrawn, name)


def cancel_packed(t: Target, value: bytes) -> None:
    """A cancel of one request of a pack, forged: naming no entry, or the value in its place."""
    keys = t.keys(t.rng.choice((*VALID, VICTIM)))
    stream = keys.stream("default").encode()
    message = t.rng.choice(
        (
            stream + b"\n1-0/" + value,
            stream + b"\n" + value + b"/1",
            stream + b"\n99999999999999-0/" + str(t.rng.randrange(1 << 40)).encode(),
        )
    )
    t.r.publish(keys.cancel, message)


def _reply_junk(t: Target, value: bytes) -> bytes:
    rid = t.rng.choice((10**15 + t.rng.randrange(1000), -1, "x", None, 2**64 - 1))
    rows = t.rng.choice(
        (
            [[rid, 0, 1, RESULTS, ["forged"]]],
            [[rid, hostile_object(t.rng), hostile_object(t.rng), hostile_object(t.rng), value]],
            hostile_object(t.rng),
            [[rid, 0, 1, ERROR, hostile_object(t.rng)]],
        )
    )
    body = t.rng.choice((bytes(msgpack.packb(rows)), value))
    return t.rng.choice((b"m", b"p", b"\x00", b"\xff", b"")) + body


def inbox_element(t: Target, value: bytes) -> None:
    """Junk in a client's shared inbox, or in the inbox of one of its threads (a lone
    dispatch waits on ``<inbox>.<thread>`` itself)."""
    element = t.rng.choice((value, _reply_junk(t, value)))
    inboxes = t.inboxes or [t.junk_inbox]
    if t.rng.random() < 0.3:
        found = list(t.r.scan_iter(match=t.rng.choice(inboxes) + ".*", count=1000))
        inboxes = found or inboxes
    inbox = t.rng.choice(inboxes)
    t.r.rpush(inbox, element)
    t.created.add(inbox)


def events_message(t: Target, value: bytes) -> None:
    if not t.channels:
        return
    rid = t.rng.choice((10**15, -1, "x", None))
    event = t.rng.choice(
        (
            [rid, 0, "o", RESULTS, ["forged"], 0, 1],
            [[rid, hostile_object(t.rng), "h", value, hostile_object(t.rng), 0, 1]],
            [rid, -1, "h", "start", value, 0, 10**9],
            hostile_object(t.rng),
        )
    )
    message = t.rng.choice((value, b"m" + bytes(msgpack.packb(event)), b"p" + value))
    t.r.publish(t.rng.choice(t.channels), message)


class _Reads(dict[str, str]):
    """A worker's record, empty, that remembers which fields were read of it."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[str, None] = {}

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read[key] = None
        return super().get(key, default)

    def __missing__(self, key: str) -> str:
        self.read[key] = None
        return ""


def dashboard_reads() -> tuple[str, ...]:
    """The fields of a worker's record the dashboard reads (a row of its workers table and
    the counters its charts are drawn from), found by reading a record through its own code."""
    record = _Reads()
    board._worker("fuzz", 0, record, 0)
    return tuple(record.read)


def worker_fields(t: Target | None = None) -> tuple[bytes, ...]:
    """The fields of a worker's record to attack: what the dashboard reads, and what a live
    worker's heartbeat writes (``t.record_fields``, read from Redis when the run starts)."""
    held = (f"{HELD_FIELD}{name}" for name in VALID)  # the keys a worker holds (affinity.py)
    found = {f.encode() for f in (*dashboard_reads(), "heartbeat_ms", "pid", *held)}
    return tuple(sorted(found | (t.record_fields if t is not None else set())))


def worker_record(t: Target, value: bytes) -> None:
    """A field of a live worker's registry record; the record of a ghost worker that the
    dashboard lists (alive in a valid serving's workers set), each field hostile; or a
    forged record no serving names."""
    fields = worker_fields(t)
    consumers = t.consumers()
    choice = t.rng.random()
    if consumers and choice < 0.4:
        name = worker_key(t.prefix, t.rng.choice(consumers))
        field = t.rng.choice((*fields, value[:64] or b"?"))
        t.r.hset(name, field, value)
        if field not in t.record_fields:  # the next heartbeat rewrites its own
            t.note(name, field)
        return
    if choice < 0.7:
        ghost = f"fuzz-ghost-record{t.rng.randrange(4)}"
        keys = t.keys(t.rng.choice(VALID))
        t.r.zadd(keys.workers, {ghost: int(t.r.time()[0]) * 1000})
        t.note(keys.workers, ghost)
        name = worker_key(t.prefix, ghost)
        shapes = (value[:64], b"-" + value[:20], b"99999999999999999999", b"")
        record = {f: t.rng.choice(shapes) for f in fields}
        record[t.rng.choice(fields)] = value  # one value whole: a 10 MB one is one
        t.r.hset(name, mapping=record)
        t.created.add(name)
        return
    name = worker_key(t.prefix, "fuzz-" + value[:32].decode("latin-1"))
    t.r.hset(name, mapping={"heartbeat_ms": value, "pid": value, "servings": value})
    t.created.add(name)


def live_worker_record(t: Target) -> str:
    consumers = t.consumers()
    if not consumers:
        return worker_key(t.prefix, "fuzz-nobody")
    return worker_key(t.prefix, t.rng.choice(consumers))


def _job_fields(rid: int) -> tuple[bytes, ...]:
    r = b"%d" % rid
    return (r, r + b".a", r + b".h", b"m1", b"m2", b"#", b"live", b"until", b"%d" % (rid + 1))


def job_record(t: Target, value: bytes) -> None:
    """A field of a job's record group (wire/job_record.py), then a request of that job (its inbox
    and request id name it), written with its record or not, which a worker answers into the
    forged group (job.lua), with a keep that may be junk too; then the record read as
    ``Client.job`` reads it, and its result, cancel or forget called (cancel.lua and
    job_end.lua act on what the entry itself says, so the valid traffic loses nothing): each
    an answer or a QueueServeError."""
    rid = t.rng.randrange(128)  # two groups, which wrong_type replaces now and then
    name = group_key(t.prefix, "fuzzjunk", rid)
    t.r.hset(name, t.rng.choice((*_job_fields(rid), value[:64] or b"?")), value)
    t.r.pexpire(name, 60_000)
    t.created.add(name)
    keep = t.rng.choice((60_000, 60_000, -1, 0, "x", 10**13, 1.5))
    header = t.header(f1=rid, f6="", f7=0, f8={"job_keep": keep})
    jobs = [(0, name, str(rid), 60_000)] if t.rng.random() < 0.5 else []
    with contextlib.suppress(QueueServeError):  # a full queue, as it says
        t.broker.enqueue(t.keys(), [("default", 1, header, msgpack.packb([1]), 0)], 0, jobs=jobs)
    job = Job(t.broker.jobs, t.broker.cancel, t.prefix, f"fuzzjunk-{rid}", None)
    with contextlib.suppress(QueueServeError):  # refused with a clear error
        job.status()
        job.progress()
    action = t.rng.choice(("result", "cancel", "forget", None))
    with contextlib.suppress(QueueServeError):  # a Timeout, or refused with a clear error
        if action == "result":
            job.result(timeout=0.01, return_exceptions=True)
        elif action == "cancel":
            job.cancel()
        elif action == "forget":
            job.forget()


# --- the worker's metrics port (worker/metrics.py: /metrics, /healthz, /readyz) ---------------
HTTP_WAIT_S = 2.0  # what a hostile request waits for its answer; the server must not wait
SCRAPE_WITHIN_S = 5.0  # a scrape is answered within this, whatever else holds the port
SLOW_HELD = MAX_CONNECTIONS + 4  # slow clients held at once: more than the server serves
PATHS = (b"/metrics", b"/healthz", b"/readyz")


def scrape(port: int, path: str = "/metrics") -> tuple[int, bytes]:
    """(status, body) of a GET as Prometheus makes it, within SCRAPE_WITHIN_S; AssertionError
    saying what happened instead."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_WITHIN_S)
    try:
        conn.request("GET", path, headers={"Accept": "text/plain"})
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as e:
        raise AssertionError(f"a scrape of {path} on port {port} got {e!r}") from None
    finally:
        conn.close()


def _connect(t: Target) -> socket.socket | None:
    if t.metrics_port is None:
        return None
    try:
        return socket.create_connection(("127.0.0.1", t.metrics_port), timeout=HTTP_WAIT_S)
    except OSError as e:  # a listening port takes every connection, if only to close it
        raise AssertionError(
            f"the metrics port {t.metrics_port} took no connection: {e!r}"
        ) from None


def _http(t: Target, request: bytes) -> None:
    """Send ``request``, say nothing more (half-close), and read what comes back until the
    server closes, at most HTTP_WAIT_S: an answer or a close, whatever was sent."""
    conn = _connect(t)
    if conn is None:
        return
    with conn, contextlib.suppress(OSError):  # a reset, a refused 10 MB header: its answer
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass


def _line(value: bytes) -> bytes:
    return value.replace(b"\r", b" ").replace(b"\n", b" ")


def http_path(t: Target, value: bytes) -> None:
    """A GET of a hostile path: the value itself, under /, after a served path or as its
    query, or a path far longer than a request line may be."""
    path = t.rng.choice(
        (
            value,
            b"/" + value,
            t.rng.choice(PATHS) + value,
            t.rng.choice(PATHS) + b"?" + value,
            b"/metrics/../" + value,
            b"//" * 40_000,
        )
    )
    _http(t, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")


def http_method(t: Target, value: bytes) -> None:
    """A served path asked with another method (a body with it, or one it claims and lacks)
    or with the value as the method."""
    method = t.rng.choice(
        (value, _line(value) or b"?", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"get")
    )
    body = t.rng.choice((b"", value[:1000], b"Content-Length: 99999\r\n\r\nx"))
    head = method + b" " + t.rng.choice(PATHS) + b" HTTP/1.1\r\nHost: x\r\n"
    if body and not body.startswith(b"Content-Length"):
        head += b"Content-Length: %d\r\n" % len(body)
        body = b"\r\n" + body
    _http(t, head + (body or b"\r\n"))


def http_header(t: Target, value: bytes) -> None:
    """A GET of a served path with hostile headers: a name or a value, a line with no colon,
    a folded line, a count or length past what a server reads, framing it cannot trust."""
    line = _line(value)
    headers = t.rng.choice(
        (
            b"X-Fuzz: " + line,
            line + b": x",
            line,
            b"X-Fuzz: a\r\n " + line,
            b"X-Fuzz: " + b"y" * 70_000,
            b"\r\n".join(b"X-Fuzz-%d: %s" % (i, line[:40]) for i in range(200)),
            b"Content-Length: " + line,
            b"Transfer-Encoding: chunked\r\n\r\n" + value[:1000],
            b"Expect: 100-continue\r\nContent-Length: " + line,
            b"Connection: keep-alive, " + line,
        )
    )
    _http(t, b"GET " + t.rng.choice(PATHS) + b" HTTP/1.1\r\n" + headers + b"\r\n\r\n")


def http_request(t: Target, value: bytes) -> None:
    """A request that is no HTTP/1 request: the value itself, a hostile version, HTTP/0.9,
    HTTP/2's preface, a TLS hello."""
    request = t.rng.choice(
        (
            value + b"\r\n\r\n",
            b"GET /metrics " + _line(value) + b"\r\n\r\n",
            b"GET /metrics HTTP/9.9\r\n\r\n",
            b"GET /metrics\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + value[:100],
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + value[:200],
        )
    )
    _http(t, request)


def http_slow(t: Target, value: bytes) -> None:
    """A slow client held open: silent, sending its head a byte at a time (each held one
    gets another byte now, so none is silent long), or asking and never reading the answer.
    At most SLOW_HELD at once: more than the server serves at once (MAX_CONNECTIONS)."""
    conn = _connect(t)
    if conn is None:
        return
    start = t.rng.choice(
        (
            b"",
            b"GET /metrics HTTP/1.1\r\nX-Fuzz: " + _line(value)[:200],
            _line(value)[:200],
            b"GET /metrics HTTP/1.1\r\n\r\n",
        )
    )
    with contextlib.suppress(OSError):
        conn.sendall(start)
    t.slow.append(conn)
    while len(t.slow) > SLOW_HELD:
        t.slow.pop(0).close()
    trickle(t)


def trickle(t: Target) -> None:
    """One more byte from each slow client held; one the server closed is let go."""
    for conn in list(t.slow):
        try:
            conn.send(b"a")
        except OSError:
            t.slow.remove(conn)
            conn.close()


def http_reset(t: Target, value: bytes) -> None:
    """A request whose client resets the connection at once, before its answer is written."""
    conn = _connect(t)
    if conn is None:
        return
    path = t.rng.choice((*PATHS, b"/" + _line(value)[:100]))
    with contextlib.suppress(OSError):
        conn.sendall(b"GET " + path + b" HTTP/1.1\r\n\r\n")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


HTTP_ATTACKS = (
    Attack("path", http_path),
    Attack("method", http_method),
    Attack("header", http_header),
    Attack("request", http_request),
    Attack("slow", http_slow),
    Attack("reset", http_reset),
)


SURFACES: tuple[Surface, ...] = (
    *(
        Surface(f"entry.{f}", ENTRY_READERS.get(f, "worker: decode_entry, split.lua"), attacks)
        for f, attacks in ENTRY_ATTACKS.items()
    ),
    *(
        Surface(
            f"header.{name}",
            "worker: parse_header, then the field's reader",
            (Attack("field", header_field(name, near)),),
        )
        for name, near in HEADER_ATTACKS.items()
    ),
    Surface(
        "in",
        "worker: read.lua, sweep.lua, decode",
        (
            Attack("entry", any_entry),
            Attack("batch_key", hostile_batch_key),
            Attack("consumer", hostile_consumer),
            _wrong_type("in", stream_of_wrong_type),
        ),
    ),
    Surface("pN", "worker: read.lua, sweep.lua, decode", (Attack("entry", priority_entry),)),
    Surface(
        "seen",
        "worker: sweep.lua; stats; enqueue.lua (a key's lead)",
        (
            Attack("member", seen_member),
            Attack("score", seen_score, ("numbers",)),
            _wrong_type("seen", lambda t: t.victim.seen),
        ),
    ),
    Surface(
        "ready",
        "worker: read.lua",
        (
            Attack("member", ready_member),
            Attack("score", ready_score, ("numbers",)),
            _wrong_type("ready", lambda t: t.victim.ready),
        ),
    ),
    Surface(
        "active",
        "worker: reclaim, sweep.lua",
        (
            Attack("member", active_member),
            _wrong_type("active", lambda t: t.victim.active),
        ),
    ),
    Surface(
        "wake",
        "worker: blocking read",
        (
            Attack("entry", wake_entry),
            _wrong_type("wake", lambda t: t.victim.wake),
        ),
    ),
    Surface(
        "depth",
        "enqueue.lua, ack.lua, sweep.lua; stats",
        (
            Attack("field", depth_field),
            _wrong_type("depth", lambda t: t.victim.depth),
        ),
    ),
    Surface(
        "pdepth",
        "enqueue.lua, ack.lua, cancel.lua, replay.lua; metrics, stats, dashboard",
        (
            Attack("field", pdepth_field),
            _wrong_type("pdepth", lambda t: t.victim.pdepth),
        ),
    ),
    Surface(
        "keys",
        "worker start: adopt_legacy_keys",
        (
            Attack("member", legacy_key),
            _wrong_type("keys", lambda t: t.victim.keys),
        ),
    ),
    Surface(
        "queued",
        "enqueue.lua, ack.lua",
        (
            Attack("value", queued_value),
            _wrong_type("queued", lambda t: t.victim.queued),
        ),
    ),
    Surface(
        "meta",
        "clients naming a serving; enqueue.lua (max_queue, pack_items); stats; workers (kept)",
        (
            Attack("field", meta_field),
            Attack("codec", meta_codec),
            _wrong_type("meta", lambda t: t.victim.meta),
        ),
    ),
    Surface(
        "config",
        "worker: run-time config; config get",
        (
            Attack("field", config_field),
            _wrong_type("config", lambda t: t.victim.config),
        ),
    ),
    Surface(
        "workers",
        "worker: reclaim, heartbeat; clients (durable); stats",
        (
            Attack("member", workers_member),
            _wrong_type("workers", lambda t: t.victim.workers),
        ),
    ),
    Surface(
        "dead",
        "worker: dead-lettering; dead-letter list/replay",
        (
            Attack("record", dead_record),
            Attack("replayed", dead_replayed),
            _wrong_type("dead", lambda t: t.victim.dead),
        ),
    ),
    Surface(
        "cancel",
        "worker: cancel listener",
        (Attack("message", cancel_message), Attack("packed", cancel_packed)),
    ),
    Surface(
        "withdrawn",
        "cancel.lua, read.lua; worker: intake",
        (
            Attack("field", withdrawn_field),
            _wrong_type("withdrawn", lambda t: t.victim.withdrawn),
        ),
    ),
    Surface(
        "once",
        "enqueue.lua (keyed requests); clients: client/once.py",
        (
            Attack("value", once_value),
            _wrong_type("once", lambda t: t.victim.once("fuzz")),
        ),
    ),
    Surface(
        "cached",
        "enqueue.lua (cached requests); clients: CallTable.answer_cached",
        (
            Attack("value", cached_value),
            _wrong_type("cached", lambda t: t.victim.cached("0" * 32)),
        ),
    ),
    Surface(
        "cachestats",
        "enqueue.lua (hits, misses); workers: broker/replies.py (stored, bytes, too_big)",
        (
            Attack("value", cache_stats_value),
            _wrong_type("cachestats", lambda t: t.victim.cache_stats()),
        ),
    ),
    Surface(
        "inbox",
        "clients: reply reader; worker: replies",
        (
            Attack("element", inbox_element),
            _wrong_type("inbox", lambda t: t.junk_inbox),
        ),
    ),
    Surface("events", "clients: streamed events", (Attack("message", events_message),)),
    Surface(
        "worker",
        "worker: heartbeat",
        (
            Attack("field", worker_record),
            _wrong_type("worker", live_worker_record),
        ),
    ),
    Surface(
        "servings",
        "gateway: GET /v1/models; dashboard; queueserve stats, config get, dead-letter list",
        (
            Attack("member", servings_member),
            Attack("flood", servings_flood),
            _wrong_type("servings", lambda t: servings_key(t.prefix)),
        ),
    ),
    Surface(
        "jobs",
        "worker: job.lua; clients: Client.job; queueserve job",
        (
            Attack("field", job_record),
            _wrong_type("jobs", lambda t: group_key(t.prefix, "fuzzjunk", t.rng.randrange(128))),
        ),
    ),
    Surface(
        "tenants",
        "workers: the reader's run-time config (tenants' weights; wire/tenants.py)",
        (
            Attack("field", tenants_field),
            _wrong_type("tenants", lambda t: tenants_key(t.prefix)),
        ),
    ),
    Surface(
        "jobkey",
        "gateways: job ids (gateway/job_ids.py; tests/integration/test_gateway_tenants.py)",
        (
            Attack("value", job_id_key_value),
            _wrong_type("jobkey", lambda t: job_id_key(t.prefix)),
        ),
    ),
    Surface(
        "http.metrics_server", "worker: MetricsServer (/metrics, /healthz, /readyz)", HTTP_ATTACKS
    ),
)


def by_kind() -> dict[str, Surface]:
    return {s.kind: s for s in SURFACES}
