"""The Redis boundary: every redis-py error becomes a queueserve error at queueserve/broker/,
for the sync and the asyncio broker alike; transient ones are ``RedisUnavailable`` (ridden
out by every loop), the rest ``RedisCommandError``; passwords never leave it; only it imports
redis; and an outage is logged once when it begins and once when it ends.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import threading
from pathlib import Path

import pytest
import redis
from redis._parsers.base import BaseParser

import queueserve as qs
from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.redis_errors import redis_errors, translate
from queueserve.broker.retry import Outage, Retry
from queueserve.broker.urls import redact_url
from queueserve.wire.keys import Keys
from tests.support.broker import RedisBroker
from tests.support.helpers import wait_until
from tests.support.redis_server import free_port

URL = "redis://app:s3cret@127.0.0.1:1/0"
PACKAGE = Path(qs.__file__).parent


def reply_error(text: str) -> redis.RedisError:
    """The exception redis-py raises for the error reply ``text`` (its own parser)."""
    error = BaseParser.parse_error(text)
    assert isinstance(error, redis.RedisError)
    return error


def in_pipeline(error: redis.RedisError) -> redis.RedisError:
    """``error`` as redis-py re-raises it from a pipeline: the command is named first."""
    error.args = (f"Command # 1 (XADD k * a b) of pipeline caused error: {error.args[0]}",)
    return error


TRANSIENT = {
    "connection lost": redis.ConnectionError("Connection closed by server."),
    "timeout": redis.TimeoutError("Timeout reading from socket"),
    "LOADING": reply_error("LOADING Redis is loading the dataset in memory"),
    "OOM": reply_error("OOM command not allowed when used memory > 'maxmemory'."),
    "OOM in a pipeline": in_pipeline(reply_error("OOM command not allowed")),
    "READONLY": reply_error("READONLY You can't write against a read only replica."),
    "UNBLOCKED": reply_error(
        "UNBLOCKED force unblock from blocking operation, instance state changed"
    ),
    "NOGROUP": reply_error("NOGROUP No such key 'k' or consumer group 'qs'"),
    "NOGROUP in a pipeline": in_pipeline(reply_error("NOGROUP No such key 'k'")),
    "MASTERDOWN": reply_error("MASTERDOWN Link with MASTER is down"),
    "TRYAGAIN": reply_error("TRYAGAIN Multiple keys request during rehashing of slot"),
    "BUSY": reply_error("BUSY Redis is busy running a script."),
}
PERMANENT = {
    "NOPERM": (reply_error("NOPERM User app has no permissions to run the 'xadd' command"), "ACL"),
    "WRONGTYPE": (
        reply_error("WRONGTYPE Operation against a key holding the wrong kind of value"),
        "prefix",
    ),
    "WRONGPASS": (reply_error("WRONGPASS invalid username-password pair"), "password"),
    "script error": (
        reply_error("ERR user_script:12: Script attempted to access nonexistent global variable"),
        "script",
    ),
    "NOSCRIPT": (reply_error("NOSCRIPT No matching script."), "script"),
    "other reply error": (reply_error("ERR unknown command 'FOO'"), "will fail again"),
    "client-side data error": (redis.DataError("Invalid input of type: 'dict'"), "will fail again"),
}


@pytest.mark.parametrize("error", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_transient_redis_errors_become_redis_unavailable(error: redis.RedisError) -> None:
    mapped = translate(error, URL)
    assert type(mapped) is qs.RedisUnavailable
    words = str(error).split("caused error: ")[-1]
    assert words in str(mapped)  # Redis's own words are kept, a pipeline's arguments not
    assert "XADD in a pipeline" in str(mapped) if "pipeline" in str(error) else True
    assert "s3cret" not in str(mapped)


@pytest.mark.parametrize(("error", "advice"), PERMANENT.values(), ids=PERMANENT.keys())
def test_permanent_redis_errors_become_redis_command_error(
    error: redis.RedisError, advice: str
) -> None:
    mapped = translate(error, URL)
    assert type(mapped) is qs.RedisCommandError
    assert isinstance(mapped, qs.QueueServeError)
    assert str(error) in str(mapped) and advice in str(mapped)
    assert "s3cret" not in str(mapped)


def test_the_context_manager_raises_the_mapped_error_without_the_redis_one() -> None:
    with pytest.raises(qs.RedisUnavailable) as caught, redis_errors(URL):
        raise TRANSIENT["READONLY"]
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://app:s3cret@db:6379/0", "redis://app:***@db:6379/0"),
        ("redis://:s3cret@db:6379/0", "redis://:***@db:6379/0"),
        ("rediss://s3cret@db/1", "rediss://***@db/1"),
        (
            "redis://db:6379/0?password=s3cret&ssl_cert_reqs=none",
            "redis://db:6379/0?password=***&ssl_cert_reqs=none",
        ),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redact_url_hides_passwords_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- the real thing: a server that answers with these errors -----------------------------------
def test_wrongtype_from_a_real_redis_is_a_command_error_sync_and_async(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    # (a meta key of another type reads as no declaration: test_redis_values.py)
    keys = Keys(prefix, "sq")
    redis_client.set(keys.config, "not a hash")
    redis_client.set(keys.workers, "not a sorted set")
    broker = RedisBroker(redis_url)
    try:
        with pytest.raises(qs.RedisCommandError, match="WRONGTYPE"):
            broker.config(keys)
    finally:
        broker.close()

    async def alive() -> None:
        aio = AsyncProducer(redis_url)
        try:
            await aio.alive_workers(keys, 10.0)
        finally:
            await aio.aclose()

    with pytest.raises(qs.RedisCommandError, match="WRONGTYPE"):
        asyncio.run(alive())


def test_noperm_from_a_real_redis_is_a_command_error(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    user = f"{prefix}-reader"
    redis_client.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+@read", "+ping", "+hello", "+auth"],
    )
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        broker = RedisBroker(url)
        try:
            with pytest.raises(qs.RedisCommandError, match=r"NOPERM|no permissions") as caught:
                broker.declare(Keys(prefix, "sq"), {"batch_size": 4})
            assert ":pw@" not in str(caught.value) and ":***@" in str(caught.value)
        finally:
            broker.close()
    finally:
        redis_client.acl_deluser(user)


def test_unblocked_inbox_read_is_unavailable(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    # Given a blocked inbox read (what a failover's REPLICAOF does to it: UNBLOCKED)
    # (every connection of its client named, so the test finds the blocked one)
    broker = RedisBroker(
        redis_url, client=redis.Redis.from_url(redis_url, client_name=f"{prefix}-reader")
    )
    caught: list[BaseException] = []

    def read() -> None:
        try:
            broker.read_inbox(f"{prefix}:inbox", timeout=10)
        except BaseException as e:
            caught.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        # When Redis unblocks it with an error
        def blocked_id() -> int | None:
            for c in redis_client.client_list():
                if c["name"] == f"{prefix}-reader" and c["cmd"] == "blmpop":
                    return int(c["id"])
            return None

        client_id = wait_until(blocked_id, "the inbox read to block")
        redis_client.client_unblock(client_id, error=True)
        reader.join(10)
        # Then the reader gets RedisUnavailable, which every loop rides out
        assert len(caught) == 1 and type(caught[0]) is qs.RedisUnavailable, caught
        assert "UNBLOCKED" in str(caught[0])
    finally:
        reader.join(10)
        broker.close()


def test_an_unreachable_redis_never_shows_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="queueserve")
    url = f"redis://app:s3cret@127.0.0.1:{free_port()}/0"
    with qs.Client(url, prefix="qstredact") as client, pytest.raises(qs.RedisUnavailable) as caught:
        client.dispatch("sq", 1, timeout=0.3)
    assert "s3cret" not in str(caught.value) and "app:***@" in str(caught.value)

    async def dispatch() -> None:
        async with qs.AsyncClient(url, prefix="qstredact") as aclient:
            await aclient.dispatch("sq", 1, timeout=0.3)

    with pytest.raises(qs.RedisUnavailable) as acaught:
        asyncio.run(dispatch())
    assert "s3cret" not in str(acaught.value) and "app:***@" in str(acaught.value)
    assert "s3cret" not in caplog.text


# -- one retry policy, one log line at each end of an outage -----------------------------------
def test_an_outage_seen_by_many_loops_is_logged_once_at_start_and_once_at_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="queueserve.broker.retry")
    outage = Outage("partition 0")
    loops = [Retry(outage, name) for name in ("reader", "replier", "heartbeat")]
    down = qs.RedisUnavailable("Redis at redis://h/0 is unavailable (OOM)")
    for _ in range(5):  # many failed attempts by every loop
        for loop in loops:
            assert loop.failed(down) > 0
    loops[0].succeeded()
    loops[1].succeeded()
    assert outage.ongoing  # the heartbeat still fails: not over yet
    loops[2].succeeded()
    assert not outage.ongoing
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
    assert "partition 0" in lines[0][1] and "unavailable" in lines[0][1]
    assert "reachable again after" in lines[1][1]


def test_retry_run_rides_out_failures_and_backs_off() -> None:
    outage = Outage("test")
    answers: list[Exception | str] = [
        qs.RedisUnavailable("down"),
        qs.RedisCommandError("NOPERM"),
        "ok",
    ]
    waits: list[float] = []

    def operation() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert Retry(outage, "loop").run(operation, sleep=waits.append) == "ok"
    assert len(waits) == 2 and waits[1] > waits[0] > 0
    assert not outage.ongoing


def test_retry_run_gives_up_when_told_and_raises_the_last_error() -> None:
    def down() -> None:
        raise qs.RedisUnavailable("down")

    with pytest.raises(qs.RedisUnavailable):
        Retry(Outage("test"), "loop").run(down, keep_going=lambda: False, sleep=lambda _s: None)


# -- the boundary itself -----------------------------------------------------------------------
def test_only_the_broker_package_imports_redis() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "broker":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "redis" or n.startswith("redis.") for n in names):
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_no_module_outside_the_broker_reaches_into_its_redis_client() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "broker"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "redis"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "broker"
    ]
    assert offenders == []
