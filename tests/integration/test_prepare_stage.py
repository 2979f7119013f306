"""The preparation stage (issue 13): ``prepare_batch`` on a CPU pool ahead of the device,
``handle_batch`` on the device's thread with ``batch.prepared``, ``finish_batch`` on the
replier; per-key order, per-item isolation of prepare errors, cancellation and deadlines checked
again before the device, a bounded lookahead, and SIGTERM draining what was prepared."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

import queueserve as qs
from tests.support.fault_app import WorkerProc
from tests.support.helpers import stream_key, wait_until
from tests.support.servings import GATE_LIMIT_S

StartWorker = Callable[..., qs.Worker]
RESULT_WAIT_S = 30.0


class Staged(qs.Serving):
    """Records every stage call as (stage, thread name, items, prepared); the device waits on
    ``gate`` (open unless ``gated``); prepare raises for negative numbers, and waits while an
    item names a held event in ``prep_gates``."""

    batch_timeout = 0.0

    def __init__(self, *, gated: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[tuple[str, str, list[Any], Any]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.prep_gates: dict[Any, threading.Event] = {}

    def _record(self, stage: str, items: list[Any], prepared: Any = None) -> None:
        with self.lock:
            self.calls.append((stage, threading.current_thread().name, list(items), prepared))

    def prepare_batch(self, batch: qs.Batch) -> Any:
        self._record("prepare", batch)
        for x in batch:
            if x in self.prep_gates and not self.prep_gates[x].wait(GATE_LIMIT_S):
                raise RuntimeError(f"prepare gate of {x!r} stayed shut")
            if isinstance(x, int) and x < 0:
                raise ValueError(f"cannot prepare negative item {x}")
        prepared = tuple(batch)  # what the device needs: made from exactly these items
        self._record("prepared", batch, prepared)
        return prepared

    def handle_batch(self, batch: qs.Batch) -> Any:
        self._record("handle", batch, batch.prepared)
        if not self.gate.wait(GATE_LIMIT_S):
            raise RuntimeError("device gate stayed shut")
        return {"device": list(batch.prepared)}

    def finish_batch(self, batch: qs.Batch, output: Any) -> list[Any]:
        self._record("finish", batch, output)
        return [f"r:{x}" for x in output["device"]]

    def stage(self, name: str) -> list[list[Any]]:
        with self.lock:
            return [items for stage, _, items, _ in self.calls if stage == name]

    def threads(self, name: str) -> set[str]:
        with self.lock:
            return {thread for stage, thread, _, _ in self.calls if stage == name}


# --- the serving API, inline ------------------------------------------------------------------


def test_inline_runs_prepare_then_handle_with_prepared_then_finish() -> None:
    serving = Staged(name="inl", batch_size=3)
    assert serving.inline_many([1, 2, 3, 4]) == ["r:1", "r:2", "r:3", "r:4"]
    stages = [(stage, items) for stage, _, items, _ in serving.calls]
    assert stages == [
        ("prepare", [1, 2, 3]),
        ("prepared", [1, 2, 3]),
        ("handle", [1, 2, 3]),
        ("finish", [1, 2, 3]),
        ("prepare", [4]),
        ("prepared", [4]),
        ("handle", [4]),
        ("finish", [4]),
    ]
    assert [p for stage, _, _, p in serving.calls if stage == "handle"] == [(1, 2, 3), (4,)]


def test_function_servings_take_prepare_and_finish_as_options() -> None:
    seen: list[Any] = []

    def prepare(batch: qs.Batch) -> list[int]:
        return [x * 10 for x in batch]

    def model(batch: qs.Batch) -> list[int]:
        seen.append(batch.prepared)
        return [p + 1 for p in batch.prepared]

    serving = qs.Serving(
        model, prepare=prepare, finish=lambda b, out: [-x for x in out], prepare_concurrency=2
    )
    assert serving.inline_many([1, 2]) == [-11, -21]
    assert seen == [[10, 20]]
    assert serving.prepare_concurrency == 2 and serving.has_prepare and serving.has_finish
    assert serving.options()["prepare_concurrency"] == 2
    plain = qs.Serving(model, name="plain")
    assert not plain.has_prepare and not plain.has_finish


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_prepare_concurrency_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"prepare_concurrency must be an int >= 1, got"):
        qs.Serving(lambda xs: xs, name="x", prepare_concurrency=bad)


def test_prepare_and_finish_must_be_callable() -> None:
    with pytest.raises(TypeError, match="prepare must be callable or None, got 3"):
        qs.Serving(lambda xs: xs, name="x", prepare=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="finish must be callable"):
        qs.Serving(lambda xs: xs, name="x", finish="f")  # type: ignore[arg-type]


# --- in a worker ------------------------------------------------------------------------------


def test_each_stage_runs_on_its_own_thread_and_the_device_gets_what_was_prepared(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Staged(name="threads", batch_size=4, prepare_concurrency=2)
    start_worker(serving)
    assert client.dispatch_many(serving, [1, 2, 3], timeout=RESULT_WAIT_S) == ["r:1", "r:2", "r:3"]
    assert client.dispatch_many(serving, [4, 5], timeout=RESULT_WAIT_S) == ["r:4", "r:5"]

    # prepare on the pool, the batch function on the device's thread, finish on the replier
    assert all("-preparer" in t for t in serving.threads("prepare"))
    assert all("-executor" in t for t in serving.threads("handle"))
    assert all(t.endswith("-replier") for t in serving.threads("finish"))
    handled = [(items, p) for stage, _, items, p in serving.calls if stage == "handle"]
    assert handled == [([1, 2, 3], (1, 2, 3)), ([4, 5], (4, 5))]


def test_batches_of_one_key_reach_the_device_in_order_whichever_prepares_first(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given two preparers, and a first batch whose preparation waits for the second's
    serving = Staged(name="order", batch_size=2, prepare_concurrency=2)
    first_held = serving.prep_gates["slow"] = threading.Event()
    start_worker(serving)
    first = client.submit(serving, ["slow", "a"])
    wait_until(lambda: serving.stage("prepare"), "the first batch's preparation")
    second = client.submit(serving, ["fast", "b"])

    # When the second batch is prepared while the first still is
    wait_until(lambda: serving.stage("prepared"), "the second batch prepared")
    assert serving.stage("prepared") == [["fast", "b"]]
    assert serving.stage("handle") == []  # it waits for the first: same key
    first_held.set()

    # Then the device ran them in the order they were taken
    assert first.result(RESULT_WAIT_S) == ["r:slow", "r:a"]
    assert second.result(RESULT_WAIT_S) == ["r:fast", "r:b"]
    assert serving.stage("handle") == [["slow", "a"], ["fast", "b"]]


def test_a_key_whose_batch_prepares_slowly_does_not_hold_up_another_key(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Staged(name="keys", batch_size=2, prepare_concurrency=2)
    held = serving.prep_gates["slow"] = threading.Event()
    start_worker(serving)
    slow = client.submit(serving, ["slow"], batch_key="a")
    wait_until(lambda: serving.stage("prepare"), "key a's preparation")

    # key b's batch is prepared and run while key a's is still being prepared
    assert client.dispatch(serving, "quick", batch_key="b", timeout=RESULT_WAIT_S) == "r:quick"
    assert not slow.done()
    held.set()
    assert slow.result(RESULT_WAIT_S) == ["r:slow"]


def test_prepare_errors_are_isolated_per_item(start_worker: StartWorker, client: qs.Client) -> None:
    # Given a batch of four items, one of which its preparation cannot take
    serving = Staged(name="isolate", batch_size=4, gated=True)
    start_worker(serving)
    blocker = client.submit(serving, [0])
    wait_until(lambda: serving.stage("handle"), "the blocker on the device")
    ticket = client.submit(serving, [1, -2, 3, 4])
    wait_until(lambda: len(serving.stage("prepared")) >= 3, "the bisected preparation")
    serving.gate.set()

    # Then only that item gets the error, and the others their results
    assert blocker.result(RESULT_WAIT_S) == ["r:0"]
    got = ticket.result(RESULT_WAIT_S, return_exceptions=True)
    assert got[0] == "r:1" and got[2:] == ["r:3", "r:4"]
    assert isinstance(got[1], qs.RemoteError) and got[1].remote_type == "ValueError"
    assert "cannot prepare negative item -2" in got[1].remote_message
    # and the device never saw the failing item: each healthy part ran with its own prepared
    handled = [(items, p) for stage, _, items, p in serving.calls if stage == "handle"][1:]
    assert handled == [([1], (1,)), ([3, 4], (3, 4))]


def test_on_error_fail_fails_the_whole_batch_on_a_prepare_error(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Staged(name="failall", batch_size=4, on_error="fail")
    start_worker(serving)
    got = client.dispatch_many(serving, [1, -2], timeout=RESULT_WAIT_S, return_exceptions=True)
    assert all(isinstance(g, qs.RemoteError) for g in got)
    assert serving.stage("handle") == []


def test_cancelled_and_expired_requests_are_dropped_between_prepare_and_device(
    start_worker: StartWorker, client: qs.Client, pending: Callable[..., int]
) -> None:
    # Given a device busy with a gated batch, and a batch of three requests prepared behind it
    # (batches run when full: the three requests share one)
    serving = Staged(name="recheck", batch_size=3, batch_timeout=60, gated=True)
    worker = start_worker(serving)
    runner = worker._host.runners[0]  # type: ignore[union-attr]
    blocker = client.submit(serving, ["blocker", "b", "c"])
    wait_until(lambda: serving.stage("handle"), "the blocker on the device")
    # (each in an entry of its own: a cancel never drops a request that shares one, a pack)
    cancelled = client.submit(serving, ["gone"])
    wait_until(lambda: pending("recheck") == 2, "the worker to read it")
    expiring = client.submit(serving, ["late"], timeout=1.0)
    wait_until(lambda: pending("recheck") == 3, "the worker to read it")
    kept = client.submit(serving, ["kept"])
    wait_until(
        lambda: ["gone", "late", "kept"] in serving.stage("prepared"),
        "one batch of the three prepared",
    )

    # When one caller cancels and another's deadline passes while the batch waits
    cancelled.cancel()
    wait_until(lambda: runner.ledger.cancelled, "the worker to hear of the cancel")
    with pytest.raises(qs.Timeout):
        expiring.result(RESULT_WAIT_S)
    serving.gate.set()

    # Then neither reaches the device; the rest is prepared again without them and runs
    assert blocker.result(RESULT_WAIT_S) == ["r:blocker", "r:b", "r:c"]
    assert kept.result(RESULT_WAIT_S) == ["r:kept"]
    with pytest.raises(qs.Cancelled):
        cancelled.result(RESULT_WAIT_S)
    handled = [(items, p) for stage, _, items, p in serving.calls if stage == "handle"]
    assert handled == [(["blocker", "b", "c"], ("blocker", "b", "c")), (["kept"], ("kept",))]


def test_prepared_batches_waiting_for_the_device_stay_within_the_bound(
    start_worker: StartWorker, client: qs.Client, pending: Callable[..., int]
) -> None:
    # Given a device held on its first batch and a backlog of 30 one-item batches
    concurrency = 2
    bound = concurrency + 1
    serving = Staged(name="bound", batch_size=1, prepare_concurrency=concurrency, gated=True)
    start_worker(serving)
    tickets = [client.submit(serving, [i]) for i in range(30)]

    # When the worker has read all it will hold: the running batch, the bound, and one batch
    # waiting in the Assembler
    wait_until(lambda: pending("bound") == 1 + bound + 1, "the worker to fill up")

    # Then only the running batch and `bound` more were prepared; no more were taken
    assert len(serving.stage("handle")) == 1
    assert len(serving.stage("prepare")) == 1 + bound
    assert pending("bound") == 1 + bound + 1
    serving.gate.set()
    assert [t.result(RESULT_WAIT_S) for t in tickets] == [[f"r:{i}"] for i in range(30)]
    assert serving.stage("handle") == [[i] for i in range(30)]


def test_sigterm_drains_prepared_batches(
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    client: qs.Client,
) -> None:
    # Given a worker process whose device is held on a first batch, with batches prepared
    worker = WorkerProc.one_partition(
        ["tests.support.prepare_app:staged"], redis_url, prefix, tmp_path / "worker.log"
    )
    rec = f"{prefix}:fault"
    try:
        tickets = [client.submit("staged", [i], timeout=120) for i in range(8)]
        # (the device thread may record its first batch after the preparers their next ones)
        wait_until(
            lambda: (
                redis_client.llen(f"{rec}:exec") == 1 and redis_client.llen(f"{rec}:prepared") >= 3
            ),
            "the device held on its first batch and three batches prepared",
        )

        # When its process group gets SIGTERM, and only then the device goes on
        os.killpg(worker.proc.pid, signal.SIGTERM)
        wait_until(lambda: redis_client.exists(f"{rec}:sigterm"), "the partition's SIGTERM")
        redis_client.set(f"{rec}:go", 1)

        # Then it runs and answers every prepared batch before it exits 0
        assert worker.proc.wait(60) == 0, worker.output()
        prepared = [int(x) for x in redis_client.lrange(f"{rec}:prepared", 0, -1)]
        executed = [int(x) for x in redis_client.lrange(f"{rec}:exec", 0, -1)]
        # (two preparers may finish out of order; the device runs them in the order taken)
        assert executed == sorted(prepared) == list(range(len(executed)))
        assert len(executed) >= 3
        for i in executed:
            assert tickets[i].result(10) == [i * 2]
        # and what it had not taken stays queued for another worker
        assert redis_client.xlen(stream_key(prefix, "staged")) == 8 - len(executed)
    finally:
        if worker.alive:
            worker.kill_group()
