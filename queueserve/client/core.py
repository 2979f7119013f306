"""What the sync and async clients share, without I/O: ``ClientCore``, which each client holds
(as ``_core``) beside its outbox, inbox and jobs parts. It names the client's keys, keeps what
it knows of servings (target_table.py), plans calls into encoded requests and tracks them in
the call table; the planning helpers it uses live beside it (targets.py, once.py, caching.py,
outgoing.py, unserved.py).

The parts that do I/O (outbox.py and async_outbox.py send, inbox.py and async_inbox.py wait
and route replies, job_part.py follows jobs) hold this core; neither client inherits it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from queueserve.broker.urls import redact_url
from queueserve.client.caching import cached_plan, caches_at, marked
from queueserve.client.calls import Call, CallTable, deadline_after
from queueserve.client.events import RequestStream
from queueserve.client.job_sends import jobs_at
from queueserve.client.once import IdempotencyKey, answered, call_plan, onces_at
from queueserve.client.outgoing import Outgoing, admitted
from queueserve.client.target_table import TargetTable
from queueserve.client.targets import Part, Target
from queueserve.client.unserved import UnservedWatch
from queueserve.errors import Cancelled, QueueServeError, RedisUnavailable, Timeout
from queueserve.settings import Settings, check_prefix, check_redis_url
from queueserve.tracing import trace_fields
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, events_channel, inbox_key
from queueserve.wire.request import encode_request
from queueserve.wire.tenants import check_tenant, lane_key
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S

log = logging.getLogger("queueserve.client")

_new_tuple = tuple.__new__
INBOX_BLOCK_S = 1.0  # a blocked inbox read returns this often, so a closed client is seen


# What a submit asks of its call: (batch_key, timeout, priority, reply_to, keep, tenant,
# idempotency_key), checked by the client shell (timeout, priority) and carried unchanged
# through its outbox to ``ClientCore.plan``; ``reply_to``: the caller's own inbox, for a call
# it waits on alone. A plain tuple: built and taken apart per call for a few ns, where a
# NamedTuple's constructor costs 0.4-0.6 µs on the hot path.
CallSpec = tuple[
    str | None, float | None, int, str | None, float | None, str | None, IdempotencyKey | None
]


class Confirmed(Protocol):
    """A subscription (sync or asyncio): whether Redis has confirmed it."""

    confirmed: bool


class ClientCore:
    """What ``Client`` and ``AsyncClient`` hold in common, without I/O: naming, the call
    table, planning a call into encoded requests, reply delivery and error wording."""

    def __init__(
        self,
        url: str | None,
        prefix: str | None,
        codec: str | None = None,
        wait_for_worker: bool | None = None,
    ) -> None:
        settings = Settings()
        # A name no worker declared waits rather than failing (the client's option, else the
        # setting).
        self.wait_for_worker = (
            settings.wait_for_worker if wait_for_worker is None else wait_for_worker
        )
        # The codec a caller trusts for servings it names (None: msgpack only). Redis cannot
        # choose it: a codec read from a serving's meta hash was written by whoever can write
        # to Redis, and decoding pickle runs code.
        self.trusted_codec = None if codec is None else get_codec(codec).name
        self.url = check_redis_url(url or settings.redis_url)
        self.prefix = check_prefix(prefix) if prefix else settings.prefix
        self.default_timeout = settings.default_timeout  # a call's, unless it gives one
        self.unserved = UnservedWatch(self.url, self.prefix)
        self.client_id = uuid.uuid4().hex[:16]
        self.inbox = inbox_key(self.prefix, self.client_id)
        self.table = CallTable()
        self.events_channel = events_channel(self.prefix, self.client_id)
        self.targets = TargetTable(
            self.prefix, self.shown_url, self.trusted_codec, self.wait_for_worker, self.table
        )
        self.jobs_sent = False  # set by the first job: plain sends never look for jobs
        # set by the first call with an idempotency key: plain sends never look for keys
        self.keys_sent = False
        self.cache_sent = False  # set by the first call of a caching serving: likewise

    @property
    def shown_url(self) -> str:
        """The Redis URL as it may appear in logs and messages: without its password."""
        return redact_url(self.url)

    @property
    def owner(self) -> str:
        return f"queueserve client {self.client_id}"

    def closed_error(self, kind: str) -> QueueServeError:
        return QueueServeError(f"this client is closed; create a new qs.{kind}")

    def request(
        self,
        target: Target,
        part: Part,
        deadline: float | None,
        priority: int = 0,
        streamed: bool = False,
        reply_to: str | None = None,
        keep_ms: int = 0,
        tenant: str | None = None,
    ) -> Outgoing:
        """A new call for ``part``, encoded and checked; what the sender sends. Its answer
        goes to the client's inbox, or to ``reply_to`` (a caller's own inbox); with
        ``keep_ms`` it is a job, whose answer its record keeps too (wire/job_record.py); ``tenant``
        (a tenant's name, checked here) travels in its header to the worker, and its batch key
        is the tenant's lane (wire/tenants.py)."""
        key = part.batch_key if tenant is None else lane_key(part.batch_key, check_tenant(tenant))
        call = self.table.new(len(part.items), target.keys, key, priority)
        call.deadline = deadline
        fields: dict[str, Any] | None = trace_fields() if target.traced else None
        if keep_ms:
            call.keep_ms = keep_ms
            fields = {**fields, "job_keep": keep_ms} if fields else {"job_keep": keep_ms}
        if tenant is not None:
            fields = {**fields, "tenant": tenant} if fields else {"tenant": tenant}
        try:  # an item that does not encode, or a payload over the limit: the call goes
            header, payload = encode_request(
                target.codec,
                call.rid,
                part.items,
                reply_to or self.inbox,
                deadline,
                self.events_channel if streamed else "",
                priority,
                fields,
            )
            target.check_payload(payload, call.n)
        except Exception:
            self.table.forget(call)
            raise
        # tuple.__new__ directly: the NamedTuple's own __new__ is a Python function, which
        # cost 0.25 µs more per request on the client's hot path.
        return _new_tuple(Outgoing, (target, key, call, header, payload))

    def plan(
        self, target: Target, items: Iterable[Any], spec: CallSpec
    ) -> tuple[list[Part], list[Outgoing]]:
        """A submit's requests (what either client's outbox sends) and the parts they carry:
        the call cut as its serving and the spec's keep, idempotency key and the cache say
        (once.py, caching.py), each request encoded with the deadline the spec's timeout sets.
        The spec's reply_to holds for a call of one request only (``CallSpec``: a plain tuple,
        taken apart below)."""
        items = items if isinstance(items, list) else list(items)
        batch_key, timeout, priority, reply_to, keep, tenant, idempotency_key = spec
        parts, keep_ms, onces = call_plan(target, items, batch_key, keep, idempotency_key)
        parts, cached = cached_plan(target, parts, keep_ms, onces is not None)
        self.cache_sent = self.cache_sent or cached is not None
        self.jobs_sent = self.jobs_sent or keep_ms > 0
        self.keys_sent = self.keys_sent or onces is not None
        deadline = deadline_after(timeout)
        if len(parts) != 1:
            reply_to = None
        return parts, self.requests(
            target, parts, deadline, priority, reply_to, keep_ms, tenant, onces, cached
        )

    def requests(
        self,
        target: Target,
        parts: list[Part],
        deadline: float | None,
        priority: int,
        reply_to: str | None = None,
        keep_ms: int = 0,
        tenant: str | None = None,
        onces: tuple[list[str], int] | None = None,
        cached: str | None = None,
    ) -> list[Outgoing]:
        """``request`` of each part of one call: several are admitted together or not at all
        (``Call.group``), so a call refused for max_queue never runs in part; one part
        refused before sending (BadRequest) takes the others' calls with it. ``onces``: each
        part's idempotency key, and their records' TTL: keyed requests go each on its own;
        ``cached``: the serving's cache_version, for a call of one item per request
        (client/caching.py)."""
        outgoing: list[Outgoing] = []
        try:
            for p in parts:
                outgoing.append(
                    self.request(target, p, deadline, priority, False, reply_to, keep_ms, tenant)
                )
        except Exception:
            for o in outgoing:
                self.table.forget(o.call)
            raise
        return marked(outgoing, onces, tenant, cached)

    def streamed_request(
        self,
        target: Target,
        offset: int,
        part: Part,
        deadline: float | None,
        put: Callable[[Any], object],
        priority: int = 0,
        tenant: str | None = None,
    ) -> tuple[RequestStream, Outgoing]:
        """A request of ``stream``: its events and its end (None) go to ``put``."""
        outgoing = self.request(target, part, deadline, priority, streamed=True, tenant=tenant)
        call = outgoing.call

        def on_event(seq: int, body: list[Any]) -> None:
            put((seq, body))

        def on_done(_call: Call) -> None:
            put(None)

        call.on_event, call.on_done = on_event, on_done
        self.table.streamed[call.rid] = call
        return RequestStream(call, offset), outgoing

    def own_inbox(self, thread_id: int) -> str:
        """An inbox of this client that only one thread reads: a lone ``dispatch`` waits on
        it itself, so its answer wakes the caller directly, not the inbox reader first."""
        return f"{self.inbox}.{thread_id}"

    def cancel_call(self, call: Call) -> bool:
        """Fail a pending call with Cancelled; False when it had finished already. The
        caller then withdraws it from the outbox or from its stream."""
        if call.state != "pending":
            return False
        self.table.forget(call)
        call.fail(Cancelled(f"request {self.client_id}-{call.rid} was cancelled"))
        call.state = "cancelled"
        return True

    def withdraw_failed(self, call: Call, error: QueueServeError) -> None:
        """A request cancelled on its way could not be withdrawn once it reached Redis: a
        worker may run it; its caller has its Cancelled, and the result is dropped."""
        log.warning(
            "request %s-%s, cancelled while it was being sent, was not withdrawn (%s): a "
            "worker may run it, and its result is dropped",
            self.client_id,
            call.rid,
            error,
        )

    def expire(self, call: Call, text: str) -> None:
        """Fail ``call`` with Timeout: its request's own deadline passed."""
        self.table.forget(call)
        call.fail(Timeout(text))

    def fail_batch(self, batch: list[Outgoing], error: QueueServeError) -> None:
        for _, _, call, _, _ in batch:
            self.table.forget(call)
            call.fail(error)

    def send_failed(self, batch: list[Outgoing], error: Exception) -> None:
        """A send that gave up: its callers get its error. One stopped by something other
        than a queueserve error (a bug) is logged, and the thread or task that sends lives on
        to send the next requests."""
        if not isinstance(error, QueueServeError):
            error = send_failure(len(batch), error)
        self.fail_batch(batch, error)

    def marks(self, keys: Keys, group: list[Outgoing]) -> tuple[Any, Any, Any]:
        """What one enqueue script call (``group``'s requests, on shard ``keys``) marks: its
        jobs' records, idempotency keys and cache entries (``jobs=``, ``onces=``, ``caches=``),
        each looked for only once this client has sent one (plain sends never look)."""
        return (
            jobs_at(self.prefix, self.client_id, group) if self.jobs_sent else (),
            onces_at(self.client_id, keys, group) if self.keys_sent else (),
            caches_at(keys, group) if self.cache_sent else (),
        )

    def admit(
        self, group: list[Outgoing], reply: tuple[int, int, list[Any]]
    ) -> tuple[list[Call] | None, list[Call]]:
        """Record what enqueue.lua answered ``group`` (outgoing.py's ``admitted``): the calls
        that follow another request's job from now on (their keys' first), if any, and those
        cancelled on their way, for the sender to withdraw (``cancel_place`` has them now)."""
        keyed, cancelled = admitted(self.table, group, *reply)
        return answered(self.table, self.client_id, keyed) if keyed else None, cancelled

    def withdrawn(self, call: Call, *boxes: list[Outgoing]) -> bool | None:
        """Withdraw ``call`` from what is still to send (``boxes``): True when it was there, so
        it never runs; False when it cannot be withdrawn (it ended, or follows another
        request's job, which runs on for its caller); None when it is in Redis (or on its
        way), for the caller to cancel there (``cancel_place``)."""
        if not self.cancel_call(call):
            return False
        for box in boxes:
            for i, outgoing in enumerate(box):
                if outgoing.call is call:
                    del box[i]
                    return True
        return False if call.follows is not None else None

    def cancel_place(self, call: Call) -> tuple[Keys, str, bytes, int, int, str] | None:
        """The arguments of the broker's ``cancel`` of ``call``'s entry, None when it has none
        to cancel (b"": a keyed request queued by an earlier try of its send, once.py; None:
        on its way, sent and its entry id not yet back, when its send withdraws it: ``admit``)."""
        if call.entry_id is None or call.entry_id == b"":
            return None
        stream = call.keys.stream(call.batch_key, call.priority)
        return call.keys, stream, call.entry_id, call.n, call.rid, self.inbox

    def take_event(self, subscription: Confirmed, confirm: Callable[[], object], data: Any) -> None:
        """What the event subscriber does with what it read: ``confirm`` once Redis confirmed
        the subscription, then the event to its call."""
        if subscription.confirmed:
            confirm()
        self.deliver_event(data)

    def deliver(self, messages: list[bytes]) -> None:
        """Apply replies read from the inbox; a bad one is logged and dropped."""
        for message in messages:
            if not message:  # the wake-up pushed by close()
                continue
            try:
                self.table.deliver(message)
            except Exception:
                log.exception("dropped an undecodable reply in %s", self.inbox)

    def deliver_event(self, data: bytes | None) -> None:
        if data is None:
            return
        try:
            self.table.deliver_event(data)
        except Exception:
            log.exception("dropped an undecodable event on %s", self.events_channel)

    def subscribe_failed(self) -> QueueServeError:
        return RedisUnavailable(
            f"could not subscribe to this client's event channel on Redis at {self.shown_url} "
            f"within {RECONNECT_WITHIN_S:g}s; check that Redis is up"
        )


def send_failure(requests: int, error: Exception) -> QueueServeError:
    """What the callers of a send stopped by a bug (not a queueserve error) are told."""
    log.error("sending %d requests failed unexpectedly", requests, exc_info=error)
    failed = QueueServeError(
        f"the request could not be sent: {type(error).__name__}: {error} (a bug in queueserve "
        "or in something it called; the client keeps working)"
    )
    failed.__cause__ = error
    return failed


def timeout_message(target: Target, timeout: float | None, alive: int | None) -> str:
    """What a caller whose answer did not come in time is told (``alive``: workers with a
    heartbeat, None when Redis could not be asked)."""
    waited = f"within {timeout:g}s" if timeout is not None else "before its deadline"
    head = f"no answer from serving {target.keys.name!r} {waited}"
    if alive is None:
        return f"{head}; Redis could not be asked whether any worker is alive"
    if alive == 0:
        return (
            f"{head}; no worker is alive for it (none sent a heartbeat in the last "
            f"{ALIVE_WITHIN_S:g}s): start one with `queueserve worker module:attr`"
        )
    return (
        f"{head}; {alive} worker(s) alive for it, so the queue is long or the batch slow: "
        "raise timeout or add workers"
    )
