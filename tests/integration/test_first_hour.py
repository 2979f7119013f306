"""A new user's first hour (issue 12): every first mistake gets a one-line answer.

CLI tests run the real command as a subprocess, the way a user types it; each asserts the
message the user now sees (docs/troubleshooting.md quotes them). Nothing waits on a sleep:
every wait is for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
import queueserve.client.unserved as client_unserved
from queueserve.settings import Settings, check_redis_url, redact_url
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, servings_key
from tests.support.helpers import REPO, WAIT_S, child_env, wait_until
from tests.support.redis_server import free_port

# What the `queueserve` console script is: a file that imports queueserve.ops.cli, so that
# (unlike `python -m`) the current directory is not on sys.path unless the CLI puts it there.
CONSOLE_SCRIPT = """\
import sys
from queueserve.ops.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


@pytest.fixture
def console(tmp_path: Path) -> Path:
    script = tmp_path / "bin" / "queueserve"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    return script


def cli(*args: str, cwd: Path = REPO, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queueserve", *args],
        cwd=cwd,
        env=child_env(**extra),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


class Proc:
    """A worker started in its own process group, output to a file."""

    def __init__(self, argv: list[str], cwd: Path, log: Path, environ: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self) -> int:
        try:
            return self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within {WAIT_S:g}s; output:\n{self.output()}")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def run(argv: list[str], cwd: Path = REPO, **extra: str) -> Proc:
        proc = Proc(argv, cwd, tmp_path / f"worker-{len(started)}.log", child_env(**extra))
        started.append(proc)
        return proc

    yield run
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(10)


def alive(client: redis.Redis, prefix: str, serving: str) -> Callable[[], bool]:
    return lambda: client.zcard(Keys(prefix, serving).workers) > 0


def dead_url() -> str:
    return f"redis://:s3cret@127.0.0.1:{free_port()}/0"


def declare(client: redis.Redis, prefix: str, *names: str) -> None:
    """What a worker does on start: publish the serving's options, and list the serving in the
    prefix's servings registry."""
    for name in names:
        client.hset(Keys(prefix, name).meta, mapping={"batch_size": 8, "codec": "msgpack"})
        client.zadd(servings_key(prefix), {name: int(time.time() * 1000)})


# -- the README, literally: module in the current folder, worker from there ---------------------
def test_worker_imports_the_module_from_the_current_directory_and_logs_start_and_stop(
    start: Callable[..., Proc],
    console: Path,
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given myapp/servings.py in the current folder, as the README has it
    app = tmp_path / "project"
    (app / "myapp").mkdir(parents=True)
    (app / "myapp" / "__init__.py").write_text("")
    (app / "myapp" / "servings.py").write_text(
        "import queueserve as qs\n\n"
        "def square(xs):\n    return [x * x for x in xs]\n\n"
        "serving = qs.Serving(square, name='square', batch_size=10, batch_timeout=0.1)\n"
    )
    # When the console script is run from that folder (Redis from the environment)
    worker = start(
        [sys.executable, str(console), "worker", "myapp.servings:serving"],
        cwd=app,
        QUEUESERVE_REDIS_URL=redis_url,
        QUEUESERVE_PREFIX=prefix,
    )
    wait_until(alive(redis_client, prefix, "square"), "the worker's heartbeat", process=worker)

    # Then a partition process imported it too, and answers
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("square", 3, timeout=30) == 9
        assert client.dispatch("square", 4, timeout=30) == 16

    # and the start said, one line each: version, Redis (and where it came from), servings
    out = worker.output()
    assert f"queueserve {qs_version()} worker starting" in out
    assert f"Redis: {redis_url} (from QUEUESERVE_REDIS_URL), key prefix {prefix!r}" in out
    assert "serving square: batch_timeout=0.1s batch_size=10 codec=msgpack" in out
    assert "partitions: 1 (cpu)" in out

    # When it is stopped with SIGTERM, its last line says what it drained, and exit code 0
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
    last = worker.output().strip().splitlines()[-1]
    assert last.endswith(
        "worker stopped (SIGTERM): partitions drained 0 batches (0 requests) held at stop; "
        "2 batches, 2 requests, 2 items in all; exit code 0"
    ), last


def qs_version() -> str:
    from importlib import metadata

    return metadata.version("queueserve")


def test_a_module_that_is_not_found_says_where_it_was_looked_for(
    console: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(console),
            "worker",
            "myapp.servings:serving",
            "--redis-url",
            dead_url(),
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "queueserve: cannot import module 'myapp.servings' for 'myapp.servings:serving': "
        f"No module named 'myapp' (searched the current directory {tmp_path} and PYTHONPATH: "
        "run the command from the folder that holds myapp/ or myapp.py, or add that folder to "
        "PYTHONPATH)"
    )


def test_the_worker_drains_a_held_batch_and_counts_it_in_its_stop_line(
    start: Callable[..., Proc],
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a batch that is executing
    worker = start(
        [
            sys.executable,
            "-m",
            "queueserve",
            "worker",
            "tests.support.first_hour_app:Held",
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
        ],
        FIRST_HOUR_REDIS_URL=redis_url,
        FIRST_HOUR_PREFIX=prefix,
    )
    wait_until(alive(redis_client, prefix, "held"), "the worker's heartbeat", process=worker)
    with qs.Client(redis_url, prefix=prefix) as client:
        ticket = client.submit("held", [1, 2], timeout=60)
        wait_until(
            lambda: redis_client.get(f"{prefix}:started"), "the batch to start", process=worker
        )

        # When SIGTERM comes, and the partition has begun draining, the batch may finish
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "partition 0 draining" in worker.output(), "the drain", process=worker)
        redis_client.rpush(f"{prefix}:go", 1)

        # Then it is answered, and the stop lines count it as drained
        assert ticket.result(timeout=30) == [1, 2]
    assert worker.wait() == 0, worker.output()
    out = worker.output()
    assert (
        "partition 0 stopped: drained 1 batch (1 request) held at stop; 1 batch, 1 request, "
        "2 items in all"
    ) in out
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith(
            "worker stopped (SIGTERM): partitions drained 1 batch (1 request) held at stop; "
            "1 batch, 1 request, 2 items in all; exit code 0"
        )
    )


# -- startup errors: one line, the documented exit code, no restarts ---------------------------
def test_redis_unreachable_at_start_is_one_line_and_exit_1(start: Callable[..., Proc]) -> None:
    url = dead_url()
    worker = start(
        [
            sys.executable,
            "-m",
            "queueserve",
            "worker",
            "tests.support.cli_app:square",
            "--redis-url",
            url,
        ]
    )
    assert worker.wait() == 1, worker.output()
    out = worker.output()
    shown = url.replace("s3cret", "***")
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert (
        f"queueserve: Redis at {shown} is unavailable (ConnectionError: Error 111 "
        f"connecting to 127.0.0.1:{port}. Connection refused.): check that it is up, has "
        "memory left and is a primary (retried for 5s), or point the worker at yours with "
        "--redis-url or QUEUESERVE_REDIS_URL"
    ) in out
    assert "reachable again" not in out
    assert "s3cret" not in out
    assert "Traceback" not in out
    assert "partition 0 (cpu) started" not in out  # checked before any partition was spawned


def test_a_url_that_is_not_redis_is_rejected_at_once_with_exit_2() -> None:
    done = cli(
        "worker", "tests.support.cli_app:square", "--redis-url", "http://user:pw@localhost:6379/0"
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "queueserve: 'http://user:***@localhost:6379/0' is not a Redis URL: it must start with "
        "redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// (for example "
        "redis://localhost:6379/0); pass --redis-url or set QUEUESERVE_REDIS_URL"
    )
    from_env = cli("stats", QUEUESERVE_REDIS_URL="http://localhost:6379")
    assert from_env.returncode == 2
    assert "'http://localhost:6379' is not a Redis URL" in from_env.stderr
    assert "Traceback" not in from_env.stderr and "pydantic" not in from_env.stderr


def test_a_serving_whose_setup_fails_stops_the_worker_with_exit_1_without_restarts(
    start: Callable[..., Proc],
    redis_url: str,
    prefix: str,
) -> None:
    worker = start(
        [
            sys.executable,
            "-m",
            "queueserve",
            "worker",
            "tests.support.first_hour_app:Broken",
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
        ]
    )
    assert worker.wait() == 1, worker.output()
    out = worker.output()
    assert (
        "partition 0 could not start: setup() of serving 'broken' failed on partition 0 "
        "(cpu): FileNotFoundError: model file /models/missing.bin not found. Stopping the "
        "worker (exit code 1) without restarts: fix the cause and start it again "
        "(the traceback of setup() is logged above)"
    ) in out
    assert "restarting" not in out
    assert out.count("Traceback") == 1  # at ERROR (tests/integration/test_first_hour_worker.py)
    assert out.count("started as pid") == 1


# -- help and usage -----------------------------------------------------------------------------
def test_help_describes_the_tool_its_defaults_and_exit_codes() -> None:
    top, worker = cli("--help"), cli("worker", "--help")
    assert top.returncode == worker.returncode == 0
    assert "Only this module" not in top.stdout
    assert "queueserve batches work from many producers over Redis Streams" in top.stdout
    assert "exit codes: 0 ok" in top.stdout
    assert "docs/troubleshooting.md" in top.stdout
    assert (
        " ".join(worker.stdout.split()).count(
            "Redis URL (default: $QUEUESERVE_REDIS_URL, else redis://127.0.0.1:6379/0)"
        )
        == 1
    )


def test_optional_arguments_are_not_called_required(redis_url: str, prefix: str) -> None:
    listed = cli("dead-letter", "list", "--redis-url", redis_url, "--prefix", prefix)
    got = cli("config", "get", "--redis-url", redis_url, "--prefix", prefix)
    replay = cli("dead-letter", "replay", "--redis-url", redis_url, "--prefix", prefix)
    for done in (listed, got, replay):
        assert "required" not in done.stderr, done.stderr
    assert listed.returncode == 0
    assert listed.stderr.strip() == f"no dead letters for any serving under prefix {prefix!r}"
    assert got.returncode == 0
    assert got.stdout.strip() == f"no servings under prefix {prefix!r} on Redis {redis_url}"
    assert replay.returncode == 2
    assert replay.stderr.strip() == (
        "queueserve: dead-letter replay takes a serving and ids (or --all), e.g. "
        "`queueserve dead-letter replay square --all`"
    )


def test_an_empty_dead_letter_list_says_so(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    declare(redis_client, prefix, "square")
    done = cli("dead-letter", "list", "square", "--redis-url", redis_url, "--prefix", prefix)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # stays an empty list for scripts
    assert done.stderr.strip() == "no dead letters for serving 'square'"


def test_unknown_servings_are_named_with_the_known_ones(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    declare(redis_client, prefix, "square", "cube")
    where = ["--redis-url", redis_url, "--prefix", prefix]
    told = (
        f"queueserve: no worker has declared serving 'nosuch' under prefix {prefix!r} on "
        f"Redis {redis_url}; known servings: cube, square. Check the name, --prefix and "
        "--redis-url"
    )
    set_ = cli("config", "set", "nosuch", "batch_size=8", *where)
    assert set_.returncode == 1
    assert set_.stderr.strip() == f"{told} (or pass --force to set it before any worker runs)"
    assert redis_client.exists(Keys(prefix, "nosuch").config) == 0
    stats = cli("stats", "nosuch", "--interval", "1ms", *where)
    assert (stats.returncode, stats.stderr.strip(), stats.stdout) == (1, told, "")
    # --force is how an operator sets options before the first worker comes
    forced = cli("config", "set", "nosuch", "batch_size=8", "--force", *where)
    assert forced.returncode == 0, forced.stderr
    assert "batch_size = 8  (set at run time)" in forced.stdout


# -- the client ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf")])
def test_a_timeout_that_can_never_be_met_is_refused_at_the_call(
    bad: float, redis_url: str, prefix: str
) -> None:
    with qs.Client(redis_url, prefix=prefix) as client:
        with pytest.raises(
            ValueError,
            match=r"timeout must be a finite number of seconds > 0, "
            r"got .*; use None to wait until answered",
        ):
            client.dispatch("square", 2, timeout=bad)
        with pytest.raises(TypeError, match="timeout must be seconds"):
            client.submit("square", [2], timeout=True)  # type: ignore[arg-type]

    async def main() -> None:
        async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
            with pytest.raises(ValueError, match="timeout must be a finite number"):
                await aclient.dispatch("square", 2, timeout=bad)

    asyncio.run(main())


def test_default_timeout_bounds_calls_without_one(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str
) -> None:
    monkeypatch.setenv("QUEUESERVE_DEFAULT_TIMEOUT", "200ms")
    told = r"no answer from serving 'nobody' within 0\.2s; no worker is alive for it"
    with qs.Client(redis_url, prefix=prefix) as client, pytest.raises(qs.Timeout, match=told):
        client.dispatch("nobody", 1)

    async def main() -> None:
        async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
            with pytest.raises(qs.Timeout, match=r"within 0\.2s"):
                await aclient.dispatch("nobody", 1)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "QUEUESERVE_DEFAULT_TIMEOUT must be a duration > 0"),
        ("soon", "QUEUESERVE_DEFAULT_TIMEOUT 'soon' is not a duration"),
    ],
)
def test_a_bad_default_timeout_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("QUEUESERVE_DEFAULT_TIMEOUT", value)
    with pytest.raises(ValueError, match=message):
        Settings()


def test_default_timeout_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUEUESERVE_DEFAULT_TIMEOUT", raising=False)
    assert Settings().default_timeout is None
    monkeypatch.setenv("QUEUESERVE_DEFAULT_TIMEOUT", "2m")
    assert Settings().default_timeout == 120.0


def test_waiting_on_a_serving_nobody_serves_warns_once(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    redis_url: str,
    prefix: str,
) -> None:
    monkeypatch.setattr(client_unserved, "UNSERVED_WARN_AFTER", 0.05)  # 10s in real life
    caplog.set_level(logging.WARNING, logger="queueserve.client")
    with qs.Client(redis_url, prefix=prefix) as client:
        for _ in range(2):
            with pytest.raises(qs.Timeout):
                client.dispatch("nobody", 1, timeout=2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "queueserve.client"]
    assert warnings == [
        f"serving 'nobody': a call has waited 0.05s and no worker is alive for it (none sent a "
        f"heartbeat in the last 10s) on Redis {redis_url}, prefix {prefix!r}. Start one with "
        f"`queueserve worker module:attr --redis-url {redis_url} --prefix {prefix}`; the call "
        "keeps waiting (pass timeout= or set QUEUESERVE_DEFAULT_TIMEOUT to bound calls)"
    ]


def test_waiting_on_a_served_serving_does_not_warn(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    monkeypatch.setattr(client_unserved, "UNSERVED_WARN_AFTER", 0.05)
    caplog.set_level(logging.WARNING, logger="queueserve.client")
    # A worker's heartbeat, without a worker: the call will wait, but someone serves it
    redis_client.zadd(Keys(prefix, "busy").workers, {"w1": int(time.time() * 1000)})
    with qs.Client(redis_url, prefix=prefix) as client, pytest.raises(qs.Timeout, match="1 worker"):
        client.dispatch("busy", 1, timeout=0.5)
    assert [r for r in caplog.records if r.name == "queueserve.client"] == []


def test_async_client_warns_once_too(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    redis_url: str,
    prefix: str,
) -> None:
    monkeypatch.setattr(client_unserved, "UNSERVED_WARN_AFTER", 0.05)
    caplog.set_level(logging.WARNING, logger="queueserve.client")

    async def main() -> None:
        async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
            for _ in range(2):
                with pytest.raises(qs.Timeout):
                    await aclient.dispatch("nobody", 1, timeout=2)

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.name == "queueserve.client"]
    assert len(warnings) == 1 and "serving 'nobody': a call has waited" in warnings[0]


def test_an_int_past_64_bits_says_so(redis_url: str, prefix: str) -> None:
    told = (
        "cannot encode int 1180591620717411303424 with codec 'msgpack': it exceeds 64 bits "
        "(msgpack integers range from -2**63 to 2**64-1); send it as a str (str(n)) or "
        "bytes, or choose codec='pickle'"
    )
    with pytest.raises(TypeError) as e:
        get_codec("msgpack").dumps([1, 2**70])
    assert str(e.value) == told
    with pytest.raises(TypeError, match="cannot encode int of 4001 bits"):
        get_codec("msgpack").dumps(2**4000)  # too long to print: its size instead
    with qs.Client(redis_url, prefix=prefix) as client, pytest.raises(TypeError, match="64 bits"):
        client.dispatch("square", 2**70, timeout=5)
    assert get_codec("msgpack").loads(get_codec("msgpack").dumps([2**64 - 1, -(2**63)])) == [
        2**64 - 1,
        -(2**63),
    ]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://app:s3cret@host/1?password=x&db=2", "redis://app:***@host/1?password=***&db=2"),
        ("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***"),
        ("rediss://host:6380/0", "rediss://host:6380/0"),
    ],
)
def test_urls_in_logs_and_messages_hide_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert check_redis_url(url) == url


def test_clients_refuse_a_url_that_is_not_redis() -> None:
    with pytest.raises(ValueError, match="'http://localhost:6379' is not a Redis URL"):
        qs.Client("http://localhost:6379")


# -- the demo -----------------------------------------------------------------------------------
class _IndexingResult:
    """A Celery AsyncResult seen by the demo: PROGRESS stuck at 640/1200, then done."""

    def __init__(self) -> None:
        self.polls = 0
        self.state = "PROGRESS"
        self.info = {"done": 640, "total": 1200, "items_per_s": 48.0}

    def ready(self) -> bool:
        self.polls += 1
        return self.polls > 1

    def get(self, timeout: float) -> dict[str, Any]:
        return {"count": 1200, "items_per_s": 51.5, "seconds": 23.3}


def test_demo_progress_ends_on_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.demo import _show_progress

    assert _show_progress(_IndexingResult(), limit_s=60)["count"] == 1200
    assert capsys.readouterr().out.splitlines() == [
        "  PROGRESS   640/1200 passages,   48.0/s",
        "  PROGRESS  1200/1200 passages,   51.5/s",
    ]


def test_demo_keeps_celery_shutdown_chatter_out_unless_it_fails(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from tasks.demo import Processes

    procs = Processes(child_env(), tmp_path)
    procs.start(
        "celery worker", "-c", "print('worker: Warm shutdown (MainProcess)')", capture=True
    ).wait(WAIT_S)
    assert procs.stop() == []
    assert "Warm shutdown" not in capfd.readouterr().out

    failing = Processes(child_env(), tmp_path)
    failing.start(
        "celery worker", "-c", "import sys; print('no broker'); sys.exit(3)", capture=True
    ).wait(WAIT_S)
    assert failing.stop() == ["celery worker exited with code 3; its output ended:\n    no broker"]
