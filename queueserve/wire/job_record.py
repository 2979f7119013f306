"""Jobs: requests whose answer is kept in Redis, under an id any process can follow.

A request sent with ``keep`` carries one optional header field (wire/request.py),
``job_keep``: how long its answer stays once it ended, in ms. Its id is
``<client id>-<request id>`` (the ticket's id, unique across clients): the worker knows it from
the request's inbox (``P:inbox:<client id>``) and request id, so the header carries no id.

Records live in groups: the jobs of 64 consecutive request ids of one client share one hash,
``P:jobs:<client id>:<request id // 64>`` (wire/keys.py's layout), so a send or a reply touches
one key for a run of jobs, and Redis does a few commands per group instead of several per job
(issue 26: what a job costs is Redis's work per command and per key). For job ``r`` (its
request id, in decimal) the group holds::

    r        while it waits, where: ``<items>:<keep ms>:<serving>:<entry id>:<stream>``,
             written with its entry (enqueue.lua; on a cluster by the client around the
             enqueue: job_new.lua, job_placed.lua; entry id and stream empty until placed);
             once it ended, how: ``<status>:<unix ms its keep ends>:<items>:<bytes>:<message
             numbers>[:<why, for a job that failed without an answer>]`` (job.lua,
             job_end.lua), status done, failed or cancelled. One field tells both, so the
             worker reads one field per job (one that is missing costs a scan of the whole
             hash in Redis's compact encoding).
    r.a      a job answered in parts, while it waits: ``<bytes>:<errored 0|1>:<message
             numbers>`` (space separated)
    r.h      the last hook event of its batches (``qs.emit``), as a codec tag and the
             encoding of ``["h", name, payload, start, size]`` (wire/event.py)
    m<k>     reply message k, as an inbox would get it (wire/reply.py): the rows of one
             reply round trip for the group's jobs (a reader takes its own rows)
    #        the last message number; live, the group's jobs not ended; until, the unix ms
             the last of its ended jobs' keep ends

The group's TTL is a week while one of its jobs is live, then ``until``: its memory goes once
the keep of every ended job in it passed. A job whose own keep passed reads ``expired`` at
once (a reader compares its end with Redis's clock). "running" and "expired" are read, not
stored: an entry a worker holds, and a record that is gone or past its keep.

Anyone who can write to Redis can write a record: ``parse_record`` checks every field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from queueserve.wire.codec import Codec, loads_tagged
from queueserve.wire.keys import CLIENT_ID, split_inbox

QUEUED, RUNNING, DONE, FAILED, CANCELLED, EXPIRED = (
    "queued",
    "running",
    "done",
    "failed",
    "cancelled",
    "expired",
)

# The answers one job may keep: a job is a request, so this bounds what a forged or runaway
# job costs Redis; a bigger answer ends the job "failed" with a message saying so.
MAX_JOB_BYTES: Final = 64 * 1024 * 1024
MAX_KEEP_MS: Final = 30 * 24 * 3600 * 1000
# How long a record waits for its request's answer before Redis drops it: every key has a
# TTL (docs/design.md §4); a job still queued after a week has no one waiting for it.
LIVE_TTL_MS: Final = 7 * 24 * 3600 * 1000
_MAX_MESSAGES: Final = 1 << 20
# A job of more items could never keep its answer (an item's answer takes a byte at least):
# a reader refuses a record that says so rather than make room for that many.
_MAX_ITEMS: Final = MAX_JOB_BYTES
_JOB_ID: Final = re.compile(CLIENT_ID + r"-(?:0|[1-9][0-9]{0,17})")  # <client id>-<request id>


def check_job_id(job_id: object) -> str:
    """``job_id`` if it is a job's id (``<client id>-<request id>``), else ValueError: an id
    is turned into a key name, which must stay among this prefix's job records."""
    if not isinstance(job_id, str) or _JOB_ID.fullmatch(job_id) is None:
        raise ValueError(
            f"{job_id!r:.100} is not a job id: a job id is what submit(..., keep=...) gave "
            "as ticket.id, '<client id>-<request number>' (letters, digits, '_', '.', '-')"
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
    """A header's ``job_keep`` field (ms), or ValueError."""
    if type(keep_ms) is not int or not 0 < keep_ms <= MAX_KEEP_MS:
        raise ValueError(
            f"header field 'job_keep' must be ms from 1 to {MAX_KEEP_MS}, got {keep_ms!r}"
        )
    return keep_ms


GROUP_SHIFT: Final = 6  # a group holds the jobs of 2**6 consecutive request ids


def job_place(prefix: str, job_id: str) -> tuple[str, str]:
    """(group key, field) of a checked job id's record."""
    client_id, rid = job_id.rsplit("-", 1)
    return group_key(prefix, client_id, int(rid)), rid


def group_key(prefix: str, client_id: str, rid: int) -> str:
    return f"{prefix}:jobs:{client_id}:{rid >> GROUP_SHIFT}"


def inbox_group(inbox: str, rid: int) -> str:
    """The record group of a job from its request's inbox (``P:inbox:<client id>``, checked
    by the worker) and request id."""
    return group_key(*split_inbox(inbox), rid)


def record_fields(rid: str) -> tuple[str, str, str]:
    """The fields of job ``rid``'s record in its group: its own, its answers so far, its hook."""
    return rid, rid + ".a", rid + ".h"


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record, checked; ``refs``: the group's messages that hold its answers."""

    status: str
    n: int
    serving: str
    stream: str
    entry_id: bytes
    refs: list[bytes]
    failure: str
    hook: bytes


def parse_record(job_id: str, raw: list[bytes | None], now_ms: int) -> JobRecord | None:
    """The record of job ``job_id`` from its fields (``record_fields``' values, HMGET), or
    None when it has none or its keep passed by ``now_ms``; ValueError naming the field that
    is wrong, for a record someone else wrote."""
    own, answered, hook = raw
    if own is None:
        return None
    if own[:1].isdigit():  # waiting: <items>:<keep>:<serving>:<entry id>:<stream>
        parts = own.split(b":", 4)
        if len(parts) != 5 or not _count(parts[0], _MAX_ITEMS) or not _count(parts[1], 1 << 50):
            raise _bad(job_id, "", own)
        refs = _refs(job_id, answered, b"0:0:")
        return JobRecord(
            QUEUED,
            int(parts[0]),
            _text(job_id, "", parts[2]),
            _text(job_id, "", parts[4]),
            parts[3],
            refs,
            "",
            hook or b"",
        )
    # ended: <status>:<ends, unix ms>:<items>:<bytes>:<message numbers>[:<why>]
    parts = own.split(b":", 5)
    if (
        len(parts) < 5
        or parts[0] not in _ENDS
        or not _count(parts[1], 1 << 50)
        or not _count(parts[2], _MAX_ITEMS)
        or not _count(parts[3], 1 << 50)
    ):
        raise _bad(job_id, "", own)
    if int(parts[1]) <= now_ms:
        return None
    failure = _text(job_id, "", parts[5]) if len(parts) > 5 else ""
    return JobRecord(
        parts[0].decode(),
        int(parts[2]),
        "",
        "",
        b"",
        _numbers(job_id, "", own, parts[4]),
        failure,
        hook or b"",
    )


_ENDS: Final = {DONE.encode(), FAILED.encode(), CANCELLED.encode()}


def _refs(job_id: str, answered: bytes | None, default: bytes) -> list[bytes]:
    """The message numbers of a waiting job's answers so far: ``<bytes>:<errored>:<numbers>``."""
    fields = (answered or default).split(b":")
    if len(fields) != 3 or not _count(fields[0], 1 << 50) or fields[1] not in (b"0", b"1"):
        raise _bad(job_id, ".a", answered or b"")
    return _numbers(job_id, ".a", answered or b"", fields[2])


def _numbers(job_id: str, field: str, raw: bytes, numbers: bytes) -> list[bytes]:
    refs = numbers.split()
    if len(refs) > _MAX_MESSAGES or not all(_count(r, 1 << 50) for r in refs):
        raise _bad(job_id, field, raw)
    return refs


def _count(value: bytes, upper: int) -> bool:
    return value.isdigit() and len(value) <= 16 and int(value) <= upper


def _text(job_id: str, field: str, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise _bad(job_id, field, value) from None


def check_messages(job_id: str, messages: list[bytes | None]) -> list[bytes]:
    """A record's messages (HMGET of its ``refs``), each there; ValueError otherwise."""
    found = [m for m in messages if m is not None]
    if len(found) != len(messages):
        raise ValueError(
            f"job {job_id}'s record names an answer its group does not hold: it was not "
            "written by queueserve; forget it (job.forget())"
        )
    return found


def _bad(job_id: str, field: str, value: bytes) -> ValueError:
    rid = job_id.rsplit("-", 1)[-1]
    return ValueError(
        f"job {job_id}'s record has a bad {rid + field!r} field "
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


def placings(serving: str, groups: list[list[Any]], again: bool = False) -> bytes:
    """enqueue.lua's last argument for jobs: whether the send was tried before, and per record
    group (request number, request id, keep ms) of each of its jobs."""
    packed: bytes = msgpack.packb([serving, LIVE_TTL_MS, again, *groups], use_bin_type=False)
    return packed


def job_writes(
    messages: list[bytes], jobs: list[list[Any]], plain: list[str], per_item: float
) -> tuple[bytes, str, str]:
    """job.lua's arguments for a group after the limit: its messages and the values of its
    jobs that are not plain (msgpack with strings as its raw type, as Redis's cmsgpack reads
    no bin type), the plain jobs' request ids, and the bytes a plain job counts per item."""
    packed: bytes = msgpack.packb([messages, jobs], use_bin_type=False)
    return packed, " ".join(plain), repr(per_item)
