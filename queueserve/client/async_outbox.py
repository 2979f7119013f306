"""The asyncio client's sending: its outbox, combined sends (the task that finds no send in
progress sends everything queued, in one Lua call), and the durable task that waits for
replicas apart from the other servings' sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.retry import Retry
from queueserve.client.caching import caches_at
from queueserve.client.calls import Call, check_placed, unsent
from queueserve.client.core import BaseClient, timeout_message
from queueserve.client.following import AsyncFollowers
from queueserve.client.job_handles import AsyncJob
from queueserve.client.job_sends import job_place_of, jobs_at
from queueserve.client.once import answered, onces_at
from queueserve.client.outgoing import Outgoing, admitted, enqueue_groups, send_window
from queueserve.client.targets import Target
from queueserve.client.ticket import ticket_id
from queueserve.errors import NotReplicated, QueueServeError, Timeout
from queueserve.wire.timing import ALIVE_WITHIN_S, RECONNECT_WITHIN_S


async def wait_uncancelled(waiting: asyncio.Future[Any], limit: float | None) -> None:
    """Await ``waiting`` up to ``limit`` seconds (TimeoutError after), never cancelling it: a
    caller cancelled or timed out here may await the same ticket again. The per-call cost of
    ``asyncio.wait_for(asyncio.shield(...))`` (a shield future, a wait_for future and its
    callbacks) was a fifth of an awaited dispatch's CPU (docs/benchmarks.md)."""
    if not waiting.done():
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        waiting.add_done_callback(wake)
        timer = None if limit is None else loop.call_later(limit, wake)
        try:
            await woken
        finally:
            waiting.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()
        if not waiting.done():
            raise TimeoutError
    waiting.result()


class AsyncSending(BaseClient):
    """``AsyncClient``'s sending state and tasks (``AsyncClient`` adds the calls)."""

    def __init__(self, url: str | None, prefix: str | None, codec: str | None) -> None:
        super().__init__(url, prefix, codec)
        self._broker = AsyncProducer(self.url, owner=self._owner)
        self._closed = False
        self._send_retry = Retry(self._broker.outage, "sender")
        self._outbox: list[Outgoing] = []
        self._flushing = False
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) in a task
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_task: asyncio.Task[None] | None = None
        self._durable_retry = Retry(self._broker.outage, "durable sender")
        self._jobs_sent = False  # set by the first job: plain sends never look for jobs
        # set by the first call with an idempotency key: plain sends never look for keys
        self._keys_sent = False
        self._cache_sent = False  # set by the first call of a caching serving: likewise
        self._followers = AsyncFollowers(self._broker.jobs, self._followed_job)
        self._send_waiters: list[asyncio.Future[None]] = []  # woken as each send ends

    def _followed_job(self, job_id: str) -> AsyncJob:
        return AsyncJob(
            self._broker.jobs, self._broker.cancel, self.prefix, job_id, self._trusted_codec
        )

    async def _sent_id(self, calls: list[Call]) -> str:
        """``AsyncTicket.id``: as ``Ticket.id``, a job's once the job is in Redis (with its
        record): from then on the id holds whatever becomes of this process."""
        if calls[0].keep_ms:
            await self._until_sent(calls)
        return ticket_id(self.client_id, calls)

    async def _until_sent(self, calls: list[Call]) -> None:
        """Return once ``calls`` are enqueued, or failed: sending what is queued if no task is
        sending, else waiting for the sends under way to end; RedisUnavailable when they are
        still being sent after RECONNECT_WITHIN_S (a send that fails fails its calls; so does
        one that gives up retrying)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + RECONNECT_WITHIN_S
        while unsent(calls):
            if not self._flushing and self._outbox:
                await self._flush()
                continue
            left = end - loop.time()
            if left <= 0:
                break
            sent = loop.create_future()
            self._send_waiters.append(sent)
            await asyncio.wait((sent,), timeout=left)
        check_placed(calls, RECONNECT_WITHIN_S)

    def _expire(self, calls: list[Call], text: str) -> None:
        """Fail ``calls`` with Timeout: their request's own deadline passed."""
        for call in calls:
            self._table.forget(call)
            call.fail(Timeout(text))

    async def _withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (see ``Client.withdraw``)."""
        if not self._cancel_call(call):
            return False
        for box in (self._outbox, self._durable_box):
            for i, outgoing in enumerate(box):
                if outgoing.call is call:
                    del box[i]
                    return True
        if call.follows is not None:  # another request's job: it runs on for its caller
            return False
        if call.keep_ms:  # a job: its record ends cancelled first, and keeps no answer
            await self._broker.jobs.cancel(*job_place_of(self.prefix, self.client_id, call))
        stream = call.keys.stream(call.batch_key, call.priority)
        # (b"": a keyed request queued by an earlier try of its send, client/once.py)
        return (
            call.entry_id is not None
            and call.entry_id != b""
            and await self._broker.cancel(
                call.keys, stream, call.entry_id, call.n, call.rid, self._inbox
            )
        )

    async def _flush(self) -> None:
        self._flushing = True
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                batch = self._set_aside_durable(batch)
                if batch:
                    await self._send_batch(batch, self._send_retry)
        finally:
            self._flushing = False

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable task."""
        durable = [o for o in batch if o.target.durable]
        if not durable:
            return batch
        self._durable_box += durable
        if self._durable_task is None or self._durable_task.done():
            self._durable_task = asyncio.get_running_loop().create_task(
                self._send_durable(), name=f"queueserve-send-durable-{self.client_id}"
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
                keep_going=lambda: not self._closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except QueueServeError as e:
            self._fail_batch(batch, e)
        except Exception as e:
            self._fail_send(batch, e)
        finally:
            if self._send_waiters:
                self._wake_send_waiters()

    def _wake_send_waiters(self) -> None:
        waiters, self._send_waiters = self._send_waiters, []
        for sent in waiters:
            if not sent.done():
                sent.set_result(None)

    async def _enqueue(self, batch: list[Outgoing], again: bool = False) -> None:
        for group, keys, requests, max_queue, durable, together in enqueue_groups(batch):
            jobs = jobs_at(self.prefix, self.client_id, group) if self._jobs_sent else ()
            onces = onces_at(self.client_id, keys, group) if self._keys_sent else ()
            caches = caches_at(keys, group) if self._cache_sent else ()
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
                self._fail_batch(group, e)
                continue
            keyed = admitted(self._table, group, *reply)
            if keyed and (follow := answered(self._table, self.client_id, keyed)):
                self._followers.add(follow)

    # -- what AsyncTicket calls: _wait_watched, _timeout_text (and _expire, _withdraw) ----
    async def _timeout_text(self, target: Target, timeout: float | None) -> str:
        return timeout_message(target, timeout, await self._alive(target))

    async def _alive(self, target: Target) -> int | None:
        try:
            return await self._broker.alive_workers(target.keys, ALIVE_WITHIN_S)
        except QueueServeError:
            return None

    async def _wait_watched(
        self, target: Target, waiting: asyncio.Future[Any], limit: float | None
    ) -> None:
        """Await ``waiting`` up to ``limit`` (TimeoutError after), warning once if it waits
        on a serving no worker serves. ``waiting`` itself is never cancelled."""
        first = self._unserved.first_wait(target.keys.name, limit)
        if first is not None:
            try:
                await wait_uncancelled(waiting, first)
                return
            except TimeoutError:
                self._unserved.check(target, await self._alive(target))
                limit = None if limit is None else limit - first
        await wait_uncancelled(waiting, limit)

    async def _stop_durable(self) -> None:
        if self._durable_task is not None:
            self._durable_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._durable_task, 2.0)
