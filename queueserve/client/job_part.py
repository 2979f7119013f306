"""A client's jobs part: handles of jobs by id (``client.job(id)``), the calls that follow
another request's job (following.py), and a job's record ended when its caller withdraws it.
``JobPart`` for ``Client``, ``AsyncJobPart`` for ``AsyncClient``: the same methods, awaited."""

from __future__ import annotations

from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.producer import Producer
from queueserve.client.calls import Call
from queueserve.client.core import ClientCore
from queueserve.client.following import AsyncFollowers, Followers
from queueserve.client.job_handles import AsyncJob, Job
from queueserve.client.job_sends import job_place_of
from queueserve.errors import QueueServeError


class JobPart:
    """``Client``'s jobs: ``job(id)``, ``follow(calls)``, ``cancel(call)``, ``close(error)``."""

    def __init__(self, broker: Producer, core: ClientCore) -> None:
        self._store = broker.jobs
        self._cancel = broker.cancel
        self._core = core
        self._followers = Followers(broker.jobs, self.job, f"queueserve-follow-{core.client_id}")
        self.follow = self._followers.add

    def job(self, job_id: str) -> Job:
        """The job ``job_id``, from any process."""
        core = self._core
        return Job(self._store, self._cancel, core.prefix, job_id, core.trusted_codec)

    def cancel(self, call: Call) -> None:
        """End the record of ``call``'s job cancelled: it keeps no answer."""
        self._store.cancel(*job_place_of(self._core.prefix, self._core.client_id, call))

    def close(self, error: QueueServeError) -> None:
        """Stop following jobs; the calls still following one fail with ``error``."""
        self._followers.close(error)


class AsyncJobPart:
    """``AsyncClient``'s jobs: as ``JobPart``, with ``cancel`` and ``close`` awaited."""

    def __init__(self, broker: AsyncProducer, core: ClientCore) -> None:
        self._store = broker.jobs
        self._cancel = broker.cancel
        self._core = core
        self._followers = AsyncFollowers(broker.jobs, self.job)
        self.follow = self._followers.add

    def job(self, job_id: str) -> AsyncJob:
        """The job ``job_id``, from any process, its methods awaited."""
        core = self._core
        return AsyncJob(self._store, self._cancel, core.prefix, job_id, core.trusted_codec)

    async def cancel(self, call: Call) -> None:
        """End the record of ``call``'s job cancelled: it keeps no answer."""
        await self._store.cancel(*job_place_of(self._core.prefix, self._core.client_id, call))

    async def close(self, error: QueueServeError) -> None:
        """Stop following jobs; the calls still following one fail with ``error``."""
        await self._followers.aclose(error)
