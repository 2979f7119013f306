"""Raw client connections for the door's tests (tests/faults/test_hostile_connections.py, the
option-effect table of the connection options): half-sent heads, slow bodies, idle kept-alive
connections, each from a chosen loopback address, and whether the server has closed them."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import redis

from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import LISTENING, GatewayProc
from tests.support.helpers import REPO, child_env, wait_until

GATED = "tests.support.gateway_app:gated"
HALF_HEAD = b"POST /v1/servings/gated/dispatch HTTP/1.1\r\nhost: gw\r\nx-slow: "
SLOW_BODY = (
    b"POST /v1/servings/gated/dispatch HTTP/1.1\r\nhost: gw\r\n"
    b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"item": '
)
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n"
PAGE = b"GET / HTTP/1.1\r\nhost: board\r\n\r\n"  # the dashboard's


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def connect(port: int, source: str = "127.0.0.1", send: bytes = b"") -> socket.socket:
    """A connection to the server on 127.0.0.1:``port`` from ``source`` (any 127.x address
    is this host), having sent ``send``; non-blocking from then on."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    if send:
        s.sendall(send)
    s.setblocking(False)
    return s


class Conn:
    """A socket and what the server sent on it, until it closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = b""
        self.closed = False

    def poll(self) -> bool:
        """Reads what arrived; whether the server has closed the connection."""
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return False
            except OSError:  # reset
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self.received += data
        return self.closed


def kept_alive(port: int, source: str = "127.0.0.1", request: bytes = HEALTHZ) -> Conn:
    """A connection whose one request (GET /healthz) was answered, idle since."""
    conn = Conn(connect(port, source, request))
    conn.sock.setblocking(True)
    while not answered_whole(conn.received):
        data = conn.sock.recv(65536)
        assert data, f"the server closed the connection before answering: {conn.received!r}"
        conn.received += data
    conn.sock.setblocking(False)
    return conn


def answered_whole(received: bytes) -> bool:
    """Whether ``received`` holds a response's head and as much body as it declares."""
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return True


def all_closed(conns: list[Conn]) -> bool:
    return all([c.poll() for c in conns])  # every one polled: their buffers drained


def still_open(conns: list[Conn]) -> list[Conn]:
    return [c for c in conns if not c.poll()]


@contextlib.contextmanager
def closing(conns: list[Conn]) -> Iterator[list[Conn]]:
    try:
        yield conns
    finally:
        for c in conns:
            c.sock.close()


class ServerProc(GatewayProc):
    """``python -m queueserve gateway|dashboard --port 0 ...`` with ``QUEUESERVE_*`` variables
    of the test's (``env``); ``url`` once it listens."""

    def __init__(
        self,
        command: str,
        redis_url: str,
        prefix: str,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "queueserve", command, "--port", "0"),
                    *("--redis-url", redis_url, "--prefix", prefix, *args),
                ],
                cwd=REPO,
                env=child_env(**(env or {})),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        port = wait_until(
            lambda: LISTENING.search(self.output()), f"the {command} to listen", process=self
        ).group(1)
        self.url = f"http://127.0.0.1:{port}"
        self.port = int(port)


@contextlib.contextmanager
def server(
    command: str, redis_url: str, prefix: str, log: Path, *args: str, **env: str
) -> Iterator[ServerProc]:
    proc = ServerProc(command, redis_url, prefix, log, *args, env=env)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def serving_worker(
    redis_url: str, prefix: str, log: Path, specs: tuple[str, ...] = (GATED,)
) -> Iterator[WorkerProc]:
    """A worker of ``specs`` (module:attr), once it declared each; killed on the way out."""
    worker = WorkerProc.one_partition(list(specs), redis_url, prefix, log)
    try:
        with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
            names = [spec.rsplit(":", 1)[1] for spec in specs]
            wait_until(
                lambda: all(r.exists(f"{prefix}:{{{n}}}:meta") for n in names),
                f"the worker to declare {names}",
                timeout=180,
                process=worker,
            )
        yield worker
    finally:
        worker.kill_group()
