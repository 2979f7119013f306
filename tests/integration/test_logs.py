"""What a worker's log tells its operator (docs/operations.md, "Logs"): a failed batch function
call is one WARNING naming its requests, rate-limited; JSON lines carry partition, batch and
request ids; redis-py's maintenance-notification noise is dropped; startup errors are one line
and exit 2; a torch-free serving's worker never imports torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import queueserve as qs
from queueserve.errors import RemoteError
from tests.integration.test_cli import PYTHON, Spawn, WorkerProcess, run_cli, spawn  # noqa: F401
from tests.support.helpers import REPO, child_env, wait_until
from tests.support.log_app import BAD

ENTRY_ID = r"\d{13}-\d+"
FAILED = "batch function failed"


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[qs.Client]:
    with qs.Client(redis_url, prefix=prefix) as c:
        yield c


def serve(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    *flags: str,
) -> WorkerProcess:
    return spawn(
        "tests.support.log_app:flaky",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--partitions",
        "1",
        *flags,
    )


def fails(client: qs.Client) -> Callable[[], bool]:
    def call() -> bool:
        (result,) = client.dispatch_many("flaky", [BAD], return_exceptions=True, timeout=30)
        return isinstance(result, RemoteError)

    return call


def test_a_failed_batch_is_one_warning_naming_its_requests_and_floods_are_counted(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    worker = serve(spawn, redis_url, prefix)
    got = client.dispatch_many("flaky", [1, BAD, 2], return_exceptions=True, timeout=60)
    assert got[0] == 2 and got[2] == 3 and isinstance(got[1], RemoteError)
    line = wait_until(
        lambda: next((x for x in worker.output().splitlines() if FAILED in x), None),
        "the failed batch's WARNING",
        process=worker,
    )
    assert " WARNING " in line and "serving flaky" in line and "batch of 3 items" in line
    assert re.search(rf"\(requests {ENTRY_ID}\): ValueError: bad item {BAD}$", line), line
    # A serving failing every call: at most a line a second, and the next line counts the rest.
    calls = 0

    def flood_counted() -> bool:
        nonlocal calls
        calls += 1
        assert fails(client)()
        return "more failed batches not logged since the last line" in worker.output()

    wait_until(flood_counted, "a line counting the failures not logged", process=worker)
    assert worker.output().count(FAILED) < 1 + calls


def test_json_lines_carry_partition_batch_and_request_ids(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    worker = serve(spawn, redis_url, prefix, "--log-format", "json")
    assert client.dispatch_many("flaky", [1, 2, 3], timeout=60) == [2, 3, 4]
    wait_until(lambda: "handling 3 items" in worker.output(), "the batch's log line")
    records = [json.loads(line) for line in worker.output().splitlines() if line.strip()]
    (handling,) = [r for r in records if r["message"] == "handling 3 items"]
    assert handling["logger"] == "log_app" and handling["level"] == "INFO"
    assert handling["partition"] == "0"
    assert re.fullmatch(r"0\.\d+", handling["batch_id"])
    assert re.fullmatch(ENTRY_ID, handling["request_ids"])
    starting = next(r for r in records if "worker starting" in r["message"])
    assert starting["partition"] == "-" and starting["batch_id"] == "-"


def test_debug_logs_hold_no_maintenance_notification_noise(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    client: qs.Client,
) -> None:
    worker = serve(spawn, redis_url, prefix, "--log-level", "DEBUG")
    assert client.dispatch("flaky", 1, timeout=60) == 2
    wait_until(lambda: "handling 1 items" in worker.output(), "the batch's log line")
    assert "MAINT_NOTIFICATIONS" not in worker.output()


def test_a_syntax_error_in_the_served_module_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("import queueserve as qs\n\ndef f(:\n    pass\n")
    done = subprocess.run(
        [PYTHON, "-m", "queueserve", "worker", "broken_app:serving"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "SyntaxError" in line and "broken_app.py, line 3" in line, line


def test_metrics_without_the_metrics_extra_is_one_line_and_exit_2() -> None:
    # prometheus_client made unimportable, as in an install without the extra
    code = (
        "import sys; sys.modules['prometheus_client'] = None; "
        "from queueserve.ops.cli import main; "
        "sys.exit(main(['worker', 'tests.support.log_app:flaky', '--metrics-port', '0']))"
    )
    done = run_cli(program=(PYTHON, "-c", code))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "queueserve: --metrics-port needs the metrics extra: pip install 'queueserve[metrics]'"
    )


@pytest.mark.skipif(
    Path("/proc/driver/nvidia/version").exists(), reason="this host has an NVIDIA driver"
)
def test_partitions_are_counted_without_importing_torch_on_a_machine_without_gpus() -> None:
    code = (
        "import sys; from queueserve.worker.supervisor import resolve_partitions; "
        "assert resolve_partitions('auto') == (1, 'cpu'); "
        "assert resolve_partitions(2) == (2, 'cpu'); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
