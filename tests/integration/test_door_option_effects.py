"""The option-effect table of the door's options (issue 38; docs/gateway.md, "Connections" and
"Browsers: Origin and Content-Type"): each connection option and ``--allow-origin`` of
``queueserve gateway`` and ``queueserve dashboard``, set each way it can be (its flag, its
``QUEUESERVE_GATEWAY_*`` / ``QUEUESERVE_DASHBOARD_*`` variable) to a value other than its
default, changes what a real server process does, seen from real sockets:

- ``header_timeout`` 3s: a connection that sends nothing is closed within 6 s (default 10 s);
- ``body_timeout`` 3s: a head whose body never comes whole is closed within 6 s (30 s);
- ``keep_alive_timeout`` 2s: a kept-alive connection idle is closed within 4 s (75 s; 5 s);
- ``max_connections`` 4: a fifth connection takes the oldest one's place (10,000; 1,000);
- ``max_connections_per_client`` 3: an address's fourth is closed at once (1,000; 100);
- ``allow_origin``: a write from that origin's page is not refused (403 otherwise).

Each check was run once with its option left out and failed. A connection option of the CLI
without a row here fails ``test_every_connection_option_has_a_row``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from queueserve.ops.cli import build_parser
from tests.support.door import (
    HEALTHZ,
    PAGE,
    Conn,
    ServerProc,
    closing,
    connect,
    kept_alive,
    server,
)
from tests.support.helpers import wait_until

TOKEN = "door-options"
APP = "https://app.example"
VALUES = {
    "header_timeout": "3s",
    "body_timeout": "3s",
    "keep_alive_timeout": "2s",
    "max_connections": "4",
    "max_connections_per_client": "3",
    "allow_origin": f"{APP},https://other.example",
}
# A write whose body never comes whole, on a route that reads it (the token and the type
# right: nothing answers it before its body)
CUT_BODY = (
    b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + TOKEN.encode() + b"\r\n"
    b"content-type: application/json\r\ncontent-length: 50\r\n\r\n{"
)
WRITE = {"gateway": b"/v1/servings/nosuch/dispatch", "dashboard": b"/api/config"}


def ways(command: str, how: str) -> tuple[list[str], dict[str, str]]:
    """Every option set by flag (``--allow-origin`` once per origin), or by variable."""
    if how == "env":
        prefix = f"QUEUESERVE_{command.upper()}_"
        return [], {prefix + name.upper(): value for name, value in VALUES.items()}
    args = []
    for name, value in VALUES.items():
        flag = "--" + name.replace("_", "-")
        for part in value.split(",") if name == "allow_origin" else [value]:
            args += [flag, part]
    return args, {}


def check_max_connections(proc: ServerProc, request: bytes) -> None:
    # Given four connections held (three from one address, one from another)
    first = [Conn(connect(proc.port, "127.0.0.9")) for _ in range(3)]
    other = [Conn(connect(proc.port, "127.0.0.10"))]
    with closing(first + other):
        # When a fifth client asks, it is answered, and the oldest made room for it
        answered = kept_alive(proc.port, "127.0.0.11", request)
        with closing([answered]):
            wait_until(lambda: first[0].poll(), "the oldest closed", timeout=2, process=proc)
            assert not (other[0].poll() or first[1].poll())  # (no deadline closed them)
            assert "1 evicted" in proc.output()


def check_max_connections_per_client(proc: ServerProc, request: bytes) -> None:
    conns = [Conn(connect(proc.port, "127.0.0.8")) for _ in range(4)]
    with closing(conns):
        wait_until(lambda: conns[3].poll(), "the fourth closed at once", timeout=2, process=proc)
        assert conns[3].received == b""
        assert not any(c.poll() for c in conns[:3])
        with closing([kept_alive(proc.port, "127.0.0.12", request)]):
            pass  # another address is served meanwhile


def check_deadlines(proc: ServerProc, command: str, request: bytes) -> None:
    """header_timeout, body_timeout and keep_alive_timeout, waited for at once."""
    silent = Conn(connect(proc.port, "127.0.0.5"))
    cut = Conn(connect(proc.port, "127.0.0.6", CUT_BODY % WRITE[command]))
    idle = kept_alive(proc.port, "127.0.0.7", request)
    with closing([silent, cut, idle]):
        wait_until(lambda: idle.poll(), "the idle connection closed", timeout=4, process=proc)
        wait_until(lambda: silent.poll(), "the silent connection closed", timeout=6, process=proc)
        wait_until(lambda: cut.poll(), "the cut body closed", timeout=6, process=proc)


def check_allow_origin(proc: ServerProc, command: str) -> None:
    path, body = (
        ("/v1/servings/nosuch/dispatch", {"item": 1})
        if command == "gateway"
        else ("/api/config", {"serving": "nosuch", "assignments": ["batch_size=2"]})
    )
    for origin in (APP, "https://other.example"):
        headers = {"origin": origin, "authorization": f"Bearer {TOKEN}"}
        response = httpx.post(proc.url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 404, (origin, response.text[:300])
    headers = {"origin": "https://evil.example", "authorization": f"Bearer {TOKEN}"}
    evil = httpx.post(proc.url + path, json=body, headers=headers, timeout=30)
    assert evil.status_code == 403, evil.text[:300]


CHECKS: dict[str, Callable[[ServerProc, str, bytes], None]] = {
    "max_connections": lambda proc, command, request: check_max_connections(proc, request),
    "max_connections_per_client": lambda proc, command, request: check_max_connections_per_client(
        proc, request
    ),
    "allow_origin": lambda proc, command, request: check_allow_origin(proc, command),
    "deadlines": check_deadlines,
}
COVERS = {
    "max_connections": {"max_connections"},
    "max_connections_per_client": {"max_connections_per_client"},
    "allow_origin": {"allow_origin"},
    "deadlines": {"header_timeout", "body_timeout", "keep_alive_timeout"},
}


def connection_options(command: str) -> set[str]:
    """The dests of ``command``'s connection flags (ops/server_flags.py, from its options)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    own = sub.choices[command]  # type: ignore[index]
    found = {a.dest for a in own._actions}
    return found & set(VALUES) | {d for d in found if "connection" in d or "timeout" in d} - {
        "shutdown_timeout"
    }


@pytest.mark.parametrize("command", ["gateway", "dashboard"])
def test_every_connection_option_has_a_row(command: str) -> None:
    covered = set().union(*COVERS.values())
    assert connection_options(command) == covered == set(VALUES)


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("command", ["gateway", "dashboard"])
def test_each_door_option_changes_what_a_real_server_does(
    command: str, how: str, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    args, env = ways(command, how)
    request = HEALTHZ if command == "gateway" else PAGE
    with server(
        command, redis_url, prefix, tmp_path / f"{command}.log", "--token", TOKEN, *args, **env
    ) as proc:
        for check in CHECKS.values():
            check(proc, command, request)
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
