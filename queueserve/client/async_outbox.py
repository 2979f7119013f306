"""The asyncio client's outbox: its queue of requests, combined sends (the task that finds no
send in progress sends everything queued, in one Lua call), and the durable task that waits for
replicas apart from the other servings' sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterable
from typing import Any

from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.retry import Retry
from queueserve.client.calls import Call, check_placed, unsent
from queueserve.client.core import CallSpec, ClientCore
from queueserve.client.job_part import AsyncJobPart
from queueserve.client.outgoing import Outgoing, enqueue_groups, send_window
from queueserve.client.target_table import ServingRef
from queueserve.client.targets import Part, Target
from queueserve.errors import NotReplicated, QueueServeError
from queueserve.wire.timing import RECONNECT_WITHIN_S


class AsyncOutbox:
    """``AsyncClient``'s planning and sending: ``target``, ``send``, ``withdraw``,
    ``until_sent``; its durable task."""

    def __init__(self, core: ClientCore, broker: AsyncProducer, jobs: AsyncJobPart) -> None:
        self._core = core
        self._plan, self._cached = core.plan, core.targets.cached  # bound once: every submit's
        self._broker = broker
        self._jobs = jobs
        self.closed = False
        self._send_retry = Retry(broker.outage, "sender")
        self._box: list[Outgoing] = []
        self.flushing = False
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) in a task
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_task: asyncio.Task[None] | None = None
        self._durable_retry = Retry(broker.outage, "durable sender")
        self._send_waiters: list[asyncio.Future[None]] = []  # woken as each send ends

    async def target(self, serving: ServingRef) -> Target:
        """The Target of ``serving`` (``Outbox.target``)."""
        targets = self._core.targets
        target = targets.cached(serving)
        if target is not None:
            return target
        keys = targets.meta_keys(serving)
        meta = await self._broker.meta(keys) if keys else {}
        if targets.undeclared(keys, meta):
            assert keys is not None
            raise targets.unknown(keys.name, await self._broker.servings(self._core.prefix))
        last = targets.last_shard(keys, meta)  # confirms a count of shards over 1
        return targets.remember(serving, meta, await self._broker.meta(last) if last else None)

    async def submit(
        self, serving: ServingRef, items: Iterable[Any], spec: CallSpec
    ) -> tuple[Target, list[Part], list[Call], list[asyncio.Future[None]]]:
        """Plan a call (its serving's ``target``, its requests: the core's ``plan``) and
        ``send`` it; what its ticket is made of, with a future per request, done when its
        call ends."""
        # A coroutine costs per call: a name known already is taken without one, and the
        # requests are queued as ``send`` does, inline.
        target = self._cached(serving)
        if target is None:
            target = await self.target(serving)
        parts, requests = self._plan(target, items, spec)
        loop = asyncio.get_running_loop()
        calls, futures = [], []
        for outgoing in requests:
            future: asyncio.Future[None] = loop.create_future()
            outgoing.call.on_done = lambda _c, f=future: f.done() or f.set_result(None)
            calls.append(outgoing.call)
            futures.append(future)
        self._box += requests
        if not self.flushing:
            await self._flush()
        return target, parts, calls, futures

    async def send(self, outgoing: list[Outgoing]) -> None:
        """Queue the requests of one call, and send everything queued unless a task is
        sending (it sends these too)."""
        self._box += outgoing
        if not self.flushing:
            await self._flush()

    async def withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (see ``Outbox.withdraw``)."""
        withdrawn = self._core.withdrawn(call, self._box, self._durable_box)
        return withdrawn if withdrawn is not None else await self._withdraw_sent(call)

    async def _withdraw_sent(self, call: Call) -> bool:
        """As ``Outbox._withdraw_sent``."""
        if call.keep_ms:  # a job: its record ends cancelled first, and keeps no answer
            await self._jobs.cancel(call)
        place = self._core.cancel_place(call)
        return place is not None and await self._broker.cancel(*place)

    async def until_sent(self, calls: list[Call]) -> None:
        """Return once ``calls`` are enqueued, or failed: sending what is queued if no task is
        sending, else waiting for the sends under way to end; RedisUnavailable when they are
        still being sent after RECONNECT_WITHIN_S (a send that fails fails its calls; so does
        one that gives up retrying)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + RECONNECT_WITHIN_S
        while unsent(calls):
            if not self.flushing and self._box:
                await self._flush()
                continue
            left = end - loop.time()
            if left <= 0:
                break
            sent = loop.create_future()
            self._send_waiters.append(sent)
            await asyncio.wait((sent,), timeout=left)
        check_placed(calls, RECONNECT_WITHIN_S)

    async def close(self) -> None:
        """Stop sending: the durable task ends (what it held is not sent)."""
        self.closed = True
        if self._durable_task is not None:
            self._durable_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._durable_task, 2.0)

    async def _flush(self) -> None:
        self.flushing = True
        try:
            while self._box:
                batch, self._box = self._box, []
                batch = self._set_aside_durable(batch)
                if batch:
                    await self._send_batch(batch, self._send_retry)
        finally:
            self.flushing = False

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable task."""
        durable = [o for o in batch if o.target.durable]
        if not durable:
            return batch
        self._durable_box += durable
        if self._durable_task is None or self._durable_task.done():
            self._durable_task = asyncio.get_running_loop().create_task(
                self._send_durable(), name=f"queueserve-send-durable-{self._core.client_id}"
            )
        return [o for o in batch if not o.target.durable]

    async def _send_durable(self) -> None:
        while self._durable_box:
            batch, self._durable_box = self._durable_box, []
            await self._send_batch(batch, self._durable_retry)

    async def _send_batch(self, batch: list[Outgoing], retry: Retry) -> None:
        """Enqueue ``batch``, retrying transient failures; its callers get any error."""
        tries = itertools.count()  # a send tried again may find its jobs written (or ended)
        try:
            await retry.arun(
                lambda: self._enqueue(batch, next(tries) > 0),
                keep_going=lambda: not self.closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except Exception as e:
            self._core.send_failed(batch, e)
        finally:
            if self._send_waiters:
                self._wake_send_waiters()

    def _wake_send_waiters(self) -> None:
        waiters, self._send_waiters = self._send_waiters, []
        for sent in waiters:
            if not sent.done():
                sent.set_result(None)

    async def _enqueue(self, batch: list[Outgoing], again: bool = False) -> None:
        core = self._core
        for group, keys, requests, max_queue, durable, together in enqueue_groups(batch):
            jobs, onces, caches = core.marks(keys, group)
            try:
                reply = await self._broker.enqueue(
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
                    await self._withdraw_sent(call)
                except QueueServeError as e:
                    core.withdraw_failed(call, e)
