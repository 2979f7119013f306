"""The fault suite (docs/design.md §5 "No loss", "Exactly one answer"; issue 4): real workers
SIGKILLed again and again under load from concurrent callers, counted at the callers.

Two `queueserve worker` processes (one partition each) serve ``tests.support.fault_app:busy``,
whose batches take real time. 16 caller threads over 4 clients send 20,000 requests (one in eight
carries 2-6 items), each keeping a window of requests in flight. The load advances in phases;
between phases a killer SIGKILLs the partition process of one worker (its supervisor restarts
it) or the whole worker process group (the test starts a new worker), always while that worker
is in the middle of a batch. Every caller checks it got exactly its own results, once.

Figures (printed; with ``$QS_FAULT_REPORT`` set, also written there as JSON):
answered, lost, duplicates delivered, duplicate reply slices the clients dropped, items
re-executed, kills, and the worst recovery time: from a kill to the answer of the last request
the killed partition held.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.wire.codec import codec_for_tag
from queueserve.wire.timing import DEAD_AFTER_S, RECLAIM_EVERY_S
from tests.support.fault_app import WorkerProc, Workers, consumer_of
from tests.support.helpers import entry_headers, wait_until

SERVING = "busy"
TOTAL = 20_000
CALLERS = 16
CLIENTS = 4
WINDOW = 12  # requests each caller keeps in flight
KILLS = 12
PHASE = TOTAL // (KILLS + 1)
RUN_LIMIT_S = 240.0  # a caller still waiting after this counts its requests as lost


def items_of(index: int) -> list[int]:
    """Request ``index``'s items: unique ints; one request in eight has 2-6 items."""
    n = 1 if index % 8 else 2 + index % 5
    return [index * 8 + j for j in range(n)]


def expected(items: list[int]) -> list[int]:
    return [x * 3 + 1 for x in items]


@dataclass
class Kill:
    number: int
    worker: int
    how: str  # "partition" or "group"
    at: float  # monotonic
    held: list[str]  # ticket ids of the requests the killed partition held unanswered


@dataclass
class Run:
    """State shared by callers, the killer and the clients' inbox readers."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    allowance: int = 0  # requests callers may have sent so far
    next_index: int = 0
    answered: int = 0
    answered_at: dict[str, float] = field(default_factory=dict)  # ticket id -> monotonic
    wrong: list[tuple[int, Any]] = field(default_factory=list)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    duplicate_slices: int = 0
    finished: list[tuple[qs.Ticket, int, list[Any]]] = field(default_factory=list)
    deadline: float = 0.0

    def take(self) -> int | None:
        """The next request index this caller may send now (caller holds cond)."""
        if self.next_index >= min(self.allowance, TOTAL):
            return None
        self.next_index += 1
        return self.next_index - 1


def count_duplicate_slices(client: qs.Client, run: Run) -> None:
    """Wrap the client's reply handling: count reply slices it will drop because every item in
    them was answered already (re-executions), and wake the callers after each reply."""
    table = client._table
    deliver = table.deliver

    def counting(message: bytes) -> None:
        if message and message[0] in (ord("m"), ord("p")):
            dropped = 0
            for row in codec_for_tag(message[0]).loads(memoryview(message)[1:]):
                rid, offset, count = row[0], row[1], row[2]
                call = table.calls.get(rid)
                if call is None or call.filled.count(0, offset, offset + count) != count:
                    dropped += 1
            if dropped:
                with run.cond:
                    run.duplicate_slices += dropped
        deliver(message)
        with run.cond:
            run.cond.notify_all()

    table.deliver = counting  # type: ignore[method-assign]


def caller(client: qs.Client, run: Run) -> None:
    window: list[tuple[qs.Ticket, int]] = []

    def ready() -> bool:
        return (
            any(t.done() for t, _ in window)
            or (len(window) < WINDOW and run.next_index < min(run.allowance, TOTAL))
            or (not window and run.next_index >= TOTAL)
        )

    while True:
        with run.cond:
            run.cond.wait_for(ready, timeout=1.0)
            fresh: list[int] = []
            while len(window) + len(fresh) < WINDOW and (i := run.take()) is not None:
                fresh.append(i)
            out_of_work = not window and not fresh and run.next_index >= TOTAL
        if out_of_work:
            return
        window += [(client.submit(SERVING, items_of(i)), i) for i in fresh]
        done = [(t, i) for t, i in window if t.done()]
        now = time.monotonic()
        for ticket, i in done:
            window.remove((ticket, i))
            result = ticket.result(0, return_exceptions=True)
            with run.cond:
                run.answered += 1
                run.answered_at[ticket.id] = now
                run.finished.append((ticket, i, list(result)))
                errors = [r for r in result if isinstance(r, BaseException)]
                if errors:
                    run.errors.append((i, errors[0]))
                elif result != expected(items_of(i)):
                    run.wrong.append((i, result))
                run.cond.notify_all()
        if time.monotonic() > run.deadline:
            with run.cond:
                run.lost += [i for _, i in window]
            return


class Killer:
    def __init__(
        self, workers: Workers, procs: list[WorkerProc], r: redis.Redis, prefix: str, run: Run
    ) -> None:
        self.workers = workers
        self.procs = procs
        self.r = r
        self.prefix = prefix
        self.run = run
        self.kills: list[Kill] = []
        self.error: BaseException | None = None
        self.stream = f"{prefix}:{{{SERVING}}}:in:default"

    def serving_partition(self, w: int) -> tuple[int, str] | None:
        """(pid, consumer) of worker ``w``'s partition once it serves (heartbeat sent)."""
        proc = self.procs[w]
        if not proc.alive:
            raise AssertionError(f"worker {w} exited:\n{proc.output()}")
        for pid in proc.partition_pids():
            consumer = consumer_of(self.r, self.prefix, SERVING, pid)
            if consumer is not None:
                return pid, consumer
        return None

    def mid_batch(self, pid: int) -> bool:
        return bool(self.r.exists(f"{self.prefix}:fault:running:{pid}"))

    def held_tickets(self, consumer: str) -> list[str]:
        """Ticket ids (client-rid) of the entries ``consumer`` holds unacked."""
        pending = self.r.xpending_range(self.stream, "qs", "-", "+", 10_000, consumer)
        held = []
        for p in pending:
            for _, fields in self.r.xrange(self.stream, p["message_id"], p["message_id"]):
                for raw in entry_headers(fields):
                    header = msgpack.unpackb(raw)
                    client_id = header[3].rsplit(":", 1)[1]
                    held.append(f"{client_id}-{header[1]}")
        return held

    def allow(self, more: int) -> None:
        with self.run.cond:
            self.run.allowance = min(TOTAL, self.run.allowance + more)
            self.run.cond.notify_all()

    def __call__(self) -> None:
        try:
            for k in range(KILLS):
                self.kill_once(k)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.allow(TOTAL)

    def kill_once(self, k: int) -> None:
        w = k % 2
        how = "partition" if (k // 2) % 2 == 0 else "group"
        # Given both workers serving (a killed one restarted) and a new phase of load
        for other in (0, 1):
            wait_until(lambda o=other: self.serving_partition(o), f"worker {other} to serve")
        self.allow(PHASE)
        with self.run.cond:
            ok = self.run.cond.wait_for(
                lambda: self.run.answered >= self.run.allowance - PHASE // 2, timeout=120
            )
        assert ok, f"phase {k}: answers stopped at {self.run.answered}"
        # When the target is in the middle of a batch, SIGKILL it
        pid, consumer = wait_until(
            lambda: (p := self.serving_partition(w)) and self.mid_batch(p[0]) and p,
            f"worker {w} to be mid-batch",
        )
        at = time.monotonic()
        if how == "partition":
            self.procs[w].kill_partition(pid)  # its supervisor restarts it
        else:
            self.procs[w].kill_group()
            self.procs[w] = self.workers.start(SERVING, "--max-restarts", "100")
        self.kills.append(Kill(k, w, how, at, self.held_tickets(consumer)))


@pytest.mark.timeout(400)
def test_sigkilled_workers_lose_nothing_and_callers_get_exactly_one_answer(
    workers: Workers,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given two workers and four clients whose duplicate reply slices are counted
    procs = [workers.start(SERVING, "--max-restarts", "100") for _ in range(2)]
    run = Run(deadline=time.monotonic() + RUN_LIMIT_S)
    clients = [qs.Client(redis_url, prefix=prefix) for _ in range(CLIENTS)]
    for c in clients:
        count_duplicate_slices(c, run)
    killer = Killer(workers, procs, redis_client, prefix, run)
    started = time.monotonic()
    try:
        # When 16 callers send 20,000 requests while the killer SIGKILLs workers mid-batch
        threads = [
            threading.Thread(target=caller, args=(clients[i % CLIENTS], run), daemon=True)
            for i in range(CALLERS)
        ]
        kill_thread = threading.Thread(target=killer, daemon=True)
        for t in [*threads, kill_thread]:
            t.start()
        for t in [*threads, kill_thread]:
            t.join(RUN_LIMIT_S + 30)
        elapsed = time.monotonic() - started
        # (re-read every result after the run: a late duplicate must not have changed one)
        changed = [
            i
            for ticket, i, first in run.finished
            if ticket.result(0, return_exceptions=True) != first
        ]
    finally:
        for c in clients:
            c.close()

    figures = report(run, killer, redis_client, prefix, elapsed, changed)
    assert killer.error is None, f"killer failed: {killer.error!r}"
    assert not any(t.is_alive() for t in threads), "a caller never finished"
    # Then every request was answered, exactly once, with its own results
    assert figures["lost"] == 0, run.lost[:20]
    assert not run.errors, run.errors[:5]
    assert not run.wrong, run.wrong[:5]
    assert figures["duplicates_delivered"] == 0, changed[:20]
    assert figures["answered"] == TOTAL
    assert figures["kills"] >= 10
    # and the killed batches really ran again: execution is at least once
    assert figures["items_reexecuted"] >= 1, figures
    assert figures["items_never_executed"] == 0, figures
    # and everything was acked: no backlog, no admitted items left, nothing dead-lettered
    keys = f"{prefix}:{{{SERVING}}}"
    wait_until(lambda: redis_client.xlen(f"{keys}:in:default") == 0, "the stream to empty")
    assert int(redis_client.get(f"{keys}:queued") or 0) == 0
    assert redis_client.xlen(f"{keys}:dead") == 0


def report(
    run: Run, killer: Killer, r: redis.Redis, prefix: str, elapsed: float, changed: list[int]
) -> dict[str, Any]:
    executed = [int(x) for x in r.lrange(f"{prefix}:fault:exec", 0, -1)]
    all_items = {x for i in range(TOTAL) for x in items_of(i)}
    recoveries = []
    for kill in killer.kills:
        times = [run.answered_at[t] - kill.at for t in kill.held if t in run.answered_at]
        after = [s for s in times if s >= 0]
        recoveries.append(
            {
                "kill": kill.number,
                "worker": kill.worker,
                "how": kill.how,
                "held_requests": len(kill.held),
                "last_held_answered_s": round(max(after), 2) if after else None,
            }
        )
    worst = max((x["last_held_answered_s"] or 0.0) for x in recoveries) if recoveries else None
    figures: dict[str, Any] = {
        "command": "python -m pytest tests/faults/test_faults.py -s",
        "requests": TOTAL,
        "items": len(all_items),
        "callers": CALLERS,
        "answered": run.answered,
        "lost": len(run.lost) + (TOTAL - run.answered - len(run.lost)),
        "errors": len(run.errors),
        "wrong_results": len(run.wrong),
        "duplicates_delivered": len(changed) + len(run.wrong),
        "duplicate_reply_slices_dropped_by_clients": run.duplicate_slices,
        "item_executions": len(executed),
        "items_reexecuted": len(executed) - len(set(executed)),
        "items_never_executed": len(all_items - set(executed)),
        "kills": len(killer.kills),
        "kills_by_kind": {
            how: sum(k.how == how for k in killer.kills) for how in ("partition", "group")
        },
        "worst_recovery_s": worst,
        "dead_after_s": DEAD_AFTER_S,
        "reclaim_every_s": RECLAIM_EVERY_S,
        "elapsed_s": round(elapsed, 1),
        "per_kill": recoveries,
    }
    text = json.dumps(figures, indent=2)
    print(f"\nfault suite figures:\n{text}")
    path = os.environ.get("QS_FAULT_REPORT")
    if path:
        Path(path).write_text(text + "\n")
    return figures
