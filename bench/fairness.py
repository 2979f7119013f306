"""Fairness under every shape of backlog (issue 25): a quiet key's and a priority-9 request's
wait, in batch times, while key "bulk" drains a backlog.

The serving's batch takes a fixed BATCH_S (``batch_size=10, batch_timeout=5ms``, one
partition), so "a batch time" is a fixed, known duration on any machine. Shapes of backlog:

- ``submit``: one ``submit`` of ITEMS items;
- ``dispatch_many``: one ``dispatch_many`` of ITEMS items (from a thread: it blocks);
- ``map``: ``list(client.map(..., chunk_size=256))`` of ITEMS items (map is lazy: its results
  are consumed, so its chunks are sent as it goes);
- ``packs16``: 16 clients, each submitting ITEMS / 16 one-item requests (clients pack them);
- ``keys1000``: 1,000 batch keys with two batches each, sent as two ``submit``s of a batch per
  key; the calls start once every key had its first turn (its first ``submit`` answered), so
  the worker is in the round of their second batches. Each quiet call is on a key of its own:
  a key that sends again within a second is not quiet, and waits for its turn like the busy
  keys (docs/usage.md); each priority-9 request goes on a busy key of its own too (a stream of
  priority-9 requests on one key, each sent before the last second is out, is a flood that
  priority ageing weighs against work that has waited: a round of 1,000 keys lasts 12 s here,
  more than the 9 s that 9 levels are worth by default).
- ``keys1000new``: outside the budget, to show the limit: 1,000 batch keys with ITEMS / 1,000
  items each (under a batch), sent just before the calls, so none had its first turn yet. They
  are all quiet keys, as the quiet key is, and it comes after the ones that came before it.

Per shape: the backlog alone (its items/s), then again with SAMPLES quiet-key dispatches and
SAMPLES priority-9 dispatches, one at a time, alternating; p50 and p99 of their latencies in
batch times, and the backlog's items/s with them over alone (a reading, not a budget: each
call runs in a batch of its own, so 2 x SAMPLES batches are taken out of the backlog's). Every
call must join, answered with its own item, and every backlog item with its own, or the run
fails (exit status 2). Budget (issue 25): p99 <= 2 batch times of waiting, for the quiet key
and for priority 9, in every shape but ``keys1000new``. The figures include the request's own
batch (1 batch time), so the budget reads 3 here.

Two more shapes (issue 37), in the same run, on servings whose batch answers each item with
the batch's number and start, so that the order of service is counted, not guessed:

- ``weights``: keys "heavy" (``batch_key_weights={"heavy": 4}``) and "light" each with a
  backlog of KEY_BATCHES batches, sent together; then, as the unweighted baseline, keys "left"
  and "right" of weight 1 the same way. Batches per key are counted while both had work, from
  the 11th (before it: each key's first turn, the worker learning what a batch takes) to the
  last of the key that ended first. Budget: heavy gets 3.5-4.5x light's batches; the baseline
  is judged at 0.75-1.33x (if it were not even, the weighted figure would mean nothing).
- ``ageing``: a flood of priority 9 on key "flood" (``priority_age=100ms``), and priority-0
  calls on the same key, one every 4 batch times, each from a thread of its own (several wait
  at once). Each must run while the flood still has batches before and after it (or the
  figure proves nothing, and the run fails). Budget: p99 of their waits <= 9 levels x 100 ms
  plus 3 batches (the one running, the one handed over, its own), a batch being the flood's
  measured median.

Verdict lines at the end; exit status 1 when a budget is MISSED.

    python -m bench.fairness [--quick] [--only SHAPE ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

import queueserve as qs

from ._harness import RedisServer, percentile, spawn_module, stop_process, wait_until
from ._verdict import Threads, Verdict, WorkFailed, at_most, report, run, within

PREFIX = "bfair"
BATCH_S = 0.01
BATCH_SIZE = 10
BACKLOGS = ["submit", "dispatch_many", "map", "packs16", "keys1000", "keys1000new"]
SHAPES = [*BACKLOGS, "weights", "ageing"]
WAIT_S = 300.0
BUDGET = 3.0  # batch times: 2 of waiting, and the call's own batch
WEIGHT = 4
KEY_BATCHES = 100  # each weights key's backlog, in batches
SKIP = 10  # batches not counted: each key's first turn, the worker learning a batch's time
AGE_S = 0.1  # the ageing serving's priority_age
LEVELS = 9  # priority levels a priority-0 request ages through to pass priority 9


def _fixed_time(xs: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return xs


fair = qs.Serving(_fixed_time, name="bfair", batch_size=BATCH_SIZE, batch_timeout=0.005)


class _Stamped:
    """A batch of BATCH_S that answers each item ``[item, n, started]``: ``n`` the batch's
    number in this worker's serving (they run one at a time) and ``started`` its start
    (``time.time()``, one machine's clock for the worker and the benchmark)."""

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def __call__(self, xs: list[Any]) -> list[Any]:
        n, started = next(self._numbers), time.time()
        time.sleep(BATCH_S)
        return [[x, n, started] for x in xs]


weighed = qs.Serving(
    _Stamped(),
    name="bweigh",
    batch_size=BATCH_SIZE,
    batch_timeout=0,
    batch_key_weights={"heavy": WEIGHT},
)
aged = qs.Serving(
    _Stamped(), name="bage", batch_size=BATCH_SIZE, batch_timeout=0, priority_age=AGE_S
)
SERVINGS = ("bfair", "bweigh", "bage")


def stamps(what: str, items: list[Any], answers: list[Any]) -> list[tuple[int, float]]:
    """(batch number, batch start) of each answer of a stamped serving, once every answer is
    its own item's; WorkFailed otherwise."""
    if len(answers) != len(items):
        raise WorkFailed(f"{what}: {len(answers)} answers for {len(items)} items")
    for item, answer in zip(items, answers, strict=True):
        if not isinstance(answer, list) or len(answer) != 3 or answer[0] != item:
            raise WorkFailed(f"{what}: item {item!r} was answered {answer!r:.80}")
    return [(int(answer[1]), float(answer[2])) for answer in answers]


def batches_while_both_had_work(ran: dict[str, set[int]], skip: int = SKIP) -> Counter[str]:
    """Batches per key (``ran``: each key's batch numbers), from the one after the first
    ``skip`` of them all to the last batch of the key that ended first."""
    order = sorted((n, key) for key, numbers in ran.items() for n in numbers)
    end = min(max(numbers) for numbers in ran.values())
    return Counter(key for n, key in order[skip:] if n <= end)


def _checked(shape: str, send: Callable[[list[int]], list[int]], items: int) -> None:
    if send(list(range(items))) != list(range(items)):
        raise WorkFailed(f"{shape}: wrong answers")


def _packs(client: qs.Client, share: int) -> None:
    tickets = [client.submit("bfair", [i], batch_key="bulk") for i in range(share)]
    if [t.result(WAIT_S) for t in tickets] != [[i] for i in range(share)]:
        raise WorkFailed("packs16: wrong answers")


def _many_keys(client: qs.Client, per_key: int, turned: threading.Event | None = None) -> None:
    """Sends ``per_key`` items on each of 1,000 keys; with ``turned``, as a second call of as
    many after the first, and sets it once the first calls were all answered."""
    sends = 2 if turned else 1
    tickets = [
        client.submit("bfair", list(range(per_key)), batch_key=f"k{k}")
        for _ in range(sends)
        for k in range(1000)
    ]
    for i, t in enumerate(tickets):
        if t.result(WAIT_S) != list(range(per_key)):
            raise WorkFailed("keys1000: wrong answers")
        if turned and i == 999:
            turned.set()


def _bodies(
    shape: str, clients: list[qs.Client], items: int, turned: threading.Event
) -> list[Callable[[], None]]:
    """What each thread of the backlog of ``shape`` runs."""
    c = clients[0]
    if shape == "submit":
        send: Callable[[list[int]], list[int]] = lambda xs: c.submit(  # noqa: E731
            "bfair", xs, batch_key="bulk"
        ).result(WAIT_S)
    elif shape == "dispatch_many":
        send = lambda xs: c.dispatch_many("bfair", xs, batch_key="bulk")  # noqa: E731
    elif shape == "map":
        send = lambda xs: list(c.map("bfair", xs, batch_key="bulk"))  # noqa: E731
    elif shape == "packs16":
        return [functools.partial(_packs, client, items // len(clients)) for client in clients]
    elif shape == "keys1000":
        return [functools.partial(_many_keys, c, BATCH_SIZE, turned)]
    else:
        return [functools.partial(_many_keys, c, max(1, items // 1000))]
    return [functools.partial(_checked, shape, send, items)]


class Backlog:
    """The backlog of ``shape``, started on threads of its own (16 clients for packs16, one
    otherwise); ``turned`` is set once the calls may start (keys1000)."""

    def __init__(self, url: str, shape: str, items: int, turned: threading.Event) -> None:
        self.clients = [
            qs.Client(url, prefix=PREFIX) for _ in range(16 if shape == "packs16" else 1)
        ]
        self.threads = Threads(f"{shape}: the backlog")
        for body in _bodies(shape, self.clients, items, turned):
            self.threads.start(body)

    def wait(self) -> None:
        """Until all of it was answered, each answer checked: a failed call fails the run."""
        try:
            self.threads.join(WAIT_S)
        finally:
            for client in self.clients:
                client.close()


def _turn_of(backlog: Backlog, turned: threading.Event) -> None:
    """Until the 1,000 keys' first calls were all answered (keys1000)."""
    deadline = time.monotonic() + WAIT_S
    while not turned.wait(0.05):
        backlog.threads.check()
        if time.monotonic() > deadline:
            raise WorkFailed(f"keys1000: the keys' first calls not answered within {WAIT_S:g} s")


def _call(probe: qs.Client, key: str, priority: int) -> float:
    """One call joined and answered right: its latency in batch times."""
    sent = time.perf_counter()
    answer = probe.dispatch("bfair", 7, batch_key=key, priority=priority, timeout=WAIT_S)
    if answer != 7:
        raise WorkFailed(f"a call on key {key!r} (priority {priority}) answered {answer!r:.80}")
    return (time.perf_counter() - sent) / BATCH_S


def one_shape(url: str, shape: str, items: int, samples: int) -> dict[str, float]:
    probe = qs.Client(url, prefix=PREFIX)
    if shape == "keys1000":
        items = 2000 * BATCH_SIZE
    many = shape.startswith("keys1000")
    try:
        t0 = time.perf_counter()
        Backlog(url, shape, items, threading.Event()).wait()
        alone = items / (time.perf_counter() - t0)
        urgent_key = "k7" if many else "bulk"  # (keys1000: k7, k8, ..., one each, below)
        turned = threading.Event()
        t0 = time.perf_counter()
        backlog = Backlog(url, shape, items, turned)
        if shape == "keys1000":
            _turn_of(backlog, turned)
        else:
            time.sleep(20 * BATCH_S)  # the backlog sent and running
        quiet: list[float] = []
        urgent: list[float] = []
        for i in range(samples):
            quiet_key, busy_key = (
                (f"quiet{i}", f"k{7 + i}") if shape == "keys1000" else ("quiet", urgent_key)
            )
            quiet.append(_call(probe, quiet_key, 0))
            time.sleep(2 * BATCH_S)
            urgent.append(_call(probe, busy_key, 9))
            time.sleep(2 * BATCH_S)
        backlog.wait()
        mixed = items / (time.perf_counter() - t0)
    finally:
        probe.close()
    quiet.sort()
    urgent.sort()
    row = {
        "quiet_p50": percentile(quiet, 50),
        "quiet_p99": percentile(quiet, 99),
        "p9_p50": percentile(urgent, 50),
        "p9_p99": percentile(urgent, 99),
        "backlog_ratio": mixed / alone,
    }
    print(
        f"| {shape} | {row['quiet_p50']:.2f} / {row['quiet_p99']:.2f} | "
        f"{row['p9_p50']:.2f} / {row['p9_p99']:.2f} | {row['backlog_ratio']:.2f} |",
        flush=True,
    )
    return row


def weights(url: str, batches: int = KEY_BATCHES) -> dict[str, float]:
    """Two keys' backlogs of ``batches`` batches each, sent together: heavy (weight 4) and
    light, then left and right (both weight 1, the baseline); batches counted while both had
    work."""
    items = list(range(batches * BATCH_SIZE))
    row: dict[str, float] = {}
    with qs.Client(url, prefix=PREFIX) as client:
        for first, second in (("heavy", "light"), ("left", "right")):
            tickets = {k: client.submit("bweigh", items, batch_key=k) for k in (first, second)}
            ran = {
                k: {n for n, _ in stamps(f"weights, key {k}", items, t.result(WAIT_S))}
                for k, t in tickets.items()
            }
            counted = batches_while_both_had_work(ran)
            if not counted[first] or not counted[second]:
                raise WorkFailed(f"weights: no batches of both keys to count: {dict(counted)}")
            row[f"{first}_batches"], row[f"{second}_batches"] = counted[first], counted[second]
            row[f"{first}_per_{second}"] = counted[first] / counted[second]
    print(
        f"weights, {batches} batches a key, counted while both had work: heavy (weight "
        f"{WEIGHT}) {row['heavy_batches']:.0f} / light {row['light_batches']:.0f} = "
        f"{row['heavy_per_light']:.2f}x; unweighted left {row['left_batches']:.0f} / right "
        f"{row['right_batches']:.0f} = {row['left_per_right']:.2f}x",
        flush=True,
    )
    return row


def ageing(url: str, probes: int) -> dict[str, float]:
    """``probes`` priority-0 calls on key "flood" under a flood of priority 9 there, one every
    4 batch times: how long each waited for its batch to start, and the bound it is judged by
    (tests/integration/test_priority_ageing.py's, in time: 9 levels' worth, then the batch
    running, the one taken as the ready set hands it over and one more as the worker's ranking
    catches up with Redis's)."""
    flood_items = list(range((4 * probes + 200) * BATCH_SIZE))
    waits: list[tuple[float, float, int]] = []  # (seconds to its batch's start, to its answer, n)

    def call(client: qs.Client, i: int) -> None:
        sent = time.time()
        answer = client.dispatch("bage", -1 - i, batch_key="flood", timeout=WAIT_S)
        [(n, started)] = stamps(f"ageing, priority-0 call {i}", [-1 - i], [answer])
        waits.append((started - sent, time.time() - sent, n))

    with qs.Client(url, prefix=PREFIX) as client:
        flood = client.submit("bage", flood_items, batch_key="flood", priority=9)
        time.sleep(5 * BATCH_S)  # the flood running (checked below, from the batch numbers)
        calls = Threads(f"ageing: {probes} priority-0 calls")
        for i in range(probes):
            calls.start(call, client, i)
            time.sleep(4 * BATCH_S)
        calls.join(WAIT_S)
        ran = sorted(set(stamps("ageing, the flood", flood_items, flood.result(WAIT_S))))
    first, last = ran[0][0], ran[-1][0]
    outside = [n for _, _, n in waits if not first < n < last]
    if outside:
        raise WorkFailed(
            f"ageing: {len(outside)} of {probes} priority-0 calls ran in batches {outside}, "
            f"not within the flood's {first}..{last}: they prove nothing (a longer flood)"
        )
    batch_s = statistics.median(b[1] - a[1] for a, b in itertools.pairwise(ran))
    started = sorted(w for w, _, _ in waits)
    answered = sorted(w for _, w, _ in waits)
    row = {
        "start_p50_s": percentile(started, 50),
        "start_p99_s": percentile(started, 99),
        "answer_p99_s": percentile(answered, 99),
        "batch_s": batch_s,
        "bound_s": LEVELS * AGE_S + 3 * batch_s,
    }
    print(
        f"ageing, priority_age {AGE_S * 1000:g} ms, {probes} priority-0 calls under a "
        f"priority-9 flood of {len(ran)} batches (median {batch_s * 1000:.1f} ms): waited for "
        f"their batch p50 {row['start_p50_s'] * 1000:.0f} ms, p99 "
        f"{row['start_p99_s'] * 1000:.0f} ms; answered p99 {row['answer_p99_s'] * 1000:.0f} ms",
        flush=True,
    )
    return row


def judge(results: dict[str, Any]) -> list[Verdict]:
    """The budgets against the figures of the shapes run (``results[shape]``)."""
    verdicts = []
    for shape in (s for s in BACKLOGS if s in results):
        outside = shape == "keys1000new"
        note = "outside the budget: the 1,000 keys came before the call" if outside else ""
        for who, key in (("quiet key", "quiet_p99"), ("priority 9", "p9_p99")):
            verdicts.append(
                at_most(
                    f"{shape}: {who} p99 <= {BUDGET:g} batch times (2 of waiting, its own)",
                    results[shape][key],
                    BUDGET,
                    judged=not outside,
                    note=note,
                )
            )
    if "weights" in results:
        row = results["weights"]
        verdicts += [
            within(
                f"weights: heavy (weight {WEIGHT}) gets 3.5-4.5x light's batches",
                row["heavy_per_light"],
                3.5,
                4.5,
                fmt="{:.2f}x",
            ),
            within(
                "weights: unweighted keys get 0.75-1.33x each other's batches (baseline)",
                row["left_per_right"],
                0.75,
                1.33,
                fmt="{:.2f}x",
            ),
        ]
    if "ageing" in results:
        row = results["ageing"]
        verdicts.append(
            at_most(
                f"ageing: priority-0 p99 wait for its batch under a priority-9 flood <= "
                f"{LEVELS} x {AGE_S * 1000:g} ms + 3 batches ({row['bound_s'] * 1000:.0f} ms)",
                row["start_p99_s"] * 1000,
                row["bound_s"] * 1000,
                fmt="{:.0f} ms",
            )
        )
    return verdicts


def measure(shapes: list[str], items: int, samples: int) -> dict[str, Any]:
    results: dict[str, Any] = {"batch_s": BATCH_S, "items": items, "samples": samples}
    server = RedisServer().start()
    try:
        proc = spawn_module(
            "queueserve",
            "worker",
            *(f"bench.fairness:{n}" for n in ("fair", "weighed", "aged")),
            "--redis-url",
            server.url,
            "--prefix",
            PREFIX,
            "--log-level",
            "WARNING",
        )
        try:
            r = redis.Redis.from_url(server.url)
            for name in SERVINGS:
                wait_until(
                    lambda n=name: r.zcard(f"{PREFIX}:{{{n}}}:workers") > 0, 60, "the worker"
                )
            r.close()
            backlogs = [s for s in shapes if s in BACKLOGS]
            if backlogs:
                print(f"backlog of {items:,} items on key 'bulk'; {samples} calls of each kind")
                print("| backlog | quiet key p50 / p99 | priority 9 p50 / p99 | backlog vs alone |")
                print("|---|---|---|---|")
            for shape in backlogs:
                results[shape] = one_shape(server.url, shape, items, samples)
            if "weights" in shapes:
                results["weights"] = weights(server.url)
            if "ageing" in shapes:
                results["ageing"] = ageing(server.url, samples)
        finally:
            stop_process(proc)
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 items, 10 samples")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--only", nargs="+", choices=SHAPES, default=SHAPES, help="these shapes")
    args = parser.parse_args(argv)
    items, samples = (2000, 10) if args.quick else (5000, 50)

    def body() -> int:
        results = measure(args.only, items, samples)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return report(judge(results))

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
