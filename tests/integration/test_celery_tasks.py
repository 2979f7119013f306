"""Celery-triggered indexing, end to end, with real processes.

A real Celery worker (solo pool, ``celery -A tasks.celery_app worker``) and a real
``queueserve worker tasks.embed:embed`` run against the test Redis under a prefix of this module;
the tests send the tasks with ``apply_async`` and wait with ``get(timeout=...)``. Every state the
indexing task stores is also published by Celery's Redis backend on the task's key, so the test
subscribes there before sending and sees each PROGRESS state, however fast the task runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tasks.celery_app import (
    COLLECT_TASK,
    INDEX_TASK,
    SEARCH_TASK,
    STATUS_TASK,
    SUBMIT_TASK,
    celery_settings,
    make_app,
)
from tasks.indexing import Index
from tests.support.helpers import REPO, wait_until
from tests.support.redis_server import delete_keys

LIMIT = 80  # passages: enough for several requests of CHUNK, quick on two CPU cores
CHUNK = 16
TASK_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Stack:
    url: str
    prefix: str
    app: Celery
    index_dir: Path
    logs: Path


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        out.close()  # the child holds its own copy


def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (graceful for both workers); the whole session is killed if it will not go."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both workers running under a prefix of this module; stopped and cleaned up after."""
    prefix = f"qstcel{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("celery-logs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUEUESERVE_", "CELERY_"))}
    env.update(
        QUEUESERVE_REDIS_URL=redis_server,
        QUEUESERVE_PREFIX=prefix,
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    embedder = _start(
        ["-m", "queueserve", "worker", "tasks.embed:embed", "--partitions", "1"],
        env,
        logs / "queueserve.log",
    )
    celery = _start(
        [
            "-m",
            "celery",
            "-A",
            "tasks.celery_app",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--hostname",
            f"{prefix}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env,
        logs / "celery.log",
    )
    app = make_app(celery_settings(redis_server, prefix))
    try:
        # Tasks go once the serving is declared, as a deployment starts its producers after
        # its workers: a call to a name no worker declared fails at once (qs.UnknownServing)
        with contextlib.closing(redis.Redis.from_url(redis_server)) as r:
            wait_until(
                lambda: r.exists(f"{prefix}:{{embed}}:meta"),
                "the embed worker to declare its serving",
                timeout=180,
            )
        yield Stack(redis_server, prefix, app, tmp_path_factory.mktemp("index"), logs)
    finally:
        app.close()
        codes = {"celery": _stop(celery), "queueserve": _stop(embedder)}
        client = redis.Redis.from_url(redis_server)
        try:
            delete_keys(client, prefix)
        finally:
            client.close()
        assert codes == {"celery": 0, "queueserve": 0}, _logs(logs)


def _logs(directory: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
        for p in sorted(directory.glob("*.log"))
    )


@dataclass
class Indexed:
    summary: dict[str, Any]
    states: list[dict[str, Any]]  # every state the task stored, in order


@pytest.fixture(scope="module")
def indexed(stack: Stack) -> Indexed:
    """``index_corpus`` run once through Celery, with every state it published."""
    task_id = str(uuid.uuid4())
    channel = stack.app.backend.get_key_for_task(task_id)
    listener = redis.Redis.from_url(stack.url).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(channel)
    try:
        result = stack.app.tasks[INDEX_TASK].apply_async(
            kwargs={"limit": LIMIT, "index_dir": str(stack.index_dir), "chunk_size": CHUNK},
            task_id=task_id,
        )
        try:
            summary = result.get(timeout=TASK_TIMEOUT_S)
        except Exception as e:
            raise AssertionError(f"index_corpus failed: {e!r}\n{_logs(stack.logs)}") from e
        # The SUCCESS state was published before get() returned, so it is in the buffer.
        states: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (states and states[-1]["status"] == "SUCCESS"):
            message = listener.get_message(timeout=1)  # None also for the subscribe reply
            if message is not None:
                states.append(json.loads(message["data"]))
    finally:
        listener.close()
    return Indexed(summary, states)


def test_index_corpus_reports_progress_and_stores_the_index(
    stack: Stack,
    indexed: Indexed,
) -> None:
    # The task finished with its summary
    assert indexed.summary["count"] == LIMIT
    assert indexed.summary["items_per_s"] > 0
    assert sum(indexed.summary["buckets"].values()) == LIMIT
    # It published PROGRESS states, from 0 up to the total, then SUCCESS
    statuses = [s["status"] for s in indexed.states]
    assert statuses[-1] == "SUCCESS", statuses
    progress = [s["result"] for s in indexed.states if s["status"] == "PROGRESS"]
    assert progress, statuses
    assert progress[0]["done"] == 0
    assert progress[-1]["done"] == LIMIT
    assert all(p["total"] == LIMIT for p in progress)
    assert [p["done"] for p in progress] == sorted(p["done"] for p in progress)
    assert all(p["items_per_s"] >= 0 for p in progress)
    # And the index holds one unit vector per passage
    index = Index.load(stack.index_dir)
    assert len(index.ids) == len(set(index.ids)) == LIMIT
    assert index.vectors.shape == (LIMIT, 384)
    assert abs(float((index.vectors**2).sum(axis=1).mean()) - 1.0) < 1e-4


def test_a_retried_index_corpus_embeds_no_passage_again(
    stack: Stack, indexed: Indexed, tmp_path: Path
) -> None:
    # Given the corpus indexed once (each passage sent with its idempotency key)
    def requests_sent() -> int:
        with contextlib.closing(redis.Redis.from_url(stack.url)) as r:
            streams = r.scan_iter(f"{stack.prefix}:{{embed}}:in:*", count=1000)
            return sum(int(r.xinfo_stream(s)["entries-added"]) for s in streams)

    before = requests_sent()
    assert before > 0
    # When the task runs again (a retry), then no request reaches the embedding worker, and
    # the index holds the same vectors
    again = stack.app.tasks[INDEX_TASK].apply_async(
        kwargs={"limit": LIMIT, "index_dir": str(tmp_path), "chunk_size": CHUNK}
    )
    assert again.get(timeout=TASK_TIMEOUT_S)["count"] == LIMIT
    assert requests_sent() == before
    first, second = Index.load(stack.index_dir), Index.load(tmp_path)
    assert second.ids == first.ids and (second.vectors == first.vectors).all()


def test_search_finds_a_passage_by_its_own_text(stack: Stack, indexed: Indexed) -> None:
    index = Index.load(stack.index_dir)
    search = stack.app.tasks[SEARCH_TASK]
    for i in (0, LIMIT // 2, LIMIT - 1):
        hits = search.apply_async(
            args=(index.texts[i],),
            kwargs={"k": 3, "index_dir": str(stack.index_dir)},
        ).get(timeout=TASK_TIMEOUT_S)
        assert len(hits) == 3
        (first_id, score, text), *rest = hits
        assert (first_id, text) == (index.ids[i], index.texts[i])
        assert score == pytest.approx(1.0, abs=1e-4)
        assert all(score >= s for _, s, _ in rest)


def test_search_without_an_index_says_what_to_run(stack: Stack, tmp_path: Path) -> None:
    result = stack.app.tasks[SEARCH_TASK].apply_async(
        args=("anything",), kwargs={"index_dir": str(tmp_path)}
    )
    with pytest.raises(FileNotFoundError, match="index_corpus"):
        result.get(timeout=TASK_TIMEOUT_S)


def test_a_task_submits_jobs_and_other_tasks_check_on_them_and_collect_the_index(
    stack: Stack, tmp_path: Path
) -> None:
    # A task submits the corpus as queueserve jobs and returns at once with their ids
    submitted = (
        stack.app.tasks[SUBMIT_TASK]
        .apply_async(kwargs={"limit": LIMIT, "chunk_size": CHUNK})
        .get(timeout=TASK_TIMEOUT_S)
    )
    assert submitted["count"] == LIMIT
    assert sorted(i for _, part in submitted["jobs"] for i in part) == list(range(LIMIT))
    # A second task checks on them until they are done
    status = stack.app.tasks[STATUS_TASK]
    deadline = time.monotonic() + TASK_TIMEOUT_S
    while (state := status.apply_async(args=(submitted,)).get(timeout=TASK_TIMEOUT_S))[
        "status"
    ] == "running":
        assert state["total"] == LIMIT and 0 <= state["done"] <= LIMIT
        assert time.monotonic() < deadline, state
    assert state == {
        "status": "done",
        "done": LIMIT,
        "total": LIMIT,
        "jobs": {"done": len(submitted["jobs"])},
    }
    # A third collects the answers kept in Redis and stores the index, which search reads
    summary = (
        stack.app.tasks[COLLECT_TASK]
        .apply_async(args=(submitted,), kwargs={"index_dir": str(tmp_path)})
        .get(timeout=TASK_TIMEOUT_S)
    )
    assert summary["count"] == LIMIT
    index = Index.load(tmp_path)
    hits = (
        stack.app.tasks[SEARCH_TASK]
        .apply_async(args=(index.texts[3],), kwargs={"k": 1, "index_dir": str(tmp_path)})
        .get(timeout=TASK_TIMEOUT_S)
    )
    assert hits[0][0] == index.ids[3]
