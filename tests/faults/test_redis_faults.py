"""Redis faults a deployment meets, against a real redis-server of the test's own, under load:
``maxmemory`` reached with noeviction (OOM), a REPLICAOF flip (what a failover does: READONLY
and UNBLOCKED), and a restart without persistence (NOGROUP). After each, every request is
answered, each item ran once, every client and worker thread is alive, and the client and the
worker each logged the outage once when it began and once when it ended.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis

import queueserve as qs
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer, free_port
from tests.support.servings import Recording, tag_items

FAULT_S = 2.0  # how long a fault is held once everyone has seen it
ANSWER_WAIT_S = 60.0


@dataclass
class Load:
    """Requests submitted one by one from a thread until stopped (the sender thread sends)."""

    client: qs.Client
    serving: qs.Serving
    tickets: list[tuple[str, qs.Ticket]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            item = f"i{len(self.tickets)}"
            self.tickets.append((item, self.client.submit(self.serving, [item], timeout=120)))

    def answers(self) -> list[tuple[str, list[str]]]:
        return [(item, t.result(timeout=ANSWER_WAIT_S)) for item, t in self.tickets]


@dataclass
class Rig:
    server: redis.Redis
    redis_server: RedisServer
    worker: qs.Worker
    client: qs.Client
    serving: Recording
    load: Load
    caplog: pytest.LogCaptureFixture
    fault: str = ""

    def outage_lines(self, owner: str) -> list[str]:
        return [
            r.levelname
            for r in self.caplog.records
            if r.name == "queueserve.broker.retry" and r.getMessage().startswith(f"{owner}:")
        ]

    @property
    def owners(self) -> list[str]:
        host = self.worker._host
        assert host is not None
        return [self.client._core.owner, host.broker.outage.owner]

    def seen_by_all(self) -> bool:
        return all("WARNING" in self.outage_lines(owner) for owner in self.owners)

    def threads(self) -> dict[str, bool]:
        host = self.worker._host
        assert host is not None and host._heart is not None
        alive = {t.name: t.is_alive() for r in host.runners for t in r.threads}
        alive["heartbeat"] = host._heart.is_alive()
        for name, part in (("_reader", self.client._inbox), ("_sender", self.client._outbox)):
            thread = getattr(part, name)
            alive[f"client{name}"] = thread is not None and thread.is_alive()
        return alive

    def check(self, submitted_during: int) -> None:
        """Every request answered with its own result, run once; every thread alive; one log
        line per owner at each end of the outage. Prints the figures (run with -s)."""
        assert len(self.load.tickets) > submitted_during, "no load after the fault"
        answered = sum(result == [f"r:{item}"] for item, result in self.load.answers())
        runs = Counter(self.serving.items_run)
        duplicated = sum(n > 1 for n in runs.values())
        sent = len(self.load.tickets)
        print(
            f"\n{self.fault}: sent {sent}, answered {answered}, lost {sent - answered}, "
            f"run twice {duplicated}; threads alive: {all(self.threads().values())}"
        )
        assert answered == sent
        assert sorted(runs) == sorted(item for item, _ in self.load.tickets)
        assert duplicated == 0
        assert all(self.threads().values()), self.threads()
        for owner in self.owners:  # the last of an owner's loops to recover says it ended
            wait_until(
                lambda o=owner: self.outage_lines(o) != ["WARNING"],
                f"{owner} to log the end of the outage",
                timeout=30,
            )
            # one line as an outage begins and one as it ends; a flip may show as two short
            # outages (a role change also unblocks reads), never as a storm of lines
            lines = self.outage_lines(owner)
            assert lines in (["WARNING", "INFO"], ["WARNING", "INFO"] * 2), (
                owner,
                self.caplog.text,
            )


@pytest.fixture
def rig(
    redis_tmp_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> Iterator[Rig]:
    caplog.set_level(logging.INFO, logger="queueserve")
    url = redis_tmp_server.url
    serving = Recording(tag_items, name="tag", batch_size=16, batch_timeout=0.002)
    worker = qs.Worker([serving], redis_url=url, prefix=prefix, handle_signals=False).start()
    client = qs.Client(url, prefix=prefix)
    server = redis.Redis.from_url(url)
    rig = Rig(server, redis_tmp_server, worker, client, serving, Load(client, serving), caplog)
    try:
        assert client.dispatch(serving, "warm", timeout=30) == "r:warm"
        serving._batches.clear()
        yield rig
    finally:
        rig.load.stop()
        if redis_tmp_server.running:
            server.config_set("maxmemory", 0)
            server.execute_command("REPLICAOF", "NO", "ONE")
        server.close()
        client.close()
        worker.stop(timeout=10)


def hold_fault(rig: Rig, lift: Callable[[], None]) -> int:
    """Keep the fault until client and worker both logged it, then FAULT_S more; returns how
    many requests were submitted by then."""
    wait_until(rig.seen_by_all, "client and worker to log the outage", timeout=30)
    threading.Event().wait(FAULT_S)
    during = len(rig.load.tickets)
    lift()
    return during


@pytest.mark.timeout(180)
def test_maxmemory_with_noeviction_is_ridden_out(rig: Rig) -> None:
    # Given requests flowing
    rig.fault = "maxmemory with noeviction (OOM)"
    rig.load.start()
    wait_until(lambda: len(rig.load.tickets) > 20, "some load")
    # When Redis refuses every write for lack of memory (OOM), for a while
    rig.server.config_set("maxmemory-policy", "noeviction")
    rig.server.config_set("maxmemory", 1)
    during = hold_fault(rig, lambda: rig.server.config_set("maxmemory", 0))
    # Then, once it has memory again, everything is answered and everyone lives on
    wait_until(lambda: len(rig.load.tickets) > during + 20, "load after the fault")
    rig.load.stop()
    rig.check(during)


@pytest.mark.timeout(180)
def test_a_replicaof_flip_is_ridden_out(rig: Rig) -> None:
    rig.fault = "REPLICAOF flip"
    rig.load.start()
    wait_until(lambda: len(rig.load.tickets) > 20, "some load")
    # When the primary becomes a replica (of a primary it cannot reach) and back: READONLY
    # for writes, UNBLOCKED for blocked reads, as in a failover
    rig.server.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    during = hold_fault(rig, lambda: rig.server.execute_command("REPLICAOF", "NO", "ONE"))
    wait_until(lambda: len(rig.load.tickets) > during + 20, "load after the fault")
    rig.load.stop()
    rig.check(during)


@pytest.mark.timeout(180)
def test_a_restart_without_persistence_is_ridden_out(rig: Rig) -> None:
    # Given everything sent so far answered (a restart without persistence loses what Redis
    # holds; nothing can bring that back)
    rig.fault = "restart without persistence"
    rig.load.start()
    wait_until(lambda: len(rig.load.tickets) > 20, "some load")
    rig.load.stop()
    rig.load.answers()
    # When Redis restarts empty (no consumer groups: NOGROUP) while requests are submitted
    rig.redis_server.stop()
    rig.load.start()
    during = hold_fault(rig, rig.redis_server.start)
    wait_until(lambda: len(rig.load.tickets) > during + 20, "load after the restart")
    rig.load.stop()
    rig.check(during)
