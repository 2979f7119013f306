"""A job's ``ticket.id`` names a job in Redis, or raises (docs/usage.md, "Jobs"): when its
request is still being sent after the client's reconnect window (Redis away, the send under
way in another thread or task retrying), there is no job of that id yet."""

from __future__ import annotations

import asyncio

import pytest

import queueserve as qs
from queueserve.client import async_outbox, outbox
from queueserve.client.calls import Call
from queueserve.wire.keys import Keys

UNREACHABLE = "redis://127.0.0.1:1/0"  # never connected to: nothing here sends


def job_call() -> Call:
    call = Call(1, 1, Keys("qsu", "s"), "default")
    call.keep_ms = 60_000
    return call


def test_a_sync_job_id_still_unsent_after_the_window_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outbox, "RECONNECT_WITHIN_S", 0.05)
    client = qs.Client(UNREACHABLE, prefix="qsu")
    client._outbox.flushing = True  # another thread's send is under way, and does not end
    with pytest.raises(qs.RedisUnavailable, match="names no job yet"):
        client._outbox.until_sent([job_call()])
    sent = job_call()
    sent.entry_id = b"1-0"
    client._outbox.until_sent([sent])  # in Redis: nothing to wait for


def test_an_async_job_id_still_unsent_after_the_window_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(async_outbox, "RECONNECT_WITHIN_S", 0.05)

    async def wait() -> None:
        client = qs.AsyncClient(UNREACHABLE, prefix="qsu")
        client._outbox.flushing = True  # another task's send is under way, and does not end
        with pytest.raises(qs.RedisUnavailable, match="names no job yet"):
            await client._outbox.until_sent([job_call()])

    asyncio.run(wait())
