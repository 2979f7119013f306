"""The Redis fixtures themselves: the rest of the suite stands on them."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from tests.support.redis_server import REDIS_URL_ENV, prefixed_client, start_redis_server


def test_session_server_answers_ping(redis_client: redis.Redis) -> None:
    assert redis_client.ping() is True


def test_session_server_is_the_given_one_or_a_private_one(redis_url: str) -> None:
    given = os.environ.get(REDIS_URL_ENV)
    if given:
        assert redis_url == given
    else:
        # The machine's shared Redis listens on 6379; the suite must never use it unasked.
        assert ":6379/" not in redis_url


def test_redis_client_deletes_the_prefix_keys_afterwards(redis_url: str, prefix: str) -> None:
    # Given a test that writes keys under its prefix through the client redis_client yields
    with prefixed_client(redis_url, prefix) as client:
        client.set(f"{prefix}:a", b"1")
        client.xadd(f"{{{prefix}}}:stream", {"f": "v"})
        client.set(f"other{prefix[3:]}:kept", b"1")
    # When the test ends, then its keys are gone and no one else's was touched
    checker = redis.Redis.from_url(redis_url)
    try:
        assert list(checker.scan_iter(match=f"*{prefix}*")) == []
        assert checker.get(f"other{prefix[3:]}:kept") == b"1"
    finally:
        checker.delete(f"other{prefix[3:]}:kept")
        checker.close()


def test_appendonly_restart_keeps_data(tmp_path: Path) -> None:
    # Given a private server with AOF on, holding a key and a stream entry
    server = start_redis_server(tmp_path / "aof", appendonly=True)
    try:
        port = server.port
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", b"v")
            entry_id = client.xadd("s", {"f": "v"})
        finally:
            client.close()

        # When it is killed without a chance to shut down cleanly, then restarted
        server.kill()
        assert not server.running
        server.restart()

        # Then it is back on the same port with the data written before the crash
        assert server.port == port
        client = redis.Redis.from_url(server.url)
        try:
            assert client.get("k") == b"v"
            entries = client.xrange("s")
            assert entries is not None
            assert [e[0] for e in entries] == [entry_id]
        finally:
            client.close()
    finally:
        server.stop()
    assert (tmp_path / "aof" / "appendonlydir").is_dir()
