"""A private ``redis-server`` for demos and local runs when no Redis is configured.

It listens on a unix socket in a temporary directory (so it can never clash with, or be
mistaken for, a shared server), keeps nothing on disk, and is stopped when the context exits.

It dies with its owner too: a SIGKILLed owner never runs its ``__exit__``. On Linux the server
is started with ``PR_SET_PDEATHSIG``, so the kernel kills it when the thread that started it
ends (start it from a thread that lives as long as it should: the main thread, usually); and
every start first removes what owners that are gone left behind (directories named
``queueserve-redis-<owner pid>-*``, shutting down a server still listening there), which also
covers other systems and servers started from threads that ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

from queueserve.errors import RedisUnavailable

_DIR_PREFIX = "queueserve-redis-"
_OWNED = re.compile(re.escape(_DIR_PREFIX) + r"(\d+)-")
_PR_SET_PDEATHSIG = 1


class EmbeddedRedis:
    """``with EmbeddedRedis() as url: ...`` runs a throwaway redis-server for the block."""

    def __init__(self, binary: str = "redis-server", startup_timeout: float = 10.0) -> None:
        self.binary = binary
        self.startup_timeout = startup_timeout
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> str:
        path = shutil.which(self.binary)
        if path is None:
            raise RedisUnavailable(
                f"no Redis configured and {self.binary!r} is not installed: install it "
                "(apt-get install redis-server) or set QUEUESERVE_REDIS_URL to a Redis to use"
            )
        remove_orphans()
        self._dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        socket = Path(self._dir) / "redis.sock"
        self._proc = subprocess.Popen(
            [
                path,
                "--port",
                "0",
                "--unixsocket",
                str(socket),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_dies_with_owner(),
        )
        self.url = f"unix://{socket}"
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
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
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _dies_with_owner() -> Callable[[], None] | None:
    """What the child runs before exec: ask the kernel for SIGKILL when this thread ends, and
    quit at once if the owner is gone already. None where there is no prctl (not Linux), or
    when started from a thread other than the main one (it would die with that thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # loaded before fork
    owner = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != owner:  # it died between fork and prctl: nobody would kill us
            os._exit(1)

    return preexec


def remove_orphans(directory: str | None = None) -> list[str]:
    """Remove what embedded servers of owners that are gone left in ``directory`` (the temp
    directory by default): shut down a server still listening there, then delete its
    directory. Returns the directories removed."""
    removed = []
    parent = Path(directory or tempfile.gettempdir())
    for path in parent.glob(f"{_DIR_PREFIX}*"):
        found = _OWNED.match(path.name)
        if found is None or not path.is_dir() or _alive(int(found.group(1))):
            continue
        _shut_down(path / "redis.sock")
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: not ours to judge
        return True
    return True


def _shut_down(socket: Path) -> None:
    if not socket.exists():
        return
    client = redis.Redis(unix_socket_path=str(socket), socket_timeout=2)
    with contextlib.suppress(redis.RedisError, OSError):
        client.shutdown(nosave=True)
    client.close()
