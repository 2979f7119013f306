"""What the sync and async clients share, without I/O: ``BaseClient`` (as httpx shares its
``BaseClient``); the planning, sending and waiting helpers it uses live beside it (targets.py,
outgoing.py, windows.py, unserved.py).

Each client module keeps only its I/O: sending through its broker, waiting on its kind of
queue or future, and its threads or tasks.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from queueserve import tracing
from queueserve.broker.urls import redact_url
from queueserve.client.caching import declared_cache, marked
from queueserve.client.calls import Call, CallTable
from queueserve.client.events import RequestStream
from queueserve.client.outgoing import Outgoing
from queueserve.client.targets import (
    Part,
    ShardSpread,
    Target,
    claimed_shards,
    confirmed_shards,
)
from queueserve.client.unserved import UnservedWatch, unknown_serving_message
from queueserve.errors import (
    BadRequest,
    Cancelled,
    QueueServeError,
    RedisUnavailable,
    UnknownServing,
)
from queueserve.options.stored import declared_rule, parse_declared
from queueserve.serving import Serving
from queueserve.settings import Settings, check_prefix, check_redis_url, check_timeout
from queueserve.tracing import reads_trace, trace_fields
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, events_channel, inbox_key
from queueserve.wire.request import encode_request
from queueserve.wire.tenants import check_tenant, lane_key
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S

log = logging.getLogger("queueserve.client")

_new_tuple = tuple.__new__
INBOX_BLOCK_S = 1.0  # a blocked inbox read returns this often, so a closed client is seen

ServingRef = str | Serving


class BaseClient:
    """What ``Client`` and ``AsyncClient`` share, without I/O (as httpx's ``BaseClient``):
    naming, request planning, reply delivery and error wording. Each subclass adds its I/O:
    sending through its broker, waiting on its kind of queue or future, its threads or tasks."""

    def __init__(self, url: str | None, prefix: str | None, codec: str | None = None) -> None:
        settings = Settings()
        # Set by Client/AsyncClient: a name no worker declared waits rather than failing.
        self._wait_for_worker = settings.wait_for_worker
        # The codec a caller trusts for servings it names (None: msgpack only). Redis cannot
        # choose it: a codec read from a serving's meta hash was written by whoever can write
        # to Redis, and decoding pickle runs code.
        self._trusted_codec = None if codec is None else get_codec(codec).name
        self.url = check_redis_url(url or settings.redis_url)
        self.prefix = check_prefix(prefix) if prefix else settings.prefix
        self._default_timeout = settings.default_timeout
        self._unserved = UnservedWatch(self.url, self.prefix)
        self.client_id = uuid.uuid4().hex[:16]
        self._inbox = inbox_key(self.prefix, self.client_id)
        self._table = CallTable()
        self._events_channel = events_channel(self.prefix, self.client_id)
        self._targets: dict[str, Target] = {}
        # Key names per serving name: a serving object's call makes a new Target, whose keys
        # would otherwise be built again (some twenty strings) and kept by the call in flight.
        self._keys: dict[str, Keys] = {}
        self._spreads: dict[str, ShardSpread] = {}
        # Servings whose workers declared they read trace context (tracing.py), by name
        self._traced: dict[str, bool] = {}

    def _timeout_for(self, timeout: float | None) -> float | None:
        """The call's timeout, checked (a mistake is reported now, not as a Timeout later);
        QUEUESERVE_DEFAULT_TIMEOUT when the call gives none."""
        checked = check_timeout(timeout)
        return self._default_timeout if checked is None else checked

    @property
    def _shown_url(self) -> str:
        """The Redis URL as it may appear in logs and messages: without its password."""
        return redact_url(self.url)

    @property
    def _owner(self) -> str:
        return f"queueserve client {self.client_id}"

    def _closed_error(self, kind: str) -> QueueServeError:
        return QueueServeError(f"this client is closed; create a new qs.{kind}")

    def _meta_keys(self, serving: ServingRef) -> Keys | None:
        """Keys whose meta hash to read before ``remember``: None when a serving object (or
        a cached name) says all there is to know."""
        if isinstance(serving, str):
            return self._keys_of(serving)
        if tracing.AVAILABLE and isinstance(serving, Serving) and serving.name not in self._traced:
            return self._keys_of(serving.name)  # read once, for the trace gate
        return None

    def _undeclared(self, keys: Keys | None, meta: dict[str, str]) -> bool:
        """Whether a serving named by a string has no meta hash (no worker ever declared it)
        and this client does not wait for workers: the call fails with ``_unknown``."""
        return keys is not None and not meta and not self._wait_for_worker

    def _unknown(self, name: str, known: list[str]) -> UnknownServing:
        return UnknownServing(unknown_serving_message(name, known, self.prefix, self._shown_url))

    def _keys_of(self, name: str) -> Keys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = Keys(self.prefix, name)
        return keys

    def _request(
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
        call = self._table.new(len(part.items), target.keys, key, priority)
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
                reply_to or self._inbox,
                deadline,
                self._events_channel if streamed else "",
                priority,
                fields,
            )
            target.check_payload(payload, call.n)
        except Exception:
            self._table.forget(call)
            raise
        # tuple.__new__ directly: the NamedTuple's own __new__ is a Python function, which
        # cost 0.25 µs more per request on the client's hot path.
        return _new_tuple(Outgoing, (target, key, call, header, payload))

    def _requests(
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
        """``_request`` of each part of one call: several are admitted together or not at all
        (``Call.group``), so a call refused for max_queue never runs in part; one part
        refused before sending (BadRequest) takes the others' calls with it. ``onces``: each
        part's idempotency key, and their records' TTL: keyed requests go each on its own;
        ``cached``: the serving's cache_version, for a call of one item per request
        (client/caching.py)."""
        outgoing: list[Outgoing] = []
        try:
            for p in parts:
                outgoing.append(
                    self._request(target, p, deadline, priority, False, reply_to, keep_ms, tenant)
                )
        except Exception:
            for o in outgoing:
                self._table.forget(o.call)
            raise
        return marked(outgoing, onces, tenant, cached)

    def _streamed_request(
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
        outgoing = self._request(target, part, deadline, priority, streamed=True, tenant=tenant)
        call = outgoing.call

        def on_event(seq: int, body: list[Any]) -> None:
            put((seq, body))

        def on_done(_call: Call) -> None:
            put(None)

        call.on_event, call.on_done = on_event, on_done
        self._table.streamed[call.rid] = call
        return RequestStream(call, offset), outgoing

    def _own_inbox(self, thread_id: int) -> str:
        """An inbox of this client that only one thread reads: a lone ``dispatch`` waits on
        it itself, so its answer wakes the caller directly, not the inbox reader first."""
        return f"{self._inbox}.{thread_id}"

    def _cancel_call(self, call: Call) -> bool:
        """Fail a pending call with Cancelled; False when it had finished already. The
        caller then withdraws it from the outbox or from its stream."""
        if call.state != "pending":
            return False
        self._table.forget(call)
        call.fail(Cancelled(f"request {self.client_id}-{call.rid} was cancelled"))
        call.state = "cancelled"
        return True

    def _fail_batch(self, batch: list[Outgoing], error: QueueServeError) -> None:
        for _, _, call, _, _ in batch:
            self._table.forget(call)
            call.fail(error)

    def _fail_send(self, batch: list[Outgoing], error: Exception) -> None:
        """A send stopped by something other than a queueserve error (a bug): its callers are
        told at once, and the thread that sends lives on to send the next requests."""
        self._fail_batch(batch, send_failure(len(batch), error))

    def _deliver(self, messages: list[bytes]) -> None:
        """Apply replies read from the inbox; a bad one is logged and dropped."""
        for message in messages:
            if not message:  # the wake-up pushed by close()
                continue
            try:
                self._table.deliver(message)
            except Exception:
                log.exception("dropped an undecodable reply in %s", self._inbox)

    def _deliver_event(self, data: bytes | None) -> None:
        if data is None:
            return
        try:
            self._table.deliver_event(data)
        except Exception:
            log.exception("dropped an undecodable event on %s", self._events_channel)

    def _subscribe_failed(self) -> QueueServeError:
        return RedisUnavailable(
            f"could not subscribe to this client's event channel on Redis at {self._shown_url} "
            f"within {RECONNECT_WITHIN_S:g}s; check that Redis is up"
        )

    def _cached(self, serving: ServingRef) -> Target | None:
        return self._targets.get(serving) if isinstance(serving, str) else None

    def _last_shard(self, keys: Keys | None, meta: dict[str, str]) -> Keys | None:
        """When ``meta`` claims more than one shard, the keys of the last one: workers declare
        the count there too, and ``remember`` needs that hash (``confirmation``) to trust it."""
        count = claimed_shards(meta)
        return None if keys is None or count <= 1 else keys.last_shard(count)

    def _remember(
        self,
        serving: ServingRef,
        meta: dict[str, str],
        confirmation: dict[str, str] | None = None,
    ) -> Target:
        """The target for ``serving``, given the options its workers declared (maybe none)
        and, for a count of shards over 1, the last shard's meta hash (``last_shard``)."""
        target = self._target_for(serving, meta.get("codec"))
        target.traced = tracing.AVAILABLE and self._reads_trace(target.keys.name, meta)
        if meta:
            target.keeps_jobs = "job_keep" in meta.get(tracing.HEADER_FIELDS, "").split(",")
        if target.serving is not None:
            target.batch_size = target.serving.batch_size
            target.hooks = target.serving.hooks is not None
            target.durable = target.serving.durable
            target.spread = self._spread(target.keys, target.serving.shards)
        elif meta:
            declared = parse_declared(meta, target.keys)
            target.max_payload_bytes = declared.get("max_payload_bytes")
            target.idempotency_ttl = declared.get("idempotency_ttl")
            target.cache_ttl, target.cache_version = declared_cache(declared)
            target.key_rule = declared_rule(meta, target.keys)
            target.batch_size = declared.get("batch_size")
            target.hooks = declared.get("streaming", False)
            target.durable = declared.get("durable", False)
            target.spread = self._spread(
                target.keys,
                confirmed_shards(target.keys, declared.get("shards", 1), confirmation or {}),
            )
        if isinstance(serving, str) and "codec" in meta:
            self._targets[serving] = target
        self._table.accept(target.codec)
        return target

    def _reads_trace(self, name: str, meta: dict[str, str]) -> bool:
        """Whether serving ``name``'s workers read trace context; learnt once a worker has
        declared the serving (``meta`` holds its codec), from then on without a round trip."""
        known = self._traced.get(name)
        if known is None:
            known = reads_trace(meta)
            if "codec" in meta:
                self._traced[name] = known
        return known

    def _spread(self, keys: Keys, count: int) -> ShardSpread:
        """This client's ShardSpread of a serving (one per shard count it was told)."""
        spread = self._spreads.get(keys.name)
        if spread is None or len(spread.shards) != count:
            spread = self._spreads[keys.name] = ShardSpread(keys, count)
        return spread

    def _target_for(self, serving: ServingRef, meta_codec: str | None) -> Target:
        if isinstance(serving, Serving):
            return Target(
                self._keys_of(serving.name),
                get_codec(serving.codec),
                serving,
                serving.max_queue,
                serving.max_payload_bytes,
            )
        if not isinstance(serving, str):
            raise TypeError(f"serving must be a name or a qs.Serving, got {serving!r}")
        codec = meta_codec or "msgpack"
        if codec != "msgpack" and codec != self._trusted_codec:
            raise BadRequest(
                f"serving {serving!r} is declared with codec {codec!r} in Redis, which a client "
                "does not take on trust when it names a serving: anyone who can write to Redis "
                f"could have set it, and decoding {codec} can run code. Pass the qs.Serving "
                f"object to dispatch, or create the client with codec={codec!r} if you trust "
                "every writer of this Redis"
            )
        return Target(self._keys_of(serving), get_codec(codec), None, 0, None)


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
