"""One serving inside one partition: read, assemble, execute, reply, ack.

Threads, so that Redis I/O overlaps the batch function:

    reader     read.lua (XREADGROUP over the ready streams) / reclaim -> Intake -> Assembler
               (about max_concurrent_batches + 1 batches waiting beyond those running;
               reader.py, one per shard)
    preparers  Assembler -> prepare_batch (prepare_concurrency of them; servings with one)
    executors  -> batch function (max_concurrent_batches of them, default 1; see stages.py)
    replier    finish_batch, rows -> RPUSH to each caller's inbox + XACK/XDEL, one round trip
    cancels    the serving's cancel channel -> the ledger

What they share is in the ledger (ledger.py: held entries and cancels, under the one lock).
Executors touch Redis only when they would otherwise idle: an executor with nothing to run
takes the reader's blocking read (lease.py) and sends its own batch's reply when nothing
else is queued (``_hand_over``), so an idle worker answers from one thread, with no hand-off
between threads; busy, the device never waits on Redis. A partition holds at most
max_concurrent_batches running batches, prepare_concurrency + 1 batches prepared ahead of them
and about one more batch waiting each, over all batch keys, so a crash strands little and other
workers share the load. A step serving runs instead under one step executor
(step_executor.py). A pub/sub listener learns of requests cancelled after they were read.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from queueserve.broker.consumer import Consumer
from queueserve.broker.held import held_elsewhere
from queueserve.broker.reads import PendingRead
from queueserve.broker.replies import CacheWrites
from queueserve.broker.retry import RedisFailure, Retry
from queueserve.serving import Partition, Serving
from queueserve.steps import StepServing
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys
from queueserve.wire.tenants import split_lane
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.affinity import HELD_FIELD, Affinity
from queueserve.worker.pipeline.batching import Assembler, Slice, TakenBatch
from queueserve.worker.pipeline.cancels import CancelListener
from queueserve.worker.pipeline.execute import Row
from queueserve.worker.pipeline.intake import Intake
from queueserve.worker.pipeline.ledger import Ledger
from queueserve.worker.pipeline.reader import Reader
from queueserve.worker.pipeline.replies import Composed, ReplyQueue, compose
from queueserve.worker.pipeline.stages import Handover, Reply, Stages
from queueserve.worker.stepping.executor import StepExecutor
from queueserve.worker.stepping.joins import StepQueue
from queueserve.worker.watchdog import run_guarded

log = logging.getLogger(__name__)

INBOX_TTL_MS = 600_000  # an inbox outlives a client that died by ten minutes at most


class ServingRunner:
    """Serves one serving from one partition process."""

    def __init__(
        self,
        serving: Serving,
        broker: Consumer,
        prefix: str,
        consumer: str,
        partition: Partition,
        *,
        batch_keys: tuple[str, ...] = (),
        max_concurrent_batches: int = 1,
        middleware: Middleware | None = None,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_fatal = on_fatal
        # Our own copy: run-time config changes it, and the caller's object stays as it was.
        self.serving = serving = copy.copy(serving)
        self.middleware = middleware or Middleware()
        self.broker = broker
        self.keys = Keys(prefix, serving.name)
        self.shards = self.keys.sharded(serving.shards)  # shard 0 is self.keys
        self.consumer = consumer
        self.partition = partition
        self.ledger = Ledger()
        self.outbox = ReplyQueue()
        intake = Intake(
            serving, get_codec(serving.codec), self.keys, broker, consumer, self.middleware
        )
        self.codec = intake.codec
        # A step serving's requests wait in a StepQueue (the reader fills it like an
        # Assembler) and run under continuous batching, by one StepExecutor.
        self.assembler: Assembler | StepQueue
        if isinstance(serving, StepServing):
            self.assembler = StepQueue(serving.batch_size)
        else:
            # the reader tunes it from the serving's options (reader._tune_assembler)
            self.assembler = Assembler(serving.batch_size, serving.batch_timeout)
        step = isinstance(serving, StepServing)
        self.executors = 1 if step else max_concurrent_batches
        # An idle worker's blocking read is done by the thread that will run what it brings
        # (lease.py). One shard only: a taker blocks on one shard's wake stream.
        self.reader = Reader(
            serving,
            broker,
            self.shards,
            consumer,
            intake,
            self.ledger,
            self.assembler,
            self.outbox,
            executors=self.executors,
            declared_keys=tuple(dict.fromkeys(("default", *batch_keys))),
            lends=len(self.shards) == 1 and not step,
            batch_s=lambda: self.stages.recent_batch_s,
        )
        self.lease = self.reader.lease
        self.stepper: StepExecutor | None = None
        if isinstance(self.assembler, StepQueue):
            self.stepper = StepExecutor(
                serving,
                self.assembler,
                self.ledger,
                self.outbox,
                broker,
                consumer,
                partition,
                self.middleware,
                reading=lambda: self.reading,
            )
        self.threads: list[threading.Thread] = []
        self.cancels = CancelListener(serving.name, broker, self.shards, self.ledger)
        self._reply_retry = Retry(broker.outage, f"serving {serving.name} replier")
        self.stages = Stages(
            serving,
            partition,
            self.middleware,
            self.ledger,
            take=self._next_batch,
            send=self._hand_over,
            count_delivery=self._count_delivery,
        )
        if isinstance(self.assembler, Assembler):
            self.stages.batch_times = self.assembler.batch_times
        self.affinity: Affinity | None = None  # with load_key: reads follow what is loaded
        states = self.stages.states
        if states is not None:
            waiting: Callable[[], AbstractSet[str]]
            if isinstance(self.assembler, Assembler):
                waiting = functools.partial(
                    waiting_keys, self.assembler, self.ledger.cond, self.stages
                )
                states.wanted = waiting  # (a step executor's KeyLoads tells its own)
            else:
                assert self.stepper is not None  # a StepQueue has its executor
                self.stepper.hold(states)  # load_key: the steps run with key states
                waiting = functools.partial(getattr, self.stepper.keys, "wanted")
            self.affinity = follow_loads(
                self.stages, self.assembler, waiting, lambda: self.serving.batch_size
            )

    @property
    def redis_threads(self) -> int:
        """This serving's threads that may each hold a Redis connection at once (the
        partition sizes its pool from them): a reader per shard, the replier, and the
        executors and preparers, or the stepper. Its cancel listener reads the partition's
        one shared pub/sub connection."""
        runners = 1 if self.stepper is not None else self.executors + self.stages.preparers
        return len(self.shards) + 1 + runners

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.reader.apply_config()
        self.reader.declaration.declare()
        self.broker.adopt_legacy_keys(self.keys)
        for keys in self.shards:
            for key in self.reader.declared_keys:  # so anyone may XADD to a declared key's stream
                self.broker.ensure_group(keys.stream(key))
        self.cancels.listen()
        roles: list[tuple[str, Callable[[], None]]] = [
            (f"reader{keys.shard or ''}", functools.partial(self.reader.loop, keys))
            for keys in self.shards
        ]
        roles.append(("replier", self._reply_loop))
        if self.stepper is not None:
            roles.append(("stepper", self.stepper.run))
        else:
            roles += [
                (f"preparer{i}", self.stages.prepare_loop) for i in range(self.stages.preparers)
            ]
            roles += [(f"executor{i}", self.stages.device_loop) for i in range(self.executors)]
        roles += [("cancels", self.cancels.loop)]  # last: join() stops it after the others
        for name, target in roles:
            t = threading.Thread(
                target=self._guarded,
                args=(name, target),
                name=f"queueserve-{self.serving.name}-p{self.partition.index}-{name}",
                daemon=True,
            )
            t.start()
            self.threads.append(t)

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies of a bug (or ends before a stop), the partition must
        not live on half-dead: ``on_fatal`` ends it, and its work is reclaimed by others or by
        its restart (watchdog.run_guarded)."""
        run_guarded(
            f"serving {self.serving.name} partition {self.partition.index}: {name}",
            loop,
            self.on_fatal,
            lambda: not self.reader.reading,
        )

    @property
    def reading(self) -> bool:
        """Still taking work in (False once draining for a stop and the last read is in:
        a read that began before the stop may bring entries after it)."""
        return not self.reader.ended

    def stop_reading(self) -> None:
        self.reader.stop()

    def join(self, timeout: float | None) -> bool:
        """Wait until everything held was executed and answered; False if time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Cancels matter until the last held batch ran: the listener stops after the others.
        *working, listener = self.threads
        for t in working:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.cancels.end()  # it ends within one read of its channel
        listener.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def held_field(self) -> dict[str, str]:
        """The keys whose state this serving holds here, for the partition's heartbeat record
        (affinity.py), a step serving's as a batch serving's; nothing without load_key."""
        if self.affinity is not None:
            return {HELD_FIELD + self.serving.name: "\n".join(self.affinity.held())}
        return {}

    def follow_holders(self) -> None:
        """Learn which keys the serving's other partitions hold (after each heartbeat)."""
        if self.affinity is not None:
            name = HELD_FIELD + self.serving.name
            self.affinity.follow(held_elsewhere(self.broker, self.keys, self.consumer, name, 256))

    # -- executor ----------------------------------------------------------------------------
    def _next_batch(self) -> tuple[TakenBatch, list[Slice]] | None:
        assert isinstance(self.assembler, Assembler)  # step servings run a StepExecutor
        reader, lease, cond = self.reader, self.lease, self.ledger.cond
        while True:
            with cond:
                while True:
                    now = time.monotonic()
                    chosen, wait = self.assembler.pick(now, flush=reader.flushing)
                    if chosen is not None:
                        batch = self.assembler.take(chosen, now)
                        cond.notify_all()  # room for the reader
                        return batch, self.ledger.withdraw_cancelled(batch)
                    if reader.ended and self.assembler.buffered == 0:
                        return None
                    wake_id = lease.borrow()
                    if wake_id is not None:
                        break
                    if lease.lends and self.assembler.buffered and 0 in lease.drained_at:
                        # A batch filling up until its timeout: the reader reads meanwhile.
                        lease.reader_wake.set()
                    cond.wait(wait)
            lease.read_lent(wake_id)

    def _count_delivery(self, piece: Slice) -> None:
        request = piece.request
        try:
            self.broker.count_delivery(request.stream, self.consumer, request.entry_id)
        except RedisFailure as e:
            log.warning("serving %s: could not count a redelivery: %s", self.serving.name, e)

    def _hand_over(self, item: Handover) -> None:
        """Give a batch's reply to the replier; or, when no batch waits to run, the last read
        left nothing unread and the replier has nothing to do, send it from this thread: the
        executor would idle meanwhile, and the answer leaves without waking another thread.
        With a backlog the replier sends, so the next batch never waits for a reply; and a
        serving with a finish stage always finishes on the replier, off the device's thread."""
        if (
            item is not None
            and self.reader.caught_up
            and not self.serving.has_finish
            and self.assembler.buffered == 0
            and self.outbox.claim()
        ):
            # A batch's answer, on the thread that takes the next batch itself (no preparers):
            # its next step is the lent read, so that goes in the same write (see _send).
            read_next = isinstance(item, Reply) and not self.stages.preparers
            pending = None
            try:
                pending = self._send(item if isinstance(item, list) else item.rows(), read_next)
            finally:
                self.outbox.done()
            if pending is not None:
                self.lease.read_lent(pending)
        else:
            self.outbox.put(item)

    # -- replier -----------------------------------------------------------------------------
    def _reply_loop(self) -> None:
        executors_left = self.executors  # each executor ends the outbox with None
        while executors_left:
            rows: list[Row] = []
            # Whatever is queued goes in the same round trip.
            for item in self.outbox.take():
                if item is None:
                    executors_left -= 1
                else:  # a Reply is split into rows here, off the device's thread
                    rows += item if isinstance(item, list) else item.rows()
            try:
                if rows:
                    self._send(rows)
            finally:
                self.outbox.done()

    def _send(self, rows: list[Row], read_next: bool = False) -> PendingRead | None:
        """Reply and ack. ``read_next``: when the reader's blocking read is free, borrow it and
        send it behind the reply, so Redis starts it as soon as the next request comes, while
        this thread still settles this reply; returned for ``lease.read_lent`` to finish."""
        out = compose(rows, self.codec, self.serving.max_reply_bytes, cache_limit(self.serving))
        lease = self.lease
        with self.ledger.cond:
            wake_id = lease.borrow() if read_next else None
            then_read = None if wake_id is None else lease.wake_read(wake_id)
        pending: PendingRead | None = None

        def attempt() -> None:
            nonlocal then_read, pending
            fused, then_read = then_read, None  # a retry sends the reply alone
            pending = self.broker.reply_and_ack(
                self.keys,
                out.messages,
                out.acks,
                INBOX_TTL_MS,
                out.events,
                durable=self.serving.durable,
                then_read=fused,
                jobs=out.jobs,
                cache=cache_writes(self.serving, out),
            )

        try:
            # Unacked work stays ours (our heartbeat holds it): retry until Redis takes it.
            self._reply_retry.run(attempt)
            settle(self.middleware, self.serving, self.ledger, out)
        except BaseException:
            if pending is not None:
                pending.abandon()  # what it read is taken back as forgotten (intake)
                pending = None
            raise
        finally:
            if wake_id is not None and pending is None:
                lease.give_back(wake_id)
        return pending


def follow_loads(
    stages: Stages,
    queue: Assembler | StepQueue,
    waiting: Callable[[], AbstractSet[str]],
    batch_size: Callable[[], int],
) -> Affinity:
    """Reads that follow what is loaded, for a serving with load_key (affinity.py): the marks
    of the keys ``stages`` holds into ``queue``'s reads (a batch serving's assembler, a step
    serving's queue), '*' while fewer of the keys whose work waits here (``waiting``) wait
    for a load than the partition loads at once."""
    states = stages.states
    assert states is not None
    affinity = Affinity(
        states.held,
        lambda: states.mean_load_s,
        lambda marks: setattr(queue, "affinity_marks", marks),
        batch_size,
        lambda: len(waiting() - states.loaded) < states.max_loading,  # (at each read)
    )
    stages.on_states = affinity.refresh
    return affinity


def waiting_keys(assembler: Assembler, cond: threading.Condition, stages: Stages) -> set[str]:
    """The batch keys whose work waits here to run (a serving with load_key): read and not
    yet taken (``cond``: the ledger's), or taken and not yet on the device."""
    with cond:
        keys = {split_lane(key)[0] for key in assembler.queues}
    return keys | stages.keys_ahead()


def cache_limit(serving: Serving) -> int:
    """The largest result a serving caches (wire/cache.py); 0: it caches none."""
    return serving.cache_max_bytes if serving.cache_ttl > 0 else 0


def cache_writes(serving: Serving, out: Composed) -> CacheWrites:
    """What ``out`` caches, with the serving's cache_ttl as it is now (``config set``)."""
    return CacheWrites(out.cached, out.too_big, int(serving.cache_ttl * 1000))


def settle(middleware: Middleware, serving: Serving, ledger: Ledger, out: Composed) -> None:
    """What a reply round trip tells the middleware and the ledger once Redis took it."""
    middleware.replied(serving, out.answered, len(out.finished), out.errors)
    if out.finished and middleware.wants("requests_answered"):
        middleware.requests_answered(serving, [ref[1] for ref in out.finished])
    ledger.settle(out.finished)
