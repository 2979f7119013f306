"""Commands are packed by hiredis directly, on the sync and the asyncio connections, into the
same bytes redis-py's own packers write (or by redis-py itself, where only it knows how)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import connection as aioconnection
from redis.connection import HiredisRespSerializer, PythonRespSerializer
from redis.exceptions import DataError

from queueserve.broker import async_producer
from queueserve.broker.common import HiredisPacker, pack_fast
from queueserve.broker.connect import connect, connect_async

COMMANDS: list[tuple[Any, ...]] = [
    (
        "EVALSHA",
        "a" * 40,
        2,
        "qs:{s}:queued",
        "qs:{s}:in:default",
        0,
        "qs",
        1000,
        1,
        "default",
        0,
        1,
        1,
        b"\x96\x01\x07",
        b"\x91\x05",
    ),
    ("BLMPOP", 1.0, 1, "qs:inbox:abc", "LEFT", "COUNT", 512),
    (b"RPUSH", "qs:inbox:é", memoryview(b"m\x91\x01"), bytearray(b"x")),
    ("XINFO GROUPS", "qs:{s}:in:default"),  # a name with a space: redis-py splits it
    ("ZADD", "k", 0.1, "m", -3, "n"),
]


def python_packed(args: tuple[Any, ...]) -> bytes:
    encoder = aioconnection.Encoder("utf-8", "strict", False)
    return b"".join(PythonRespSerializer(6000, encoder.encode).pack(*args))


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_commands_pack_to_the_bytes_redis_py_writes(args: tuple[Any, ...]) -> None:
    expected = python_packed(args)
    assert b"".join(HiredisPacker().pack(*args)) == expected
    assert b"".join(HiredisRespSerializer().pack(*args)) == expected


def test_what_hiredis_cannot_pack_is_left_to_redis_py() -> None:
    assert pack_fast(("XINFO GROUPS", "s")) is None
    assert pack_fast(("SET", "k", None)) is None
    with pytest.raises(DataError):  # redis-py's own refusal, as before
        HiredisPacker().pack("SET", "k", None)


def test_sync_broker_connections_use_the_hiredis_packer() -> None:
    client = connect("redis://127.0.0.1:1/0")
    connection = client.connection_pool.make_connection()
    assert isinstance(client.connection_pool.connection_kwargs["command_packer"], HiredisPacker)
    assert connection.pack_command("GET", "k") == [b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"]


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/qs-none.sock"]
)
def test_asyncio_broker_connections_pack_with_hiredis(url: str) -> None:
    pool = async_producer.hiredis_packing(connect_async(url)).connection_pool
    connection = pool.make_connection()
    assert isinstance(connection, async_producer._HiredisPacking)
    for args in COMMANDS:
        assert b"".join(connection.pack_command(*args)) == python_packed(args)
