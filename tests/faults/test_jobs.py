"""Jobs (docs/guarantees.md, "Jobs"): a request sent with ``keep`` is followed, fetched and
cancelled by its id from any process; its answer is kept in Redis for ``keep`` after it ends,
through the death of the process that sent it and of the worker that ran it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import redis

import queueserve as qs
from queueserve.broker.job_store import Jobs
from queueserve.wire.codec import get_codec
from queueserve.wire.job_record import group_key, job_place, job_writes
from queueserve.wire.keys import Keys
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.fault_app import RawInbox, Workers
from tests.support.helpers import REPO, child_env, stream_key, wait_until
from tests.support.servings import Recording, tag_items

StartWorker = Callable[..., qs.Worker]
LUA = REPO / "queueserve" / "broker" / "lua"


@pytest.fixture
def other(redis_url: str, prefix: str) -> Iterator[qs.Client]:
    """A second client: another process's view, in this one."""
    with qs.Client(redis_url, prefix=prefix) as c:
        yield c


def record(r: redis.Redis, prefix: str, job_id: str) -> bytes | None:
    """A job's own field in its record group (wire/job_record.py): where it waits, or how it
    ended."""
    return r.hget(*job_place(prefix, job_id))


def group_of(prefix: str, job_id: str) -> str:
    return job_place(prefix, job_id)[0]


def in_another_process(redis_url: str, prefix: str, code: str) -> str:
    """Run ``code`` (with ``client`` a qs.Client of this Redis and prefix) in a new Python
    process; its stdout."""
    script = (
        "import json, sys, queueserve as qs\n"
        f"client = qs.Client({redis_url!r}, prefix={prefix!r})\n" + code
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_job_goes_queued_running_done_and_another_process_fetches_its_result(
    start_worker: StartWorker, client: qs.Client, other: qs.Client, redis_url: str, prefix: str
) -> None:
    # Given a job sent before any worker serves it
    ticket = client.submit("tagged", ["a", "b"], keep=60)
    job = other.job(ticket.id)
    wait_until(lambda: job.status() == "queued", "the job recorded, queued")
    assert job.progress()[:2] == (0, 2)

    # When a worker takes it and its batch is held
    serving = Recording(tag_items, gated=True, name="tagged", batch_size=4, batch_timeout=0)
    start_worker(serving)
    # Then it is running, until the batch ends: done, with its results
    wait_until(lambda: job.status() == "running", "the job running")
    serving.release()
    assert job.result(timeout=30) == ["r:a", "r:b"]
    assert job.status() == "done" and job.progress()[:2] == (2, 2)
    assert ticket.result() == ["r:a", "r:b"]  # its submitter is answered as ever

    # And a second OS process fetches it by its id alone
    out = in_another_process(
        redis_url, prefix, f"print(json.dumps(client.job({ticket.id!r}).result(timeout=30)))"
    )
    assert json.loads(out) == ["r:a", "r:b"]


def test_a_job_s_item_errors_end_it_failed_with_the_errors_a_ticket_gives(
    start_worker: StartWorker, client: qs.Client, other: qs.Client
) -> None:
    def half_broken(xs: list[int]) -> list[int]:
        if -1 in xs:
            raise ValueError("negative item")
        return [x * 2 for x in xs]

    start_worker(qs.Serving(half_broken, name="halfbroken", batch_size=4, batch_timeout=0))
    ticket = client.submit("halfbroken", [1, -1], keep=60)
    job = other.job(ticket.id)
    with pytest.raises(qs.RemoteError, match="negative item"):
        job.result(timeout=30)
    assert job.status() == "failed"
    first, second = job.result(return_exceptions=True)
    assert first == 2 and isinstance(second, qs.RemoteError)


def test_cancel_by_id_of_a_queued_job_takes_it_out_of_its_stream(
    client: qs.Client, other: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    ticket = client.submit("nobody", ["a"], keep=60)
    job = other.job(ticket.id)
    wait_until(lambda: job.status() == "queued", "the job recorded")
    assert job.cancel() is True
    assert job.status() == "cancelled"
    assert redis_client.xlen(stream_key(prefix, "nobody")) == 0  # it never runs
    assert job.cancel() is False  # it ended already
    with pytest.raises(qs.Cancelled):
        job.result(timeout=5)


def test_a_job_refused_for_max_queue_leaves_no_record_and_an_admitted_one_says_where_it_waits(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a serving with max_queue=2 whose executor is held, so nothing is acked
    serving = Recording(
        tag_items, name="fulljobs", batch_size=4, batch_timeout=0, max_queue=2, gated=True
    )
    start_worker(serving)
    admitted = client.submit("fulljobs", ["a", "b"], keep=60)
    refused = client.submit("fulljobs", ["c"], keep=60)
    with pytest.raises(qs.QueueFull):
        refused.result(timeout=30)
    # the refused job has no record; the admitted one's names its stream and entry, written
    # in the same step as the entry (enqueue.lua)
    assert record(redis_client, prefix, refused.id) is None
    kept = record(redis_client, prefix, admitted.id)
    assert kept is not None
    items, _keep, name, entry, stream = kept.split(b":", 4)
    assert (items, name) == (b"2", b"fulljobs")
    assert stream == stream_key(prefix, "fulljobs").encode()
    assert redis_client.xrange(stream, entry, entry)
    serving.release()
    assert client.job(admitted.id).result(timeout=30) == ["r:a", "r:b"]


def test_cancel_by_id_of_a_running_job_keeps_no_answer_and_it_stays_cancelled(
    start_worker: StartWorker,
    client: qs.Client,
    other: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    serving = Recording(tag_items, gated=True, name="held", batch_size=4, batch_timeout=0)
    start_worker(serving)
    ticket = client.submit("held", ["a"], keep=60)
    job = other.job(ticket.id)
    wait_until(lambda: job.status() == "running", "the job running")

    assert job.cancel() is True
    serving.release()  # the batch ends; its answer for this job is not kept
    wait_until(lambda: redis_client.xlen(stream_key(prefix, "held")) == 0, "entry acked")
    assert job.status() == "cancelled"
    kept = record(redis_client, prefix, ticket.id)
    assert kept is not None and kept.startswith(b"cancelled:") and kept.endswith(b":0:")


def test_cancel_by_id_of_a_packed_job_leaves_the_others_of_its_pack_done(
    start_worker: StartWorker,
    other: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given three jobs in one pack entry (enqueue.lua packs once pack_items is declared)
    keys = Keys(prefix, "packs")
    redis_client.hset(keys.meta, "pack_items", 8)
    broker = RedisBroker(redis_url)
    inbox = f"{prefix}:inbox:packer"
    ids = [f"packer-{rid}" for rid in (1, 2, 3)]
    requests = []
    for rid, item in zip((1, 2, 3), "abc", strict=True):
        h, p = encode_request(
            get_codec("msgpack"),
            rid,
            [item],
            inbox,
            None,
            fields={"job_keep": 60_000},
        )
        requests.append(("default", 1, h, p, 0))
    at = [
        (i, group_key(prefix, "packer", rid), str(rid), 60_000) for i, rid in enumerate((1, 2, 3))
    ]
    jobs = Jobs(redis_client, redis_url)
    made = jobs.created(keys, requests, at, False)  # as a client on a cluster writes them
    reply = broker.enqueue(keys, requests, 0)
    assert len(set(reply[2])) == 1  # one pack
    jobs.placed(keys, requests, at, reply, made)

    # When the second is cancelled by id, then a worker runs the pack
    assert other.job(ids[1]).cancel() is True
    start_worker(qs.Serving(tag_items, name="packs", batch_size=8, batch_timeout=0))

    # Then the others end done, and the cancelled one stays cancelled, its answer not kept
    assert other.job(ids[0]).result(timeout=30) == ["r:a"]
    assert other.job(ids[2]).result(timeout=30) == ["r:c"]
    assert other.job(ids[1]).status() == "cancelled"
    kept = record(redis_client, prefix, ids[1])
    assert kept is not None and kept.startswith(b"cancelled:") and kept.endswith(b":0:")


def test_a_sigkilled_submitter_s_job_is_still_answered_and_fetched(
    start_worker: StartWorker, other: qs.Client, redis_url: str, prefix: str
) -> None:
    # Given a process that submitted a job (no worker yet) and was SIGKILLed
    code = (
        "ticket = client.submit('orphaned', ['x'], keep=60)\n"
        "job = client.job(ticket.id)\n"
        "import time\n"
        "while job.status() != 'queued': time.sleep(0.01)\n"
        "print(ticket.id, flush=True)\n"
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    script = (
        f"import queueserve as qs\nclient = qs.Client({redis_url!r}, prefix={prefix!r})\n" + code
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == -9, done.stderr
    job_id = done.stdout.strip()

    # When a worker starts, then the job is answered and fetched by its id
    start_worker(qs.Serving(tag_items, name="orphaned", batch_size=4, batch_timeout=0))
    assert other.job(job_id).result(timeout=30) == ["r:x"]
    assert other.job(job_id).status() == "done"


def test_a_sigkilled_worker_s_job_still_ends_done_once(
    workers: Workers, other: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker that dies mid-batch (the "slow" serving waits for its gate on "long")
    first = workers.start("slow")
    ticket = other.submit("slow", ["long"], keep=60)
    rec = f"{prefix}:fault"
    wait_until(lambda: redis_client.llen(f"{rec}:exec") >= 1, "batch started", process=first)
    first.kill_group()

    # When another worker reclaims and runs it
    redis_client.set(f"{rec}:go", 1)
    second = workers.start("slow")
    job = other.job(ticket.id)
    assert job.result(timeout=60) == ["done:long"]

    # Then it ended done, with one answer kept
    wait_until(lambda: job.status() == "done", "done", process=second)
    kept = record(redis_client, prefix, ticket.id)
    assert kept is not None and kept.startswith(b"done:")
    assert kept.split(b":")[4] == b"1"  # one message: the first answer alone


def test_expiry_frees_a_job_s_memory(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    start_worker(qs.Serving(tag_items, name="brief", batch_size=4, batch_timeout=0))
    ticket = client.submit("brief", ["a"], keep=0.3)
    job = client.job(ticket.id)
    assert job.result(timeout=30) == ["r:a"]
    assert 0 < redis_client.pttl(group_of(prefix, ticket.id)) <= 300
    wait_until(lambda: job.status() == "expired", "the record expired")
    wait_until(lambda: not redis_client.exists(group_of(prefix, ticket.id)), "memory freed")
    with pytest.raises(qs.QueueServeError, match="keep passed"):
        job.result()


def test_forget_deletes_a_job_s_record(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    start_worker(qs.Serving(tag_items, name="forgotten", batch_size=4, batch_timeout=0))
    ticket = client.submit("forgotten", ["a"], keep=60)
    job = client.job(ticket.id)
    assert job.result(timeout=30) == ["r:a"]
    assert job.forget() is True
    assert job.status() == "expired" and record(redis_client, prefix, ticket.id) is None
    # its group keeps the reply message it may share with other jobs until the last keep
    assert 0 < redis_client.pttl(group_of(prefix, ticket.id)) <= 60_000


def test_an_answer_over_the_job_size_limit_ends_it_failed_with_a_clear_error(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("queueserve.broker.replies.MAX_JOB_BYTES", 1000)
    start_worker(qs.Serving(lambda xs: ["x" * 5000 for _ in xs], name="big", batch_size=4))
    ticket = client.submit("big", ["a"], keep=60)
    assert ticket.result() == ["x" * 5000]  # its submitter still gets it
    job = client.job(ticket.id)
    with pytest.raises(qs.QueueServeError, match="over 1000 bytes, the most one job keeps"):
        job.result(timeout=30)
    assert job.status() == "failed"
    # and its group keeps none of that answer
    group = redis_client.hkeys(group_of(prefix, ticket.id))
    assert not [f for f in group if f.startswith(b"m")], group


def test_forged_job_records_and_ids_are_refused_with_a_clear_error(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Ids that would name a key outside this prefix's job records
    for bad in ("../x", "a:b-1", "{tag}-1", "x" * 100 + "-1", "nodash", "c-007", 7):
        with pytest.raises(ValueError, match="is not a job id"):
            client.job(bad)  # type: ignore[arg-type]
    # A record whose field is no waiting job's nor ended one's, whose counts are no counts,
    # that names answers its group does not hold, or holds an answer that is no answer
    ends = b"%d" % (time.time() * 1000 + 600_000)
    forged = {
        "f1-1": {"1": b"exploded"},
        "f1-2": {"2": b"done:" + ends + b":many:1:"},
        "f1-3": {"3": b"done:" + ends + b":1:10:5"},
        "f1-4": {"4": b"done:" + ends + b":1:10:" + b"1 " * 2_000_000},
        "f1-5": {"5": b"done:" + ends + b":1:10:1", "m1": b"\x00garbage"},
        "f1-6": {"6": b"2:60000:s::", "6.a": b"lots:0:"},
        "f1-7": {"7": b"%d:60000:s::" % (1 << 40)},  # a reader makes no room for that many
    }
    for job_id, fields in forged.items():
        redis_client.hset(group_of(prefix, job_id), mapping=fields)
        # (progress: it reads a record and its answers, and never waits for an end)
        with pytest.raises(qs.QueueServeError, match=f"job {job_id}'s record"):
            client.job(job_id).progress()
    # a count no job can have is refused as such, before any room is made for it
    with pytest.raises(qs.QueueServeError, match="has a bad '7' field"):
        client.job("f1-7").progress()


def test_a_forged_job_field_in_a_header_is_answered_with_no_record_and_the_reason_logged(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    start_worker(qs.Serving(tag_items, name="strict", batch_size=4, batch_timeout=0))
    keys = Keys(prefix, "strict")
    inbox = RawInbox(redis_client, prefix, "forger")
    forged = ({"job_keep": "1000"}, {"job_keep": -5}, {"job_keep": 10**12})
    requests = []
    for rid, fields in enumerate(forged, start=1):
        h, p = encode_request(get_codec("msgpack"), rid, ["a"], inbox.key, None, fields=fields)
        requests.append(("default", 1, h, p, 0))
    RedisBroker(redis_url).enqueue(keys, requests, 0)
    # Each caller is answered, its admitted items released, and no job key is written
    wait_until(lambda: inbox.answered([1, 2, 3]), "every forger answered")
    assert all(inbox.slices[rid][0][3] == ["r:a"] for rid in (1, 2, 3))
    wait_until(lambda: int(redis_client.get(keys.queued) or 0) == 0, "admission released")
    assert not redis_client.keys(f"{prefix}:jobs:*")
    assert caplog.text.count("'job_keep' must be ms") == 3


async def test_an_async_client_submits_follows_and_cancels_jobs(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    start_worker(qs.Serving(tag_items, name="asyncjobs", batch_size=4, batch_timeout=0))
    async with qs.AsyncClient(redis_url, prefix=prefix) as client:
        ticket = await client.submit("asyncjobs", ["a"], keep=60)
        job = client.job(await ticket.id)
        assert await job.result(timeout=30) == ["r:a"]
        assert await job.status() == "done"
        assert (await job.progress())[:2] == (1, 1)
        queued = client.job(await (await client.submit("nobody", ["b"], keep=60)).id)
        assert await queued.cancel() is True
        assert await queued.status() == "cancelled"
        assert await job.forget() is True


async def test_an_async_job_s_id_is_awaited_until_the_job_is_in_redis(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    start_worker(qs.Serving(tag_items, name="asyncsent", batch_size=4, batch_timeout=0))
    async with qs.AsyncClient(redis_url, prefix=prefix) as client:
        assert await client.dispatch("asyncsent", "warm") == "r:warm"  # declared, looked up

        async def first() -> None:  # sending its job while the second's waits in the outbox
            await client.submit("asyncsent", ["a"], keep=60)

        async def second() -> int:
            ticket = await client.submit("asyncsent", ["b"], keep=60)
            job_id = await ticket.id
            # Asked with a sync call: nothing else runs on the loop meanwhile
            return int(redis_client.hexists(*job_place(prefix, job_id)))

        sending = asyncio.create_task(first())
        await asyncio.sleep(0)
        assert client._outbox.flushing  # the first is sending
        assert await second() == 1
        await sending


def test_keep_is_checked_and_a_job_is_one_request(client: qs.Client) -> None:
    for bad in (0, -1, "60", True, 10**9):
        with pytest.raises(ValueError, match="keep must be"):
            client.submit("nobody", ["a"], keep=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a job is one request"):
        client.submit(
            qs.Serving(tag_items, name="nobody", batch_key=lambda x: x), ["a", "b"], keep=60
        )


def cli(redis_url: str, prefix: str, *args: str) -> tuple[int, dict]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "job",
            *args,
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, json.loads(done.stdout) if done.stdout else {"stderr": done.stderr}


def test_queueserve_job_shows_waits_for_and_cancels_a_job_as_json(
    start_worker: StartWorker, client: qs.Client, redis_url: str, prefix: str
) -> None:
    queued = client.submit("cliwait", ["a"], keep=60)
    code, shown = cli(redis_url, prefix, "show", queued.id)
    assert code == 0
    assert shown == {"id": queued.id, "status": "queued", "progress": {"done": 0, "total": 1}}

    start_worker(qs.Serving(tag_items, name="cliwait", batch_size=4, batch_timeout=0))
    code, waited = cli(redis_url, prefix, "wait", queued.id, "--timeout", "30")
    assert code == 0 and waited["status"] == "done" and waited["result"] == ["r:a"]

    other = client.submit("clinobody", ["b"], keep=60)
    code, cancelled = cli(redis_url, prefix, "cancel", other.id)
    assert code == 0 and cancelled == {"id": other.id, "cancelled": True, "status": "cancelled"}
    code, failed = cli(redis_url, prefix, "wait", other.id)
    assert code == 1 and "was cancelled" in failed["error"]


def test_a_job_group_key_of_another_type_costs_only_its_own_jobs_records(
    start_worker: StartWorker,
    client: qs.Client,
    other: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker held on a batch, and two jobs of two clients (two record groups) that
    # will share one batch
    serving = Recording(tag_items, gated=True, name="shared", batch_size=8, batch_timeout=0)
    start_worker(serving)
    first = client.submit("shared", ["a"], keep=60)
    second = other.submit("shared", ["b"], keep=60)
    wait_until(lambda: other.job(second.id).status() == "running", "both read")
    # When someone makes the first job's group a list before the reply
    key = group_of(prefix, first.id)
    redis_client.delete(key)
    redis_client.rpush(key, "junk")
    serving.release()
    # Then both callers are answered, and the second job's record keeps its answer
    assert first.result(timeout=30) == ["r:a"] and second.result(timeout=30) == ["r:b"]
    assert other.job(second.id).result(timeout=30) == ["r:b"]
    assert redis_client.lrange(key, 0, -1) == [b"junk"]


@pytest.mark.parametrize("declared", ["trace", "trace,job,keep,tenant"])
def test_a_job_for_workers_that_do_not_keep_jobs_is_refused_before_sending(
    client: qs.Client, redis_client: redis.Redis, prefix: str, declared: str
) -> None:
    # Workers of a version before jobs, or of the first jobs release (one key per job, the
    # header's 'job' and 'keep'): their meta hash lists no 'job_keep' among header_fields
    keys = Keys(prefix, "older")
    redis_client.hset(keys.meta, mapping={"codec": "msgpack", "header_fields": declared})
    with pytest.raises(ValueError, match="do not keep jobs"):
        client.submit("older", ["a"], keep=60)
    assert not redis_client.exists(stream_key(prefix, "older"))


def test_a_job_s_progress_carries_the_last_hook_event_of_its_batches(
    start_worker: StartWorker, client: qs.Client, other: qs.Client, redis_url: str, prefix: str
) -> None:
    def counting(xs: list[str]) -> list[str]:
        for i in range(len(xs)):
            qs.emit("progress", {"done": i + 1, "of": len(xs)})
        return [f"r:{x}" for x in xs]

    serving = qs.Serving(counting, name="counting", batch_size=4, batch_timeout=0)
    start_worker(serving.streaming(hooks=["progress"]))
    ticket = client.submit("counting", ["a", "b", "c"], keep=60)
    job = other.job(ticket.id)
    assert job.result(timeout=30) == ["r:a", "r:b", "r:c"]
    done, total, hook = job.progress()
    assert (done, total) == (3, 3)
    assert hook is not None and (hook.name, hook.payload) == ("progress", {"done": 3, "of": 3})
    code, shown = cli(redis_url, prefix, "show", ticket.id)
    assert code == 0
    assert shown["progress"]["hook"] == {"name": "progress", "payload": {"done": 3, "of": 3}}


def test_a_forged_record_s_stream_is_looked_at_only_within_the_prefix(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a stream outside this prefix with an entry a consumer holds, and queued job
    # records that name it, or a key of the prefix that is no request stream of their serving
    outside = f"{prefix}-other:stream"
    entry = redis_client.xadd(outside, {"x": "1"})
    redis_client.xgroup_create(outside, "qs", id="0")
    redis_client.xreadgroup("qs", "c", {outside: ">"})
    waiting = f"1:60000:s:{entry}:"
    redis_client.hset(group_of(prefix, "f2-1"), "1", waiting + outside)
    redis_client.hset(group_of(prefix, "f2-2"), "2", waiting + f"{prefix}:{{s}}:meta")
    try:
        # Then the status never reads the key outside: queued, as the record says
        assert client.job("f2-1").status() == "queued"
        # and a stream the serving does not have is refused, saying so
        with pytest.raises(qs.QueueServeError, match="was not written by queueserve"):
            client.job("f2-2").status()
    finally:
        redis_client.delete(outside)


def test_a_job_past_its_keep_reads_expired_while_a_job_of_its_group_waits_on(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given two jobs of one client (one record group): one answered with a short keep, one
    # that waits behind a held batch
    start_worker(qs.Serving(tag_items, name="quick", batch_size=4, batch_timeout=0))
    held = Recording(tag_items, gated=True, name="stuck", batch_size=4, batch_timeout=0)
    start_worker(held)
    brief = client.submit("quick", ["a"], keep=0.3)
    waiting = client.submit("stuck", ["b"], keep=60)
    assert group_of(prefix, brief.id) == group_of(prefix, waiting.id)
    assert client.job(brief.id).result(timeout=30) == ["r:a"]
    # When the short keep passes
    wait_until(lambda: client.job(brief.id).status() == "expired", "its keep passed")
    # Then the other job's record lives on (the group keeps a week's TTL while one of its
    # jobs waits), and ends done with its own keep
    assert client.job(waiting.id).status() in ("queued", "running")
    assert redis_client.pttl(group_of(prefix, waiting.id)) > 60_000
    held.release()
    assert client.job(waiting.id).result(timeout=30) == ["r:b"]
    assert 0 < redis_client.pttl(group_of(prefix, waiting.id)) <= 60_000
    with pytest.raises(qs.QueueServeError, match="keep passed"):
        client.job(brief.id).result()


def test_a_job_forgotten_while_queued_is_not_made_again_by_its_answer(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    ticket = client.submit("later", ["a"], keep=60, timeout=60)
    assert client.job(ticket.id).forget() is True
    start_worker(qs.Serving(tag_items, name="later", batch_size=4, batch_timeout=0))
    assert ticket.result(timeout=30) == ["r:a"]  # its submitter is answered as ever
    assert client.job(ticket.id).status() == "expired"
    assert record(redis_client, prefix, ticket.id) is None
    # no job of its group waits or ended: the group is gone
    assert not redis_client.exists(group_of(prefix, ticket.id))


def test_a_group_s_ttl_never_falls_below_the_keep_an_ended_job_has_left(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a job kept 30 days that ends while another job of its group waits
    start_worker(qs.Serving(tag_items, name="quick", batch_size=4, batch_timeout=0))
    start_worker(Recording(tag_items, gated=True, name="stuck", batch_size=4, batch_timeout=0))
    month = 30 * 24 * 3600
    kept = client.submit("quick", ["a"], keep=month)
    waiting = client.submit("stuck", ["b"], keep=60)
    assert kept.result(timeout=30) == ["r:a"]
    group = group_of(prefix, kept.id)
    wait_until(lambda: client.job(kept.id).status() == "done", "its record ended")
    # Then the group stays a month, not the week a waiting job would give it, and a later
    # job of the group does not cut that
    assert redis_client.pttl(group) > (month - 60) * 1000
    later = client.submit("stuck", ["c"], keep=60)
    assert group_of(prefix, later.id) == group
    assert client.job(later.id).status() in ("queued", "running")  # (its id: once in Redis)
    assert redis_client.pttl(group) > (month - 60) * 1000
    assert client.job(waiting.id).status() in ("queued", "running")


def test_a_job_sent_twice_is_one_waiting_job_of_its_group(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # A send retried after a lost reply enqueues its requests again: the job's field is
    # written again, and its group still counts one job waiting, so its TTL drops to its
    # keep once that job ends
    keys = Keys(prefix, "twice")
    inbox = f"{prefix}:inbox:twicer"
    h, p = encode_request(get_codec("msgpack"), 5, ["a"], inbox, None, fields={"job_keep": 1000})
    at = [(0, group_key(prefix, "twicer", 5), "5", 1000)]
    broker = RedisBroker(redis_url)
    for _ in range(2):
        broker.enqueue(keys, [("default", 1, h, p, 0)], 0, jobs=at)
    assert redis_client.hget(at[0][1], "live") == b"1"


def test_cancelling_a_job_s_ticket_ends_its_record_cancelled(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    ticket = client.submit("nobodyyet", ["a"], keep=60)
    job = client.job(ticket.id)
    assert job.status() == "queued"
    assert ticket.cancel() is True
    assert job.status() == "cancelled"
    # no job of its group waits any more: the group goes with the cancelled job's keep
    assert 0 < redis_client.pttl(group_of(prefix, ticket.id)) <= 60_000


def test_the_answer_of_a_job_over_the_size_limit_is_not_kept_beside_another_job_s(
    redis_client: redis.Redis, prefix: str
) -> None:
    # Given a group with two waiting jobs, and a worker's write (job.lua) of one round trip
    # whose messages are each job's own: job 1's over the size limit, job 2's small
    group = group_key(prefix, "mixer", 1)
    redis_client.hset(group, mapping={"1": b"1:60000:s::", "2": b"1:60000:s::", "live": 2})
    job_lua = redis_client.register_script((LUA / "job.lua").read_text())
    big, small = b"m" + b"x" * 2_000, b"m" + b"small"
    jobs = [["1", True, False, [1], len(big), b""], ["2", True, False, [2], len(small), b""]]
    job_lua(keys=[group], args=[1_000, *job_writes([big, small], jobs, [], 0.0)])
    # Then job 1 ends failed, job 2 done, and the group keeps job 2's message alone
    fields = redis_client.hgetall(group)
    assert fields[b"1"].startswith(b"failed:") and fields[b"2"].startswith(b"done:")
    assert [f for f in fields if f.startswith(b"m")] == [b"m2"]
    assert fields[b"m2"] == small


def end_job(redis_client: redis.Redis, group: str, plain: str) -> None:
    """job.lua as the worker calls it for plain jobs ``plain`` (request ids) of ``group``."""
    job_lua = redis_client.register_script((LUA / "job.lua").read_text())
    job_lua(keys=[group], args=[1 << 20, *job_writes([b"m-answer"], [], plain.split(), 1.0)])


def test_a_send_tried_again_leaves_a_job_that_ended_meanwhile_as_it_ended(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a job enqueued, answered and ended, whose send is then tried again (its reply
    # was lost), as it was, and then a second job of its group that waits
    keys = Keys(prefix, "again")
    inbox = f"{prefix}:inbox:againer"
    group = group_key(prefix, "againer", 5)
    codec = get_codec("msgpack")
    broker = RedisBroker(redis_url)
    first = encode_request(codec, 5, ["a"], inbox, None, fields={"job_keep": 1000})
    broker.enqueue(keys, [("default", 1, *first, 0)], 0, jobs=[(0, group, "5", 1000)])
    end_job(redis_client, group, "5")
    broker.enqueue(keys, [("default", 1, *first, 0)], 0, jobs=[(0, group, "5", 1000)], again=True)
    second = encode_request(codec, 6, ["b"], inbox, None, fields={"job_keep": 1000})
    broker.enqueue(keys, [("default", 1, *second, 0)], 0, jobs=[(0, group, "6", 1000)])
    # When the first job's entry runs again
    end_job(redis_client, group, "5")
    # Then it stays as it ended, and its group counts the second job waiting, a week's TTL
    assert redis_client.hget(group, "5").startswith(b"done:")
    assert redis_client.hget(group, "live") == b"1"
    assert redis_client.pttl(group) > 3_600_000


def test_a_refused_cluster_job_goes_only_when_this_send_made_it(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    keys = Keys(prefix, "placing")
    requests = [("default", 1, b"h", b"p", 0)]
    at = [(0, group_key(prefix, "placer", 3), "3", 60_000)]
    jobs = Jobs(redis_client, redis_url)
    refused = (1, 1, [0])
    # A first try refused: its field goes, and with no job left its group
    made = jobs.created(keys, requests, at, False)
    assert made == {"3"}
    jobs.placed(keys, requests, at, refused, made)
    assert not redis_client.exists(at[0][1])
    # A first try admitted whose reply was lost, then its retry refused (the first entry
    # fills max_queue): the field of the first try stays, where it waits
    made = jobs.created(keys, requests, at, False)
    jobs.placed(keys, requests, at, (1, 1, [b"1-1"]), made)
    made = jobs.created(keys, requests, at, True)
    assert made == set()
    jobs.placed(keys, requests, at, refused, made)
    assert redis_client.hget(at[0][1], "3").split(b":")[3] == b"1-1"
    assert redis_client.hget(at[0][1], "live") == b"1"


def test_one_request_id_twice_in_a_worker_s_write_ends_its_job_once(
    redis_client: redis.Redis, prefix: str
) -> None:
    group = group_key(prefix, "twin", 1)
    waiting = b"1:60000:s::"
    redis_client.hset(group, mapping={"1": waiting, "2": waiting, "live": 2})
    end_job(redis_client, group, "1 1")  # (a forged entry's copy of a request)
    assert redis_client.hget(group, "live") == b"1"
    assert redis_client.pttl(group) == -1 or redis_client.pttl(group) > 60_000


def test_cancel_and_forget_by_id_free_a_group_only_when_none_of_its_jobs_waits(
    client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    waiting = b"1:60000:s::"
    week = 7 * 24 * 3600 * 1000
    # A group with one ended job (its keep a minute) and two waiting ones
    group = group_key(prefix, "ender", 1)
    redis_client.hset(group, mapping={"1": waiting, "2": waiting, "3": waiting, "live": 3})
    redis_client.pexpire(group, week)
    end_job(redis_client, group, "1")
    assert redis_client.pttl(group) > week - 60_000  # two wait
    # Cancel one: the other still waits, so the group keeps its TTL
    assert client.job("ender-2").cancel() is True
    assert redis_client.pttl(group) > week - 60_000
    # Forget the last waiting one: none waits, the group goes with the last keep
    assert client.job("ender-3").forget() is True
    assert 0 < redis_client.pttl(group) <= 60_000
    assert client.job("ender-1").status() == "done"
    # A group whose count someone made unreadable is never freed early by a forget
    other = group_key(prefix, "ender2", 1)
    redis_client.hset(other, mapping={"1": waiting, "2": waiting, "live": "junk"})
    redis_client.pexpire(other, week)
    assert client.job("ender2-1").forget() is True
    assert redis_client.hget(other, "2") == waiting and redis_client.pttl(other) > week - 60_000
