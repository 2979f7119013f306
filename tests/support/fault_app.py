"""Servings that the guarantee and fault tests run in real worker processes
(``queueserve worker tests.support.fault_app:NAME``).

They record what happens inside the partitions into Redis, under ``$QS_TEST_PREFIX:fault:*`` on
``$QS_TEST_URL`` (read when a partition starts), so a test can tell how often an item really ran,
which process ran it, and when a batch is in progress. Gates are Redis keys a batch polls for,
tolerating a Redis that is briefly away (the reconnect tests restart it under a running batch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgpack
import redis

import queueserve as qs
from queueserve.wire.codec import codec_for_tag
from queueserve.wire.kinds import ERROR
from tests.support.helpers import REPO, child_env, wait_until

T = TypeVar("T")

GATE_LIMIT_S = 60.0  # a gate nobody opens fails the batch after this long, instead of hanging


_CONNECTION: tuple[redis.Redis, str] | None = None


def _connect() -> tuple[redis.Redis, str]:
    """This process's connection to the test's Redis and the key prefix to record under."""
    global _CONNECTION
    if _CONNECTION is None:
        r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
        _CONNECTION = r, f"{os.environ['QS_TEST_PREFIX']}:fault"
    return _CONNECTION


def wait_for_key(r: redis.Redis, key: str, limit: float = GATE_LIMIT_S) -> None:
    """Poll until ``key`` exists: a condition, riding out Redis restarts and dropped links."""
    deadline = time.monotonic() + limit
    while True:
        try:
            if r.exists(key):
                return
        except redis.RedisError:
            pass  # Redis is restarting: keep waiting for the gate
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {key} stayed shut for {limit}s")
        time.sleep(0.01)


class _Recorded(qs.Serving):
    """Base: records into the test's Redis (a per-process connection, so nothing depends on
    which copy of the serving object runs the batch)."""

    def setup(self, partition: qs.Partition) -> None:
        self.r.rpush(f"{self.rec}:setup", os.getpid())

    @property
    def r(self) -> redis.Redis:
        return _connect()[0]

    @property
    def rec(self) -> str:
        return _connect()[1]


class Busy(_Recorded):
    """Fault suite: every batch takes real time (so a SIGKILL lands mid-batch), records each
    item it runs (``exec``) and marks itself running (``running:<pid>``) while it does."""

    name = "busy"
    batch_size = 32
    batch_timeout = 0.005
    max_deliveries = 1000  # this suite proves no loss under kills, not dead-lettering
    work_s = 0.03

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        running = f"{self.rec}:running:{os.getpid()}"
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(f"{self.rec}:exec", *batch)
        pipe.set(running, len(batch))
        pipe.execute()
        time.sleep(self.work_s)  # the batch's work (a device would be busy here)
        self.r.delete(running)
        return [x * 3 + 1 for x in batch]


class Slow(_Recorded):
    """A batch that runs until the test opens the ``go`` gate (longer than DEAD_AFTER_S)."""

    name = "slow"
    batch_size = 4
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(f"{self.rec}:exec", *batch)
        pipe.rpush(f"{self.rec}:exec-by", *[f"{x}@{os.getpid()}" for x in batch])
        pipe.execute()
        if "long" in batch:
            wait_for_key(self.r, f"{self.rec}:go")
        return [f"done:{x}" for x in batch]


class Crasher(_Recorded):
    """Kills its own process (as a segfault or the kernel's OOM killer would) on the item
    "boom", until the test sets the ``fixed`` flag; records every item it completes."""

    name = "crasher"
    batch_size = 1
    batch_timeout = 0.0
    max_deliveries = 2

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        if "boom" in batch and not self.r.exists(f"{self.rec}:fixed"):
            self.r.rpush(f"{self.rec}:crashes", os.getpid())
            os._exit(9)
        self.r.rpush(f"{self.rec}:exec", *batch)
        return [f"ok:{x}" for x in batch]


class CrasherBatched(Crasher):
    """Like Crasher, but batches of up to 4 requests: a crasher shares its batch. Records each
    batch's items, sorted and joined by ``,`` (``batches``), before it runs (or dies)."""

    name = "crasher-batched"
    batch_size = 4
    batch_timeout = 0.2

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.r.rpush(f"{self.rec}:batches", ",".join(sorted(batch)))
        return super().handle_batch(batch)


class CrasherBatchedThree(CrasherBatched):
    """Like CrasherBatched with the default max_deliveries (3): a redelivered crasher's first
    retry is batched with its neighbours (docs/design.md §5)."""

    name = "crasher-batched-3"
    max_deliveries = 3


class Gathering(_Recorded):
    """Batches of up to 8 gathered for 0.3 s, each one's size recorded (``sizes``); a batch
    holding "wait" waits for the ``go`` gate, so a kill can land inside it."""

    name = "gathering"
    batch_size = 8
    batch_timeout = 0.3

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.r.rpush(f"{self.rec}:sizes", len(batch))
        if "wait" in batch:
            wait_for_key(self.r, f"{self.rec}:go")
        return [f"r:{x}" for x in batch]


class Sturdy(_Recorded):
    """Plain serving for the bad-input flood: answers ``r:<item>``."""

    name = "sturdy"
    batch_size = 64
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return [f"r:{x}" for x in batch]


class LateStart(Sturdy):
    """Sturdy, whose setup waits until the file ``start_gate(prefix)`` exists: a model still
    loading, gated outside Redis so the test can stop Redis meanwhile."""

    name = "late-start"

    def setup(self, partition: qs.Partition) -> None:
        gate = start_gate(os.environ["QS_TEST_PREFIX"])
        deadline = time.monotonic() + GATE_LIMIT_S
        while not gate.exists():  # polls a condition, bounded
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} never appeared")
            time.sleep(0.01)


def start_gate(prefix: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{prefix}.start-gate"


class Held(_Recorded):
    """Reconnect tests: records each batch's items, then waits for the ``go`` gate when an item
    is "wait" (riding out a Redis restart inside the batch)."""

    name = "held"
    batch_size = 8
    batch_timeout = 0.001

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        with contextlib.suppress(redis.RedisError):  # best effort while Redis is away
            self.r.rpush(f"{self.rec}:exec", *batch)
        if "wait" in batch:
            wait_for_key(self.r, f"{self.rec}:go")
        return [f"r:{x}" for x in batch]


class Hanger(_Recorded):
    """A batch function that never returns on the item "hang" (a deadlock, a stuck device)."""

    name = "hanger"
    batch_size = 1
    batch_timeout = 0.0
    max_deliveries = 2

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        if "hang" in batch:
            self.r.rpush(f"{self.rec}:hangs", os.getpid())
            threading.Event().wait()
        return [f"ok:{x}" for x in batch]


class Hoarder(_Recorded):
    """Leaks: every batch keeps 64 MiB alive for the life of its process, and records which
    process ran it."""

    name = "hoarder"
    batch_size = 1
    batch_timeout = 0.0
    leaked: ClassVar[list[bytearray]] = []

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.leaked.append(bytearray(64 * 1024 * 1024))
        self.r.rpush(f"{self.rec}:ran-by", os.getpid())
        return [os.getpid() for _ in batch]


busy = Busy()
slow = Slow()
hanger = Hanger()
hoarder = Hoarder()
crasher = Crasher()
crasher_batched = CrasherBatched()
crasher_batched_3 = CrasherBatchedThree()
gathering = Gathering()
sturdy = Sturdy()
late_start = LateStart()
held = Held()


# --- test side: real worker processes --------------------------------------------------------
# Only the tests use what follows; worker processes import this module for the servings above.


def worker_env(url: str, prefix: str) -> dict[str, str]:
    """A worker's environment (``child_env``) plus where the servings above record
    (QS_TEST_URL, QS_TEST_PREFIX)."""
    return child_env(QS_TEST_URL=url, QS_TEST_PREFIX=prefix)


class WorkerProc:
    """One `python -m queueserve worker` process, in a session (process group) of its own, so
    the group holds exactly this worker and the partition processes it spawned."""

    def __init__(self, args: list[str], url: str, prefix: str, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "queueserve", "worker", *args],
                cwd=REPO,
                env=worker_env(url, prefix),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def one_partition(cls, specs: list[str], url: str, prefix: str, log: Path) -> WorkerProc:
        """A worker of ``specs`` (``module:serving``) with one partition, on ``url`` and
        ``prefix``."""
        args = [*specs, "--redis-url", url, "--prefix", prefix, "--partitions", "1"]
        return cls(args, url, prefix, log)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def partition_pids(self) -> list[int]:
        """Pids of this worker's partition processes (its spawn'd children; not the
        multiprocessing resource tracker), read from /proc."""
        pids: list[int] = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                pids += [int(p) for p in children.read_text().split()]
            except OSError:
                continue  # the thread or the process is gone
        found = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                found.append(pid)
        return found

    def kill_partition(self, pid: int) -> None:
        """SIGKILL one partition process, after checking it is this worker's child."""
        if pid not in self.partition_pids():
            raise AssertionError(f"pid {pid} is not a partition of worker {self.proc.pid}")
        os.kill(pid, signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL the worker and its partitions at once (the leader is alive, so the group id
        is still this worker's)."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class Workers:
    """Starts worker processes for one test and kills whatever is left of them afterwards."""

    def __init__(self, url: str, prefix: str, directory: Path) -> None:
        self.url = url
        self.prefix = prefix
        self.dir = directory
        self.started: list[WorkerProc] = []

    def start(self, spec: str, *args: str, url: str | None = None) -> WorkerProc:
        url = url or self.url
        log = self.dir / f"worker-{len(self.started)}.log"
        worker = WorkerProc(
            [
                spec if ":" in spec else f"tests.support.fault_app:{spec}",
                "--redis-url",
                url,
                "--prefix",
                self.prefix,
                "--partitions",
                "1",
                *args,
            ],
            url,
            self.prefix,
            log,
        )
        self.started.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.started:
            worker.kill_group()


def consumer_of(r: redis.Redis, prefix: str, serving: str, pid: int) -> str | None:
    """The consumer name under which partition process ``pid`` serves ``serving`` (names are
    host-pid-pPARTITION-nonce), once it has sent a heartbeat."""
    marker = f"-{pid}-p"
    for name in r.zrange(f"{prefix}:{{{serving}}}:workers", 0, -1):
        text = name.decode()
        if marker in text:
            return text
    return None


def serving_consumer(r: redis.Redis, prefix: str, serving: str, worker: WorkerProc) -> str:
    """Wait until ``worker``'s partition serves ``serving`` (heartbeat sent); its consumer."""
    return wait_until(
        lambda: next(
            (c for pid in worker.partition_pids() if (c := consumer_of(r, prefix, serving, pid))),
            None,
        ),
        f"a partition of worker {worker.proc.pid} to serve {serving}",
    )


# --- test side: requests written and replies read by hand, as any Redis user could ------------


def header(rid: int, n: int, reply_to: str, deadline_ms: int = 0, codec: str = "msgpack") -> bytes:
    """A well-formed request header (protocol.py: version, id, count, reply_to, deadline,
    codec)."""
    return bytes(msgpack.packb([1, rid, n, reply_to, deadline_ms, codec]))


class RawInbox:
    """A reply address that the test reads itself: every reply slice, by request id."""

    def __init__(self, r: redis.Redis, prefix: str, name: str = "raw") -> None:
        self.r = r
        self.key = f"{prefix}:inbox:{name}"
        self.slices: dict[int, list[tuple[int, int, int, Any]]] = {}

    def drain(self) -> int:
        """Read what arrived; returns how many slices were read."""
        read = 0
        while True:
            messages = self.r.lpop(self.key, 1000)
            if not messages:
                return read
            for message in messages:
                for row in codec_for_tag(message[0]).loads(memoryview(message)[1:]):
                    rid, offset, count, kind, body = row[:5]
                    self.slices.setdefault(rid, []).append((offset, count, kind, body))
                    read += 1

    def answered(self, rids: Iterable[int]) -> bool:
        self.drain()
        return all(rid in self.slices for rid in rids)

    def error_kind(self, rid: int) -> str | None:
        """The queueserve error kind of the request's only reply slice (None: a result).
        The same slice may come twice: a worker whose ack script Redis does not hold yet
        (the first ack after Redis started or flushed its scripts) sends its replies again
        with the loaded script, and clients keep the first (docs/guarantees.md, "Exactly one
        answer"). Any other second slice fails."""
        (_, _, kind, body), *more = self.slices[rid]
        assert all(s == self.slices[rid][0] for s in more), (
            f"request {rid} got {1 + len(more)} different reply slices: {self.slices[rid]}"
        )
        return str(body[3]) if kind == ERROR else None
