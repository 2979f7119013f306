"""The first hour without a wrong turn (issue 36), at the doors other than the worker: the job
CLI, the dashboard and the gateway. Each test runs the real command (a worker, a gateway or a
dashboard process) against a real Redis and checks what a new user sees: the exit code and the
JSON a script reads, the page's words, the probe a load balancer asks, the startup log and the
error body. Nothing waits on a sleep: every wait is for a condition with a deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
from tests.support.fault_app import WorkerProc
from tests.support.helpers import REPO, WAIT_S, child_env, wait_until

EXIT_JOB_FAILED = 5  # docs/operations.md, "Supervision and exit codes"


# --- queueserve job wait -------------------------------------------------------------------
def job_cli(redis_url: str, prefix: str, *args: str) -> tuple[int, Any, str]:
    """``queueserve job ARGS`` as a user types it: its exit code, its stdout read as JSON
    (None when it is not), and its stderr."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "job",
            *args,
            *("--redis-url", redis_url, "--prefix", prefix),
        ],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    try:
        out = json.loads(done.stdout)
    except ValueError:
        out = None
    return done.returncode, out, done.stdout + done.stderr


@pytest.fixture
def gated_worker(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> Iterator[None]:
    """A worker process serving tests.support.gateway_app:gated (the item "bad" raises)."""
    worker = WorkerProc.one_partition(
        ["tests.support.gateway_app:gated"], redis_url, prefix, tmp_path / "worker.log"
    )
    try:
        wait_until(
            lambda: redis_client.exists(f"{prefix}:{{gated}}:meta"), "the worker", process=worker
        )
        yield
    finally:
        worker.kill_group()


def test_job_wait_exits_with_the_failed_code_and_json_for_a_failed_job_and_0_for_a_good_one(
    gated_worker: None, redis_url: str, prefix: str
) -> None:
    # Given a job one of whose items fails, and a job whose items all succeed
    with qs.Client(redis_url, prefix=prefix) as client:
        failed = client.submit("gated", ["a", "bad"], keep=60).id
        good = client.submit("gated", ["b"], keep=60).id

    # When a script waits for each with `queueserve job wait`
    code, out, text = job_cli(redis_url, prefix, "wait", failed, "--timeout", "60")

    # Then the failed one exits with the documented code, and its JSON holds the good item's
    # result and the failed item's error as JSON (not a Python repr)
    assert code == EXIT_JOB_FAILED, text
    assert out == {
        "id": failed,
        "status": "failed",
        "progress": {"done": 2, "total": 2},
        "result": [
            "r:a",
            {"error": {"type": "ValueError", "message": "the item 'bad' is refused"}},
        ],
    }, text

    # and the good one exits 0 with its results
    code, out, text = job_cli(redis_url, prefix, "wait", good, "--timeout", "60")
    assert code == 0, text
    assert out == {
        "id": good,
        "status": "done",
        "progress": {"done": 1, "total": 1},
        "result": ["r:b"],
    }, text


def test_the_failed_job_exit_code_is_in_the_help_and_the_docs() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "queueserve", "--help"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    ).stdout
    assert f"{EXIT_JOB_FAILED} `job wait`: the job failed" in help_text
    operations = (REPO / "docs" / "operations.md").read_text()
    assert f"| {EXIT_JOB_FAILED} | `queueserve job wait`: the job ended failed" in operations
