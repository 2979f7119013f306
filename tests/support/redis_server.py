"""Throwaway ``redis-server`` processes for the test suite.

A server started here listens on 127.0.0.1 on a free port, keeps its files in a directory of the
test's own, and is never the machine's shared Redis. ``restart()`` keeps the port and the
directory, so with ``appendonly=True`` a restart (or a ``kill()`` then ``restart()``) shows what
survives on disk.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

REDIS_URL_ENV = "QUEUESERVE_TEST_REDIS_URL"  # a server of yours instead of a private one
STARTUP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server not found on PATH: install it (apt-get install -y redis-server, "
            "as scripts/test does) or set QUEUESERVE_TEST_REDIS_URL to a server to use"
        )
    return path


class RedisServer:
    """One private redis-server process; start with :func:`start_redis_server`."""

    def __init__(
        self, directory: Path, port: int, appendonly: bool, extra_args: tuple[str, ...]
    ) -> None:
        self.dir = directory
        self.port = port
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.logfile = directory / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self._wait_until_ready()

    def command(self) -> list[str]:
        return [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", str(self.logfile),
            *self.extra_args,
        ]  # fmt: skip

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown (the AOF is flushed)."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and wait: a crash, with no chance to flush anything."""
        self._end(signal.SIGKILL)

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and directory."""
        if self.running:
            self.stop()
        self.start()

    def _end(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def _wait_until_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with code {code} at startup; "
                    f"its log:\n{self._log_tail()}"
                )
            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
            try:
                # With an AOF to replay, PING answers LOADING until the data set is in memory.
                # The pid check makes sure the answer is ours, not that of another server that
                # holds the port while ours is failing to bind it.
                if client.ping() and client.info("server")["process_id"] == self._proc.pid:
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
                last_error = exc
            finally:
                client.close()
            time.sleep(0.02)
        self._end(signal.SIGKILL)
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within {STARTUP_TIMEOUT_S}s "
            f"(last error: {last_error!r}); its log:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        return f"RedisServer(url={self.url!r}, dir={str(self.dir)!r}, pid={self.pid})"


def start_redis_server(
    tmp_path: Path,
    port: int | None = None,
    appendonly: bool = False,
    extra_args: tuple[str, ...] = (),
) -> RedisServer:
    """Start a private redis-server keeping its files in ``tmp_path``; the caller stops it.

    With ``port=None`` a free port is chosen; should another process grab it before the server
    binds, the start is retried on a new port.
    """
    attempts = 1 if port is not None else 3
    for attempt in range(1, attempts + 1):
        server = RedisServer(
            tmp_path, port if port is not None else free_port(), appendonly, extra_args
        )
        try:
            server.start()
        except RuntimeError:
            if attempt == attempts:
                raise
            continue
        return server
    raise AssertionError("unreachable")


def delete_keys(client: redis.Redis, prefix: str) -> int:
    """UNLINK every key containing ``prefix`` (so ``{prefix}:...`` hash-tag names too)."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.unlink(*batch)
            batch.clear()
    if batch:
        deleted += client.unlink(*batch)
    return deleted


@contextmanager
def prefixed_client(url: str, prefix: str) -> Iterator[redis.Redis]:
    """A client whose keys containing ``prefix`` are deleted on exit, however it exits."""
    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        try:
            delete_keys(client, prefix)
        finally:
            client.close()
