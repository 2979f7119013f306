"""``QUEUESERVE_<NAME>`` sets any worker option of ``queueserve worker`` (a flag wins), and a
misspelled one stops it with the name meant (docs/operations.md, "Environment variables")."""

from __future__ import annotations

import subprocess

import redis

from tests.integration.test_cli import PYTHON, Spawn, dead_url, spawn  # noqa: F401
from tests.support.helpers import REPO, child_env, wait_until


def _declared_batch_size(redis_client: redis.Redis, prefix: str) -> object:
    return redis_client.hget(f"{prefix}:{{square}}:meta", "batch_size")


def test_queueserve_batch_size_sets_the_worker_option_and_the_flag_wins(
    spawn: Spawn,  # noqa: F811
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
) -> None:
    # Given QUEUESERVE_BATCH_SIZE=64 in the environment of two workers, one also given a flag
    env = child_env(QUEUESERVE_BATCH_SIZE="64")
    spawn("tests.support.cli_app:square", "--redis-url", redis_url, "--prefix", prefix, env=env)
    spawn(
        "tests.support.cli_app:square",
        "--redis-url",
        redis_url,
        "--prefix",
        f"{prefix}-flag",
        "--batch-size",
        "8",
        env=env,
    )

    # Then each declares its serving with that batch size: the variable's, and the flag's
    wait_until(
        lambda: _declared_batch_size(redis_client, prefix) == b"64",
        "batch_size 64 from QUEUESERVE_BATCH_SIZE",
    )
    wait_until(
        lambda: _declared_batch_size(redis_client, f"{prefix}-flag") == b"8",
        "batch_size 8 from --batch-size",
    )


def test_a_misspelled_or_bad_variable_is_a_usage_error() -> None:
    url = dead_url()  # nothing may reach Redis: the environment is checked first
    for extra, says in (
        (
            {"QUEUESERVE_BATCH_SIZ": "64"},
            "QUEUESERVE_BATCH_SIZ is not a queueserve variable: "
            "did you mean QUEUESERVE_BATCH_SIZE?",
        ),
        (
            {"QUEUESERVE_BATCH_SIZE": "0"},
            "QUEUESERVE_BATCH_SIZE='0': batch_size must be an int from 1 to 1000000000",
        ),
    ):
        done = subprocess.run(
            [
                PYTHON,
                "-m",
                "queueserve",
                "worker",
                "tests.support.cli_app:square",
                "--redis-url",
                url,
            ],
            cwd=REPO,
            env=child_env(**extra),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
