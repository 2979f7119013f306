"""Jobs: requests whose answer is kept in Redis, under an id any process can follow.

A request sent with ``keep`` carries two optional header fields (wire/request.py): ``job``,
its id (``<client id>-<request id>``, the ticket's id: unique across clients), and ``keep``,
how long its answer stays once it ended, in ms. Its record is one hash, ``P:job:<id>``
(protocol.py's layout), written with its entry by enqueue.lua (where it waits; on a cluster by
the client around the enqueue: job_new.lua, job_placed.lua)
and by the worker that answers it (job.lua, in the reply-and-ack round trip, before the ack)::

    s   status: queued, done, failed or cancelled ("running" and "expired" are read, not
        stored: an entry a worker holds, and a record that is gone)
    n   item count
    k   keep, ms
    sv  serving name; st, e: the stream and entry id it waits in (for cancel)
    m   how many reply messages it holds; b, their bytes
    r1 .. rm  the reply messages, as an inbox would get them (wire/reply.py)
    x   why it failed without an answer (its answer went over MAX_JOB_BYTES)
    h   the last hook event of its batches (``qs.emit``), as a codec tag and the encoding of
        ``["h", name, payload, start, size]`` (wire/event.py), when the serving emits one

Anyone who can write to Redis can write a record: ``parse_record`` checks every field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from queueserve.wire.codec import Codec, loads_tagged

QUEUED, RUNNING, DONE, FAILED, CANCELLED, EXPIRED = (
    "queued",
    "running",
    "done",
    "failed",
    "cancelled",
    "expired",
)
STORED: Final = frozenset((QUEUED, DONE, FAILED, CANCELLED))
ENDED: Final = frozenset((DONE, FAILED, CANCELLED, EXPIRED))

# The answers one job may keep: a job is a request, so this bounds what a forged or runaway
# job costs Redis; a bigger answer ends the job "failed" with a message saying so.
MAX_JOB_BYTES: Final = 64 * 1024 * 1024
MAX_KEEP_MS: Final = 30 * 24 * 3600 * 1000
# How long a record waits for its request's answer before Redis drops it: every key has a
# TTL (docs/design.md §4); a job still queued after a week has no one waiting for it.
LIVE_TTL_MS: Final = 7 * 24 * 3600 * 1000
_MAX_MESSAGES: Final = 1 << 20
_JOB_ID: Final = re.compile(r"[A-Za-z0-9_.]{1,64}-[0-9]{1,18}")


def check_job_id(job_id: object) -> str:
    """``job_id`` if it is a job's id (``<client id>-<request id>``), else ValueError: an id
    is turned into a key name, which must stay among this prefix's job records."""
    if not isinstance(job_id, str) or _JOB_ID.fullmatch(job_id) is None:
        raise ValueError(
            f"{job_id!r:.100} is not a job id: a job id is what submit(..., keep=...) gave "
            "as ticket.id, '<client id>-<request number>' (letters, digits, '_', '.')"
        )
    return job_id


def check_keep(keep: object) -> int:
    """``keep`` (seconds) in ms, or ValueError saying what a keep must be."""
    if (
        isinstance(keep, bool)
        or not isinstance(keep, int | float)
        or not 0 < keep * 1000 <= MAX_KEEP_MS
    ):
        raise ValueError(
            f"keep must be a number of seconds above 0 and at most {MAX_KEEP_MS // 1000} "
            f"(30 days): how long a job's answer stays in Redis after it ends; got {keep!r}"
        )
    return max(1, int(keep * 1000))


def check_keep_ms(keep_ms: object) -> int:
    """A header's ``keep`` field (ms), or ValueError."""
    if type(keep_ms) is not int or not 0 < keep_ms <= MAX_KEEP_MS:
        raise ValueError(f"header field 'keep' must be ms from 1 to {MAX_KEEP_MS}, got {keep_ms!r}")
    return keep_ms


def job_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:job:{job_id}"


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record, checked."""

    status: str
    n: int
    serving: str
    stream: str
    entry_id: bytes
    messages: list[bytes]
    failure: str
    hook: bytes


def parse_record(job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
    """The record of job ``job_id`` from its hash (HGETALL); ValueError naming the field that
    is wrong, for a record someone else wrote."""

    def text(name: bytes, default: str = "") -> str:
        value = raw.get(name)
        if value is None:
            return default
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise _bad(job_id, name, value) from None

    def count(name: bytes, upper: int) -> int:
        value = raw.get(name, b"0")
        if not value.isdigit() or len(value) > 12 or int(value) > upper:
            raise _bad(job_id, name, value)
        return int(value)

    status = text(b"s", QUEUED)
    if status not in STORED:
        raise _bad(job_id, b"s", raw[b"s"])
    n = count(b"n", 1 << 40)
    count(b"b", MAX_JOB_BYTES)  # checked only: the messages' own lengths are what count
    m = count(b"m", _MAX_MESSAGES)
    messages = []
    for i in range(1, m + 1):
        message = raw.get(b"r%d" % i)
        if message is None:
            raise _bad(job_id, b"r%d" % i, b"(missing)")
        messages.append(message)
    if sum(map(len, messages)) > MAX_JOB_BYTES:
        raise ValueError(
            f"job {job_id}'s record holds {sum(map(len, messages))} bytes of answers, over "
            f"the {MAX_JOB_BYTES} a job may keep: it was not written by queueserve; forget it"
        )
    return JobRecord(
        status,
        n,
        text(b"sv"),
        text(b"st"),
        raw.get(b"e", b""),
        messages,
        text(b"x"),
        raw.get(b"h", b""),
    )


def _bad(job_id: str, name: bytes, value: bytes) -> ValueError:
    return ValueError(
        f"job {job_id}'s record has a bad {name.decode(errors='replace')!r} field "
        f"({value!r:.80}): it was not written by queueserve; forget it (job.forget())"
    )


def encode_hook(codec: Codec, body: list[Any]) -> bytes:
    """A hook event's body (wire/event.py's ``hook_event``) as a record keeps it: the codec
    tag and its encoding."""
    return bytes((codec.tag,)) + codec.dumps(body)


def parse_hook(raw: bytes, accepted: set[int]) -> tuple[str, Any, int, int]:
    """(name, payload, start, size) of a record's hook event; ValueError when it is none."""
    body = loads_tagged(raw, accepted, "hook event")
    if type(body) is not list or len(body) != 5 or body[0] != "h" or type(body[1]) is not str:
        raise ValueError(f"not a hook event: {body!r:.100}")
    _, name, payload, start, size = body
    if type(start) is not int or type(size) is not int:
        raise ValueError(f"not a hook event: {body!r:.100}")
    return name, payload, start, size


def job_writes(values: list[list[Any]]) -> bytes:
    """job.lua's one argument for all its jobs' values: msgpack with strings as its raw type,
    as Redis's cmsgpack reads no bin type."""
    packed: bytes = msgpack.packb(values, use_bin_type=False)
    return packed
