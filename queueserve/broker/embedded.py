"""A private ``redis-server`` for demos and local runs when no Redis is configured.

It listens on a unix socket in a temporary directory (so it can never clash with, or be
mistaken for, a shared server), keeps nothing on disk, and is stopped when the context exits.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from queueserve.errors import RedisUnavailable


class EmbeddedRedis:
    """``with EmbeddedRedis() as url: ...`` runs a throwaway redis-server for the block."""

    def __init__(self, binary: str = "redis-server", startup_timeout: float = 10.0) -> None:
        self.binary = binary
        self.startup_timeout = startup_timeout
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> str:
        path = shutil.which(self.binary)
        if path is None:
            raise RedisUnavailable(
                f"no Redis configured and {self.binary!r} is not installed: install it "
                "(apt-get install redis-server) or set QUEUESERVE_REDIS_URL to a Redis to use"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="queueserve-redis-")
        socket = Path(self._dir.name) / "redis.sock"
        self._proc = subprocess.Popen(
            [path, "--port", "0", "--unixsocket", str(socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"unix://{socket}"
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis.from_url(self.url)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisUnavailable(f"redis-server exited with code {self._proc.returncode}")
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, FileNotFoundError):
                    if time.monotonic() > deadline:
                        raise RedisUnavailable("redis-server did not start in time") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._dir is not None:
            self._dir.cleanup()
