"""Partitions: real worker processes, real signals (issue 3, docs/design.md §5 graceful shutdown,
§6)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from queueserve.worker.partition import YOUNG_COLLECTION_AFTER
from queueserve.worker.supervisor import EXIT_CRASH_LOOP, resolve_partitions
from tests.support.helpers import REPO, child_env, wait_until


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_worker(
    redis_url: str, prefix: str, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(spec: str, *args: str) -> WorkerProcess:
        log = tmp_path / f"worker{len(started)}.log"
        env = child_env(QS_TEST_URL=redis_url, QS_TEST_PREFIX=prefix)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "queueserve",
                    "worker",
                    f"tests.support.partition_app:{spec}",
                    "--redis-url",
                    redis_url,
                    "--prefix",
                    prefix,
                    *args,
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        worker = WorkerProcess(proc, log)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(10)


def _texts(r: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in r.lrange(key, 0, -1)]


def test_auto_partitions_without_cuda_is_one_cpu_partition() -> None:
    if resolve_partitions("auto")[1] == "cuda":
        pytest.skip("this machine has CUDA")
    assert resolve_partitions("auto") == (1, "cpu")
    assert resolve_partitions(3) == (3, "cpu")
    for bad in (0, -1, "two", True):
        with pytest.raises(ValueError, match="partitions must be 'auto' or an int >= 1"):
            resolve_partitions(bad)


def test_two_partitions_run_batches_at_the_same_time(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker with two partitions whose batches each wait until two batches have
    # started (a rendezvous only concurrent partitions can reach)
    start_worker("Pair", "--partitions", "2")
    wait_until(lambda: redis_client.llen(f"{prefix}:rec:setup") == 2, "both partitions' setup")

    # When eight requests of one batch each arrive
    tickets = [client.submit("pair", list(range(i * 4, i * 4 + 4))) for i in range(8)]

    # Then every caller gets its results in order
    for i, ticket in enumerate(tickets):
        assert ticket.result(timeout=60) == [x * 10 for x in range(i * 4, i * 4 + 4)]
    # and setup ran once in each partition process, bound to its own index
    setups = [s.split(":") for s in _texts(redis_client, f"{prefix}:rec:setup")]
    assert sorted(int(index) for index, _, _ in setups) == [0, 1]
    assert {device for _, device, _ in setups} == {"cpu"}
    assert len({pid for _, _, pid in setups}) == 2
    # and two batches in two different processes ran during overlapping time windows
    windows = [w.split(":") for w in _texts(redis_client, f"{prefix}:rec:windows")]
    overlapping = [
        (a, b)
        for a in windows
        for b in windows
        if a[0] != b[0] and float(a[2]) < float(b[3]) and float(b[2]) < float(a[3])
    ]
    assert overlapping, windows


def test_a_dead_partition_is_restarted_and_a_crash_loop_stops_the_worker(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    worker = start_worker("Unstable", "--partitions", "1", "--max-restarts", "2")
    assert client.dispatch("unstable", 1, timeout=60) == 2

    # When the partition process dies outside any batch (a bug of its own)
    redis_client.set(f"{prefix}:rec:die", 1)
    # Then the supervisor restarts it, says why, and later requests are served
    wait_until(lambda: "exited with code 9; restarting" in worker.output(), "restart log line")
    assert client.dispatch("unstable", 5, timeout=60) == 6

    # When it keeps dying (more than --max-restarts times in the window)
    for crashes in (2, 3):
        wait_until(lambda: client.dispatch("unstable", 0, timeout=60) == 1, "a live partition")
        redis_client.set(f"{prefix}:rec:die", 1)
        wait_until(
            lambda n=crashes: worker.output().count("exited with code 9") >= n, f"crash {crashes}"
        )
    # Then the worker stops with the documented crash-loop exit code
    assert worker.proc.wait(60) == EXIT_CRASH_LOOP
    assert "stopping the worker" in worker.output()


def test_a_partition_killed_inside_a_batch_is_restarted_without_counting_a_crash(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
) -> None:
    # Given a worker that tolerates one crash in the window
    worker = start_worker("Crashy", "--partitions", "1", "--max-restarts", "1")
    assert client.dispatch("crashy", 1, timeout=60) == 2

    # When an item kills the partition process from inside the batch function, twice or more
    for deaths in (1, 2):
        client.submit("crashy", [-1])
        wait_until(
            lambda n=deaths: worker.output().count("died while running a batch") >= n,
            "the death to be charged to the batch",
        )
        # Then the partition is restarted and serves, the worker still up
        assert client.dispatch("crashy", 5, timeout=60) == 6
    assert worker.proc.poll() is None


def test_sigterm_mid_batch_answers_the_running_batch_and_leaves_the_queue_to_the_next_worker(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker in the middle of a batch, with more requests queued behind it
    worker = start_worker("Gated", "--partitions", "1", "--shutdown-timeout", "30s")
    running = client.submit("gated", [1, 2, 3])
    wait_until(lambda: redis_client.llen(f"{prefix}:rec:started") == 1, "the batch to start")
    queued = [client.submit("gated", [10 + i]) for i in range(20)]

    # When it gets SIGTERM, and only then may the batch finish
    worker.proc.send_signal(signal.SIGTERM)
    # (the partition hears of it from its supervisor: wait until it stopped reading, or it
    # could serve the whole queue before it knows)
    wait_until(lambda: "stopped reading" in worker.output(), "the partition to drain")
    redis_client.rpush(f"{prefix}:rec:go", 1)

    # Then the running batch's callers get their results and the worker exits 0
    assert running.result(timeout=60) == [2, 4, 6]
    assert worker.proc.wait(60) == 0
    # and every request still queued is served by the next worker started
    after = start_worker("Gated", "--partitions", "1")
    for i, ticket in enumerate(queued):
        assert ticket.result(timeout=60) == [2 * (10 + i)]
    # each once: the first worker ran at most what it held (its running batch and one batch
    # waiting, batch_size 8), never reading more after the signal; the next worker the rest
    ran = [x.decode().split(":") for x in redis_client.lrange(f"{prefix}:rec:ran", 0, -1)]
    by = {int(item): int(pid) for pid, item in ran}
    assert len(ran) == len(by) == 23, ran
    first = {x for x, pid in by.items() if pid == worker.proc.pid}
    assert {1, 2, 3} <= first and len(first - {1, 2, 3}) <= 8, ran
    assert {x for x, pid in by.items() if pid == after.proc.pid} == set(range(10, 30)) - first


@pytest.mark.gpu
@pytest.mark.skipif(
    resolve_partitions("auto")[1] != "cuda", reason="needs a CUDA device (run on a GPU machine)"
)
def test_partitions_are_bound_to_their_cuda_device(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
) -> None:
    count, _ = resolve_partitions("auto")
    start_worker("Device", "--partitions", "auto")
    seen = {client.dispatch("device", i, timeout=120) for i in range(count * 20)}
    for index in range(count):
        assert f"cuda:{index}|{index}" in seen, seen


def test_partitions_exit_when_their_supervisor_is_killed(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker whose partition is still loading its model
    worker = start_worker("SlowSetup", "--partitions", "1")
    wait_until(lambda: redis_client.llen(f"{prefix}:rec:setup") == 1, "the partition's setup")
    pid = int(_texts(redis_client, f"{prefix}:rec:setup")[0].split(":")[2])

    # When the supervisor is SIGKILLed (as the OOM killer would) before the load finishes
    worker.proc.kill()
    worker.proc.wait(10)
    redis_client.rpush(f"{prefix}:rec:go", 1)

    # Then its partition does not serve on as an orphan: it drains and exits
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _is_zombie(pid), "the orphan to exit")


def test_a_dead_partitions_consumer_leaves_the_live_set_at_once(
    start_worker: Callable[..., WorkerProcess],
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a serving partition, live in the serving's worker set
    start_worker("Recording", "--partitions", "1")
    wait_until(lambda: redis_client.llen(f"{prefix}:rec:setup") == 1, "the partition's setup")
    pid = int(_texts(redis_client, f"{prefix}:rec:setup")[0].split(":")[2])
    workers = Keys(prefix, "recording").workers

    def consumers_of_pid() -> list[str]:
        return [c for c in _members(redis_client, workers) if f"-{pid}-p" in c]

    wait_until(consumers_of_pid, "its heartbeat")

    # When it is SIGKILLed
    os.kill(pid, signal.SIGKILL)

    # Then its supervisor takes it off the live set at once, so its entries are reclaimed at
    # the next pass (its last heartbeat would otherwise keep it there for 30 s)
    wait_until(lambda: not consumers_of_pid(), "the dead consumer to leave", timeout=10)


def _members(r: redis.Redis, key: str) -> list[str]:
    return [m.decode() for m in r.zrange(key, 0, -1)]


def test_partition_sees_its_supervisor_die_even_before_it_starts_serving(
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a partition that has not reached its serve loop yet
    probe = subprocess.Popen(
        [sys.executable, "-m", "tests.support.orphan_probe", redis_url, f"{prefix}:go"],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
    )
    assert probe.stdout is not None
    with probe.stdout:
        orphan = int(probe.stdout.readline())
    try:
        # When its supervisor is SIGKILLed first, and only then does it start serving
        probe.kill()
        probe.wait(10)
        redis_client.set(f"{prefix}:go", 1)

        # Then it still sees itself orphaned, and ends its serve loop
        wait_until(lambda: redis_client.lrange(f"{prefix}:go:exited", 0, -1), "the orphan's exit")
    finally:
        _kill_quietly(orphan)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_partition_freezes_what_setup_left_so_full_collections_skip_it(
    start_worker: Callable[..., WorkerProcess],
    client: qs.Client,
) -> None:
    # Given a worker process whose serving made an object in setup()
    start_worker("Heap")
    # When a request runs in its partition process
    answer = client.dispatch("heap", 0, timeout=60)
    # Then the heap as setup() left it is frozen: the garbage collector's full passes (150
    # ms with a model's library loaded) never walk it again
    assert answer["frozen"] > 1000
    assert answer["setup_walked"] is False
    # and the young generation is walked only once many objects outlive their allocation
    assert answer["young_threshold"] == YOUNG_COLLECTION_AFTER
