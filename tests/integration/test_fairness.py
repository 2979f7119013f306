"""Fairness at the level of items (docs/usage.md, "Batch keys, fairness and priorities"): what
one batch key or one request holds never stops the worker from reading other keys and
priorities. Under a backlog on key "bulk" built by one big ``submit``, a ``dispatch_many`` or a
``map``, a request on a quiet key, and a priority-9 request on the busy key, run within
QUIET_BOUND batches of being sent. Counted in batches the serving recorded, not in time: the
batch function's speed and the machine's load change nothing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import queueserve as qs
from queueserve.broker.common import text
from queueserve.broker.reads import ReadOutcome
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]

BATCH_S = 0.01  # each batch takes at least this long: the backlog lasts for seconds
BACKLOG = 3000  # items on key "bulk": 300 batches
QUIET_BOUND = 2  # batches that may start between a quiet request's send and its own


def slow_echo(items: list[Any]) -> list[Any]:
    time.sleep(BATCH_S)
    return items


def _backlog(client: qs.Client, shape: str) -> Iterator[None]:
    """Builds the backlog in the way ``shape`` names; yields once it is sent, and ends when
    every item of it was answered."""
    items = [f"b{i}" for i in range(BACKLOG)]
    if shape == "submit":
        ticket = client.submit("fair", items, batch_key="bulk")
        yield
        ticket.result(WAIT_S * 4)
        return
    done: list[Any] = []
    if shape == "dispatch_many":
        run = lambda: done.append(client.dispatch_many("fair", items, batch_key="bulk"))  # noqa: E731
    else:  # map is lazy: its results must be consumed for its chunks to be sent
        run = lambda: done.append(list(client.map("fair", items, batch_key="bulk")))  # noqa: E731
    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    yield
    sender.join(WAIT_S * 4)
    assert done and done[0] == items


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", ["submit", "dispatch_many", "map"])
def test_a_quiet_key_and_a_priority_9_request_run_within_two_batches_of_a_backlog(
    shape: str, start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    # Given a worker draining a backlog of BACKLOG items on batch key "bulk"
    serving = Recording(slow_echo, name="fair", batch_size=10, batch_timeout=0.005)
    start_worker(serving)
    backlog_client = qs.Client(redis_url, prefix=prefix)
    client = qs.Client(redis_url, prefix=prefix)
    backlog = _backlog(backlog_client, shape)
    next(backlog)
    wait_until(lambda: len(serving.batches) >= 5, "the backlog running")

    # When a request comes on a quiet key, and then a priority-9 one on the busy key
    before_quiet = len(serving.batches)
    assert client.dispatch("fair", "quiet", batch_key="quiet") == "quiet"
    before_urgent = len(serving.batches)
    assert client.dispatch("fair", "urgent", batch_key="bulk", priority=9) == "urgent"

    # Then each ran within QUIET_BOUND batches of being sent, long before the backlog drained
    ran = serving.batches
    quiet_at = next(i for i, (_, items) in enumerate(ran) if "quiet" in items)
    urgent_at = next(i for i, (_, items) in enumerate(ran) if "urgent" in items)
    assert quiet_at - before_quiet <= QUIET_BOUND, (quiet_at, before_quiet)
    assert urgent_at - before_urgent <= QUIET_BOUND, (urgent_at, before_urgent)
    assert sum(len(items) for _, items in ran[: urgent_at + 1]) < BACKLOG
    next(backlog, None)  # and the backlog was answered in full
    client.close()
    backlog_client.close()


AGE_S = 0.1  # priority_age set at run time: 9 levels are 0.9 s
FLOOD = 600  # priority-9 requests of one item: 150 batches of 4, several times the bound


@pytest.mark.timeout(120)
def test_priority_age_set_at_run_time_bounds_a_priority_zero_wait_under_a_flood(
    start_worker: StartWorker,
    redis_client: Any,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker whose priority_age an operator set to AGE_S (`queueserve config set`)
    serving = Recording(slow_echo, name="aged", batch_size=4, batch_timeout=0)
    start_worker(serving)
    caplog.set_level("INFO")
    redis_client.hset(f"{prefix}:{{aged}}:config", "priority_age", "100ms")
    wait_until(lambda: "priority_age changed from 1.0 to 0.1" in caplog.text, "the new age")
    # and a flood of priority-9 requests on the batch key
    client = qs.Client(redis_url, prefix=prefix)
    flood = [client.submit("aged", [f"h{i}"], priority=9) for i in range(FLOOD)]
    wait_until(lambda: len(serving.batches) >= 5, "the flood running")

    # When a priority-0 request is sent on the same key
    before = len(serving.batches)
    assert client.dispatch("aged", "low") == "low"

    # Then it ran after at most the batches its 9 levels of AGE_S allow (and a few more as
    # the ready set and the worker's ranking hand it over), long before the flood drained
    ran = serving.item_batches
    at = next(i for i, items in enumerate(ran) if "low" in items)
    bound = int(9 * AGE_S / BATCH_S) + 4
    assert at - before <= bound, (at - before, bound)
    assert sum(len(b) for b in ran[: at + 1]) < FLOOD
    for ticket in flood:
        ticket.cancel()
    client.close()


KEYS = 100  # busy keys, each with one request
# A quiet request waits for one batch per busy key (its turn in the round), the look-ahead the
# worker read before it came (executors + 1 = 2 batches) and the hand-over (QUIET_BOUND)
ROUND_BOUND = KEYS + 2 + QUIET_BOUND


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "per_key",
    [
        5,  # half a batch each: 100 batches in all
        30,  # three batches each: 300 in all
    ],
)
def test_under_many_busy_keys_a_quiet_key_waits_one_round_and_priority_9_one_batch(
    per_key: int, start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    # Given a worker draining KEYS busy keys, each with one request of per_key items
    serving = Recording(slow_echo, name="keys", batch_size=10, batch_timeout=0.005)
    start_worker(serving)
    client = qs.Client(redis_url, prefix=prefix)
    items = [f"b{i}" for i in range(per_key)]
    backlog = [client.submit("keys", items, batch_key=f"k{k}") for k in range(KEYS)]
    wait_until(lambda: len(serving.batches) >= 5, "the backlog running")

    # When a request comes on a quiet key, and then a priority-9 one on the last busy key
    before_quiet = len(serving.batches)
    assert client.dispatch("keys", "quiet", batch_key="quiet") == "quiet"
    before_urgent = len(serving.batches)
    last = f"k{KEYS - 1}"
    assert client.dispatch("keys", "urgent", batch_key=last, priority=9) == "urgent"

    # Then the priority-9 request ran within QUIET_BOUND batches of being sent, and the quiet
    # one within a round of the busy keys: no busy key ran more than its turn and what was
    # already read ahead before it (2 batches), as keys take turns by batch
    ran = serving.batches
    quiet_at = next(i for i, (_, batch) in enumerate(ran) if "quiet" in batch)
    urgent_at = next(i for i, (_, batch) in enumerate(ran) if "urgent" in batch)
    assert urgent_at - before_urgent <= QUIET_BOUND, (urgent_at, before_urgent)
    meanwhile: dict[str, int] = {}
    for key, _ in ran[before_quiet:quiet_at]:
        meanwhile[key] = meanwhile.get(key, 0) + 1
    assert max(meanwhile.values(), default=0) <= 2, meanwhile
    assert quiet_at - before_quiet <= ROUND_BOUND, (quiet_at, before_quiet)
    for ticket in backlog:  # and every busy key was answered in full
        assert ticket.result(WAIT_S * 4) == items
    client.close()


@pytest.mark.parametrize("holds_busy", [True, False])
def test_a_read_takes_keys_the_worker_holds_work_of_after_the_others(
    holds_busy: bool, redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a busy key whose work became ready before a quiet key's, a batch waiting on each
    keys = Keys(prefix, "held")
    codec, inbox = get_codec("msgpack"), inbox_key(prefix, "c1")
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        for rid, key in enumerate(("busy", "quiet")):
            broker.ensure_group(keys.stream(key))
            request = encode_request(codec, rid, ["x"] * 4, inbox, None)
            broker.enqueue(keys, [(key, 4, *request, 0)], 0)
        # (the ready set ranks keys by the ms they became ready: the same ms here, maybe)
        redis_client.zadd(keys.ready, {"0busy": 1, "0quiet": 2}, xx=True)

        # When a worker with room for one batch reads, holding part of a busy batch or nothing
        marks = ["-busy"] if holds_busy else []
        read = broker.read_ready(keys, "c", 4, 4, marks)

    # Then a worker that holds busy work reads the quiet key: what it holds of the busy key
    # runs in its turn anyway, and the quiet request would wait a read more behind it
    first = "quiet" if holds_busy else "busy"
    assert [stream for stream, _ in read.entries] == [keys.stream(first)]


STEADY_KEYS = 60  # busy keys, each with two requests of one batch
QUIET_SENDS = 5


@pytest.mark.timeout(180)
def test_once_busy_keys_had_their_turn_a_quiet_key_goes_first_and_one_back_at_once_waits(
    start_worker: StartWorker, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a worker in the second round of STEADY_KEYS busy keys: each had one batch (its
    # first turn, as a new key), and each holds one more
    serving = Recording(slow_echo, name="steady", batch_size=10, batch_timeout=0.005)
    start_worker(serving)
    client = qs.Client(redis_url, prefix=prefix)
    items = [f"b{i}" for i in range(20)]  # cut into two requests of a batch
    backlog = [client.submit("steady", items, batch_key=f"k{k}") for k in range(STEADY_KEYS)]
    wait_until(lambda: len(serving.batches) >= STEADY_KEYS, "the first round")
    assert len({key for key, _ in serving.batches[:STEADY_KEYS]}) == STEADY_KEYS

    # When quiet keys send, one at a time, then a priority-9 request comes on a busy key
    # twice in a row
    runs: dict[str, int] = {}
    for name, key, priority in (
        *((f"quiet{i}", f"quiet{i}", 0) for i in range(QUIET_SENDS)),
        ("urgent", "k5", 9),
        ("urgent again", "k5", 9),
    ):
        runs[name] = len(serving.batches)
        assert client.dispatch("steady", name, batch_key=key, priority=priority) == name
    # and the first quiet key sends again at once (its last request a moment ago, however
    # slow this machine was meanwhile)
    redis_client.zadd(Keys(prefix, "steady").seen, {"quiet0": time.time() * 1000})
    before_again = len(serving.batches)
    assert client.dispatch("steady", "quiet again", batch_key="quiet0") == "quiet again"

    # Then each quiet key and each priority-9 request ran within QUIET_BOUND batches: none
    # waited for the round of busy keys (a priority's lead is its own: the busy keys' turns
    # are of priority 0); and most quiet keys in the batch after they came, before the ones
    # the worker held (it reads a new key while its look-ahead is full)
    ran = serving.batches
    between = {}
    for name, before in runs.items():
        between[name] = next(i for i, (_, batch) in enumerate(ran) if name in batch) - before
    assert max(between.values()) <= QUIET_BOUND, between
    assert sorted(between[f"quiet{i}"] for i in range(QUIET_SENDS))[QUIET_SENDS // 2] == 0, between
    # but the quiet key back at once (within a second) had no lead: it ran after the busy keys
    # waiting for their turn (no key takes half the worker by draining and coming back)
    again_at = next(i for i, (_, batch) in enumerate(ran) if "quiet again" in batch)
    assert again_at - before_again >= STEADY_KEYS // 2, (again_at, before_again)
    for ticket in backlog:
        assert ticket.result(WAIT_S * 4) == items
    client.close()


class Scripts:
    """enqueue.lua and read.lua called directly, for one serving: a request of 4 items per
    send, and reads with room for ``room`` items, a batch (4) per key."""

    def __init__(self, broker: RedisBroker, keys: Keys, prefix: str) -> None:
        self.broker, self.keys = broker, keys
        self.codec, self.inbox = get_codec("msgpack"), inbox_key(prefix, "c1")
        self.rids = iter(range(10**6))

    def send(self, key: str, priority: int = 0) -> None:
        self.broker.ensure_group(self.keys.stream(key, priority))
        request = encode_request(self.codec, next(self.rids), ["x"] * 4, self.inbox, None)
        self.broker.enqueue(self.keys, [(key, 4, *request, priority)], 0)

    def read(self, room: int = 4) -> tuple[list[str], ReadOutcome]:
        read = self.broker.read_ready(self.keys, "c", room, 4, [])
        return [self.keys.batch_key_of(text(stream)) for stream, _ in read.entries], read

    def keys_read(self) -> list[str]:
        return self.read()[0]


def test_a_quiet_key_leads_once_and_a_key_back_within_a_second_waits_its_turn(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    keys = Keys(prefix, "lead")

    def has_lead(key: str) -> bool:  # enqueue.lua's mark of a lead: a score ending in .5
        score = redis_client.zscore(keys.ready, f"0{key}")
        return score is not None and score % 1 == 0.5

    with contextlib.closing(RedisBroker(redis_url)) as broker:
        scripts = Scripts(broker, keys, prefix)
        send, read = scripts.send, scripts.keys_read
        # Given a busy key that had its turn, and holds a batch more
        send("busy")
        send("busy")
        assert has_lead("busy")
        assert read() == ["busy"]
        assert not has_lead("busy")
        # When a quiet key sends, then it is read first
        send("quiet")
        assert has_lead("quiet")
        assert read() == ["quiet"]
        # and when it sends again within a second, it is not quiet: it waits its turn
        send("quiet")
        assert not has_lead("quiet")
        assert read() == ["busy"]
        assert read() == ["quiet"]
        # and once it had no request for a second, it is quiet again
        redis_client.zadd(keys.seen, {"quiet": time.time() * 1000 - 1500})
        send("quiet")
        assert has_lead("quiet")
        assert read() == ["quiet"]
        assert redis_client.zcard(keys.ready) == 0


@pytest.mark.parametrize("quiet_keys", [1, 20])
def test_a_quiet_key_takes_no_lead_over_more_urgent_work_waiting_its_turn(
    quiet_keys: int, redis_url: str, prefix: str
) -> None:
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        scripts = Scripts(broker, Keys(prefix, "urgent"), prefix)
        send, read = scripts.send, scripts.keys_read
        # Given priority-9 work that had its turn and waits for the next
        send("urgent", 9)
        send("urgent", 9)
        assert read() == ["urgent"]
        # When quiet keys send at priority 0
        for i in range(quiet_keys):
            send(f"quiet{i}")
        # Then the urgent work goes first, then the quiet keys (in the order they came; those
        # sent in the same ms by name)
        assert read() == ["urgent"]
        assert sorted(k for _ in range(quiet_keys) for k in read()) == sorted(
            f"quiet{i}" for i in range(quiet_keys)
        )


def test_a_quiet_key_ranked_anew_behind_urgent_work_is_read_next_not_waited_for(
    redis_url: str, prefix: str
) -> None:
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        scripts = Scripts(broker, Keys(prefix, "anew"), prefix)
        # Given a quiet key with its lead, then priority-9 work of two batches after it
        scripts.send("quiet")
        scripts.send("urgent", 9)
        scripts.send("urgent", 9)
        assert scripts.keys_read() == ["urgent"]
        # When a read with room for two batches takes the urgent work's last and ranks the
        # quiet key anew
        read, second = scripts.read(room=8)
        assert read == ["urgent"]
        # Then it says work is left unread (the reader reads again, instead of blocking on the
        # wake stream while the quiet key waits), and the next read takes it
        assert not second.drained
        assert scripts.keys_read() == ["quiet"]
