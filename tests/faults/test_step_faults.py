"""Step servings against what a serving, an operator and a dying worker can do to them (issue 23,
class 3; docs/guarantees.md "Step servings"): unhashable prompt tokens, slots shrunk at run time
under a waiting request, and a replay of a sampling generation that restarts a caller's stream.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

import queueserve as qs
from tests.support.callers import Caller
from tests.support.fault_app import WorkerProc, serving_consumer
from tests.support.helpers import REPO, WAIT_S, child_env, wait_until
from tests.support.step_app import Count, expected

StartWorker = Callable[..., qs.Worker]


def test_prompt_tokens_that_cannot_key_the_cache_get_bad_request_and_the_neighbour_runs_on(
    start_worker: StartWorker,
    client: qs.Client,
) -> None:
    # Given a step serving with a prefix cache, a request generating (held at the gate)
    serving = Count(max_slots=4, prefix_cache_bytes=4096)
    start_worker(serving)
    neighbour = Caller(client, "count", [{"n": 3, "hold": True}])
    neighbour.next_event()
    # When a request comes whose prompt_tokens() returns lists (unhashable)
    bad = client.submit("count", [{"n": 2, "prompt": "abcd", "list_tokens": True}], timeout=30)
    # Then it gets BadRequest naming the method and what it returned
    with pytest.raises(qs.BadRequest) as raised:
        bad.result(WAIT_S)
    assert "Count.prompt_tokens(item) returned [['a'], ['b'], ['c'], ['d']]" in str(raised.value)
    assert "return a sequence of hashable tokens" in str(raised.value)
    # and the request beside it, and those after it, run on
    assert client.dispatch("count", {"n": 2, "prompt": "abcd"}, timeout=30) == expected(
        {"n": 2, "prompt": "abcd"}
    )
    assert not neighbour.finished.is_set()
    serving.gate.set()
    neighbour.join()
    assert neighbour.outputs()[:3] == [0, 1, 2]


def _config_set(redis_url: str, prefix: str, *assignments: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "config",
            "set",
            "count",
            *assignments,
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("streamed", [False, True], ids=["raw", "streamed"])
def test_slots_shrunk_under_a_waiting_request_split_or_refuse_it_and_the_line_moves(
    start_worker: StartWorker,
    client: qs.Client,
    redis_url: str,
    prefix: str,
    pending: Callable[..., int],
    streamed: bool,
) -> None:
    # Given 4 slots, one taken by a request generating until the gate opens, and waiting
    # behind it a request of 4 items, raw (splittable) or streamed (it runs whole)
    serving = Count(max_slots=4)
    worker = start_worker(serving)
    held = Caller(client, "count", [{"n": 1, "hold": True}])
    held.next_event()
    items = [{"n": 2, "base": 100 + i} for i in range(4)]
    if streamed:
        four = Caller(client, "count", items, timeout=60)
    else:
        ticket = client.submit("count", items, timeout=60)
    wait_until(lambda: pending("count") == 2, "the request of 4 items read")
    small = client.submit("count", [{"n": 1, "base": 7}], timeout=60)
    # When an operator shrinks the slots to 2 while it waits
    _config_set(redis_url, prefix, "batch_size=2")
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    wait_until(lambda: runner.serving.batch_size == 2, "the worker to take batch_size=2")
    serving.gate.set()
    # Then the raw request runs in parts of 2, the streamed one is refused saying why (either
    # used to wait for 4 slots for ever, and everything behind it with it), and the request
    # behind it runs
    if streamed:
        assert four.finished.wait(WAIT_S)
        assert isinstance(four.error, qs.BadRequest), four.error
        assert "the request has 4 items, more than max_slots=2" in str(four.error)
        assert "batch_size" in str(four.error)
    else:
        assert ticket.result(WAIT_S) == [expected(x) for x in items]
    assert small.result(WAIT_S) == [expected({"n": 1, "base": 7})]
    held.join()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("spec", ["sampled", "sampled_result", "sampled_batch"])
def test_a_replayed_sampling_generation_restarts_the_stream_which_adds_up_to_the_answer(
    redis_url: str,
    prefix: str,
    client: qs.Client,
    redis_client: redis.Redis,
    tmp_path: Path,
    fault: str,
    spec: str,
) -> None:
    # Given two workers serving a sampling step serving (each run of a request says
    # something else; or a generator batch serving that samples), and a caller streaming a
    # long generation
    workers = [
        WorkerProc.one_partition(
            [f"tests.support.step_app:{spec}"], redis_url, prefix, tmp_path / f"w{i}.log"
        )
        for i in range(2)
    ]
    name = spec.replace("_", "-")
    try:
        for w in workers:
            serving_consumer(redis_client, prefix, name, w)
        caller = Caller(client, name, [{"n": 60}], timeout=120)
        for _ in range(5):
            caller.next_event()
        # When the partition generating it is SIGKILLed, or SIGSTOPped until another
        # partition runs the request again and then let go on with its own run
        pid = int(redis_client.get(f"{prefix}:steps:pid") or 0)
        victim = next(w for w in workers if pid in w.partition_pids())
        if fault == "SIGKILL":
            victim.kill_partition(pid)
        else:
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda: int(redis_client.get(f"{prefix}:steps:pid") or 0) != pid,
                    "another partition to run the request again",
                )
            finally:
                os.kill(pid, signal.SIGCONT)
        events = caller.join()
        # Then the caller was told to discard what the aborted run had streamed, and what it
        # kept is one run's steps, the run whose answer it got
        assert any(isinstance(e, qs.Restart) for e in events), events
        kept = caller.outputs()
        if spec != "sampled_result":  # the answer is the steps
            seed = kept[0].split(":")[0]
            assert kept == [f"{seed}:{i}" for i in range(60)], kept
        else:  # the answer is the final Output
            *steps, answer = kept
            assert steps == answer["outputs"][: len(steps)], (steps, answer)
            assert answer["outputs"] == [f"{answer['seed']}:{i}" for i in range(60)]
    finally:
        for w in workers:
            w.kill_group()
