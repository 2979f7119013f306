"""Idempotency keys (docs/guarantees.md, "Once per key"), each on real worker and client
processes: one key runs once whichever process sends it, whenever, and whatever was killed on
the way; its reuse for other items is refused.

The serving counts its batch function's side effects (tests/support/once_app.py): ``effects``
holds an item once per batch run that completed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

import queueserve as qs
from tests.support.fault_app import Workers, serving_consumer, worker_env
from tests.support.helpers import REPO, WAIT_S, wait_until

SENDER = [sys.executable, "-m", "tests.support.once_app"]


def recorded(r: redis.Redis, prefix: str, what: str) -> list[str]:
    return [x.decode() for x in r.lrange(f"{prefix}:fault:{what}", 0, -1)]


@pytest.fixture
def senders(redis_url: str, prefix: str) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def sender(
    started: list[subprocess.Popen[str]], url: str, prefix: str, key: str, item: str, *hang: str
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*SENDER, key, item, *hang],
        cwd=REPO,
        env=worker_env(url, prefix),
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    return proc


def said(proc: subprocess.Popen[str], word: str) -> str:
    """The rest of the sender's next line, which must start with ``word``."""
    assert proc.stdout is not None
    line = proc.stdout.readline().split(" ", 1)
    assert line[0] == word, (word, line)
    return line[1].strip()


def test_two_processes_sending_one_key_at_once_run_it_once_and_get_one_answer(
    workers: Workers,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    senders: list[subprocess.Popen[str]],
) -> None:
    # Given a worker, and two sender processes ready to send the same key at the same moment
    worker = workers.start("tests.support.once_app:counted")
    serving_consumer(redis_client, prefix, "counted", worker)
    pair = [sender(senders, redis_url, prefix, "doc-1", "a") for _ in range(2)]
    wait_until(lambda: redis_client.llen(f"{prefix}:fault:ready") == 2, "both senders ready")

    # When both send at once
    redis_client.set(f"{prefix}:fault:start", 1)
    ids = [said(p, "sent") for p in pair]
    results = [said(p, "result") for p in pair]

    # Then the batch function ran once, and both got its one job and answer
    assert results == ['["done:a"]', '["done:a"]']
    assert ids[0] == ids[1]
    assert recorded(redis_client, prefix, "effects") == ["a"]


def test_a_sender_killed_after_its_send_and_its_retry_run_the_key_once(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    senders: list[subprocess.Popen[str]],
) -> None:
    # Given a sender SIGKILLed once its keyed request was in Redis, before its answer came
    worker = workers.start("tests.support.once_app:counted")
    serving_consumer(redis_client, prefix, "counted", worker)
    redis_client.set(f"{prefix}:fault:start", 1)
    first = sender(senders, redis_url, prefix, "doc-2", "hold-2", "hang")
    job_id = said(first, "sent")
    wait_until(lambda: recorded(redis_client, prefix, "started") == ["hold-2"], "its batch runs")
    first.kill()
    first.wait(10)

    # When its retry is sent from another process (this one), and the batch goes on
    retry = client.submit("counted", ["hold-2"], idempotency_key="doc-2")
    assert retry.id == job_id  # the first send's job
    redis_client.set(f"{prefix}:fault:go", 1)

    # Then the retry gets the first send's answer, and the batch function ran once
    assert retry.result(WAIT_S) == ["done:hold-2"]
    assert recorded(redis_client, prefix, "effects") == ["hold-2"]
    assert client.job(job_id).result(WAIT_S) == ["done:hold-2"]


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_batch_runs_the_key_once_as_its_side_effects_count(
    workers: Workers,
    client: qs.Client,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a keyed request whose batch runs when its worker is SIGKILLed
    doomed = workers.start("tests.support.once_app:counted")
    serving_consumer(redis_client, prefix, "counted", doomed)
    first = client.submit("counted", ["hold-3"], idempotency_key="doc-3")
    wait_until(lambda: recorded(redis_client, prefix, "started") == ["hold-3"], "its batch runs")
    doomed.kill_group()

    # When the key is sent again (a caller's retry), while its entry waits to be reclaimed,
    # and a new worker reclaims the entry and runs it to the end
    with qs.Client(redis_url, prefix=prefix) as other:
        retry = other.submit("counted", ["hold-3"], idempotency_key="doc-3")
        assert retry.id == first.id
        redis_client.set(f"{prefix}:fault:go", 1)
        workers.start("tests.support.once_app:counted")

        # Then the redelivered entry is the same request: one run completed, and its one answer
        # reached both callers (the killed run started it, and made no side effect)
        assert first.result(60) == retry.result(60) == ["done:hold-3"]
    assert recorded(redis_client, prefix, "effects") == ["hold-3"]
    assert recorded(redis_client, prefix, "started") == ["hold-3", "hold-3"]
