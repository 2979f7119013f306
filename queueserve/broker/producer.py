"""The producer side: what a client does with Redis (enqueue, cancel, read its inbox).

``AsyncProducer`` (broker/async_producer.py) has the same methods for asyncio; both send the
commands ``broker.common`` builds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import redis

from queueserve.broker import raw
from queueserve.broker.common import (
    CacheAt,
    Enqueued,
    OnceAt,
    Request,
    Together,
    add_listing,
    cancel_arguments,
    durable_replies,
    enqueue_and_wait_commands,
    enqueue_arguments,
    enqueued,
    inbox_command,
    inbox_messages,
    listing,
    not_replicated_message,
)
from queueserve.broker.core import BrokerCore
from queueserve.broker.job_store import JobAt, Jobs
from queueserve.broker.redis_errors import raise_but_wrong_type, redis_errors
from queueserve.errors import NotReplicated, QueueServeError
from queueserve.wire.keys import Keys


class Producer(BrokerCore):
    """The stream operations of a client; ``jobs``, its job records."""

    def __init__(
        self, url: str, *, client: redis.Redis | None = None, owner: str | None = None
    ) -> None:
        super().__init__(url, client=client, owner=owner)
        self.jobs = Jobs(self.redis, url)

    def enqueue(
        self,
        keys: Keys,
        requests: Sequence[Request],
        max_queue: int,
        *,
        durable: bool = False,
        jobs: Sequence[JobAt] = (),
        together: Sequence[Together] = (),
        again: bool = False,
        onces: Sequence[OnceAt] = (),
        caches: Sequence[CacheAt] = (),
    ) -> Enqueued:
        """Admit requests ``(batch_key, n_items, header, payload, priority)`` atomically.

        Returns the limit in force, the queued item count after admission, and per request its
        stream entry id, or 0 when it was rejected for max_queue. ``durable`` waits until a
        replica holds them too (NotReplicated when none did within DURABLE_WAIT_MS). ``jobs``:
        the requests that are jobs, whose records are written with them (broker/job_store.py).
        ``together``: runs of requests of one call, admitted whole or refused whole.
        """
        if jobs and self.jobs.cluster:
            made = self.jobs.created(keys, requests, jobs, again)
            reply = self._enqueue_call(
                keys, requests, max_queue, durable, (), together, again, onces, caches
            )
            # Not retried with the enqueue (that would enqueue twice): without it a job is
            # answered as ever, and a cancel cannot withdraw its entry.
            with contextlib.suppress(QueueServeError):
                self.jobs.placed(keys, requests, jobs, reply, made)
            return reply
        return self._enqueue_call(
            keys, requests, max_queue, durable, jobs, together, again, onces, caches
        )

    def _enqueue_call(
        self,
        keys: Keys,
        requests: Sequence[Request],
        max_queue: int,
        durable: bool,
        jobs: Sequence[JobAt],
        together: Sequence[Together],
        again: bool = False,
        onces: Sequence[OnceAt] = (),
        caches: Sequence[CacheAt] = (),
    ) -> Enqueued:
        script_keys, args = enqueue_arguments(
            keys, requests, max_queue, jobs, together, again, onces, caches
        )
        with redis_errors(self.url):
            if not durable:
                return enqueued(self._evalsha(self._enqueue, script_keys, args))
            reply, replicas = self._enqueue_and_wait(script_keys, args)
        if replicas < 1:
            raise NotReplicated(not_replicated_message(keys, self.url))
        return enqueued(reply)

    def _enqueue_and_wait(self, script_keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """``enqueue_and_wait_commands`` on one connection of the shard's master."""
        client = self._node(script_keys[0])
        if id(client) not in self._loaded_on:
            # Loaded first: after a NOSCRIPT the WAIT behind it would still wait its full time.
            client.script_load(self._enqueue.script)
            self._loaded_on.add(id(client))
        commands = enqueue_and_wait_commands(self._enqueue.sha, script_keys, args)
        for first_try in (True, False):
            # A MOVED (failover or resharding) is raised as transient: sent again.
            with self._routed(script_keys[0]):
                pipe = client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                out = durable_replies(pipe.execute(raise_on_error=False), first_try)
            if out is not None:
                return out
            client.script_load(self._enqueue.script)
        raise AssertionError("unreachable: the second try returns or raises")

    def cancel(
        self, keys: Keys, stream: str, entry_id: bytes, n: int, rid: int, inbox: str
    ) -> bool:
        """cancel.lua: True when request ``rid`` (``n`` items, sent by the client of
        ``inbox``) left ``stream`` before any worker read it."""
        script_keys, args = cancel_arguments(keys, stream, entry_id, n, rid, inbox)
        with redis_errors(self.url):
            return bool(self._cancel(keys=script_keys, args=args))

    def servings(self, prefix: str) -> list[str]:
        """Names of the servings workers list under ``prefix`` (the registry P:servings, a
        bounded read: for the error of a call to an undeclared one), by name."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            add_listing(pipe, prefix, int(time.time() * 1000))
            return sorted(listing(raise_but_wrong_type(pipe.execute(raise_on_error=False)))[0])

    def read_inbox(self, inbox: str, timeout: float) -> list[bytes]:
        """Replies waiting in ``inbox`` (BLMPOP), sent straight to the inbox's master."""
        with redis_errors(self.url):
            if self._raw is not None:
                (reply,) = raw.run(self._raw, [inbox_command(inbox, timeout)])
                if isinstance(reply, Exception):
                    raise reply
                return inbox_messages(reply)
            with self._routed(inbox):
                return inbox_messages(
                    self._node(inbox).execute_command(*inbox_command(inbox, timeout))
                )

    def wake_inbox(self, inbox: str) -> None:
        """Make a blocked ``read_inbox`` return (an empty message, which readers skip)."""
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(inbox, b"")
            pipe.pexpire(inbox, 1000)
            pipe.execute()
