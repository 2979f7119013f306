"""The fuzzer: hostile values in every Redis key and channel queueserve reads, and hostile
requests to the worker's metrics port, while valid traffic runs (docs/guarantees.md, "Redis
inputs").

A real worker process (two partitions, four servings: tests/faults/fuzz/app.py; trace context
read, a metrics port) serves sync and async clients, bursts that travel as packs, calls from a
caller's span, a generator serving's stream and a step serving, while the fuzzer writes values
of every family (values.py) through every attack of every surface (surfaces.py: one per kind of
``wire/keys.py``'s LAYOUT, field of a request entry, optional header field and HTTP server
of the worker). Every 2 s the operator's commands run, the dashboard's overview is read and the
metrics port is scraped, among the slow clients the fuzzer holds. Then it checks: every valid
request answered once, with its own result, and run once; no thread died and no partition
exited (nothing CRITICAL, no traceback in the worker's log, the same partition processes); the
admission counters and depth hashes back to zero; Redis's memory back within a bound once the
fuzzer's own keys are gone; every serving, the victim included, answers again, and so does
/metrics.

QS_FUZZ_SECONDS sets how long the fuzzer writes (default 20), QS_FUZZ_SEED its seed (default
23; a failure names the seed to rerun with).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import socket
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

import queueserve as qs
from queueserve.broker.fleet import Fleet
from queueserve.dashboard.board import Board
from queueserve.dashboard.exporter import exposition
from queueserve.ops import cli
from queueserve.wire.keys import Keys, events_channel, inbox_key, worker_key
from tests.faults.fuzz import app
from tests.faults.fuzz.surfaces import (
    SURFACES,
    VALID,
    VICTIM,
    Attack,
    Surface,
    Target,
    scrape,
    trickle,
)
from tests.faults.fuzz.traffic import Tally, Traffic
from tests.faults.fuzz.values import FAMILIES, WRONG_TYPE
from tests.support.fault_app import WorkerProc
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer

SECONDS = float(os.environ.get("QS_FUZZ_SECONDS") or 20)
SEED = int(os.environ.get("QS_FUZZ_SEED") or 23)
# What to attack, comma-separated kind[:attack[:family]] (default: everything but the known
# breaks), e.g. QS_FUZZ_ONLY=ready,meta:field:numbers: to reproduce one finding quickly.
ONLY = [tuple(o.split(":")) for o in os.environ.get("QS_FUZZ_ONLY", "").split(",") if o]
WRITES_PER_ROUND = 8  # hostile writes, then wait until valid traffic made progress
# At most one 10 MB value per this many writes (the point is one, not a flood); counted in
# writes, not seconds, so a seed gives the same values in the same order on any machine.
HUGE_EVERY = 1500
OPS_EVERY_S = 2.0  # how often the operator's readers (stats, dead-letter list) run
SERVINGS = (*VALID, VICTIM)
MEMORY_SLACK = 8 * 1024 * 1024  # used_memory after cleanup over before: one 10 MB value left fails

# (surface kind, attack, family) -> the break of issue 23 it meets, until its fix lands;
# "*" matches any. They run alone, in test_known_break, expected to fail.
KNOWN_BREAKS: dict[tuple[str, str, str], str] = {}

Plan = list[tuple[Surface, Attack, str]]


def known(surface: Surface, attack: Attack, family: str) -> str | None:
    return next(
        (why for pattern, why in KNOWN_BREAKS.items() if matches(pattern, surface, attack, family)),
        None,
    )


def matches(pattern: tuple[str, ...], surface: Surface, attack: Attack, family: str) -> bool:
    what = (surface.kind, attack.name, family)
    return all(p in ("*", v) for p, v in zip(pattern, what[: len(pattern)], strict=True))


def plan(only: tuple[str, str, str] | None = None) -> Plan:
    """Every (surface, attack, family) to run: all but the known breaks (those of QS_FUZZ_ONLY
    when set), or only those of one known break."""
    out = []
    for surface in SURFACES:
        for attack in surface.attacks:
            for family in attack.families:
                if only is not None:
                    chosen = matches(only, surface, attack, family)
                elif ONLY:
                    chosen = any(matches(o, surface, attack, family) for o in ONLY)
                else:
                    chosen = known(surface, attack, family) is None
                if chosen:
                    out.append((surface, attack, family))
    return out


@dataclass
class Run:
    """One fuzzing run's counts, printed at the end."""

    written: Counter[str] = field(default_factory=Counter)  # per surface kind
    refused: Counter[str] = field(default_factory=Counter)  # writes Redis itself refused
    ops_runs: int = 0
    scrapes: int = 0  # of the worker's /metrics, among slow clients
    huge: int = 0  # 10 MB values among the writes
    sent: int = 0  # valid requests
    answered: int = 0  # valid requests answered with their own result
    memory_kib: int = 0  # used_memory after the cleanup, over what it was before

    def report(self, seed: int) -> str:
        per = ", ".join(f"{k} {n}" for k, n in sorted(self.written.items()))
        return (
            f"fuzz seed {seed}: {sum(self.written.values())} hostile writes ({per}; "
            f"{self.huge} of them 10 MB); "
            f"refused by Redis {sum(self.refused.values())}; operator reads {self.ops_runs};"
            f" scrapes {self.scrapes};"
            f" valid requests sent {self.sent}, answered correctly {self.answered}; "
            f"used_memory after cleanup {self.memory_kib:+} KiB"
        )


class Fuzzer:
    """Writes one hostile value at a time, chosen by its seed among ``steps``."""

    def __init__(self, target: Target, steps: Plan, seed: int) -> None:
        self.target = target
        self.steps = steps
        self.seed = seed
        self.rng = random.Random(seed)
        self.run = Run()
        self.recent: deque[tuple[str, str, str, bytes]] = deque(maxlen=16)
        self._writes = 0
        self._huge_at = 0
        self._ops_at = 0.0

    def write_one(self) -> None:
        surface, attack, family = self.rng.choice(self.steps)
        self._writes += 1
        if family == "huge":
            if self._writes < self._huge_at:
                family = "noise"
            else:
                self._huge_at = self._writes + HUGE_EVERY
                self.run.huge += 1
        value = b"" if family == WRONG_TYPE else FAMILIES[family](self.rng)
        self.recent.append((surface.kind, attack.name, family, value[:80]))
        try:
            attack.write(self.target, value)
        except redis.ResponseError:  # e.g. a WRONGTYPE from a key another attack replaced
            self.run.refused[surface.kind] += 1
            return
        self.run.written[surface.kind] += 1

    def operator_reads(self) -> None:
        """What `queueserve stats`, `dead-letter list`, `dead-letter replay --all` (of every
        dead letter the junk earned, forged ones included) and `config get` do: exit 0, or 1
        saying what was wrong; never raise, whatever they read. What the dashboard reads (its
        overview: meta and config hashes, workers and their records, depths), which must not
        raise either. And a scrape of the worker's /metrics and /healthz while the slow
        clients held go on: answered 200 within SCRAPE_WITHIN_S, and /readyz answered."""
        if time.monotonic() < self._ops_at:
            return
        self.dashboard_reads()
        self.scrapes()
        out = io.StringIO()
        common = ["--redis-url", self.target.url, "--prefix", self.target.prefix]
        commands = (
            ["stats", "--interval", "1ms"],
            ["dead-letter", "list"],
            ["dead-letter", "replay", "fz", "--all"],
            ["config", "get"],
        )
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            for argv in commands:
                code = cli.main([*argv, *common])
                assert code in (0, 1), f"queueserve {argv} exited {code}: {out.getvalue()}"
        self.run.ops_runs += 1
        self._ops_at = time.monotonic() + OPS_EVERY_S

    def dashboard_reads(self) -> None:
        """The dashboard's page: every serving's row (the victim's, whose keys may be of
        another type, says so: the others are shown), and the valid servings' dead letters."""
        board = Board(Fleet(self.target.url), self.target.prefix)
        try:
            overview = board.overview()
            for serving in VALID:
                board.dead_letters(serving)
            # its /metrics: well-formed counts (a flooded registry may leave a serving out)
            scraped = exposition(board.fleet, board.prefix).decode()
            values = [s.value for f in text_string_to_metric_families(scraped) for s in f.samples]
            assert all(v >= 0 and v == int(v) for v in values), scraped[:2000]
        finally:
            board.fleet.close()
        errors = {s["name"]: s["error"] for s in overview["servings"] if "error" in s}
        assert errors.keys() <= {VICTIM}, f"servings the dashboard could not read: {errors}"
        workers = [w for s in overview["servings"] for w in s["workers"]]
        assert all(type(w["items"]) is int and w["items"] >= 0 for w in workers), workers

    def scrapes(self) -> None:
        port = self.target.metrics_port
        if port is None:
            return
        trickle(self.target)  # the slow clients held are not silent now
        for path in ("/metrics", "/healthz"):
            status, body = scrape(port, path)
            assert status == 200, f"a scrape of {path} got {status}: {body[:500]!r}"
        status, _ = scrape(port, "/readyz")
        assert status in (200, 503), f"/readyz answered {status}"
        self.run.scrapes += 1


@pytest.fixture
def redis_url(redis_tmp_server: RedisServer) -> str:
    """A server of the test's own: Redis's used_memory after the attack is then the fuzz's
    alone, not also what an earlier test's processes still write to the session's server
    (a CI run saw 15 MB over the baseline with the prefix's keys holding under 1 MB)."""
    return redis_tmp_server.url


@pytest.fixture
def metrics_port() -> int:
    """A port free now, for the worker's /metrics."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def worker(
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    metrics_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[WorkerProc]:
    specs = [f"tests.faults.fuzz.app:{name}" for name in ("plain", "victim", "steps", "generate")]
    monkeypatch.setenv("QS_FUZZ_TRACING", "1")  # its partitions read trace context (app.py)
    proc = WorkerProc(
        [
            *specs,
            *("--redis-url", redis_url, "--prefix", prefix, "--partitions", "2"),
            *("--metrics-port", str(metrics_port)),
        ],
        redis_url,
        prefix,
        tmp_path / "worker.log",
    )
    try:
        yield proc
    finally:
        proc.kill_group()


def fuzz(
    worker: WorkerProc,
    r: redis.Redis,
    url: str,
    prefix: str,
    steps: Plan,
    seconds: float,
    seed: int,
    metrics_port: int | None = None,
) -> Run:
    """Run valid traffic and the fuzzer for ``seconds``, then check everything; an
    AssertionError names the seed, the last values written and what the worker logged."""
    # Given a worker serving every serving from both partitions
    for name in SERVINGS:
        keys = Keys(prefix, name)
        wait_until(
            lambda k=keys: r.zcard(k.workers) >= 2 and r.hexists(k.meta, "codec"),  # type: ignore[misc]
            f"both partitions serving {name}",
            process=worker,
        )
    # and done starting: a partition registers before its servings declare themselves, and
    # junk written meanwhile may fail a start (a start refuses a key of another type)
    wait_until(
        lambda: worker.output().count(" as consumer ") >= 2,
        "both partitions started",
        process=worker,
    )
    partitions = sorted(worker.partition_pids())
    baseline = int(r.info("memory")["used_memory"])
    target = Target(r, prefix, random.Random(seed + 1), url, metrics_port=metrics_port)
    # What a live worker's heartbeat writes to its record: each field is attacked
    consumer = target.consumers()[0]
    target.record_fields = set(r.hkeys(worker_key(prefix, consumer)))
    fuzzer = Fuzzer(target, steps, seed)
    try:
        tally = attack_under_traffic(worker, fuzzer, seconds)
        problems = problems_after(worker, target, tally, partitions)
        assert not problems, "\n".join(problems)
        fuzzer.run.memory_kib = settled_memory(r, prefix, baseline) // 1024
    except AssertionError as e:
        raise AssertionError(
            f"fuzz seed {seed} (rerun: QS_FUZZ_SEED={seed}): {e}\nthe last values written: "
            f"{list(fuzzer.recent)}\nthe worker's log, its notable lines:\n{notable(worker)}"
        ) from e
    fuzzer.run.sent, fuzzer.run.answered = tally.sent, tally.answered
    return fuzzer.run


def attack_under_traffic(worker: WorkerProc, fuzzer: Fuzzer, seconds: float) -> Tally:
    """When the fuzzer writes hostile values while valid traffic runs: WRITES_PER_ROUND of
    them each time the traffic made progress. Then the fuzzer's own writes are taken back."""
    target = fuzzer.target
    meta = {n: target.r.hgetall(target.keys(n).meta) for n in SERVINGS}

    def learn(client_id: str) -> None:
        target.inboxes.append(inbox_key(target.prefix, client_id))
        target.channels.append(events_channel(target.prefix, client_id))

    traffic = Traffic(target.url, target.prefix, fuzzer.seed, learn)
    traffic.start()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            before = traffic.tally.answered + len(traffic.tally.wrong)
            for _ in range(WRITES_PER_ROUND):
                fuzzer.write_one()
            fuzzer.operator_reads()
            wait_until(
                lambda b=before: (
                    traffic.tally.answered + len(traffic.tally.wrong)  # type: ignore[misc]
                    > b
                ),
                "valid traffic to make progress",
                process=worker,
            )
    finally:
        traffic.stop()
        target.clean(meta)
        target.close()
    return traffic.tally


def problems_after(
    worker: WorkerProc,
    target: Target,
    tally: Tally,
    partitions: list[int],
) -> list[str]:
    """Then every valid request was answered with its own result and ran exactly once, no
    thread died, no partition exited, every serving (the victim included) answers again, and
    the admission counters and depth hashes are back at zero (the per-priority ones gone)."""
    problems = (
        [f"{len(tally.wrong)} valid requests failed: {tally.wrong[:20]}"] if tally.wrong else []
    )
    if tally.answered != tally.sent:
        problems.append(f"valid requests sent {tally.sent}, answered {tally.answered}")
    r = target.r
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"{target.prefix}:fuzz:exec").items()}
    odd = [(item, runs.get(item, 0)) for item in tally.items if runs.get(item, 0) != 1]
    if odd:
        problems.append(f"{len(odd)} valid items not run exactly once (item, runs): {odd[:20]}")
    log = worker.output()
    problems += [
        f"{sign!r} in the worker's log"
        for sign in ("CRITICAL", "Traceback", "Exception in thread")
        if sign in log
    ]
    if not worker.alive or sorted(worker.partition_pids()) != partitions:
        problems.append(f"partitions {partitions} are now {worker.partition_pids()}")
    if problems:  # what follows would only wait on a worker known to be broken
        return problems
    if target.metrics_port is not None:
        status, _ = scrape(target.metrics_port)
        if status != 200:
            return [f"the worker's /metrics answered {status} after the fuzzing"]
    with qs.Client(target.url, prefix=target.prefix) as client:
        for serving in (app.plain, app.victim):
            assert client.dispatch(serving, "after", timeout=60) == app.answer("after")
    for name in SERVINGS:
        keys = target.keys(name)
        try:
            wait_until(
                lambda k=keys: (
                    int(r.get(k.queued) or 0) == 0  # type: ignore[misc]
                    and all(int(v) == 0 for v in r.hvals(k.depth))
                    and not r.exists(k.pdepth)  # deleted when queued reaches 0
                ),
                f"{name}'s admission counter and depth hash at zero, no priority counts",
            )
        except AssertionError as e:
            return [
                f"{e}: queued {r.get(keys.queued)!r}, depth {r.hgetall(keys.depth)!r}, "
                f"pdepth of type {r.type(keys.pdepth)!r}"
            ]
    return []


def settled_memory(r: redis.Redis, prefix: str, baseline: int) -> int:
    """Redis's used_memory over ``baseline``, waited for until within MEMORY_SLACK, without
    the dead letters (kept until dropped: docs/guarantees.md, "Bad input") and the answers to
    forged entries (kept until their inbox's TTL), which the worker writes until it has read
    the last junk entry."""
    kept = [
        f"{prefix}:fuzz:exec",
        inbox_key(prefix, "fuzzjunk"),
        *(Keys(prefix, n).dead for n in SERVINGS),
    ]

    def over() -> int:
        r.delete(*kept)
        m = int(r.info("memory")["used_memory"]) - baseline
        return max(m, 1) if m <= MEMORY_SLACK else 0

    try:
        return wait_until(over, f"used_memory within {MEMORY_SLACK} bytes of {baseline}, before")
    except AssertionError as e:
        info = r.info("memory")
        parts = {
            k: info[k]
            for k in (
                "used_memory_dataset",
                "used_memory_overhead",
                "mem_clients_normal",
                "used_memory_scripts",
            )
            if k in info
        }
        raise AssertionError(
            f"{e}; {parts}; the largest keys left: {largest_keys(r, prefix)}"
        ) from e


def largest_keys(r: redis.Redis, prefix: str, n: int = 10) -> str:
    """The keys left under ``prefix``: how many, and the largest."""
    sizes = [(int(r.memory_usage(k) or 0), k) for k in r.scan_iter(match=f"{prefix}*", count=1000)]
    return f"{len(sizes)} keys, {r.dbsize()} in the db; {sorted(sizes, reverse=True)[:n]}"


def notable(worker: WorkerProc) -> str:
    """What the worker logged beyond the expected warnings about each hostile value."""
    signs = ("CRITICAL", "ERROR", "Traceback", "exited", "reclaim", "restart", "died")
    lines, after = [], 0
    for line in worker.output().splitlines():
        after = 30 if "Traceback" in line else after - 1
        if after > 0 or any(s in line for s in signs):
            lines.append(line[:500])
    return "\n".join(lines[-150:])


@pytest.mark.timeout(SECONDS + 240)
def test_every_surface_fuzzed_under_valid_traffic_loses_nothing_and_kills_nothing(
    worker: WorkerProc,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    metrics_port: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = fuzz(worker, redis_client, redis_url, prefix, plan(), SECONDS, SEED, metrics_port)
    with capsys.disabled():
        print("\n" + run.report(SEED))
    untouched = {s.kind for s, _, _ in plan()} - set(run.written)
    assert not untouched, f"surfaces the run never wrote to: {sorted(untouched)}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "only",
    [
        pytest.param(k, marks=pytest.mark.xfail(reason=why, strict=False), id="-".join(k))
        for k, why in KNOWN_BREAKS.items()
    ]
    or [pytest.param(("-", "-", "-"), marks=(pytest.mark.skip(reason="no known break left")))],
)
def test_known_break(
    only: tuple[str, str, str],
    worker: WorkerProc,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    metrics_port: int,
) -> None:
    fuzz(worker, redis_client, redis_url, prefix, plan(only), min(SECONDS, 8.0), SEED, metrics_port)
