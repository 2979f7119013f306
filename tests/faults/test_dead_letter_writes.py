"""A dead letter is written once (docs/guarantees.md, "Dead letters are written once"): an
entry nobody can be answered for gets its record and its ack in one step, so a Redis error
that stops the ack stops the record too, and the worker that serves the entry again writes
one record, not a second beside the first.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis
from redis.connection import AbstractConnection

import queueserve as qs
from queueserve.broker.common import load_script
from tests.support.helpers import stream_key, wait_until

StartWorker = Callable[..., qs.Worker]
WAIT_S = 60.0
ACK_LUA = load_script("ack.lua")


def _sent(command: Any) -> bytes:
    """A packed command (or a pipeline's commands) as the bytes written to Redis."""
    parts = [command] if isinstance(command, (bytes, bytearray, memoryview)) else command
    return b"".join(bytes(p) if not isinstance(p, str) else p.encode() for p in parts)


@pytest.fixture
def refuse_ack_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bytes], list[bytes]]]:
    """``refuse_ack_once(entry_id)``: the first write to Redis that acks ``entry_id`` through
    ack.lua (EVALSHA or EVAL, alone or in a pipeline) is refused with READONLY, as a
    failover's demoted master refuses it, before anything of it is sent; returns the list
    that records the refused write."""
    refused: list[bytes] = []
    sha = hashlib.sha1(ACK_LUA.encode()).hexdigest().encode()  # what EVALSHA sends
    send = AbstractConnection.send_packed_command

    def arm(entry_id: bytes) -> list[bytes]:
        def faulty(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
            data = _sent(command)
            if not refused and entry_id in data and (sha in data or ACK_LUA[:60].encode() in data):
                refused.append(data)
                raise redis.ReadOnlyError("READONLY You can't write against a read only replica.")
            send(self, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", faulty)
        return refused

    yield arm


def test_a_redis_error_before_an_unanswerable_entrys_ack_leaves_one_dead_letter(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    refuse_ack_once: Callable[[bytes], list[bytes]],
) -> None:
    # Given a worker serving a key, and a backlog of 5 admitted items
    serving = qs.Serving(lambda xs: list(xs), name="once", batch_size=8, batch_timeout=0)
    start_worker(serving)
    assert client.dispatch(serving, "before", timeout=WAIT_S) == "before"
    stream = stream_key(prefix, "once")
    queued = f"{prefix}:{{once}}:queued"
    wait_until(lambda: redis_client.xlen(stream) == 0, "the first request acked")
    redis_client.set(queued, 5)

    # When one of them arrives in an entry nobody can be answered for (its header is
    # unreadable), and Redis refuses the write of its ack once (the worker then finds it
    # pending for itself, not held, and reads it again)
    entry_id = f"{int(time.time() * 1000) + 1}-0".encode()
    refused = refuse_ack_once(entry_id)
    redis_client.xadd(stream, {"h": b"junk", "p": msgpack.packb(["x"]), "a": b"1"}, id=entry_id)

    # Then, once it is acked and its item given back, the dead-letter stream holds one
    # record of it, not two
    wait_until(lambda: redis_client.xlen(stream) == 0, "the entry acked", timeout=WAIT_S)
    assert refused, "the fault never fired"
    records = [
        fields
        for _, fields in redis_client.xrange(f"{prefix}:{{once}}:dead")
        if fields[b"entry_id"] == entry_id
    ]
    assert len(records) == 1, records
    assert int(redis_client.get(queued) or 0) == 4
    # and the worker serves on
    assert client.dispatch(serving, "after", timeout=WAIT_S) == "after"
