"""What the replier writes for a run of rows: events, one message per caller inbox, and acks
(the messages are encoded by wire/reply.py and wire/event.py)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from queueserve.wire.cache import CACHED_KINDS
from queueserve.wire.cache import value as cache_value
from queueserve.wire.codec import Codec
from queueserve.wire.event import encode_events
from queueserve.wire.job_record import GROUP_SHIFT, encode_hook, inbox_group, job_writes
from queueserve.wire.kinds import DROP, ERROR, EVENT, JOB_HOOK
from queueserve.wire.reply import ReplyEncoder
from queueserve.wire.request import job_keep
from queueserve.worker.pipeline.execute import Row

log = logging.getLogger(__name__)
MAX_HOOK_BYTES = 64 * 1024  # a job's last hook event is kept up to this size
MAX_SHARED_BYTES = 1 << 20  # a bigger reply message is kept as each job's own (job.lua)


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


class _JobRows:
    """One job's part of a round trip's write into its record group (job.lua): how many of
    its items these rows answer, whether one is an error, its last hook event. (A plain
    class: a dataclass's generated __init__ costs more per job on the replier's thread.)"""

    __slots__ = ("errored", "hook", "items", "request", "rows")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.rows: list[list[Any]] = []
        self.items = 0
        self.errored = False
        self.hook = b""  # the last hook event of its batches, encoded (wire/job_record.py)


class _Group:
    """The jobs of one record group in one round trip, and their rows in order."""

    __slots__ = ("jobs", "rows")

    def __init__(self) -> None:
        self.jobs: dict[int, _JobRows] = {}
        self.rows: list[list[Any]] = []


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
    # job.lua's writes, one per record group (broker/replies.py's GroupWrite), before acks
    jobs: list[tuple[str, tuple[bytes, str, str]]] = field(default_factory=list)
    # results to cache (wire/cache.py): (stream, digest, value); the streams of those too big
    cached: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    too_big: list[str] = field(default_factory=list)


def compose(rows: list[Row], codec: Codec, max_bytes: int, cache_max: int = 0) -> Composed:
    """Group rows per inbox, count down each request's items, and ack those finished.

    Rows are applied in order, so the events of a batch go out before its answers. With
    ``cache_max`` (the serving caches results of at most that many bytes), the result of each
    request whose item is to be cached (``Request.cache``) is encoded for the cache too.
    """
    out = Composed()
    events: list[tuple[str, list[Any]]] = []
    messages: dict[str, list[list[Any]]] = defaultdict(list)
    acks: dict[str, dict[int, list[bytes]]] = defaultdict(dict)
    errors: dict[str, int] = defaultdict(int)
    jobs: dict[tuple[str, int], _Group] = {}
    for request, offset, count, kind, body in rows:
        if kind == EVENT:
            events.append((request.events, [request.rid, offset, *body]))
            continue
        if kind == JOB_HOOK:
            _keep(jobs, request, None, encode_hook(codec, body))
            continue
        out.answered += count
        if kind == DROP:
            errors["cancelled"] += count
        else:
            if kind == ERROR:
                errors[body[3]] += count
            row = [request.rid, offset, count, kind, body]
            if request.events:
                row += request.stream_tail()
            messages[request.reply_to].append(row)
            if request.fields is not None and "job_keep" in request.fields:
                _keep(jobs, request, row)
            if cache_max and request.cache is not None and kind in CACHED_KINDS:
                _cache(out, request, kind, body, codec, cache_max)
        request.remaining -= count
        if request.remaining <= 0:
            _finish(request, acks, out)
    out.events = list(encode_events(codec, events, max_bytes))
    encoder = ReplyEncoder(codec, bytes((codec.tag,)), max_bytes - 1, errors)
    out.messages = {inbox: encoder.messages(m) for inbox, m in messages.items()}
    out.acks, out.errors = dict(acks), dict(errors)
    out.jobs = _job_writes(jobs, encoder, messages, out.messages)
    return out


def _job_writes(
    groups: dict[tuple[str, int], _Group],
    encoder: ReplyEncoder,
    rows: dict[str, list[list[Any]]],
    encoded: dict[str, list[bytes]],
) -> list[tuple[str, tuple[bytes, str, str]]]:
    """Per record group, its jobs' rows encoded as an inbox's would be (one message for the
    group, read by each of its jobs; a message each when they do not fit one), and per job
    what job.lua needs: a plain job (a first run answered whole, no error, no hook event)
    its request id alone. A group that has all of its inbox's rows keeps the inbox's
    message."""
    writes = []
    for (inbox, number), group in groups.items():
        if not group.rows:
            messages = []
        elif len(group.rows) == len(rows[inbox]):  # (its rows are some of its inbox's)
            messages = encoded[inbox]
        else:
            messages = encoder.messages(group.rows)
        # Shared, each job is counted for its items' share of the message's bytes: near
        # enough for a small message, not for a big one (its items' sizes may differ)
        shared = len(messages) == 1 and len(messages[0]) <= MAX_SHARED_BYTES
        per_item = 0.0
        if shared:
            per_item = len(messages[0]) / sum(job.items for job in group.jobs.values())
        else:
            messages = []
        values, plain = [], []
        for job in group.jobs.values():
            request = job.request
            if (
                shared
                and job.items == request.n
                and not (job.errored or job.hook or request.redelivered or request.replay)
            ):
                plain.append(str(request.rid))
                continue
            if not job.rows:
                refs, size = [], 0
            elif shared:
                refs, size = _FIRST, int(per_item * job.items) + 1
            else:
                own = encoder.messages(job.rows)
                refs = list(range(len(messages) + 1, len(messages) + len(own) + 1))
                messages += own
                size = sum(map(len, own))
            hook = job.hook if len(job.hook) <= MAX_HOOK_BYTES else b""  # else counts alone
            values.append(
                [
                    str(request.rid),
                    request.remaining <= 0,
                    job.errored,
                    refs,
                    size,
                    hook,
                ]
            )
        key = inbox_group(inbox, number << GROUP_SHIFT)
        writes.append((key, job_writes(messages, values, plain, per_item)))
    return writes


_FIRST = [1]


def _cache(out: Composed, request: Any, kind: int, body: Any, codec: Codec, limit: int) -> None:
    """Add the result of a request of one item to what is cached (a result that does not
    encode is not cached: its caller is told by its reply)."""
    try:
        value = cache_value(request.cache, codec, kind, body)
    except Exception:
        return
    if len(value) > limit:
        out.too_big.append(request.stream)
    else:
        out.cached.append((request.stream, request.cache, value))


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
    groups: dict[tuple[str, int], _Group], request: Any, row: list[Any] | None, hook: bytes = b""
) -> None:
    """Add ``row`` (or the encoded last ``hook`` event) to what is written into its job's
    record (a request that is a job)."""
    try:
        job_keep(request.fields)  # (its record holds its keep: enqueue.lua wrote it)
    except ValueError as e:
        # A forged header: its caller is answered as ever, and no record is written.
        log.warning("request %s: its answer is kept in no job record: %s", request.rid, e)
        return
    key = (request.reply_to, request.rid >> GROUP_SHIFT)  # its group's name, made once
    group = groups.get(key)
    if group is None:
        group = groups[key] = _Group()
    job = group.jobs.get(id(request))
    if job is None:
        job = group.jobs[id(request)] = _JobRows(request)
    if row is None:
        job.hook = hook
        return
    job.rows.append(row)
    group.rows.append(row)
    job.items += row[2]
    job.errored = job.errored or row[3] == ERROR
