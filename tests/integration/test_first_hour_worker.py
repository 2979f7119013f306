"""A new user's first hour with the worker (issue 36), each surprise they met as a test:

1. the operator's own `config set batch_size` draws no warning, and `config get` is current;
2. a serving whose setup() raises shows its traceback at ERROR, once per start of a partition;
3. an option qs.Serving refuses names the user's file and line, not pydantic's;
4. a misspelled `module:attr`, or a file path in its place, gets the right spelling;
5. the JSON log ties a failed batch's line to its batch, and says where the metrics are served.

Workers and the CLI run as real processes against the session's Redis; every wait is for a
condition (a log line, a heartbeat, an exit) with a deadline, never a sleep.
"""

from __future__ import annotations

import inspect
import json
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.errors import RemoteError
from queueserve.wire.keys import Keys
from tests.integration.test_cli import Spawn, WorkerProcess, run_cli, spawn  # noqa: F401
from tests.support.first_hour_worker_app import MISSING_MODEL
from tests.support.helpers import WAIT_S, child_env, wait_until
from tests.support.log_app import BAD
from tests.support.redis_server import free_port

APP = "tests.support.first_hour_worker_app"
STRANGER = "not what this worker declared"


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[qs.Client]:
    with qs.Client(redis_url, prefix=prefix) as c:
        yield c


def worker(start: Spawn, redis_url: str, prefix: str, spec: str, *flags: str) -> WorkerProcess:
    return start(spec, "--redis-url", redis_url, "--prefix", prefix, "--partitions", "1", *flags)


def cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--redis-url", redis_url, "--prefix", prefix)


def lines_with(text: str, output: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


# -- 1. `config set batch_size` is the operator's own change, not a stranger's ------------------
def test_config_set_batch_size_draws_no_stranger_warning_and_config_get_shows_pack_items(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given a worker serving square (batch_size 10, so pack_items 10)
    meta = Keys(prefix, "square").meta
    running = worker(spawn, redis_url, prefix, f"{APP}:square")
    wait_until(
        lambda: redis_client.zcard(Keys(prefix, "square").workers) > 0,
        "the worker's heartbeat",
        process=running,
    )

    # When the operator changes batch_size with the CLI
    done = cli(redis_url, prefix, "config", "set", "square", "batch_size=7")
    assert done.returncode == 0, done.stderr
    wait_until(
        lambda: lines_with("batch_size changed from 10 to 7", running.output()),
        "the worker to apply the change",
        process=running,
    )
    # and then a stranger writes a field of the declaration: once the worker says so, its
    # declaration passes since the change have all run
    redis_client.hset(meta, "max_queue", "16")
    wait_until(
        lambda: lines_with(f"held max_queue='16', {STRANGER}", running.output()),
        "the worker to write back the stranger's field",
        process=running,
    )

    # Then the only field the worker wrote back is the stranger's: not pack_items
    out = running.output()
    assert lines_with(STRANGER, out) == lines_with("max_queue='16'", out), out
    shown = cli(redis_url, prefix, "config", "get", "square")
    assert "batch_size = 7  (set at run time)" in shown.stdout
    assert "pack_items = 7\n" in shown.stdout, shown.stdout

    # When no worker runs (nothing writes the declaration back), a change shows at once
    running.signal(signal.SIGTERM)
    assert running.wait() == 0, running.output()
    changed = cli(redis_url, prefix, "config", "set", "square", "batch_size=5")
    assert changed.returncode == 0, changed.stderr
    assert "pack_items = 5\n" in changed.stdout, changed.stdout
    assert "pack_items = 5\n" in cli(redis_url, prefix, "config", "get", "square").stdout
    # and a pack_items withdrawn by the operator (docs/operations.md, "Upgrading workers")
    # stays withdrawn
    redis_client.hdel(meta, "pack_items")
    assert cli(redis_url, prefix, "config", "set", "square", "batch_size=4").returncode == 0
    assert not redis_client.hexists(meta, "pack_items")
    assert redis_client.hget(meta, "batch_size") == b"4"


# -- 2. a failing setup() shows its traceback, once per start of the partition ------------------
def test_a_setup_that_raises_is_an_error_with_its_traceback(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
) -> None:
    failing = worker(spawn, redis_url, prefix, f"{APP}:Unloadable")
    assert failing.wait() == 1, failing.output()
    out = failing.output()
    (error,) = lines_with("setup() failed on partition", out)
    assert " ERROR " in error and error.endswith(
        "serving unloadable: setup() failed on partition 0 (cpu)"
    ), error
    # the traceback follows it, down to the line of the serving that raised
    after = out[out.index(error) :]
    assert "Traceback (most recent call last):" in after
    assert re.search(r'first_hour_worker_app\.py", line \d+, in setup', after), after
    assert f"FileNotFoundError: {MISSING_MODEL}" in after
    assert out.count("Traceback (most recent call last):") == 1
    assert "(the traceback of setup() is logged above)" in out


def test_a_setup_that_fails_after_a_restart_is_logged_once_per_start(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
    tmp_path: Path,
) -> None:
    # Given a serving whose setup() works once, and a partition recycled after each batch
    env = child_env(FIRST_HOUR_SETUP_MARK=str(tmp_path / "set-up"))
    flags = ["--max-batches-per-partition", "1", "--max-restarts", "1"]
    args = ["--redis-url", redis_url, "--prefix", prefix, "--partitions", "1", *flags]
    fragile = spawn(f"{APP}:Fragile", *args, env=env)

    # When a batch runs, the partition is recycled, and each fresh one's setup() fails
    assert client.dispatch("fragile", 1, timeout=60) == 1

    # Then the worker gives up after the restarts it was allowed (a crash loop, exit 4)
    assert fragile.wait() == 4, fragile.output()
    out = fragile.output()
    starts = out.count("started as pid")
    errors = lines_with("serving fragile: setup() failed on partition 0 (cpu)", fragile.output())
    # and each start whose setup() failed said so once, with one traceback: not the first
    assert starts == 3, out
    assert len(errors) == starts - 1 and all(" ERROR " in e for e in errors), out
    assert out.count("Traceback (most recent call last):") == starts - 1, out


# -- 3. a refused option names the user's line, not pydantic's ----------------------------------
def test_a_refused_option_names_the_line_that_made_the_serving() -> None:
    frame = inspect.currentframe()
    assert frame is not None
    with pytest.raises(ValueError) as raised:
        qs.Serving(lambda xs: xs, name="zero", batch_size=0)
    line = frame.f_lineno - 1  # the qs.Serving line above
    assert str(raised.value) == (
        "batch_size must be an int from 1 to 1000000000, got 0 "
        f"(in the serving made at {__file__}, line {line})"
    )


def in_folder(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run from ``folder``, as a user runs it beside their module (no Redis answers)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    return subprocess.run(
        [sys.executable, "-m", "queueserve", *args, "--redis-url", dead],
        cwd=folder,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def test_the_worker_names_the_module_line_with_the_refused_option(tmp_path: Path) -> None:
    (tmp_path / "badopts.py").write_text(
        "import queueserve as qs\n"
        "\n"
        "\n"
        "serving = qs.Serving(lambda xs: xs, name='zero', batch_size=0)\n"
    )
    made = in_folder(tmp_path, "worker", "badopts:serving")
    assert made.returncode == 2, made.stderr
    assert made.stderr.strip() == (
        "queueserve: cannot import module 'badopts' for 'badopts:serving': ValueError: "
        "batch_size must be an int from 1 to 1000000000, got 0 (in the serving made at "
        f"{tmp_path / 'badopts.py'}, line 4)"
    )
    # an option a subclass sets: the line that sets it
    (tmp_path / "badclass.py").write_text(
        "import queueserve as qs\n"
        "\n"
        "\n"
        "class Model(qs.Serving):\n"
        "    name = 'model'\n"
        "    batch_timeout = '10 parsecs'\n"
        "\n"
        "    def handle_batch(self, batch):\n"
        "        return list(batch)\n"
    )
    by_class = in_folder(tmp_path, "worker", "badclass:Model")
    assert by_class.returncode == 2, by_class.stderr
    assert by_class.stderr.strip() == (
        "queueserve: cannot make serving 'badclass:Model': ValueError: batch_timeout "
        "'10 parsecs' is not a duration; write it like '10ms', '2s', '1.5m' or '0.1' (set on "
        f"class Model at {tmp_path / 'badclass.py'}, line 6)"
    )


# -- 4. a misspelled attribute or a file path gets the right spelling ---------------------------
@pytest.fixture
def project(tmp_path: Path) -> Path:
    """myapp/servings.py in a project folder, as the README has it, with two servings."""
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "servings.py").write_text(
        "import queueserve as qs\n\n"
        "def square(xs):\n    return [x * x for x in xs]\n\n"
        "serving = qs.Serving(square, name='square')\n"
        "embed = qs.Serving(square, name='embed')\n"
    )
    return tmp_path


def test_a_misspelled_attribute_suggests_the_close_servings(project: Path) -> None:
    done = in_folder(project, "worker", "myapp.servings:servng")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "queueserve: module 'myapp.servings' has no attribute 'servng'; did you mean "
        "myapp.servings:serving?"
    )
    # nothing close: the module's servings are listed (the function square is none of them)
    far = in_folder(project, "worker", "myapp.servings:model")
    assert far.returncode == 2, far.stderr
    assert far.stderr.strip() == (
        "queueserve: module 'myapp.servings' has no attribute 'model'; its servings: "
        "myapp.servings:embed, myapp.servings:serving"
    )


@pytest.mark.parametrize(
    "spec", ["myapp/servings.py:serving", "./myapp/servings.py:serving", "ABSOLUTE"]
)
def test_a_file_path_gets_the_module_name_with_dots(project: Path, spec: str) -> None:
    spec = spec.replace("ABSOLUTE", f"{project / 'myapp' / 'servings.py'}:serving")
    done = in_folder(project, "worker", spec)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"queueserve: {spec!r} names a file, not a module: name the module with dots, as "
        f"Python imports it: myapp.servings:serving (run from {project}, the folder that "
        "holds myapp/)"
    )


# -- 5. the JSON log ties a failure to its batch, and says where the metrics are ----------------
def json_records(worker: WorkerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]


def test_a_failed_batch_line_carries_the_batch_id_in_the_json_log(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    flaky = worker(spawn, redis_url, prefix, "tests.support.log_app:flaky", "--log-format", "json")
    got = client.dispatch_many("flaky", [1, BAD, 2], return_exceptions=True, timeout=60)
    assert isinstance(got[1], RemoteError)
    wait_until(
        lambda: any("batch function failed" in r["message"] for r in json_records(flaky)),
        "the failed batch's WARNING",
        process=flaky,
    )
    records = json_records(flaky)
    (failure,) = [r for r in records if "batch function failed" in r["message"]]
    (batch,) = [r for r in records if r["message"] == "handling 3 items"]
    assert failure["level"] == "WARNING"
    assert re.fullmatch(r"0\.\d+", failure["batch_id"]), failure
    assert failure["batch_id"] == batch["batch_id"]
    assert failure["request_ids"] == batch["request_ids"]


def test_the_metrics_address_is_logged_when_the_server_starts(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
) -> None:
    # Given --metrics-port 0: the port is the system's choice, known only from the log
    served = worker(
        spawn,
        redis_url,
        prefix,
        f"{APP}:square",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
    )
    # (the server starts before the first partition does)
    wait_until(
        lambda: any("started as pid" in r["message"] for r in json_records(served)),
        "the first partition's start",
        process=served,
    )
    (record,) = [r for r in json_records(served) if "/metrics" in r["message"]]
    assert record["level"] == "INFO", record
    found = re.fullmatch(
        r"metrics: http://127\.0\.0\.1:(\d+)/metrics \(and /healthz, /readyz\)",
        record["message"],
    )
    assert found, record
    # Then the address it names serves the metrics
    url = f"http://127.0.0.1:{found.group(1)}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        assert b"queueserve_queue_depth" in response.read()
