"""What a job promises its followers beyond tests/faults/test_jobs.py and test_forged_cancels.py,
each written for a mutant of queueserve/client/job_handles.py that survived them (docs/testing.md):
``result(timeout)`` waits that long and no longer, polling less often as it waits; a job is
found and cancelled by its id in whatever stream it waits (a batch key holding '}', a shard
other than the first) and whatever its client's id (the protocol lets other clients put '-' in
theirs); answers in a codec the follower trusts; a hook's place in its batch; what each error
says; and ``AsyncJob`` doing what ``Job`` does (status while running, cancel, defaults)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.client import job_handles as client_jobs
from queueserve.wire import job_record as J
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox
from tests.support.helpers import WAIT_S, stream_key, wait_until
from tests.support.servings import Recording, tag_items

StartWorker = Callable[..., qs.Worker]


@pytest.fixture
def other(redis_url: str, prefix: str) -> Iterator[qs.Client]:
    """A second client: another process's view, in this one."""
    with qs.Client(redis_url, prefix=prefix) as c:
        yield c


def queued_job(client: qs.Client, serving: str = "nobody", **options: Any) -> str:
    """The id of a job waiting in its stream (no worker serves ``serving``)."""
    ticket = client.submit(serving, ["a"], keep=60, **options)
    return ticket.id


class Clock:
    """A monotonic clock that moves only when the code under test sleeps (and by a microsecond
    each time it is read, as a real one does), so waits are checked without waiting."""

    def __init__(self, on_sleep: Callable[[int], object] | None = None) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        assert len(self.sleeps) < 200, f"still polling after {len(self.sleeps)} sleeps"
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(
            client_jobs, "time", types.SimpleNamespace(monotonic=self.monotonic, sleep=self.sleep)
        )
        monkeypatch.setattr(client_jobs, "asyncio", types.SimpleNamespace(sleep=self.async_sleep))

    def check_wait(self, timeout: float) -> None:
        """The sleeps of a wait that timed out: ``timeout`` in all, none longer than 250 ms (an
        end is noticed that soon), and backing off (the first 5 ms, none shorter but the
        last, which is what was left), so a long wait costs Redis few reads."""
        assert math.fsum(self.sleeps) == pytest.approx(timeout, abs=1e-3)
        assert max(self.sleeps) <= 0.25
        assert self.sleeps[0] == 0.005 and min(self.sleeps[:-1]) >= 0.005
        assert len(self.sleeps) <= 8  # 5, 10, 20, 40, 80, 145 ms for 0.3 s


# --- waiting ---------------------------------------------------------------------------------
def test_result_waits_its_timeout_and_no_longer_polling_less_often_as_it_waits(
    client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = client.job(queued_job(client))
    clock = Clock()
    clock.install(monkeypatch)
    with pytest.raises(qs.Timeout, match=rf"^job {job.id} did not end within 0.3 s; it goes on$"):
        job.result(timeout=0.3)
    clock.check_wait(0.3)


async def test_an_async_result_waits_its_timeout_and_no_longer(
    client: qs.Client, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = queued_job(client)
    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        job = aclient.job(job_id)
        clock = Clock()
        clock.install(monkeypatch)
        with pytest.raises(qs.Timeout, match=rf"^job {job_id} did not end within 0.3 s; it"):
            await job.result(timeout=0.3)
    clock.check_wait(0.3)


def test_result_without_a_timeout_waits_until_the_job_ends(
    client: qs.Client, other: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a queued job that another process cancels while its follower waits
    job_id = queued_job(client)
    job = client.job(job_id)
    clock = Clock(on_sleep=lambda n: n == 3 and other.job(job_id).cancel())
    clock.install(monkeypatch)
    # Then the wait ends with the job, however long it took
    with pytest.raises(qs.Cancelled, match=rf"^job {job_id} was cancelled$"):
        job.result()
    assert len(clock.sleeps) >= 3


async def test_an_async_result_without_a_timeout_waits_until_the_job_ends(
    client: qs.Client,
    other: qs.Client,
    redis_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = queued_job(client)
    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        job = aclient.job(job_id)
        clock = Clock(on_sleep=lambda n: n == 3 and other.job(job_id).cancel())
        clock.install(monkeypatch)
        with pytest.raises(qs.Cancelled, match=rf"^job {job_id} was cancelled$"):
            await job.result()
    assert len(clock.sleeps) >= 3


# --- where a job waits -----------------------------------------------------------------------
def test_a_job_whose_batch_key_holds_a_brace_is_followed_and_cancelled_by_its_id(
    client: qs.Client, other: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    job = other.job(queued_job(client, batch_key="a}b"))
    wait_until(lambda: job.status() == "queued", "the job recorded, queued")
    assert job.cancel() is True
    assert redis_client.xlen(stream_key(prefix, "nobody", "a}b")) == 0  # it never runs


def test_a_job_in_a_shard_other_than_the_first_is_followed_and_cancelled_by_its_id(
    start_worker: StartWorker,
    client: qs.Client,
    other: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving of two shards, declared by a worker that stopped, and two jobs sent one
    # after the other (a client sends to the shard it sent the fewest items: one each)
    serving = Recording(name="halves", batch_size=4, batch_timeout=0, shards=2)
    start_worker(serving).stop(timeout=10)
    jobs = [other.job(queued_job(client, "halves")) for _ in range(2)]
    streams = [waiting_in(redis_client, prefix, job.id) for job in jobs]
    assert len(set(streams)) == 2
    # Then each reads queued, and each cancel takes it out of its shard's stream
    assert [job.status() for job in jobs] == ["queued", "queued"]
    assert [job.cancel() for job in jobs] == [True, True]
    assert [redis_client.xlen(stream) for stream in streams] == [0, 0]


def waiting_in(r: redis.Redis, prefix: str, job_id: str) -> str:
    """The stream a queued job's record names."""
    own = r.hget(*J.job_place(prefix, job_id))
    assert isinstance(own, bytes), own
    record = J.parse_record(job_id, [own, None, None], 0)
    assert record is not None and record.status == J.QUEUED, record
    return record.stream


def test_a_job_of_a_client_whose_id_holds_a_dash_is_cancelled_by_its_id(
    client: qs.Client, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given another client's queued request (its id, 'my-app', is its own scheme: the protocol
    # allows '-'), with the job record it wrote as queueserve's clients write theirs
    keys = Keys(prefix, "others")
    inbox = RawInbox(redis_client, prefix, "my-app")
    header, payload = encode_request(get_codec("msgpack"), 7, ["x"], inbox.key, None)
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        _, _, (entry,) = broker.enqueue(keys, [("default", 1, header, payload, 0)], 0)
    assert isinstance(entry, bytes)
    stream = keys.stream("default")
    group, rid = J.job_place(prefix, "my-app-7")
    redis_client.hset(group, mapping={rid: f"1:60000:others:{entry.decode()}:{stream}", "live": 1})
    # Then a follower cancels it by its id: its entry leaves the stream
    assert client.job("my-app-7").cancel() is True
    assert redis_client.xlen(stream) == 0


# --- what is read ------------------------------------------------------------------------------
def frozen(items: list[Any]) -> list[Any]:
    return [frozenset({x}) for x in items]


def test_a_job_answered_in_a_codec_its_follower_trusts_is_read(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    start_worker(qs.Serving(frozen, name="frozen", batch_size=4, batch_timeout=0, codec="pickle"))
    with qs.Client(redis_url, prefix=prefix, codec="pickle") as trusting:
        job_id = trusting.submit("frozen", [1, 2], keep=60).id
        assert trusting.job(job_id).result(timeout=WAIT_S) == [frozenset({1}), frozenset({2})]
    with qs.Client(redis_url, prefix=prefix, codec="pickle") as follower:
        assert follower.job(job_id).result(timeout=WAIT_S) == [frozenset({1}), frozenset({2})]


async def test_an_async_job_answered_in_a_codec_its_follower_trusts_is_read(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    start_worker(qs.Serving(frozen, name="frozen", batch_size=4, batch_timeout=0, codec="pickle"))
    async with qs.AsyncClient(redis_url, prefix=prefix, codec="pickle") as trusting:
        job = trusting.job(await (await trusting.submit("frozen", [3], keep=60)).id)
        assert await job.result(timeout=WAIT_S) == [frozenset({3})]


def seen(items: list[str]) -> list[str]:
    qs.emit("seen", len(items))
    return [f"r:{x}" for x in items]


def test_a_jobs_hook_says_where_its_items_sit_in_the_batch(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a batch of 5 that runs only full: a request of 3 items, then a job of 2
    serving = qs.Serving(seen, name="hooked", batch_size=5, batch_timeout="1h")
    start_worker(serving.streaming(hooks=["seen"]))
    first = client.submit("hooked", ["x", "y", "z"])
    ticket = client.submit("hooked", ["a", "b"], keep=60)
    assert first.result(WAIT_S) == ["r:x", "r:y", "r:z"]
    job = client.job(ticket.id)
    assert job.result(timeout=WAIT_S) == ["r:a", "r:b"]
    # Then the job's hook event says its items are the batch's 4th and 5th
    hook = job.progress().hook
    assert hook is not None and (hook.name, hook.payload) == ("seen", 5)
    assert (hook.start, hook.size) == (3, 2)


# --- what is said ------------------------------------------------------------------------------
def test_errors_of_records_not_written_by_queueserve_say_so_and_to_forget_them(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    ends = b"%d" % (1000 * 10**10)
    records: dict[str, dict[str, bytes]] = {
        # ended done with none of its 2 items answered
        "f3-1": {"1": b"done:" + ends + b":2:10:"},
        # a hook event that is none
        "f3-2": {"2": b"1:60000:s::", "2.h": b"\x00garbage"},
        # an answer no codec of this client reads
        "f3-3": {"3": b"done:" + ends + b":1:10:1", "m1": b"\x00garbage"},
    }
    for job_id, fields in records.items():
        for field, value in fields.items():
            redis_client.hset(J.job_place(prefix, job_id)[0], field, value)
    with pytest.raises(
        qs.QueueServeError,
        match=r"^job f3-1 ended done with 0 of 2 items answered: its record was not written by "
        r"queueserve; forget it$",
    ):
        client.job("f3-1").result(timeout=1)
    with pytest.raises(
        qs.QueueServeError,
        match=r"^job f3-2's record holds a hook event that cannot be read \(.+\): it was not "
        r"written by queueserve; forget it$",
    ):
        client.job("f3-2").progress()
    with pytest.raises(
        qs.QueueServeError,
        match=r"^job f3-3's record holds an answer that cannot be read \(.+\): it was not "
        r"written by a worker for this client's codecs; forget it$",
    ):
        client.job("f3-3").progress()


def test_a_forgotten_jobs_progress_says_why_it_has_no_record(
    client: qs.Client, prefix: str
) -> None:
    job = client.job(queued_job(client))
    wait_until(lambda: job.status() == "queued", "the job recorded")
    assert job.forget() is True
    with pytest.raises(
        qs.QueueServeError,
        match=rf"^job {job.id} has no record under prefix '{prefix}': its keep passed \(status "
        r"'expired'\), it was forgotten, or it never existed$",
    ):
        job.progress()


# --- AsyncJob does what Job does -----------------------------------------------------------------
async def test_an_async_job_reads_queued_running_and_done(
    start_worker: StartWorker, client: qs.Client, redis_url: str, prefix: str
) -> None:
    ticket = client.submit("held", ["a"], keep=60)
    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        job = aclient.job(ticket.id)
        assert await job.status() == "queued"  # nobody holds it
        serving = Recording(tag_items, name="held", batch_size=4, batch_timeout=0, gated=True)
        start_worker(serving)
        await wait_async(job, "running")
        serving.release()
        assert await job.result(timeout=WAIT_S) == ["r:a"]
        assert await job.status() == "done"


async def wait_async(job: client_jobs.AsyncJob, status: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if await job.status() == status:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job.id} never read {status!r}")


async def test_an_async_cancel_takes_a_queued_job_out_of_its_stream_once(
    client: qs.Client, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    job_id = queued_job(client)
    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        job = aclient.job(job_id)
        assert await job.cancel() is True
        assert redis_client.xlen(stream_key(prefix, "nobody")) == 0  # it never runs
        assert await job.cancel() is False  # it ended already


async def test_an_async_jobs_item_errors_raise_unless_asked_for(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    def half_broken(xs: list[int]) -> list[int]:
        if -1 in xs:
            raise ValueError("negative item")
        return [x * 2 for x in xs]

    start_worker(qs.Serving(half_broken, name="halfbroken", batch_size=4, batch_timeout=0))
    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        job = aclient.job(await (await aclient.submit("halfbroken", [1, -1], keep=60)).id)
        with pytest.raises(qs.RemoteError, match="negative item"):
            await job.result(timeout=WAIT_S)
        first, second = await job.result(timeout=WAIT_S, return_exceptions=True)
        assert first == 2 and isinstance(second, qs.RemoteError)
