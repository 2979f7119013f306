"""The sync client's outbox: its queue of requests, combined sends (a caller that finds no send
in progress sends its own request and every one queued meanwhile, in one Lua call), the sender
thread, and the durable sender that waits for replicas apart from the other servings' sends.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from typing import Any

from queueserve.broker.producer import Producer
from queueserve.broker.retry import Retry
from queueserve.client.calls import Call, check_placed, unsent
from queueserve.client.core import CallSpec, ClientCore
from queueserve.client.job_part import JobPart
from queueserve.client.outgoing import Outgoing, enqueue_groups, send_window
from queueserve.client.target_table import ServingRef
from queueserve.client.targets import Part, Target
from queueserve.errors import NotReplicated, QueueServeError
from queueserve.wire.timing import RECONNECT_WITHIN_S

_SENT_POLL_S = 0.0005  # another thread is sending this job: its send takes a round trip


class Outbox:
    """``Client``'s planning and sending: ``target``, ``send``, ``withdraw``, ``until_sent``;
    its sender threads."""

    def __init__(self, core: ClientCore, broker: Producer, jobs: JobPart) -> None:
        self._core = core
        self._plan, self._cached = core.plan, core.targets.cached  # bound once: every submit's
        self._broker = broker
        self._jobs = jobs
        self.closed = False
        self._lock = threading.Lock()
        self._box: list[Outgoing] = []
        self.flushing = False
        self._sender: threading.Thread | None = None
        self._wake_sender = threading.Event()
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) on a thread
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_sender: threading.Thread | None = None
        self._wake_durable = threading.Event()
        self._durable_retry = Retry(broker.outage, "durable sender")
        # Inline senders and the sender thread take turns (never two at once): one state.
        self._send_retry = Retry(broker.outage, "sender")

    def target(self, serving: ServingRef) -> Target:
        """The Target of ``serving``: the one the core keeps, or one planned from its meta hash
        (one read; two for a serving of several shards)."""
        targets = self._core.targets
        target = targets.cached(serving)
        if target is not None:
            return target
        keys = targets.meta_keys(serving)
        meta = self._broker.meta(keys) if keys else {}
        if targets.undeclared(keys, meta):
            assert keys is not None
            raise targets.unknown(keys.name, self._broker.servings(self._core.prefix))
        last = targets.last_shard(keys, meta)  # confirms a count of shards over 1
        return targets.remember(serving, meta, self._broker.meta(last) if last else None)

    def submit(
        self, serving: ServingRef, items: Iterable[Any], spec: CallSpec, inline: bool
    ) -> tuple[Target, list[Part], list[Outgoing]]:
        """Plan a call (its serving's ``target``, its requests: the core's ``plan``) and
        ``send`` it; what its ticket is made of."""
        target = self._cached(serving)  # a name known already: no call more per submit
        if target is None:
            target = self.target(serving)
        parts, outgoing = self._plan(target, items, spec)
        self.send(outgoing, inline)
        return target, parts, outgoing

    def send(self, outgoing: list[Outgoing], inline: bool) -> None:
        """Queue the requests of one call (together: one send carries them all); with
        ``inline`` (a caller that will wait anyway) send them now from this thread, with
        everything queued meanwhile, unless another thread is sending."""
        with self._lock:
            self._box += outgoing
            if self.flushing:
                return  # the thread flushing now sends it too
            if not inline:
                if not self._wake_sender.is_set():  # set() takes a lock even when set
                    self._wake_sender.set()
                return
            self.flushing = True
        self._flush()

    def withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (taken out of the outbox before it was
        sent, or out of its stream, or its pack, before a worker read it)."""
        with self._lock:
            withdrawn = self._core.withdrawn(call, self._box, self._durable_box)
        return withdrawn if withdrawn is not None else self._withdraw_sent(call)

    def _withdraw_sent(self, call: Call) -> bool:
        """Cancel ``call`` in Redis; False for one still on its way, which its send withdraws
        once its entry id is back (``_enqueue``)."""
        if call.keep_ms:  # a job: its record ends cancelled first, and keeps no answer
            self._jobs.cancel(call)
        place = self._core.cancel_place(call)
        return place is not None and self._broker.cancel(*place)

    def until_sent(self, calls: list[Call]) -> None:
        """Return once the jobs of ``calls`` are enqueued (with their records), sending what
        is queued from this thread if no one is sending; RedisUnavailable when they are still
        being sent after RECONNECT_WITHIN_S (a send that fails fails its calls)."""
        with self._lock:
            mine = not self.flushing and bool(self._box)
            self.flushing = self.flushing or mine
        if mine:
            self._flush()
        end = time.monotonic() + RECONNECT_WITHIN_S
        while unsent(calls) and time.monotonic() < end:
            time.sleep(_SENT_POLL_S)
        check_placed(calls, RECONNECT_WITHIN_S)

    def start(self) -> None:
        """Start the sender thread, which sends what ``send`` queued without ``inline``."""
        self._sender = threading.Thread(
            target=self._sender_loop,
            name=f"queueserve-send-{self._core.client_id}",
            daemon=True,
        )
        self._sender.start()

    def close(self) -> None:
        """Send what is still queued; the sender threads end (``join`` waits for them)."""
        with self._lock:
            unsent = bool(self._box) and not self.flushing
            self.flushing = self.flushing or unsent
        if unsent:
            self._flush()
        self.closed = True

    def join(self) -> None:
        """Wait for the sender threads to end, and send what the durable one left."""
        if self._sender is not None:
            self._wake_sender.set()
            self._sender.join(timeout=5)
        if self._durable_sender is not None:
            self._wake_durable.set()
            self._durable_sender.join(timeout=5)
            with self._lock:
                left, self._durable_box = self._durable_box, []
            if left:  # set aside by the flush above, after the durable sender's last look
                self._send_batch(left, self._durable_retry)

    def _sender_loop(self) -> None:
        while not self.closed:
            self._wake_sender.wait(1.0)
            self._wake_sender.clear()
            with self._lock:
                if self.flushing or not self._box:
                    continue
                self.flushing = True
            self._flush()

    def _flush(self) -> None:
        while True:
            with self._lock:
                batch, self._box = self._box, []
                if not batch:
                    self.flushing = False
                    return
            try:
                batch = self._set_aside_durable(batch)
                if batch:
                    self._send_batch(batch, self._send_retry)
            except BaseException:
                with self._lock:
                    self.flushing = False
                raise

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable sender."""
        durable = [o for o in batch if o.target.durable]
        if not durable:
            return batch
        with self._lock:
            self._durable_box += durable
            if self._durable_sender is None:
                self._durable_sender = threading.Thread(
                    target=self._durable_loop,
                    name=f"queueserve-send-durable-{self._core.client_id}",
                    daemon=True,
                )
                self._durable_sender.start()
        self._wake_durable.set()
        return [o for o in batch if not o.target.durable]

    def _durable_loop(self) -> None:
        while not self.closed:
            self._wake_durable.wait(1.0)
            self._wake_durable.clear()
            with self._lock:
                batch, self._durable_box = self._durable_box, []
            if batch:
                self._send_batch(batch, self._durable_retry)

    def _send_batch(self, batch: list[Outgoing], retry: Retry) -> None:
        """Enqueue ``batch``, retrying transient failures; its callers get any error."""
        tries = itertools.count()  # a send tried again may find its jobs written (or ended)
        try:
            retry.run(
                lambda: self._enqueue(batch, next(tries) > 0),
                keep_going=lambda: not self.closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except Exception as e:
            self._core.send_failed(batch, e)

    def _enqueue(self, batch: list[Outgoing], again: bool = False) -> None:
        core = self._core
        for group, keys, requests, max_queue, durable, together in enqueue_groups(batch):
            jobs, onces, caches = core.marks(keys, group)
            try:
                reply = self._broker.enqueue(
                    keys,
                    requests,
                    max_queue,
                    durable=durable,
                    jobs=jobs,
                    together=together,
                    again=again,
                    onces=onces,
                    caches=caches,
                )
            except NotReplicated as e:  # queued, but not safe: these callers are told so
                core.fail_batch(group, e)
                continue
            follow, cancelled = core.admit(group, reply)
            if follow:
                self._jobs.follow(follow)
            for call in cancelled:  # not retried with the send: it is in Redis now
                try:
                    self._withdraw_sent(call)
                except QueueServeError as e:
                    core.withdraw_failed(call, e)
