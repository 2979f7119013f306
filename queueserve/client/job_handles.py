"""Jobs as callers follow them: ``Job`` (``Client.job``) and ``AsyncJob``
(``AsyncClient.job``), over a job's record in Redis (wire/job_record.py), from any process.

What a record says is judged here, without I/O (``_Reading``): its status, its progress and
its results, read as a ``Ticket`` reads an inbox's replies, so a job gives the same values and
errors. Each class adds its I/O: reads, waits and cancels.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple, TypeGuard

from queueserve.broker.job_store import AsyncJobs, Jobs
from queueserve.client.calls import Call, CallTable, outcome
from queueserve.errors import Cancelled, QueueServeError, Timeout
from queueserve.hooks import Hook
from queueserve.wire import job_record as J
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key

# A job's call is never sent: its keys are never used, only its results.
_UNSENT = Keys("qs", "job")
_FIRST_POLL_S, _MOST_POLL_S = 0.005, 0.25
DEFAULT_KEEP_MS = 60_000  # what a cancel keeps a record whose keep is unreadable


class JobProgress(NamedTuple):
    """Items of a job answered so far, of ``total``; ``hook``: the last hook event
    (``qs.emit``) of its batches, when its serving emits any."""

    done: int
    total: int
    hook: Hook | None = None


class _Reading:
    """A job's id and what its record says (no I/O)."""

    def __init__(self, prefix: str, job_id: str, trusted_codec: str | None) -> None:
        self.id = J.check_job_id(job_id)
        self._key, rid = J.job_place(prefix, job_id)
        self._fields = J.record_fields(rid)
        self._prefix = prefix
        self._rid = int(rid)
        # the inbox its client sent it with: its entry names it (cancel.lua checks)
        self._inbox = inbox_key(prefix, job_id.rsplit("-", 1)[0])
        self._accepted = {get_codec("msgpack").tag}
        if trusted_codec is not None:
            self._accepted.add(get_codec(trusted_codec).tag)

    def __repr__(self) -> str:
        return f"<queueserve Job {self.id}>"

    def _parse(self, raw: tuple[list[bytes | None], int]) -> J.JobRecord | None:
        try:
            return J.parse_record(self.id, *raw)
        except ValueError as e:
            raise QueueServeError(str(e)) from None

    def _messages(self, raw: list[bytes | None]) -> list[bytes]:
        try:
            return J.check_messages(self.id, raw)
        except ValueError as e:
            raise QueueServeError(str(e)) from None

    def _call(self, record: J.JobRecord, messages: list[bytes]) -> Call:
        """The job's answers so far, applied as a client applies its inbox's (a message of
        its group holds other jobs' rows too: the table knows this job's alone)."""
        table = CallTable()
        table._accepted = self._accepted
        try:
            call = table.calls[self._rid] = Call(self._rid, record.n, _UNSENT, "")
            for message in messages:
                table.deliver(message)
        except Exception as e:
            raise QueueServeError(
                f"job {self.id}'s record holds an answer that cannot be read ({e}): it was "
                "not written by a worker for this client's codecs; forget it"
            ) from None
        return call

    @property
    def place(self) -> tuple[str, tuple[str, str, str]]:
        """Where its record is: what ``Jobs.reads`` takes, to read many jobs at once."""
        return self._key, self._fields

    def ended(self, raw: tuple[list[bytes | None], int]) -> tuple[bool, J.JobRecord | None]:
        """From a read of its ``place``: whether it ended (or has no record), and its record."""
        record = self._parse(raw)
        return record is None or record.status != J.QUEUED, record

    def results_of(self, record: J.JobRecord | None, messages: list[bytes | None]) -> list[Any]:
        """Its results, errors as values, from its ended record and the messages it names
        (raising what ``result`` raises for one without answers)."""
        return self._results(record, self._messages(messages) if record else [], True)

    def _results(
        self, record: J.JobRecord | None, messages: list[bytes], return_exceptions: bool
    ) -> list[Any]:
        if record is None:
            raise QueueServeError(self._gone())
        if record.status == J.CANCELLED:
            raise Cancelled(f"job {self.id} was cancelled")
        if record.failure:
            raise QueueServeError(f"job {self.id} failed: {record.failure}")
        call = self._call(record, messages)
        if call.remaining:
            raise QueueServeError(
                f"job {self.id} ended {record.status} with {record.n - call.remaining} of "
                f"{record.n} items answered: its record was not written by queueserve; "
                "forget it"
            )
        return outcome(call, return_exceptions)

    def _progress(self, record: J.JobRecord | None, messages: list[bytes]) -> JobProgress:
        if record is None:
            raise QueueServeError(self._gone())
        call = self._call(record, messages)
        return JobProgress(record.n - call.remaining, record.n, self._hook(record.hook))

    def _hook(self, raw: bytes) -> Hook | None:
        if not raw:
            return None
        try:
            name, payload, start, size = J.parse_hook(raw, self._accepted)
        except Exception as e:
            raise QueueServeError(
                f"job {self.id}'s record holds a hook event that cannot be read ({e}): it "
                "was not written by queueserve; forget it"
            ) from None
        return Hook(name, payload, start, size)

    def _gone(self) -> str:
        return (
            f"job {self.id} has no record under prefix {self._prefix!r}: its keep passed "
            "(status 'expired'), it was forgotten, or it never existed"
        )

    def _keys(self, record: J.JobRecord) -> tuple[Keys, str] | None:
        """The keys of the shard its entry waits in, and the stream; None when the record
        names none (a worker answered before its client recorded where it waited)."""
        stream = record.stream
        if not record.entry_id or not stream.startswith(f"{self._prefix}:{{"):
            return None
        try:
            tag = stream[len(self._prefix) + 2 : stream.index("}")]
            keys = Keys(self._prefix, record.serving, tag=tag)
            keys.parse_stream(stream)
        except ValueError as e:
            raise QueueServeError(
                f"job {self.id}'s record names stream {stream!r:.100}, not one of serving "
                f"{record.serving!r:.100}: it was not written by queueserve ({e})"
            ) from None
        return keys, stream

    def _held_unknown(self, record: J.JobRecord | None) -> TypeGuard[J.JobRecord]:
        """Whether telling queued from running needs Redis: a queued record with no answer
        yet (one with answers is running) whose entry a worker may hold, in a stream of this
        prefix (``_keys``: a stream no worker of the serving reads raises, one outside the
        prefix is not looked at)."""
        return (
            record is not None
            and record.status == J.QUEUED
            and not record.refs
            and self._keys(record) is not None
        )


def _status(record: J.JobRecord | None, held: bool) -> str:
    if record is None:
        return J.EXPIRED
    if record.status == J.QUEUED and (held or record.refs):
        return J.RUNNING
    return record.status


class Job(_Reading):
    """A job, from any process with the same Redis and prefix: ``status()``, ``progress()``,
    ``result(timeout)``, ``cancel()``, ``forget()``."""

    def __init__(
        self, jobs: Jobs, cancel: Any, prefix: str, job_id: str, trusted_codec: str | None
    ) -> None:
        super().__init__(prefix, job_id, trusted_codec)
        self._jobs, self._withdraw = jobs, cancel

    def _record(self) -> J.JobRecord | None:
        return self._parse(self._jobs.record(self._key, self._fields))

    def _answers(self, record: J.JobRecord | None) -> list[bytes]:
        if record is None:
            return []
        return self._messages(self._jobs.messages(self._key, record.refs))

    def status(self) -> str:
        """queued, running, done, failed, cancelled, or expired (no record: its keep passed,
        or it was forgotten)."""
        record = self._record()
        held = self._held_unknown(record) and self._jobs.running(record.stream, record.entry_id)
        return _status(record, held)

    def progress(self) -> JobProgress:
        record = self._record()
        return self._progress(record, self._answers(record))

    def result(self, timeout: float | None = None, *, return_exceptions: bool = False) -> list[Any]:
        """Results in item order once it ended (waiting up to ``timeout`` seconds, None: for
        ever), with the values and errors ``Ticket.result`` gives."""
        end = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_POLL_S
        while (record := self._record()) is not None and record.status == J.QUEUED:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"job {self.id} did not end within {timeout} s; it goes on")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, _MOST_POLL_S)
        return self._results(record, self._answers(record), return_exceptions)

    def cancel(self) -> bool:
        """End it ``cancelled`` unless it ended: queued (alone or in a pack), it never runs;
        held by a worker, it leaves at its next batch or step (its answer, if one comes, is
        not kept). True when this call cancelled it."""
        record = self._record()
        if record is None or self._jobs.cancel(self._key, self._fields[0], DEFAULT_KEEP_MS) != 1:
            return False
        where = self._keys(record)
        if where is not None:
            self._withdraw(*where, record.entry_id, record.n, self._rid, self._inbox)
        return True

    def forget(self) -> bool:
        """Delete its record now (it reads ``expired``; a reply message it shares with other
        jobs of its group goes with the group); True when there was one."""
        return self._jobs.forget(self._key, self._fields[0])


class AsyncJob(_Reading):
    """``Job`` for asyncio: the same methods, awaited."""

    def __init__(
        self, jobs: AsyncJobs, cancel: Any, prefix: str, job_id: str, trusted_codec: str | None
    ) -> None:
        super().__init__(prefix, job_id, trusted_codec)
        self._jobs, self._withdraw = jobs, cancel

    async def _record(self) -> J.JobRecord | None:
        return self._parse(await self._jobs.record(self._key, self._fields))

    async def _answers(self, record: J.JobRecord | None) -> list[bytes]:
        if record is None:
            return []
        return self._messages(await self._jobs.messages(self._key, record.refs))

    async def status(self) -> str:
        record = await self._record()
        held = self._held_unknown(record) and await self._jobs.running(
            record.stream, record.entry_id
        )
        return _status(record, held)

    async def progress(self) -> JobProgress:
        record = await self._record()
        return self._progress(record, await self._answers(record))

    async def result(
        self, timeout: float | None = None, *, return_exceptions: bool = False
    ) -> list[Any]:
        end = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_POLL_S
        while (record := await self._record()) is not None and record.status == J.QUEUED:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"job {self.id} did not end within {timeout} s; it goes on")
            await asyncio.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, _MOST_POLL_S)
        return self._results(record, await self._answers(record), return_exceptions)

    async def cancel(self) -> bool:
        record = await self._record()
        if (
            record is None
            or await self._jobs.cancel(self._key, self._fields[0], DEFAULT_KEEP_MS) != 1
        ):
            return False
        where = self._keys(record)
        if where is not None:
            await self._withdraw(*where, record.entry_id, record.n, self._rid, self._inbox)
        return True

    async def forget(self) -> bool:
        return await self._jobs.forget(self._key, self._fields[0])
