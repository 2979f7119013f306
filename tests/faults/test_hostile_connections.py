"""The door holds under hostile connections (issue 38, finding 1; docs/gateway.md,
"Connections"): real ``queueserve gateway`` and ``queueserve dashboard`` processes, real
sockets from several loopback addresses (127.0.0.1 floods, 127.0.0.2 and 127.0.0.3 are
others).

Before the connection guard (door/connections.py), a connection that never finished its
request head was never closed: 3,000 held for 30 s, 0 closed, and at about 20,000 the gateway
ran out of file descriptors and failed every request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import httpx
import pytest

from tests.support.door import (
    HALF_HEAD,
    SLOW_BODY,
    Conn,
    all_closed,
    closing,
    connect,
    kept_alive,
    server,
    serving_worker,
    still_open,
)
from tests.support.helpers import wait_until
from tests.support.redis_server import prefixed_client

TOKEN = "door-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HALF_HEADS, SLOW_BODIES, IDLE = 400, 200, 200


@pytest.fixture(scope="module")
def stack(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """A worker serving ``gated`` (tests/support/gateway_app.py); (Redis URL, prefix, logs)
    for the gateways each test starts in front of it."""
    prefix = f"qsdoor{uuid4().hex[:10]}"
    logs = tmp_path_factory.mktemp("door")
    with (
        prefixed_client(redis_server, prefix),
        serving_worker(redis_server, prefix, logs / "worker.log"),
    ):
        yield redis_server, prefix, logs


def client_from(address: str, url: str) -> httpx.Client:
    """An HTTP client whose connections leave from ``address``."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=url, transport=transport, timeout=30, headers=AUTH)


def answered(http: httpx.Client, item: str) -> None:
    response = http.post("/v1/servings/gated/dispatch", json={"item": item})
    assert response.status_code == 200, response.text[:500]
    assert response.json() == {"result": f"r:{item}"}


def test_half_sent_heads_slow_bodies_and_idle_connections_are_closed_by_their_deadlines(
    stack: tuple[str, str, Path],
) -> None:
    url, prefix, logs = stack
    args = ("--token", TOKEN, "--header-timeout", "1s", "--body-timeout", "1s")
    with server(
        "gateway", url, prefix, logs / "deadlines.log", *args, "--keep-alive-timeout", "1s"
    ) as gw:
        # Given hundreds of heads never finished, bodies never finished and kept-alive
        # connections left idle, all from 127.0.0.1
        heads = [Conn(connect(gw.port, "127.0.0.1", HALF_HEAD)) for _ in range(HALF_HEADS)]
        bodies = [Conn(connect(gw.port, "127.0.0.1", SLOW_BODY)) for _ in range(SLOW_BODIES)]
        idle = [kept_alive(gw.port, "127.0.0.1") for _ in range(IDLE)]
        with closing(heads + bodies + idle), client_from("127.0.0.2", gw.url) as http:
            # When another address asks while they are held, it is answered
            for i in range(20):
                answered(http, f"while-held-{i}")
            # Then the server closes every one of them by its deadline
            wait_until(lambda: all_closed(heads), "every half-sent head closed", process=gw)
            wait_until(lambda: all_closed(bodies), "every slow body closed", process=gw)
            wait_until(lambda: all_closed(idle), "every idle connection closed", process=gw)
            # a head begun and never finished is told why
            assert all(c.received.startswith(b"HTTP/1.1 408 ") for c in heads), heads[0].received
            # and the other address is still answered, on its kept-alive connection too
            answered(http, "after")
    assert "Traceback" not in gw.output(), gw.output()[-3000:]


def test_the_per_address_cap_refuses_the_flooding_address_only(
    stack: tuple[str, str, Path],
) -> None:
    url, prefix, logs = stack
    cap, flood = 50, 120
    with server(
        "gateway",
        url,
        prefix,
        logs / "cap.log",
        "--token",
        TOKEN,
        "--max-connections-per-client",
        str(cap),
    ) as gw:
        # Given one address that opens more connections than its cap, sending nothing
        conns = [Conn(connect(gw.port, "127.0.0.1")) for _ in range(flood)]
        with closing(conns), client_from("127.0.0.2", gw.url) as http:
            # When another address asks, it is answered
            answered(http, "other-address")
            # Then the flooding address keeps its cap and no more: the rest were closed at
            # once, before anything was read (nothing was sent back on them)
            wait_until(lambda: len(still_open(conns)) == cap, f"{flood - cap} closed", process=gw)
            assert all(c.received == b"" for c in conns)
            # and a third address is not held to the first one's count
            third = [Conn(connect(gw.port, "127.0.0.3")) for _ in range(cap)]
            with closing(third):
                answered(http, "after-third")
                assert len(still_open(third)) == cap
        # Once the flood's connections are closed, its address is served again
        with client_from("127.0.0.1", gw.url) as again:
            wait_until(lambda: again.get("/healthz").status_code == 200, "127.0.0.1 served again")
            answered(again, "flooder-again")
    assert "connections closed by the guard" in gw.output(), gw.output()[-3000:]


def test_past_max_connections_a_new_one_replaces_the_one_waiting_longest(
    stack: tuple[str, str, Path],
) -> None:
    url, prefix, logs = stack
    most = 60
    with server(
        "gateway",
        url,
        prefix,
        logs / "most.log",
        *("--token", TOKEN, "--max-connections", str(most)),
        *("--max-connections-per-client", "0"),
    ) as gw:
        # Given every connection the gateway may hold taken by heads never finished
        conns = [Conn(connect(gw.port, "127.0.0.1", HALF_HEAD)) for _ in range(most)]
        with closing(conns), client_from("127.0.0.2", gw.url) as http:
            wait_until(lambda: not any(c.poll() for c in conns), "them held")
            # When another client asks, it is answered
            answered(http, "at-the-limit")
            # Then the oldest of them made room (closed unanswered), the newest are held
            wait_until(lambda: conns[0].poll(), "the oldest closed", process=gw)
            assert not conns[-1].poll()


def test_the_dashboard_closes_half_sent_heads_while_another_address_reads(
    stack: tuple[str, str, Path],
) -> None:
    url, prefix, logs = stack
    args = ("--header-timeout", "1s", "--max-connections-per-client", "0")
    with server("dashboard", url, prefix, logs / "dashboard.log", *args) as board:
        heads = [Conn(connect(board.port, "127.0.0.1", HALF_HEAD)) for _ in range(HALF_HEADS)]
        with closing(heads), client_from("127.0.0.2", board.url) as http:
            overview = http.get("/api/overview")
            assert overview.status_code == 200, overview.text[:500]
            assert "gated" in json.dumps(overview.json())
            wait_until(lambda: all_closed(heads), "every half-sent head closed", process=board)
            assert all(c.received.startswith(b"HTTP/1.1 408 ") for c in heads)
            assert http.get("/api/overview").status_code == 200
