"""What the replier writes for a run of rows: events, one message per caller inbox, and acks
(the messages are encoded by wire/reply.py and wire/event.py)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from queueserve.wire import protocol as P
from queueserve.wire.codec import Codec
from queueserve.wire.event import encode_events
from queueserve.wire.jobs import encode_hook
from queueserve.wire.reply import ReplyEncoder
from queueserve.wire.request import job_of
from queueserve.worker.pipeline.execute import Row

log = logging.getLogger(__name__)
MAX_HOOK_BYTES = 64 * 1024  # a job's last hook event is kept up to this size


class ReplyQueue:
    """Rows on their way to the replier, and who is sending now.

    Replies leave in the order rows were put: the replier takes everything queued in one go
    and sends it while no one else sends. An executor whose batch found nothing queued and
    nothing being sent may ``claim`` the sender's turn and send its own rows: one thread
    hand-off less per batch, which on an idle worker is most of the worker's share of a round
    trip. ``None`` rows mark an executor's end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # Rows, a Reply still to be split into rows (worker/pipeline/stages.py), or None.
        self._items: deque[Any] = deque()
        self._sending = False

    def put(self, rows: Any) -> None:
        with self._cond:
            self._items.append(rows)
            self._cond.notify()

    def take(self) -> list[Any]:
        """Everything queued, once there is something and no one is sending; the caller is
        the sender until it calls ``done``."""
        with self._cond:
            while not self._items or self._sending:
                self._cond.wait()
            items = list(self._items)
            self._items.clear()
            self._sending = True
            return items

    def claim(self) -> bool:
        """Become the sender, if nothing is queued and no one is sending (then call ``done``)."""
        with self._cond:
            if self._items or self._sending:
                return False
            self._sending = True
            return True

    def done(self) -> None:
        with self._cond:
            self._sending = False
            if self._items:  # the replier waits only for rows: waking it for none costs a wake
                self._cond.notify()


class JobWrite:
    """What one round trip writes into a job's record (job.lua): its rows of these batches,
    whether they end it, and whether one of them is an error. ``fresh``: the record holds
    none of its answers yet (a first run, nothing answered before these rows), so job.lua
    need not read how many it holds. (A plain class: a dataclass's generated __init__ with
    list factories costs more per job on the replier's thread.)"""

    __slots__ = (
        "errored",
        "final",
        "fresh",
        "hook",
        "job_id",
        "keep_ms",
        "messages",
        "n",
        "request",
        "rows",
    )

    def __init__(self, job_id: str, keep_ms: int, request: Any) -> None:
        self.job_id, self.keep_ms = job_id, keep_ms
        self.request = request  # the worker's Request: it ends the job once no item is left
        self.n = int(request.n)
        self.fresh = request.remaining == request.n and not (request.redelivered or request.replay)
        self.rows: list[list[Any]] = []
        self.messages: list[bytes] = []
        self.final = self.errored = False
        self.hook = b""  # the last hook event of its batches, encoded (wire/jobs.py)


@dataclass
class Composed:
    """Everything one replier round trip writes, and what it tells the middleware."""

    events: list[tuple[str, bytes]] = field(default_factory=list)  # (channel, message)
    messages: dict[str, list[bytes]] = field(default_factory=dict)  # inbox -> [message]
    # stream -> items admitted -> entry ids (ack.lua takes the ids in runs of one count)
    acks: dict[str, dict[int, list[bytes]]] = field(default_factory=dict)
    finished: list[tuple[str, bytes]] = field(default_factory=list)  # (stream, id) answered
    answered: int = 0  # items answered (results, errors or dropped)
    errors: dict[str, int] = field(default_factory=dict)  # items by error kind
    jobs: list[JobWrite] = field(default_factory=list)  # answers kept for jobs, before acks


def compose(rows: list[Row], codec: Codec, max_bytes: int) -> Composed:
    """Group rows per inbox, count down each request's items, and ack those finished.

    Rows are applied in order, so the events of a batch go out before its answers.
    """
    out = Composed()
    events: list[tuple[str, list[Any]]] = []
    messages: dict[str, list[list[Any]]] = defaultdict(list)
    acks: dict[str, dict[int, list[bytes]]] = defaultdict(dict)
    errors: dict[str, int] = defaultdict(int)
    jobs: dict[int, JobWrite] = {}
    for request, offset, count, kind, body in rows:
        if kind == P.EVENT:
            events.append((request.events, [request.rid, offset, *body]))
            continue
        if kind == P.JOB_HOOK:
            _keep(jobs, request, None, encode_hook(codec, body))
            continue
        out.answered += count
        if kind == P.DROP:
            errors["cancelled"] += count
        else:
            if kind == P.ERROR:
                errors[body[3]] += count
            row = [request.rid, offset, count, kind, body]
            if request.events:
                row += request.stream_tail()
            messages[request.reply_to].append(row)
            if request.fields is not None and "job" in request.fields:
                _keep(jobs, request, row)
        request.remaining -= count
        if request.remaining <= 0:
            _finish(request, acks, out)
    out.events = list(encode_events(codec, events, max_bytes))
    encoder = ReplyEncoder(codec, bytes((codec.tag,)), max_bytes - 1, errors)
    out.messages = {inbox: encoder.messages(m) for inbox, m in messages.items()}
    out.acks, out.errors = dict(acks), dict(errors)
    out.jobs = _job_writes(jobs, encoder)
    return out


def _job_writes(jobs: dict[int, JobWrite], encoder: ReplyEncoder) -> list[JobWrite]:
    """The jobs' rows encoded as an inbox's would be, whether each ends now, and its last
    hook event (none when too large to keep)."""
    for job in jobs.values():
        job.messages = encoder.messages(job.rows) if job.rows else []
        job.final = job.request.remaining <= 0
        if len(job.hook) > MAX_HOOK_BYTES:  # too large to keep: progress() shows counts alone
            job.hook = b""
    return list(jobs.values())


def _finish(request: Any, acks: dict[str, dict[int, list[bytes]]], out: Composed) -> None:
    """Ack a request with no item left; a pack's entry once its last request has none."""
    admitted = request.admitted
    if request.pack is not None:
        request.pack.left -= 1
        if request.pack.left > 0:
            return
        admitted = request.pack.admitted
    runs = acks[request.stream]
    if admitted in runs:
        runs[admitted].append(request.entry_id)
    else:
        runs[admitted] = [request.entry_id]
    out.finished.append(request.ref)


def _keep(
    jobs: dict[int, JobWrite], request: Any, row: list[Any] | None, hook: bytes = b""
) -> None:
    """Add ``row`` (or the encoded last ``hook`` event) to what is written into its job's
    record (a request that is a job)."""
    try:
        job = job_of(request.fields)
    except ValueError as e:
        # A forged header: its caller is answered as ever, and no record is written.
        log.warning("request %s: its answer is kept in no job record: %s", request.rid, e)
        return
    if job is None:
        return
    write = jobs.get(id(request))
    if write is None:
        write = jobs[id(request)] = JobWrite(job[0], job[1], request)
    if row is None:
        write.hook = hook
        return
    write.rows.append(row)
    write.errored = write.errored or row[3] == P.ERROR
