"""Every Redis key and channel queueserve reads, with the writers that attack it: the fuzzer's
registry (tests/faults/test_fuzz.py runs it; tests/unit/test_fuzz_registry.py checks that each
kind of ``wire/protocol.py``'s LAYOUT, and each field of a request entry, has an entry here).

A new key, channel or entry field gets a row in the layout table, in LAYOUT, and a Surface
here in the same change.

Writers of the valid servings' keys write what valid traffic must survive: junk entries,
members, fields and messages beside the real ones. Writers that replace a whole key with one of
another Redis type (``wrong_type``) attack the victim serving's keys (``fzx``), which valid
traffic does not use: replacing the admission counter or wake stream of a serving stops its
callers by design; the worker, and its other servings, must serve on.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from queueserve.client.jobs import Job
from queueserve.errors import QueueServeError
from queueserve.ops.deadletter import DeadLetters
from queueserve.wire import protocol as P
from queueserve.wire.jobs import group_key
from queueserve.wire.options import parse_option
from tests.faults.fuzz.values import FAMILIES, NUMBERS, WRONG_TYPE, hostile_object
from tests.support.broker import RedisBroker

VALID = ("fz", "fzs", "fzt")  # servings with valid traffic (tests/faults/fuzz/app.py)
VICTIM = "fzx"
TYPES = dict(P.LAYOUT)


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

    def keys(self, serving: str = "fz") -> P.Keys:
        return P.Keys(self.prefix, serving)

    @property
    def victim(self) -> P.Keys:
        return self.keys(VICTIM)

    @property
    def junk_inbox(self) -> str:
        """Where forged entries with a well-formed header ask to be answered."""
        return P.inbox_key(self.prefix, "fuzzjunk")

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
    kind: str  # a kind of P.LAYOUT, or "entry.<field>" for a field of P.ENTRY_FIELDS
    reader: str  # who reads it, for reports
    attacks: tuple[Attack, ...]


def _wrong_type(kind: str, key: Callable[[Target], str]) -> Attack:
    return Attack("wrong_type", lambda t, _: t.replace(key(t), kind), (WRONG_TYPE,))


def _score(t: Target, value: bytes) -> float:
    try:
        return float(value)
    except ValueError:
        return t.rng.choice((float("inf"), float("-inf"), 1e308, -1.0, 0.0))


# --- request stream entries (every field of P.ENTRY_FIELDS) ------------------------------------
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


ENTRY_ATTACKS = {
    "h": (Attack("h", entry_h), Attack("h_field", entry_h_field)),
    "p": (Attack("p", entry_p),),
    "a": (Attack("a", entry_a),),
    "k": (Attack("k", entry_k), Attack("extra_field", entry_extra)),
}
ENTRY_WRITERS: tuple[Callable[[Target, bytes, int], None], ...] = (
    entry_h,
    entry_h_field,
    entry_p,
    entry_a,
    entry_k,
    entry_extra,
)


def any_entry(t: Target, value: bytes) -> None:
    t.rng.choice(ENTRY_WRITERS)(t, value, 0)


def priority_entry(t: Target, value: bytes) -> None:
    t.rng.choice(ENTRY_WRITERS)(t, value, t.rng.randrange(1, P.MAX_PRIORITY + 1))


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
            t.r.xgroup_create(stream, P.GROUP, id="0")
    t.r.xreadgroup(P.GROUP, value[:512] or b"?", {stream: ">"}, count=1)
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


META_FIELDS = (
    "max_payload_bytes",
    "batch_size",
    "shards",
    "pack_items",
    "streaming",
    "durable",
    "max_queue",
    "hooks",
    "header_fields",
)


def meta_field(t: Target, value: bytes) -> None:
    """A hostile value for a field clients or enqueue.lua read, or a field nobody knows. One
    the options model takes reads as the workers' declaration (max_payload_bytes=1 refuses
    every call until they write theirs back), not an attack: it goes in spoilt, as in the
    config hash."""
    name = t.rng.choice((*META_FIELDS, "fuzz-unknown"))
    keys = t.keys(t.rng.choice(VALID))
    if name == "shards" and value in NUMBERS and t.rng.random() < 0.5:
        value = b"64"  # more shards than any worker reads: issue 23's own example
    elif name in CONFIG_FIELDS and _valid_setting(name, value):
        print(f"fuzz: meta {name}={value!r} is a valid setting; written as {b'x' + value!r}")
        value = b"x" + value
    t.r.hset(keys.meta, name, value)
    t.note(keys.meta, name)


def meta_codec(t: Target, value: bytes) -> None:
    """A codec only the victim declares (any codec but msgpack is refused by name, by design:
    docs/guarantees.md, "codec choice belongs to the caller")."""
    t.r.hset(t.victim.meta, "codec", value)
    t.note(t.victim.meta, "codec")


CONFIG_FIELDS = (
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
)


def config_field(t: Target, value: bytes) -> None:
    """A hostile value for a run-time option. One that the options model takes (noise can
    spell " 3 ") is an operator's setting, not an attack: max_queue=3 throttles callers by
    design (values.py leaves small integers out for that reason), so it goes in spoilt."""
    name = t.rng.choice((*CONFIG_FIELDS, "fuzz-unknown"))
    keys = t.keys(t.rng.choice(VALID))
    if name in CONFIG_FIELDS and _valid_setting(name, value):
        print(f"fuzz: {name}={value!r} is a valid setting; written as {b'x' + value!r}")
        value = b"x" + value
    t.r.hset(keys.config, name, value)
    t.created.add(keys.config)


def _valid_setting(name: str, value: bytes) -> bool:
    try:
        parse_option(name, value.decode())
    except (ValueError, TypeError):
        return False
    return True


def workers_member(t: Target, value: bytes) -> None:
    """A ghost consumer, alive for ever (+inf), long dead, or at a hostile time; live
    consumers' own scores are left to their heartbeats."""
    keys = t.keys(t.rng.choice(VALID))
    _zadd(t, keys.workers, b"fuzz-ghost-" + value[:128], value)


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
    fields[t.rng.choice([*fields, "field:k", value[:64] or "?"])] = value
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


def _reply_junk(t: Target, value: bytes) -> bytes:
    rid = t.rng.choice((10**15 + t.rng.randrange(1000), -1, "x", None, 2**64 - 1))
    rows = t.rng.choice(
        (
            [[rid, 0, 1, P.RESULTS, ["forged"]]],
            [[rid, hostile_object(t.rng), hostile_object(t.rng), hostile_object(t.rng), value]],
            hostile_object(t.rng),
            [[rid, 0, 1, P.ERROR, hostile_object(t.rng)]],
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
            [rid, 0, "o", P.RESULTS, ["forged"], 0, 1],
            [[rid, hostile_object(t.rng), "h", value, hostile_object(t.rng), 0, 1]],
            [rid, -1, "h", "start", value, 0, 10**9],
            hostile_object(t.rng),
        )
    )
    message = t.rng.choice((value, b"m" + bytes(msgpack.packb(event)), b"p" + value))
    t.r.publish(t.rng.choice(t.channels), message)


def worker_record(t: Target, value: bytes) -> None:
    """A field of a live worker's registry record, or a forged record."""
    consumers = t.consumers()
    if consumers and t.rng.random() < 0.5:
        name = P.worker_key(t.prefix, t.rng.choice(consumers))
        field = t.rng.choice((b"heartbeat_ms", b"pid", value[:64] or b"?"))
        t.r.hset(name, field, value)
        if field not in (b"heartbeat_ms", b"pid"):  # the next heartbeat rewrites those two
            t.note(name, field)
        return
    name = P.worker_key(t.prefix, "fuzz-" + value[:32].decode("latin-1"))
    t.r.hset(name, mapping={"heartbeat_ms": value, "pid": value, "servings": value})
    t.created.add(name)


def live_worker_record(t: Target) -> str:
    consumers = t.consumers()
    if not consumers:
        return P.worker_key(t.prefix, "fuzz-nobody")
    return P.worker_key(t.prefix, t.rng.choice(consumers))


def _job_fields(rid: int) -> tuple[bytes, ...]:
    r = b"%d" % rid
    return (r, r + b".a", r + b".h", b"m1", b"m2", b"#", b"live", b"until", b"%d" % (rid + 1))


def job_record(t: Target, value: bytes) -> None:
    """A field of a job's record group (wire/jobs.py), then a request of that job (its inbox
    and request id name it), written with its record or not, which a worker answers into the
    forged group (job.lua), with a keep that may be junk too; then the record read as
    ``Client.job`` reads it: its answer, or a QueueServeError."""
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


SURFACES: tuple[Surface, ...] = (
    *(
        Surface(f"entry.{f}", "worker: decode_entry, split.lua", ENTRY_ATTACKS[f])
        for f in P.ENTRY_FIELDS
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
    Surface("cancel", "worker: cancel listener", (Attack("message", cancel_message),)),
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
        "jobs",
        "worker: job.lua; clients: Client.job; queueserve job",
        (
            Attack("field", job_record),
            _wrong_type("jobs", lambda t: group_key(t.prefix, "fuzzjunk", t.rng.randrange(128))),
        ),
    ),
)


def by_kind() -> dict[str, Surface]:
    return {s.kind: s for s in SURFACES}
