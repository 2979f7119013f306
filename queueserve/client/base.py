"""What the sync and async clients share, without I/O: naming, request planning, map windows,
stream event pacing, reply delivery and error wording (as httpx shares ``BaseClient``).

Each client module keeps only its I/O: sending through its broker, waiting on its kind of
queue or future, and its threads or tasks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Generic, TypeVar

from queueserve.broker.urls import redact_url
from queueserve.client.calls import Call, CallTable, outcome
from queueserve.client.events import RequestStream
from queueserve.client.progress import Progress, ProgressCallback, total_of
from queueserve.errors import BadRequest, Cancelled, QueueFull, QueueServeError, RedisUnavailable
from queueserve.hooks import Event
from queueserve.serving import Serving
from queueserve.settings import Settings, check_prefix, check_redis_url, check_timeout
from queueserve.wire import protocol as P
from queueserve.wire.codec import Codec, get_codec
from queueserve.wire.request import encode_request
from queueserve.wire.options import parse_declared
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S

log = logging.getLogger("queueserve.client")

# How long a stream waits, after a request's answer, for events the answer says were sent.
STREAM_GRACE = 0.5
INBOX_BLOCK_S = 1.0  # a blocked inbox read returns this often, so a closed client is seen
# How long a call waits before the client asks whether any worker serves it (and warns if not).
UNSERVED_WARN_AFTER = 10.0


ServingRef = str | Serving


# A send of more items than this is split over the shards (one script call per shard it
# reaches); a smaller one goes whole to one shard, in one script call.
SPLIT_SEND_ABOVE = 128


class ShardSpread:
    """The items one client has sent to each shard of one serving, and where the next send
    goes: the shard with the fewest (ties taken in turn, from a random one: many clients
    that each started at shard 0 would load it most in short bursts).

    Counted here, so it costs no round trip (asking queue depths would cost one per send),
    and every worker reads every shard, so no shard waits without workers. Items, not sends,
    and a large send split: one send carries whatever its callers queued meanwhile, from 1 to
    hundreds of requests, and with one shard per send (in turn, or even the emptiest) a short
    run of large sends left one master with 45% of the items (bench/cluster.py). A send of up
    to SPLIT_SEND_ABOVE items stays one script call on one shard; a larger one costs one
    script call per shard, which its own size dwarfs."""

    def __init__(self, keys: P.Keys, count: int) -> None:
        self.shards = keys.sharded(count)
        self.sent = [0] * count
        self._turn = random.randrange(count)
        self._lock = threading.Lock()  # the async client's sends and a sync one's may overlap

    def _fewest(self, items: int) -> int:
        count = len(self.shards)
        i = min(range(count), key=lambda s: (self.sent[s], (s - self._turn) % count))
        self.sent[i] += items
        self._turn = (i + 1) % count
        return i

    def place(self, sizes: list[int]) -> list[int]:
        """The shard (index) of each request of one send, ``sizes`` being their items."""
        with self._lock:
            if sum(sizes) <= SPLIT_SEND_ABOVE:
                return [self._fewest(sum(sizes))] * len(sizes)
            return [self._fewest(n) for n in sizes]


@dataclass(slots=True)
class Target:
    """Where and how requests to one serving go."""

    keys: P.Keys
    codec: Codec
    serving: Serving | None  # given when the caller passed the Serving object
    max_queue: int  # admission limit to use until a worker has declared the serving
    max_payload_bytes: int | None  # known from the Serving object or the workers' declaration
    batch_size: int | None = None  # likewise; a streamed request holds at most this many items
    hooks: bool = False  # the serving streams hook events: its requests are never split
    durable: bool = False  # each enqueue waits for a replica (the serving's durable option)
    # Where its requests go: the serving's shards, shared by every Target of the serving
    # in this client (a caller passing the Serving object gets a new Target per call).
    spread: ShardSpread | None = None

    @property
    def shards(self) -> list[P.Keys]:
        return self.spread.shards if self.spread is not None else []

    def place(self, sizes: list[int]) -> list[P.Keys]:
        """The shard of each request of one send (``ShardSpread.place``)."""
        if self.spread is None or len(self.spread.shards) <= 1:
            return [self.keys] * len(sizes)
        return [self.spread.shards[i] for i in self.spread.place(sizes)]

    def check_payload(self, payload: bytes, n: int) -> None:
        """Refuse, before sending, a payload the workers would refuse."""
        if self.hooks and self.batch_size is not None and n > self.batch_size:
            raise BadRequest(
                f"serving {self.keys.name!r} streams events, so a request always runs in one "
                f"batch; this one has {n} items, more than batch_size={self.batch_size}: send "
                "smaller requests, or use client.stream, which chunks them"
            )
        limit = self.max_payload_bytes
        if limit is not None and len(payload) > limit:
            raise BadRequest(
                f"request of {n} items encodes to {len(payload)} bytes, over max_payload_bytes="
                f"{limit} of serving {self.keys.name!r}; send fewer or smaller items"
            )


@dataclass(slots=True)
class Part:
    """Items of one request: the caller's positions and the batch key they share."""

    batch_key: str
    positions: list[int] | None  # None = all items, in order
    items: list[Any]


class UnservedWatch:
    """Tells, once per serving per client, that a call is waiting on a serving no live worker
    serves: without a timeout such a call would otherwise wait in silence for ever."""

    def __init__(self, url: str, prefix: str) -> None:
        self.after = UNSERVED_WARN_AFTER
        self._url = url
        self._prefix = prefix
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def first_wait(self, serving: str, limit: float | None) -> float | None:
        """How long to wait before asking whether a worker is alive; None: do not ask (warned
        already, or the call's own limit comes first)."""
        if serving in self._warned or (limit is not None and limit <= self.after):
            return None
        return self.after

    def check(self, target: Target, alive: int | None) -> None:
        """Warn when ``alive`` (workers with a recent heartbeat; None: Redis did not say) is 0."""
        name = target.keys.name
        with self._lock:
            if alive != 0 or name in self._warned:
                return
            self._warned.add(name)
        url = redact_url(self._url)
        prefix = "" if self._prefix == "qs" else f" --prefix {self._prefix}"
        log.warning(
            "serving %r: a call has waited %gs and no worker is alive for it (none sent a "
            "heartbeat in the last %gs) on Redis %s, prefix %r. Start one with `queueserve "
            "worker module:attr --redis-url %s%s`; the call keeps waiting (pass timeout= or set "
            "QUEUESERVE_DEFAULT_TIMEOUT to bound calls)",
            name, self.after, ALIVE_WITHIN_S, url, self._prefix, url, prefix,
        )


class ClientBase:
    def __init__(self, url: str | None, prefix: str | None, codec: str | None = None) -> None:
        settings = Settings()
        # The codec a caller trusts for servings it names (None: msgpack only). Redis cannot
        # choose it: a codec read from a serving's meta hash was written by whoever can write
        # to Redis, and decoding pickle runs code.
        self.trusted_codec = None if codec is None else get_codec(codec).name
        self.url = check_redis_url(url or settings.redis_url)
        self.prefix = check_prefix(prefix) if prefix else settings.prefix
        self.default_timeout = settings.default_timeout
        self.unserved = UnservedWatch(self.url, self.prefix)
        self.client_id = uuid.uuid4().hex[:16]
        self.inbox = P.inbox_key(self.prefix, self.client_id)
        self.table = CallTable()
        self.events_channel = P.events_channel(self.prefix, self.client_id)
        self._targets: dict[str, Target] = {}
        # Key names per serving name: a serving object's call makes a new Target, whose keys
        # would otherwise be built again (some twenty strings) and kept by the call in flight.
        self._keys: dict[str, P.Keys] = {}
        self._spreads: dict[str, ShardSpread] = {}

    def timeout_for(self, timeout: float | None) -> float | None:
        """The call's timeout, checked (a mistake is reported now, not as a Timeout later);
        QUEUESERVE_DEFAULT_TIMEOUT when the call gives none."""
        checked = check_timeout(timeout)
        return self.default_timeout if checked is None else checked

    @property
    def shown_url(self) -> str:
        """The Redis URL as it may appear in logs and messages: without its password."""
        return redact_url(self.url)

    @property
    def owner(self) -> str:
        return f"queueserve client {self.client_id}"

    def closed_error(self, kind: str) -> QueueServeError:
        return QueueServeError(f"this client is closed; create a new qs.{kind}")

    def meta_keys(self, serving: ServingRef) -> P.Keys | None:
        """Keys whose meta hash to read before ``remember``: None when a serving object (or
        a cached name) says all there is to know."""
        return self.keys_of(serving) if isinstance(serving, str) else None

    def keys_of(self, name: str) -> P.Keys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = P.Keys(self.prefix, name)
        return keys

    def request(
        self, target: Target, part: Part, deadline: float | None, priority: int = 0,
        streamed: bool = False, reply_to: str | None = None,
    ) -> Outgoing:
        """A new call for ``part``, encoded and checked; what the sender sends. Its answer
        goes to the client's inbox, or to ``reply_to`` (a caller's own inbox)."""
        call = self.table.new(len(part.items), target.keys, part.batch_key, priority)
        call.deadline = deadline
        header, payload = encode_request(
            target.codec, call.rid, part.items, reply_to or self.inbox, deadline,
            self.events_channel if streamed else "", priority,
        )
        try:
            target.check_payload(payload, call.n)
        except BadRequest:
            self.table.forget(call)
            raise
        return (target, part.batch_key, call, header, payload)

    def streamed_request(
        self, target: Target, offset: int, part: Part, deadline: float | None,
        put: Callable[[Any], object], priority: int = 0,
    ) -> tuple[RequestStream, Outgoing]:
        """A request of ``stream``: its events and its end (None) go to ``put``."""
        outgoing = self.request(target, part, deadline, priority, streamed=True)
        call = outgoing[2]

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

    def fail_batch(self, batch: list[Outgoing], error: QueueServeError) -> None:
        for _, _, call, _, _ in batch:
            self.table.forget(call)
            call.fail(error)

    def fail_send(self, batch: list[Outgoing], error: Exception) -> None:
        """A send stopped by something other than a queueserve error (a bug): its callers are
        told at once, and the thread that sends lives on to send the next requests."""
        log.error("sending %d requests failed unexpectedly", len(batch), exc_info=error)
        failed = QueueServeError(
            f"the request could not be sent: {type(error).__name__}: {error} (a bug in queueserve "
            "or in something it called; the client keeps working)"
        )
        failed.__cause__ = error
        self.fail_batch(batch, failed)

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

    def cached(self, serving: ServingRef) -> Target | None:
        return self._targets.get(serving) if isinstance(serving, str) else None

    def last_shard(self, keys: P.Keys | None, meta: dict[str, str]) -> P.Keys | None:
        """When ``meta`` claims more than one shard, the keys of the last one: workers declare
        the count there too, and ``remember`` needs that hash (``confirmation``) to trust it."""
        count = _claimed_shards(meta)
        return None if keys is None or count <= 1 else keys.last_shard(count)

    def remember(
        self, serving: ServingRef, meta: dict[str, str],
        confirmation: dict[str, str] | None = None,
    ) -> Target:
        """The target for ``serving``, given the options its workers declared (maybe none)
        and, for a count of shards over 1, the last shard's meta hash (``last_shard``)."""
        target = self._target_for(serving, meta.get("codec"))
        if target.serving is not None:
            target.batch_size = target.serving.batch_size
            target.hooks = target.serving.hooks is not None
            target.durable = target.serving.durable
            target.spread = self._spread(target.keys, target.serving.shards)
        elif meta:
            declared = parse_declared(meta, target.keys)
            target.max_payload_bytes = declared.get("max_payload_bytes")
            target.batch_size = declared.get("batch_size")
            target.hooks = declared.get("streaming", False)
            target.durable = declared.get("durable", False)
            target.spread = self._spread(target.keys, _confirmed_shards(
                target.keys, declared.get("shards", 1), confirmation or {}))
        if isinstance(serving, str) and "codec" in meta:
            self._targets[serving] = target
        self.table.accept(target.codec)
        return target

    def _spread(self, keys: P.Keys, count: int) -> ShardSpread:
        """This client's ShardSpread of a serving (one per shard count it was told)."""
        spread = self._spreads.get(keys.name)
        if spread is None or len(spread.shards) != count:
            spread = self._spreads[keys.name] = ShardSpread(keys, count)
        return spread

    def _target_for(self, serving: ServingRef, meta_codec: str | None) -> Target:
        if isinstance(serving, Serving):
            return Target(
                self.keys_of(serving.name),
                get_codec(serving.codec),
                serving,
                serving.max_queue,
                serving.max_payload_bytes,
            )
        if not isinstance(serving, str):
            raise TypeError(f"serving must be a name or a qs.Serving, got {serving!r}")
        codec = meta_codec or "msgpack"
        if codec != "msgpack" and codec != self.trusted_codec:
            raise BadRequest(
                f"serving {serving!r} is declared with codec {codec!r} in Redis, which a client "
                "does not take on trust when it names a serving: anyone who can write to Redis "
                f"could have set it, and decoding {codec} can run code. Pass the qs.Serving "
                f"object to dispatch, or create the client with codec={codec!r} if you trust "
                "every writer of this Redis"
            )
        return Target(self.keys_of(serving), get_codec(codec), None, 0, None)

    @staticmethod
    def priority(value: object) -> int:
        """``priority=`` of a dispatch method, checked before anything is sent."""
        return P.check_priority(value)

    @staticmethod
    def plan(target: Target, items: list[Any], batch_key: str | None) -> list[Part]:
        """Apply the serving's map_inputs and group items by batch key (one request per key)."""
        if not items:
            return []  # nothing to send; the caller gets [] at once
        serving = target.serving
        if serving is None:
            return [Part(batch_key or "default", None, items)]
        if serving.has_client_maps:
            items = [serving.prepare_item(x) for x in items]
        if batch_key is not None or not callable(serving.batch_key):
            return [Part(serving.key_for(None, batch_key), None, items)]
        groups: dict[str, Part] = {}
        for i, item in enumerate(items):
            key = serving.key_for(item, None)
            part = groups.get(key)
            if part is None:
                part = groups[key] = Part(key, [], [])
            assert part.positions is not None
            part.positions.append(i)
            part.items.append(item)
        if len(groups) == 1:
            only = next(iter(groups.values()))
            return [Part(only.batch_key, None, only.items)]
        return list(groups.values())

    @staticmethod
    def stream_parts(
        target: Target, items: list[Any], batch_key: str | None
    ) -> list[tuple[int, Part]]:
        """Requests for ``stream``: runs of consecutive items with one batch key, at most
        batch_size each (streamed requests are never split), with their input offsets."""
        serving = target.serving
        if serving is not None and serving.has_client_maps:
            items = [serving.prepare_item(x) for x in items]
        size = target.batch_size or max(1, len(items))
        parts: list[tuple[int, Part]] = []
        for i, item in enumerate(items):
            key = serving.key_for(item, batch_key) if serving else batch_key or "default"
            last = parts[-1][1] if parts else None
            if last is None or last.batch_key != key or len(last.items) >= size:
                parts.append((i, Part(key, None, [])))
            parts[-1][1].items.append(item)
        return parts

    @staticmethod
    def full_message(target: Target, limit: int, queued: int, n: int, shard: int = 0) -> str:
        where = f" (shard {shard} of {len(target.shards)}; max_queue counts per shard)" if (
            len(target.shards) > 1) else ""
        return (
            f"serving {target.keys.name!r} is full{where}: {queued} items queued, "
            f"max_queue={limit}, this request has {n}; retry later, add workers, or raise "
            "max_queue"
        )

    @staticmethod
    def timeout_message(target: Target, timeout: float | None, alive: int | None) -> str:
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


def _claimed_shards(meta: dict[str, str]) -> int:
    """The shard count ``meta`` claims, unchecked but for being one (``remember`` logs a bad
    one); 1 when it claims none."""
    try:
        return P.check_shards(int(meta.get("shards") or 1))
    except ValueError:
        return 1


def _confirmed_shards(keys: P.Keys, count: int, confirmation: dict[str, str]) -> int:
    """``count`` when the last shard's meta hash says the same; else 1, with a warning.

    A count that no worker declared would send requests to shards no worker reads, where
    they wait for ever; one write to shard 0's meta hash (a stray HSET, a script, a test
    against the wrong Redis) would be enough. Workers declare the count on their last shard
    too (ServingRunner.start), and a client sends to the shards only when both agree: shard 0
    alone is always safe, as every worker reads it.
    """
    if count <= 1 or confirmation.get("shards") == str(count):
        return count
    log.warning(
        "serving %s: its meta hash %s says shards=%d, but the last shard's (%s) says %r, so "
        "no worker declared it; sending to shard 0 only (restart a worker of the serving to "
        "declare its shards again)", keys.name, keys.meta, count, keys.last_shard(count).meta,
        confirmation.get("shards"),
    )
    return 1


Outgoing = tuple[Target, str, Call, bytes, bytes]  # target, batch key, call, header, payload


def by_serving(batch: list[Outgoing]) -> list[list[Outgoing]]:
    """Requests grouped per serving: one enqueue script call each (one Cluster slot)."""
    groups: dict[str, list[Outgoing]] = {}
    for out in batch:
        groups.setdefault(out[0].keys.name, []).append(out)
    return list(groups.values())


def admitted(
    table: CallTable, group: list[Outgoing], limit: int, queued: int, ids: list[Any]
) -> None:
    """Record what enqueue.lua answered: an entry id per admitted request, QueueFull for the
    rest."""
    target = group[0][0]
    for (_, _, call, _, _), entry_id in zip(group, ids, strict=True):
        if entry_id == 0:
            table.forget(call)
            call.fail(QueueFull(
                ClientBase.full_message(target, limit, queued, call.n, call.keys.shard)
            ))
        else:
            call.entry_id = entry_id


def send_window(batch: list[Outgoing]) -> float:
    """How long sending ``batch`` may keep retrying: RECONNECT_WITHIN_S, or less when a
    request's deadline comes sooner (its caller is owed an answer by then, even an error)."""
    deadlines = [c.deadline for _, _, c, _, _ in batch if c.deadline is not None]
    if not deadlines:
        return RECONNECT_WITHIN_S
    return max(0.0, min(RECONNECT_WITHIN_S, min(deadlines) - time.time()))


def enqueue_groups(batch: list[Outgoing]) -> Iterator[tuple[list[Outgoing], P.Keys, list[Any],
                                                            int, bool]]:
    """Per serving and shard: the requests of ``batch``, the keys of the shard they go to,
    enqueue arguments, max_queue (per shard) and whether the enqueue must wait for a replica.

    Each is one script call (one Cluster slot). A small send of a serving goes whole to the
    shard this client has sent the fewest items; a large one is spread over the shards
    (``ShardSpread``)."""
    for group in by_serving(batch):
        target = group[0][0]
        for shard, outs in _by_shard(target, group):
            requests = []
            for _, key, call, h, p in outs:
                call.keys = shard  # where the request lives: cancel finds it there
                requests.append((key, call.n, h, p, call.priority))
            yield outs, shard, requests, target.max_queue, target.durable


def _by_shard(target: Target, group: list[Outgoing]) -> list[tuple[P.Keys, list[Outgoing]]]:
    """One send's requests of a serving by the shard they go to; with one shard (the common
    case) all to its keys, without per-request work on the client's hot path."""
    if len(target.shards) <= 1:
        return [(target.keys, group)]
    per_shard: dict[int, tuple[P.Keys, list[Outgoing]]] = {}
    for out, shard in zip(group, target.place([o[2].n for o in group]), strict=True):
        per_shard.setdefault(shard.shard, (shard, []))[1].append(out)
    return list(per_shard.values())


TicketT = TypeVar("TicketT")


class MapWindow(Generic[TicketT]):
    """``map``'s bookkeeping: the chunks to send next and the tickets in flight, oldest first."""

    def __init__(
        self, items: Iterable[Any], chunk_size: int, max_in_flight: int, progress: bool,
        on_progress: ProgressCallback | None,
    ) -> None:
        if chunk_size < 1 or max_in_flight < 1:
            raise ValueError(
                f"chunk_size and max_in_flight must be >= 1, got {chunk_size} and "
                f"{max_in_flight}"
            )
        self.meter = Progress(total_of(items), progress, on_progress)
        self._items = iter(items)
        self._chunk_size = chunk_size
        self._max = max_in_flight
        self.in_flight: deque[TicketT] = deque()

    def chunks(self) -> Iterator[list[Any]]:
        """Chunks to submit now (append each ticket to ``in_flight`` before the next)."""
        while len(self.in_flight) < self._max:
            chunk = list(islice(self._items, self._chunk_size))
            if not chunk:
                return
            yield chunk

    def done(self, results: list[Any]) -> list[Any]:
        self.meter.advance(len(results))
        return results


class StreamPacer:
    """When ``stream`` waits for one request's events, and when it stops: until its answer
    (or the deadline), then up to STREAM_GRACE for events the answer says are on their way."""

    def __init__(self, rs: RequestStream, deadline: float | None) -> None:
        self.rs = rs
        self.deadline = deadline
        self.grace_end: float | None = None  # set once the answer came

    def wait(self) -> float | None:
        """Seconds to wait for the next event (None: no limit); negative: stop waiting."""
        if self.grace_end is None:
            return None if self.deadline is None else max(0.0, self.deadline - time.time())
        if not self.rs.waiting_for_events:
            return -1.0
        return self.grace_end - time.monotonic()

    def take(self, event: Any) -> list[Event]:
        """Events ready after ``event`` (None marks the answer)."""
        if event is None:
            self.grace_end = time.monotonic() + STREAM_GRACE
            return []
        return self.rs.add(*event)

    def timed_out(self) -> bool:
        """Waiting ran out: True when the answer never came (the caller gets Timeout)."""
        if self.grace_end is None:
            return True
        self.grace_end = time.monotonic()  # the grace period is over
        return False

    def finish(self) -> tuple[list[Event], QueueServeError | None]:
        return self.rs.complete()



def kept_parts(parts: list[Part]) -> list[Part] | None:
    """What a ticket keeps of its parts: None when one request holds all the items in order,
    its results as they come (a ticket in flight keeps fewer objects for the collector)."""
    return None if len(parts) == 1 and parts[0].positions is None else parts


def collect(
    target: Target, parts: list[Part] | None, calls: list[Call], return_exceptions: bool
) -> list[Any]:
    """Results of finished calls, back in the caller's item order, through map_results;
    ``parts`` as ``kept_parts`` gives them."""
    if parts is None:  # one request: results as they came
        results = outcome(calls[0], return_exceptions)
    else:
        results = [None] * sum(len(p.items) for p in parts)
        for part, call in zip(parts, calls, strict=True):
            assert part.positions is not None
            for pos, r in zip(part.positions, outcome(call, return_exceptions), strict=True):
                results[pos] = r
    serving = target.serving
    if serving is not None and serving.has_client_maps:
        return [r if isinstance(r, QueueServeError) else serving.finish_result(r) for r in results]
    return results
