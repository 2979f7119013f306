"""The embedded redis-server (queueserve/broker/embedded.py) dies with its owner, and what a
SIGKILLed owner left behind is removed by the next start (docs/guarantees.md, "Embedded
Redis")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from queueserve.broker.embedded import EmbeddedRedis, remove_orphans
from tests.support.helpers import REPO, wait_until

OWNER = """
import sys, time
from queueserve.broker.embedded import EmbeddedRedis
with EmbeddedRedis() as url:
    print(url, flush=True)
    time.sleep(600)
"""


@pytest.fixture
def temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A temp directory of this test's own, short enough for a unix socket path."""
    with tempfile.TemporaryDirectory(prefix="qs", dir="/tmp") as directory:
        monkeypatch.setattr(tempfile, "tempdir", directory)
        yield directory


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped has too)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def start_owner(directory: str) -> tuple[subprocess.Popen[str], str, int]:
    """A process that runs an embedded server: the process, the server's socket and pid."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=REPO,
        env={**os.environ, "TMPDIR": directory},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    url = owner.stdout.readline().strip()
    client = redis.Redis.from_url(url)
    pid = int(client.info("server")["process_id"])
    client.close()
    return owner, url.removeprefix("unix://"), pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_embedded_server_dies_with_its_sigkilled_owner(temp_dir: str) -> None:
    # Given a process running an embedded server
    owner, socket, server = start_owner(temp_dir)

    # When the owner is SIGKILLed (its __exit__ never runs)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()  # type: ignore[union-attr]

    # Then the server dies with it
    wait_until(lambda: gone(server), "the embedded server gone with its owner", timeout=15)
    # and the next start removes the directory it left
    assert Path(socket).parent.exists()
    with EmbeddedRedis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
        assert not Path(socket).parent.exists()
    assert os.listdir(temp_dir) == []


def test_a_server_whose_owner_is_gone_is_shut_down_and_its_directory_removed(
    temp_dir: str,
) -> None:
    # Given a server left running in a directory whose owner is gone (started from a thread
    # other than the main one, or on a system without PR_SET_PDEATHSIG)
    left = Path(temp_dir) / "queueserve-redis-999999999-x"
    left.mkdir()
    socket = left / "redis.sock"
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--unixsocket",
            str(socket),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(left),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(socket.exists, "the left-over server listening")
    # and a directory of a live owner
    live = Path(temp_dir) / f"queueserve-redis-{os.getpid()}-y"
    live.mkdir()

    # When orphans are removed (as every start does first)
    removed = remove_orphans()

    # Then the orphan server is shut down and its directory removed; the live one is kept
    assert removed == [str(left)]
    assert server.wait(15) == 0
    assert not left.exists() and live.exists()
