"""Disconnecting cancels whatever other HTTP callers sent at the same time (issue 38, finding
3), through a real ``queueserve gateway`` process and a real worker process.

The gateway's one client sends different callers' one-item requests close together, and the
worker's declaration makes them packs (several requests in one entry). Before, a packed
request could not be withdrawn: 200 SSE streams closed after 3 s left 199 generations running
and a fresh 3-step stream was answered after 493 s. Here the streams' requests are packs
(checked), and once their HTTP clients are gone none is left queued or running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
import redis

from tests.support.gateway_app import gateway_stack
from tests.support.helpers import WAIT_S, pending_requests, stream_key, wait_until
from tests.support.redis_server import prefixed_client

TOKEN = "test-token-packs"
STREAMS = 60  # more than the ticker's 8 slots: most wait queued, some held by the worker
LONG = {"n": 10**6}  # a ticker request that runs until it is cancelled (about 80 minutes)


@pytest.fixture(scope="module")
def stack(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[redis.Redis, str, str]]:
    """(a client of the test's Redis, the key prefix, the gateway's URL)."""
    prefix = f"qspk{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway-packs")
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server,
            prefix,
            logs,
            ["tests.support.gateway_app:ticker"],
            ["ticker"],
            "--token",
            TOKEN,
        ) as (_, gateway),
    ):
        yield r, prefix, gateway.url


async def open_and_close_streams(r: redis.Redis, prefix: str, url: str) -> int:
    """Open STREAMS streams of LONG at once, close them all once every request is queued or
    running, and return how many entries held them (fewer than STREAMS: packs)."""
    queued = f"{prefix}:{{ticker}}:queued"
    async with httpx.AsyncClient(
        base_url=url,
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=WAIT_S,
        limits=httpx.Limits(max_connections=STREAMS + 10),
    ) as http:

        async def one() -> None:
            body = {"items": [LONG]}
            async with http.stream("POST", "/v1/servings/ticker/stream", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        streams = [asyncio.create_task(one()) for _ in range(STREAMS)]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None,
            lambda: wait_until(
                lambda: int(r.get(queued) or 0) == STREAMS, "every stream's request admitted"
            ),
        )
        entries = r.xlen(stream_key(prefix, "ticker"))
        for stream in streams:  # each HTTP client goes
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return int(entries)


def test_streams_closed_early_leave_no_generation_running_and_a_fresh_one_is_answered(
    stack: tuple[redis.Redis, str, str],
) -> None:
    r, prefix, url = stack
    stream, queued = stream_key(prefix, "ticker"), f"{prefix}:{{ticker}}:queued"
    # Given many SSE streams of requests that generate until cancelled, sent together through
    # the gateway (its client packs different callers' requests into shared entries)
    entries = asyncio.run(open_and_close_streams(r, prefix, url))
    assert entries < STREAMS, "the gateway sent no pack: this test would test nothing"
    # When their HTTP clients disconnect, Then none of their requests is left queued or running
    wait_until(
        lambda: pending_requests(r, stream) == 0 and int(r.get(queued) or 0) == 0,
        "every disconnected stream's request to be withdrawn or stopped",
    )
    assert r.xlen(stream) == 0
    # and a fresh 3-step stream is answered, each step and its result
    with httpx.Client(
        base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=WAIT_S
    ) as http:
        fresh = http.post("/v1/servings/ticker/stream", json={"items": [{"n": 3}]})
    assert fresh.status_code == 200
    data = [line[6:] for line in fresh.text.splitlines() if line.startswith("data: ")]
    assert [json.loads(d) for d in data] == [
        *({"results": [k], "start": 0, "size": 1} for k in range(3)),
        {"outputs": [[0, 1, 2]]},
    ]
