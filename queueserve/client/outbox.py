"""The sync client's sending: its outbox, combined sends (a caller that finds no send in
progress sends its own request and every one queued meanwhile, in one Lua call), the sender
thread, and the durable sender that waits for replicas apart from the other servings' sends.
"""

from __future__ import annotations

import itertools
import threading
import time

from queueserve.broker.producer import Producer
from queueserve.broker.retry import Retry
from queueserve.client.caching import caches_at
from queueserve.client.calls import Call
from queueserve.client.core import BaseClient
from queueserve.client.following import Followers
from queueserve.client.job_handles import Job
from queueserve.client.job_sends import job_place_of, jobs_at
from queueserve.client.once import answered, onces_at
from queueserve.client.outgoing import Outgoing, admitted, enqueue_groups, send_window
from queueserve.errors import Cancelled, NotReplicated, QueueServeError


class Sending(BaseClient):
    """``Client``'s sending state and threads (``Client`` adds the calls and the waiting)."""

    def __init__(self, url: str | None, prefix: str | None, codec: str | None) -> None:
        super().__init__(url, prefix, codec)
        self._broker = Producer(self.url, owner=self._owner)
        self._closed = False
        self._out_lock = threading.Lock()
        self._outbox: list[Outgoing] = []
        self._flushing = False
        self._sender: threading.Thread | None = None
        self._wake_sender = threading.Event()
        # Requests of durable servings wait for a replica (up to DURABLE_WAIT_MS) on a thread
        # of their own, so that wait never holds up the sends of other servings.
        self._durable_box: list[Outgoing] = []
        self._durable_sender: threading.Thread | None = None
        self._wake_durable = threading.Event()
        self._durable_retry = Retry(self._broker.outage, "durable sender")
        # Inline senders and the sender thread take turns (never two at once): one state.
        self._send_retry = Retry(self._broker.outage, "sender")
        self._jobs_sent = False  # set by the first job: plain sends never look for jobs
        # set by the first call with an idempotency key: plain sends never look for keys
        self._keys_sent = False
        self._cache_sent = False  # set by the first call of a caching serving: likewise
        self._followers = Followers(
            self._broker.jobs, self._followed_job, f"queueserve-follow-{self.client_id}"
        )

    def _followed_job(self, job_id: str) -> Job:
        return Job(self._broker.jobs, self._broker.cancel, self.prefix, job_id, self._trusted_codec)

    def _send(self, outgoing: list[Outgoing], inline: bool) -> None:
        """Queue the requests of one call (together: one send carries them all); with
        ``inline`` (a caller that will wait anyway) send them now from this thread, with
        everything queued meanwhile, unless another thread is sending."""
        with self._out_lock:
            self._outbox += outgoing
            if self._flushing:
                return  # the thread flushing now sends it too
            if not inline:
                if not self._wake_sender.is_set():  # set() takes a lock even when set
                    self._wake_sender.set()
                return
            self._flushing = True
        self._flush()

    def _withdraw(self, call: Call) -> bool:
        """Cancel ``call``: True when it will never run (taken out of the outbox before it was
        sent, or out of its stream, or its pack, before a worker read it)."""
        if not self._cancel_call(call):
            return False
        with self._out_lock:
            for box in (self._outbox, self._durable_box):
                for i, outgoing in enumerate(box):
                    if outgoing.call is call:
                        del box[i]
                        return True
        if call.follows is not None:  # another request's job: it runs on for its caller
            return False
        if call.keep_ms:  # a job: its record ends cancelled first, and keeps no answer
            self._broker.jobs.cancel(*job_place_of(self.prefix, self.client_id, call))
        stream = call.keys.stream(call.batch_key, call.priority)
        # (b"": a keyed request queued by an earlier try of its send, client/once.py)
        return (
            call.entry_id is not None
            and call.entry_id != b""
            and self._broker.cancel(call.keys, stream, call.entry_id, call.n, call.rid, self._inbox)
        )

    def _sender_loop(self) -> None:
        while not self._closed:
            self._wake_sender.wait(1.0)
            self._wake_sender.clear()
            with self._out_lock:
                if self._flushing or not self._outbox:
                    continue
                self._flushing = True
            self._flush()

    def _flush(self) -> None:
        while True:
            with self._out_lock:
                batch, self._outbox = self._outbox, []
                if not batch:
                    self._flushing = False
                    return
            try:
                batch = self._set_aside_durable(batch)
                if batch:
                    self._send_batch(batch, self._send_retry)
            except BaseException:
                with self._out_lock:
                    self._flushing = False
                raise

    def _set_aside_durable(self, batch: list[Outgoing]) -> list[Outgoing]:
        """``batch`` less the requests of durable servings, handed to the durable sender."""
        durable = [o for o in batch if o.target.durable]
        if not durable:
            return batch
        with self._out_lock:
            self._durable_box += durable
            if self._durable_sender is None:
                self._durable_sender = threading.Thread(
                    target=self._durable_loop,
                    name=f"queueserve-send-durable-{self.client_id}",
                    daemon=True,
                )
                self._durable_sender.start()
        self._wake_durable.set()
        return [o for o in batch if not o.target.durable]

    def _durable_loop(self) -> None:
        while not self._closed:
            self._wake_durable.wait(1.0)
            self._wake_durable.clear()
            with self._out_lock:
                batch, self._durable_box = self._durable_box, []
            if batch:
                self._send_batch(batch, self._durable_retry)

    def _send_batch(self, batch: list[Outgoing], retry: Retry) -> None:
        """Enqueue ``batch``, retrying transient failures; its callers get any error."""
        tries = itertools.count()  # a send tried again may find its jobs written (or ended)
        try:
            retry.run(
                lambda: self._enqueue(batch, next(tries) > 0),
                keep_going=lambda: not self._closed,
                give_up_at=time.monotonic() + send_window(batch),
            )
        except QueueServeError as e:
            self._fail_batch(batch, e)
        except Exception as e:
            self._fail_send(batch, e)

    def _enqueue(self, batch: list[Outgoing], again: bool = False) -> None:
        for group, keys, requests, max_queue, durable, together in enqueue_groups(batch):
            jobs = jobs_at(self.prefix, self.client_id, group) if self._jobs_sent else ()
            onces = onces_at(self.client_id, keys, group) if self._keys_sent else ()
            caches = caches_at(keys, group) if self._cache_sent else ()
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
                self._fail_batch(group, e)
                continue
            keyed = admitted(self._table, group, *reply)
            if keyed and (follow := answered(self._table, self.client_id, keyed)):
                self._followers.add(follow)

    def _start_sender(self) -> None:
        self._sender = threading.Thread(
            target=self._sender_loop,
            name=f"queueserve-send-{self.client_id}",
            daemon=True,
        )
        self._sender.start()

    def _close_sending(self) -> None:
        """Send what is still queued, then stop the sender threads."""
        with self._out_lock:
            unsent = bool(self._outbox) and not self._flushing
            self._flushing = self._flushing or unsent
        if unsent:
            self._flush()
        self._closed = True

    def _join_senders(self) -> None:
        if self._sender is not None:
            self._wake_sender.set()
            self._sender.join(timeout=5)
        if self._durable_sender is not None:
            self._wake_durable.set()
            self._durable_sender.join(timeout=5)
            with self._out_lock:
                left, self._durable_box = self._durable_box, []
            if left:  # set aside by the flush above, after the durable sender's last look
                self._send_batch(left, self._durable_retry)
        self._followers.close(Cancelled("the client was closed before the answer came"))
