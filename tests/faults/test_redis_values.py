"""Values read from Redis outside request entries (docs/guarantees.md, "Values read from Redis"
and "Encodings"): the cancel channel, the run-time config and meta hashes are written by
anyone who can write to Redis. A bad value is logged and ignored, never the end of a thread,
of a partition, or of every call to a serving; and no field joined into a message, no prefix
and no URL password breaks what it is joined into.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import redis

import queueserve as qs
from queueserve.options.stored import parse_assignments, parse_declared
from queueserve.wire.keys import Keys
from tests.support.helpers import REPO, child_env, stream_key, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]
WAIT_S = 60.0
REQUESTS = 20


def threads_alive(worker: qs.Worker) -> bool:
    host = worker._host
    assert host is not None
    return all(t.is_alive() for runner in host.runners for t in runner.threads)


def answered(client: qs.Client, serving: qs.Serving | str) -> int:
    """How many of REQUESTS concurrent calls get their own answer (a Timeout counts 0)."""
    tickets = [client.submit(serving, [i], timeout=WAIT_S) for i in range(REQUESTS)]
    count = 0
    for i, ticket in enumerate(tickets):
        with contextlib.suppress(qs.Timeout):
            count += ticket.result() == [i]
    return count


def cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queueserve", *args, "--redis-url", redis_url, "--prefix", prefix],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def cancel_a_prefetched_request(
    worker: qs.Worker,
    serving: Recording,
    client: qs.Client,
    pending: Callable[..., int],
    batch_key: str = "default",
) -> None:
    """Given a worker running one gated batch and holding a second request (of ``batch_key``)
    read ahead, cancel the second: it must never run, and the first must be answered."""
    running = client.submit(serving, ["running"])
    wait_until(lambda: serving.batches, "the first batch to start")
    prefetched = client.submit(serving, ["prefetched"], batch_key=batch_key)
    wait_until(
        lambda: (
            pending(serving.name) == 1 and pending(serving.name, batch_key) == 1
            if batch_key != "default"
            else pending(serving.name) == 2
        ),
        "the worker to read the second request ahead",
    )
    assert prefetched.cancel() is False  # read already: the worker is told on pub/sub
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    wait_until(lambda: len(runner.ledger.cancelled) == 1, "the worker to learn of the cancel")
    serving.release()
    assert running.result(WAIT_S) == ["running"]
    with pytest.raises(qs.Cancelled):
        prefetched.result(WAIT_S)
    assert client.dispatch(serving, "after", timeout=WAIT_S) == "after"
    assert serving.items_run == ["running", "after"]


# --- the cancel channel -----------------------------------------------------------------------
def test_junk_on_the_cancel_channel_is_ignored_and_cancels_still_work(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    pending: Callable[..., int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker listening on its cancel channel
    serving = Recording(name="junkcancel", batch_size=1, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    channel = f"{prefix}:{{junkcancel}}:cancel"
    wait_until(lambda: redis_client.pubsub_numsub(channel)[0][1] == 1, "the cancel listener")

    # When anyone publishes what is not a cancel of one of its entries
    stream = stream_key(prefix, "junkcancel")
    junk = [
        b"\xff\xfe\n1-1",
        b"no separator",
        b"\n",
        b"\xc3(" * 50_000 + b"\n2-2",
        f"{prefix}:{{other}}:in:default\n1-1".encode(),
        f"{stream}\nnot-an-id".encode(),
    ]
    with caplog.at_level(logging.WARNING, logger="queueserve"):
        for message in junk:
            assert redis_client.publish(channel, message) == 1

        # Then its listener lives on: a real cancel still keeps a prefetched request from
        # running, and every thread of the partition is alive
        cancel_a_prefetched_request(worker, serving, client, pending)
    assert threads_alive(worker)
    noted = [r for r in caplog.records if "is not a cancel" in r.getMessage()]
    assert len(noted) == 1, "said once, not once per message"


def test_a_batch_key_holding_a_newline_is_cancelled_like_any_other(
    start_worker: StartWorker,
    client: qs.Client,
    pending: Callable[..., int],
) -> None:
    # Given a request read ahead under a batch key that holds the cancel format's separator,
    # when it is cancelled, then it never runs (it used to run: the worker split the message
    # at the key's newline and looked for an entry that does not exist)
    serving = Recording(name="nlkey", batch_size=1, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    cancel_a_prefetched_request(worker, serving, client, pending, batch_key="tenant\n7-7")
    assert threads_alive(worker)


# --- run-time config (P:{S}:config) ----------------------------------------------------------
BAD_CONFIG = [
    ("batch_timeout", "10000000000", "batch_timeout must be a duration from 0 to 3600s"),
    ("key_idle_ttl", "1" + "0" * 400, "key_idle_ttl must be a duration from 0 to 31622400s"),
    ("batch_size", str(10**19), "batch_size must be an int from 1 to 1000000000"),
]


@pytest.mark.parametrize(("option", "value", "message"), BAD_CONFIG, ids=[c[0] for c in BAD_CONFIG])
def test_a_stored_config_value_a_worker_refuses_is_logged_and_ignored_and_config_set_refuses_it(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    option: str,
    value: str,
    message: str,
) -> None:
    # Given a value written straight into the serving's config hash, beside a good one, before
    # its workers start (it stays there: every worker that starts reads it)
    config = f"{prefix}:{{badconf}}:config"
    redis_client.hset(config, mapping={option: value, "max_reply_bytes": "2048"})
    serving = Recording(name="badconf", batch_size=4, batch_timeout=0.005)

    # When a worker starts and serves
    with caplog.at_level(logging.WARNING, logger="queueserve"):
        worker = start_worker(serving)
        refused = wait_until(
            lambda: [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()],
            "the worker to say it ignored the value",
        )

    # Then it says which value it ignored and why, applies the good one, and answers every
    # call with every thread alive (batch_timeout overflowed Condition.wait, key_idle_ttl the
    # sweep, batch_size XREADGROUP's COUNT: each stopped the partition, or every read)
    assert len(refused) == 1 and option in refused[0] and message in refused[0], refused
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    assert runner.serving.max_reply_bytes == 2048
    assert answered(client, serving) == REQUESTS
    assert threads_alive(worker)
    # and `config set` refuses the same value, with the same words, storing nothing
    redis_client.hdel(config, option)
    with pytest.raises(ValueError, match=message):
        parse_assignments([f"{option}={value}"])
    done = cli(redis_url, prefix, "config", "set", "badconf", f"{option}={value}")
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not redis_client.hexists(config, option)


def test_a_config_field_that_is_not_utf8_is_ignored(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    serving = Recording(name="binconf", batch_size=4, batch_timeout=0.005)
    worker = start_worker(serving)
    assert client.dispatch(serving, "before", timeout=WAIT_S) == "before"
    # When a running worker's config hash gets bytes that are not UTF-8, in a value and a name
    with caplog.at_level(logging.WARNING, logger="queueserve"):
        redis_client.hset(
            f"{prefix}:{{binconf}}:config", mapping={"batch_size": b"\xff\xfe", b"\xc3(": b"1"}
        )
        wait_until(
            lambda: sum("ignored" in r.getMessage() for r in caplog.records) == 2,
            "the worker to say it ignored both fields",
        )
    # Then it serves on (the read used to raise UnicodeDecodeError on the reader thread)
    assert answered(client, serving) == REQUESTS
    assert threads_alive(worker)


# --- declared options (P:{S}:meta) as clients read them ---------------------------------------
BAD_META = [
    ("shards", "64"),  # no worker reads shards 1..63: every call sent there waited for ever
    ("shards", "1024"),
    ("max_payload_bytes", "abc"),  # the client raised ValueError on every call
    ("batch_size", b"\xff"),
    ("streaming", "perhaps"),
    ("max_queue", "abc"),  # enqueue.lua compared nil with a number: every send failed
    ("max_queue", "1.5"),  # a fraction, taken as the limit: QueueFull for every caller
    ("max_queue", "1e-07"),
]


@pytest.mark.parametrize(("field", "value"), BAD_META, ids=[f"{f}={v!r}" for f, v in BAD_META])
def test_a_forged_meta_field_does_not_stop_clients_that_name_the_serving(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    field: str,
    value: str | bytes,
) -> None:
    # Given a serving a worker declared, one shard, and stopped: its declaration stays, and
    # no worker writes it back while the client reads it
    start_worker(Recording(name="forged", batch_size=4, batch_timeout=0.005)).stop(timeout=10.0)
    meta = f"{prefix}:{{forged}}:meta"
    assert redis_client.hget(meta, "codec")

    # When one write changes a field of its meta hash, a new client names the serving, and
    # a worker starts
    redis_client.hset(meta, field, value)
    with (
        caplog.at_level(logging.WARNING, logger="queueserve"),
        qs.Client(redis_url, prefix=prefix) as client,
    ):
        tickets = [client.submit("forged", [i], timeout=WAIT_S) for i in range(REQUESTS)]
        said = [r.getMessage() for r in caplog.records]  # the client's, before any worker's
        worker = start_worker(Recording(name="forged", batch_size=4, batch_timeout=0.005))
        # Then every call is answered, and the client said what it ignored
        assert [t.result() for t in tickets] == [[i] for i in range(REQUESTS)]
    assert threads_alive(worker)
    if field != "max_queue":  # read by enqueue.lua only, which falls back to the client's
        assert any(field in m for m in said), caplog.text


def test_shards_declared_by_the_workers_are_used(
    start_worker: StartWorker,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a serving of three shards (the count declared on shard 0 and on the last shard)
    serving = Recording(name="sharded", batch_size=4, batch_timeout=0.005, shards=3)
    start_worker(serving)
    wait_until(
        lambda: redis_client.hget(f"{prefix}:{{sharded}}:meta", "shards") == b"3", "the declaration"
    )
    # When a client names it, then its calls spread over the three shards
    with qs.Client(redis_url, prefix=prefix) as client:
        assert answered(client, "sharded") == REQUESTS
        target = client._core.targets.cached("sharded")
        assert target is not None and len(target.shards) == 3


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_forged_shard_count_over_a_last_shard_key_of_another_type_stops_no_client(
    start_worker: StartWorker, redis_url: str, prefix: str, redis_client: redis.Redis, kind: str
) -> None:
    # Given a serving of one shard, whose meta hash someone gave 64 shards and whose 64th
    # shard's meta key someone made a string (the client reads it to confirm the count)
    start_worker(Recording(name="typed", batch_size=4, batch_timeout=0.005))
    keys = Keys(prefix, "typed")
    wait_until(lambda: redis_client.hget(keys.meta, "codec"), "the declaration")
    redis_client.hset(keys.meta, "shards", "64")
    redis_client.set(keys.last_shard(64).meta, "junk")
    # When clients name the serving, then every call is answered from shard 0 (it raised
    # WRONGTYPE on every call)
    if kind == "sync":
        with qs.Client(redis_url, prefix=prefix) as client:
            assert answered(client, "typed") == REQUESTS
        return

    async def calls() -> list[object]:
        async with qs.AsyncClient(redis_url, prefix=prefix) as client:
            return list(
                await asyncio.gather(
                    *(client.dispatch("typed", i, timeout=WAIT_S) for i in range(REQUESTS))
                )
            )

    assert asyncio.run(calls()) == list(range(REQUESTS))


# --- prefixes and URLs ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["a:b", "x{y}", "sp ace", "nl\n"])
def test_a_prefix_is_checked_alike_in_the_environment_the_client_and_the_worker(
    redis_url: str,
    bad: str,
) -> None:
    serving = Recording(name="pfx")
    with pytest.raises(ValueError, match="is not a key namespace") as env_error:
        qs.Settings(prefix=bad)
    with pytest.raises(ValueError, match="is not a key namespace") as client_error:
        qs.Client(redis_url, prefix=bad)
    with pytest.raises(ValueError, match="is not a key namespace") as worker_error:
        qs.Worker(serving, redis_url=redis_url, prefix=bad, handle_signals=False)
    assert str(client_error.value) == str(worker_error.value)
    assert str(client_error.value) in str(env_error.value)


@pytest.mark.parametrize("mark", ["/", "?", "#"])
def test_a_password_with_an_unencoded_separator_is_never_shown_and_the_error_says_to_encode_it(
    redis_client: redis.Redis,
    prefix: str,
    mark: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a password holding '/', '?' or '#', written into a URL as it is (with a user
    # name: without one, such a URL names the default localhost:6379, which a test must
    # not touch)
    secret = f"s3cr{mark}tpart"
    port = redis_client.connection_pool.connection_kwargs["port"]
    url = f"redis://app:{secret}@127.0.0.1:{port}/0"
    # When a worker is started with it
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "worker",
            "tests.support.fault_app:sturdy",
            "--redis-url",
            url,
            "--prefix",
            prefix,
            "--log-level",
            "info",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    # Then it refuses at once, saying to percent-encode, and no part of the password is shown
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "percent-encode" in output and "tpart" not in output and "s3cr" not in output
    with pytest.raises(ValueError, match="percent-encode") as client_error:
        qs.Client(url)
    assert "tpart" not in str(client_error.value)
    # and so is a client given it in the environment (pydantic's error showed its input)
    monkeypatch.setenv("QUEUESERVE_REDIS_URL", url)
    with pytest.raises(ValueError, match="percent-encode") as env_error:
        qs.Client()
    assert "tpart" not in str(env_error.value)


def test_a_cancel_listener_thread_of_a_worker_survives_a_flood_of_junk(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker, when 12,000 cancels of entries it does not hold reach its cancel channel
    # from four publishers
    serving = Recording(name="flood", batch_size=4, batch_timeout=0.005)
    worker = start_worker(serving)
    channel = f"{prefix}:{{flood}}:cancel"
    wait_until(lambda: redis_client.pubsub_numsub(channel)[0][1] == 1, "the cancel listener")
    stream = stream_key(prefix, "flood")

    def publish(part: int) -> None:
        with redis_client.pipeline(transaction=False) as pipe:
            for i in range(3000):
                pipe.publish(channel, f"{stream}\n{part}{i}-0".encode())
            pipe.execute()

    publishers = [threading.Thread(target=publish, args=(p,)) for p in range(1, 5)]
    for t in publishers:
        t.start()
    for t in publishers:
        t.join()
    redis_client.publish(channel, f"{stream}\n9-9".encode())  # heard after all the others
    # Then it serves on, and what it keeps of cancels for entries it does not hold is bounded
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    wait_until(
        lambda: (stream, b"9-9") in runner.ledger.recent_cancels, "the worker to hear them all"
    )
    assert len(runner.ledger.recent_cancels) == 10_000
    assert answered(client, serving) == REQUESTS
    assert threads_alive(worker)


def test_a_forged_shard_count_does_not_stop_async_clients_either(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a worker of one shard and a forged shard count in its meta hash
    serving = Recording(name="aforged", batch_size=4, batch_timeout=0.005)
    start_worker(serving)
    meta = f"{prefix}:{{aforged}}:meta"
    wait_until(lambda: redis_client.hget(meta, "codec"), "the worker to declare the serving")
    redis_client.hset(meta, "shards", "64")

    # When an AsyncClient names the serving, then every call is answered
    async def main() -> list[object]:
        async with qs.AsyncClient(redis_url, prefix=prefix) as client:
            return list(
                await asyncio.gather(
                    *(client.dispatch("aforged", i, timeout=WAIT_S) for i in range(REQUESTS))
                )
            )

    assert asyncio.run(main()) == list(range(REQUESTS))


def test_a_refused_value_is_logged_once_however_often_it_is_read(
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A client reads the meta hash of a serving no worker declared yet on every call
    keys = Keys(prefix, "often")
    with caplog.at_level(logging.WARNING, logger="queueserve"):
        for _ in range(100):
            assert parse_declared({"max_payload_bytes": "abc", "batch_size": "8"}, keys) == {
                "batch_size": 8
            }
    assert sum("ignored" in r.getMessage() for r in caplog.records) == 1


# --- numbers in hashes and sets that stats and metrics read -------------------------------------
def test_digits_that_int_refuses_in_depth_and_ready_do_not_break_stats_or_queue_gauges(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a declared serving whose depth hash and ready set hold what str.isdigit() takes
    # but int() refuses: a superscript two, and 5,000 nines
    from tests.support.broker import RedisBroker

    start_worker(Recording(name="digits", batch_size=4, batch_timeout=0.005))
    keys = Keys(prefix, "digits")
    wait_until(lambda: redis_client.hget(keys.meta, "codec"), "the worker to declare the serving")
    redis_client.hset(keys.depth, mapping={"sup": "²", "long": "9" * 5000})
    redis_client.zadd(keys.ready, {"²sup": 1})
    # When an operator asks for stats, and the metrics collector reads the queue depths
    result = cli(redis_url, prefix, "stats", "digits")
    broker = RedisBroker(redis_url)
    try:
        depths = broker.queue_depths([keys])
    finally:
        broker.close()
    # Then both answer, counting what is not a number as nothing
    assert result.returncode == 0, result.stderr
    assert depths == [], depths


# --- bookkeeping keys of another type at a worker's start -----------------------------------
@pytest.mark.parametrize("kind", ["meta", "config", "workers", "keys", "seen", "ready"])
def test_a_bookkeeping_key_of_another_type_is_cleared_when_a_worker_starts(
    start_worker: StartWorker, redis_url: str, prefix: str, redis_client: redis.Redis, kind: str
) -> None:
    # Given one write that made a serving's bookkeeping key a string (a starting worker's
    # declaration, heartbeat or reads failed on it: no worker of the serving could start)
    keys = Keys(prefix, "junked")
    redis_client.set(getattr(keys, kind), "junk")
    # When a worker starts, then it serves, and the key holds what queueserve writes there
    start_worker(Recording(name="junked", batch_size=4, batch_timeout=0.005))
    with qs.Client(redis_url, prefix=prefix) as client:
        assert answered(client, "junked") == REQUESTS
    assert redis_client.type(getattr(keys, kind)) != b"string"


@pytest.mark.parametrize("forge", ["abc", "0x10", "-5", "list"])
def test_an_admission_counter_holding_no_count_is_replaced_and_the_send_queued_once(
    forge: str, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a serving whose admission counter someone overwrote with junk (or a list)
    keys = Keys(prefix, "junkq")
    redis_client.hset(keys.meta, mapping={"codec": "msgpack", "max_queue": "100"})
    if forge == "list":
        redis_client.rpush(keys.queued, "x")
    else:
        redis_client.set(keys.queued, forge)
    # When a client sends a request of 3 items
    with qs.Client(redis_url, prefix=prefix) as client:
        client.submit("junkq", [1, 2, 3])
        # Then it is queued once, and the counter holds its 3 items (no error after the XADD,
        # which would have made the client send it again)
        wait_until(
            lambda: (
                redis_client.type(keys.queued) == b"string"
                and redis_client.get(keys.queued) == b"3"
            ),
            "the counter replaced",
        )
    assert redis_client.xlen(keys.stream("default")) == 1
