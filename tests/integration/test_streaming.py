"""Streaming (issue 5, docs/design.md §2 and §3.4): hook events, generator steps and
``client.stream``.

Batches and generator steps are held at gates the test opens (``tests/support/stream_app.py``), so
every "before", "while" and "after" below is a condition the test waited for, never a sleep.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.client.calls import Call
from queueserve.client.events import RequestStream
from queueserve.wire.codec import MsgpackCodec, codec_for_tag
from queueserve.wire.keys import Keys, events_channel, inbox_key
from queueserve.wire.kinds import ERR_BAD_REQUEST, ERROR, RESULTS, STEPS
from queueserve.wire.protocol import WIRE_VERSION
from tests.support.callers import Caller
from tests.support.helpers import REPO, WAIT_S, child_env, items_waiting, stream_key, wait_until
from tests.support.stream_app import Hooks, Steps, step_value

StartWorker = Callable[..., qs.Worker]
Pending = Callable[..., int]


# --- helpers ----------------------------------------------------------------------------------
class EventTap:
    """A pub/sub subscriber of its own on clients' event channels: sees what workers publish."""

    def __init__(self, redis_client: redis.Redis, channels: list[str]) -> None:
        self.pubsub = redis_client.pubsub(  # type: ignore[no-untyped-call]
            ignore_subscribe_messages=False
        )
        self.pubsub.subscribe(*channels)
        confirmed = 0
        while confirmed < len(channels):  # subscribed before anything is sent
            message = self.pubsub.get_message(timeout=WAIT_S)
            assert message is not None, "no subscribe confirmation"
            confirmed += message["type"] == "subscribe"
        self.seen: list[tuple[str, int, int, list[Any]]] = []  # (channel, rid, seq, body)
        self.events_per_message: list[int] = []

    def _pull(self) -> None:
        message = self.pubsub.get_message(timeout=0.05)
        if message is not None and message["type"] == "message":
            data = message["data"]
            decoded = codec_for_tag(data[0]).loads(data[1:])
            # one event, or the list of one step's events for this client
            events = decoded if isinstance(decoded[0], list) else [decoded]
            self.events_per_message.append(len(events))
            for rid, seq, *body in events:
                self.seen.append((message["channel"].decode(), rid, seq, body))

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        def check() -> bool:
            self._pull()
            return condition()

        wait_until(check, what=what)

    def drain(self, redis_client: redis.Redis, channel: str) -> None:
        """Receive everything published on ``channel`` so far (up to a marker we publish)."""
        marker = bytes((MsgpackCodec.tag,)) + msgpack.packb([0, -1, "marker"])
        redis_client.publish(channel, marker)
        self.wait_for(
            "our marker", lambda: self.seen[-1][2:] == (-1, ["marker"]) if self.seen else False
        )
        self.seen.pop()

    def bodies(self, channel: str) -> list[list[Any]]:
        return [body for ch, _, _, body in self.seen if ch == channel]

    def close(self) -> None:
        self.pubsub.close()


@pytest.fixture
def make_client(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> Iterator[Callable[[], qs.Client]]:
    """More sync clients under the test's prefix (each its own event channel), closed after."""
    clients: list[qs.Client] = []

    def make() -> qs.Client:
        clients.append(qs.Client(redis_url, prefix=prefix))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def results_of(items: list[Any]) -> list[str]:
    return [f"r:{x}" for x in items]


def steps_for(items: list[str], step: int) -> list[str]:
    return [step_value(x, step) for x in items]


# --- emit outside workers -----------------------------------------------------------------------
def test_emit_outside_a_batch_is_an_error_and_inline_runs_ignore_it() -> None:
    with pytest.raises(RuntimeError, match="outside a batch"):
        qs.emit("start", 1)
    serving = Hooks(name="hooked", batch_size=2)
    assert serving.inline_many(["a", "b", "c"]) == results_of(["a", "b", "c"])
    steps = Steps(name="steps", batch_size=2, hooks=["step"])
    assert steps.inline_many(["a:1", "b:2"]) == [["a:1#0"], ["b:2#0", "b:2#1"]]


# --- hooks: order ------------------------------------------------------------------------------
def test_hook_events_come_before_the_output_of_their_batch(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0)
    start_worker(serving)

    events = list(client.stream(serving, ["a", "b", "c"], timeout=30))

    assert events == [
        qs.Hook("start", ["a", "b", "c"], 0, 3),
        qs.Hook("done", 3, 0, 3),
        qs.Output(results_of(["a", "b", "c"]), 0, 3),
    ]


def test_a_stream_longer_than_batch_size_yields_each_requests_events_in_input_order(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a hook serving of batch_size 4, known to the client only by name (from the
    # workers' declared options)
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0)
    start_worker(serving)
    items = [f"x{i}" for i in range(10)]

    # When one stream carries 10 items (requests of 4, 4 and 2, all in flight at once)
    events = list(client.stream("hooked", items, timeout=30, max_in_flight=4))

    # Then each request's hooks come, then its output, request after request
    expected: list[qs.Hook | qs.Output] = []
    for start in (0, 4, 8):
        chunk = items[start : start + 4]
        expected += [
            qs.Hook("start", chunk, 0, len(chunk)),
            qs.Hook("done", len(chunk), 0, len(chunk)),
            qs.Output(results_of(chunk), start, len(chunk)),
        ]
    assert events == expected
    assert serving.record.batches == [items[0:4], items[4:8], items[8:10]]


def test_hooks_not_listed_are_never_sent(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a serving that emits start, secret and done but lists only start and done
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0, hooks=["start", "done"])
    start_worker(serving)
    channel = events_channel(prefix, client.client_id)
    tap = EventTap(redis_client, [channel])
    try:
        events = list(client.stream(serving, ["a", "b"], timeout=30))

        # Then the caller gets no "secret" hook, and none was even published
        assert [e.name for e in events if isinstance(e, qs.Hook)] == ["start", "done"]
        tap.wait_for(
            "the done hook on the wire",
            lambda: any(b[:2] == ["h", "done"] for b in tap.bodies(channel)),
        )
        assert [b[1] for b in tap.bodies(channel)] == ["start", "done"]
    finally:
        tap.close()


def test_with_two_partitions_a_later_request_finishing_first_still_streams_after_the_first(
    redis_url: str,
    prefix: str,
    redis_client: redis.Redis,
    pending: Pending,
    tmp_path: Path,
    client: qs.Client,
) -> None:
    # Given a worker of two partition processes (two executors each, so the second request
    # never waits behind the first, whichever partition reads it), whose batch holding item 0
    # waits for the key rec:go
    log = tmp_path / "worker.log"
    env = child_env(QS_TEST_URL=redis_url, QS_TEST_PREFIX=prefix)
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "queueserve",
                "worker",
                "tests.support.stream_app:Ordered",
                "--partitions",
                "2",
                "--max-concurrent-batches",
                "2",
                "--redis-url",
                redis_url,
                "--prefix",
                prefix,
                "--shutdown-timeout",
                "10s",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        workers_key = Keys(prefix, "ordered").workers
        wait_until(lambda: redis_client.zcard(workers_key) == 2, what="both partitions up")

        # When one caller streams 8 items (two requests of 4) by the serving's name
        caller = Caller(client, "ordered", list(range(8)))
        # and the second request is answered while the first still runs
        wait_until(
            lambda: redis_client.llen(f"{prefix}:rec:done") == 1, what="the second batch to run"
        )
        inbox = inbox_key(prefix, client.client_id)
        wait_until(
            lambda: pending("ordered") == 1 and redis_client.llen(inbox) == 0,
            what="the second request's answer to reach the client",
        )
        # Then nothing of the second request has been yielded yet
        assert all(e == qs.Hook("begin", [0, 1, 2, 3], 0, 4) for e in caller.received)

        # When the first batch may finish
        redis_client.set(f"{prefix}:rec:go", 1)

        # Then the first request's events come first, then the second's
        assert caller.join() == [
            qs.Hook("begin", [0, 1, 2, 3], 0, 4),
            qs.Output([0, 10, 20, 30], 0, 4),
            qs.Hook("begin", [4, 5, 6, 7], 0, 4),
            qs.Output([40, 50, 60, 70], 4, 4),
        ]
    finally:
        redis_client.set(f"{prefix}:rec:go", 1)
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    assert worker.returncode == 0, log.read_text(errors="replace")


# --- hooks: per-caller slices -------------------------------------------------------------------
def test_each_caller_of_a_shared_batch_gets_its_own_slice(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given a hook serving whose executor is busy with a first batch
    serving = Hooks(name="hooked", batch_size=6, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    blocker = client.submit(serving, ["blocker"], timeout=30)
    wait_until(lambda: len(serving.record.batches) == 1, what="the first batch to start")

    # When three threads stream 1, 2 and 3 items, which wait together for the next batch
    own = {"p": ["p0"], "q": ["q0", "q1"], "s": ["s0", "s1", "s2"]}
    callers = {name: Caller(client, serving, items) for name, items in own.items()}
    wait_until(
        lambda: pending("hooked") == 4 and items_waiting(worker) == 6,
        what="the worker to read all three requests and hold their six items",
    )
    serving.gate.set()

    # Then they ran as one batch
    assert blocker.result() == ["r:blocker"]
    got = {name: caller.join() for name, caller in callers.items()}
    batches = serving.record.batches
    assert len(batches) == 2
    batch = batches[1]
    assert sorted(batch) == sorted(x for items in own.values() for x in items)
    # and each caller's hooks locate exactly its own items in that batch, before its output,
    # which holds only its own results
    slices = []
    for name, items in own.items():
        start_hook, done_hook, output = got[name]
        assert isinstance(start_hook, qs.Hook) and isinstance(done_hook, qs.Hook)
        assert (start_hook.name, start_hook.payload) == ("start", batch)
        assert batch[start_hook.start : start_hook.start + start_hook.size] == items
        assert done_hook == qs.Hook("done", 6, start_hook.start, start_hook.size)
        assert output == qs.Output(results_of(items), 0, len(items))
        slices.append((start_hook.start, start_hook.size))
    # and the three slices tile the batch
    assert sorted(i for start, size in slices for i in range(start, start + size)) == list(range(6))


def test_the_events_one_batch_makes_for_one_client_travel_as_one_message(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    pending: Pending,
) -> None:
    # Given three one-item streams of one client, held to run in one batch of a hook serving
    serving = Hooks(name="hooked", batch_size=6, batch_timeout=0, gated=True)
    worker = start_worker(serving)
    channel = events_channel(prefix, client.client_id)
    tap = EventTap(redis_client, [channel])
    try:
        blocker = client.submit(serving, ["blocker"], timeout=30)
        wait_until(lambda: len(serving.record.batches) == 1, what="the first batch to start")
        own = ["p", "q", "s"]
        callers = [Caller(client, serving, [x]) for x in own]
        wait_until(
            lambda: pending("hooked") == 4 and items_waiting(worker) == 3,
            what="the worker to hold the three streams' items",
        )
        serving.gate.set()

        # Then every caller gets its own hooks and its own result
        assert blocker.result() == ["r:blocker"]
        for x, caller in zip(own, callers, strict=True):
            events = caller.join()
            assert [e.name for e in events if isinstance(e, qs.Hook)] == ["start", "done"]
            assert events[-1] == qs.Output([f"r:{x}"], 0, 1)
        # and the batch's hooks reached the client in messages holding all three streams'
        # events (both hooks in one, when the replier sends them together), not one each
        tap.wait_for("both hooks of the three streams", lambda: len(tap.seen) == 6)
        assert min(tap.events_per_message) >= 3
    finally:
        tap.close()


def test_forged_events_on_a_clients_channel_are_dropped_and_its_stream_goes_on(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a caller streaming from a hook serving whose batch waits at its gate
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0, gated=True)
    start_worker(serving)
    caller = Caller(client, serving, ["a"])
    assert caller.next_event() == qs.Hook("start", ["a"], 0, 1)
    (rid,) = client._table.streamed

    # When someone publishes malformed events for its request on the client's channel: alone,
    # in a list of events, and next to a list's events for nobody
    channel = events_channel(prefix, client.client_id)
    forged = [
        [rid, "1", "h", "done", 1, 0, 1],  # a sequence number that is not one
        [rid, 1, "o", RESULTS, "not a list", 0, 1],
        [rid, 1, "o", RESULTS, ["x"], 5, 1],  # an item the request does not have
        [rid, 1, "h"],
        [[rid, -1, "h", "done", 1, 0, 1], [], 7, [None, 1]],
        [],
        "not an event",
    ]
    for message in forged:
        redis_client.publish(channel, bytes((MsgpackCodec.tag,)) + msgpack.packb(message))
    serving.gate.set()

    # Then the stream goes on as if they had not been sent
    assert caller.join() == [
        qs.Hook("start", ["a"], 0, 1),
        qs.Hook("done", 1, 0, 1),
        qs.Output(["r:a"], 0, 1),
    ]


# --- no split in hook mode ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hooks", "how", "expected_sizes"),
    [
        pytest.param(["start"], "submit", [1, 3, 3], id="hook-serving-never-splits"),
        pytest.param(None, "stream", [1, 3, 3], id="streamed-request-never-splits"),
        pytest.param(None, "submit", [1, 4, 2], id="plain-request-is-split"),
    ],
)
def test_hook_servings_and_streamed_requests_run_whole(
    start_worker: StartWorker,
    client: qs.Client,
    pending: Pending,
    hooks: list[str] | None,
    how: str,
    expected_sizes: list[int],
) -> None:
    # Given a serving of batch_size 4 whose executor is busy with a first batch
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0, hooks=hooks, gated=True)
    worker = start_worker(serving)
    blocker = client.submit(serving, ["z"], timeout=30)
    wait_until(lambda: len(serving.record.batches) == 1, what="the first batch to start")

    # When a request of 3 and then one of 3 wait behind it
    first, second = ["a0", "a1", "a2"], ["b0", "b1", "b2"]
    if how == "submit":
        tickets = [client.submit(serving, first, timeout=30)]
        wait_until(
            lambda: pending("hooked") == 2 and items_waiting(worker) == 3,
            what="the first request to be read",
        )
        tickets.append(client.submit(serving, second, timeout=30))
        wait_until(
            lambda: pending("hooked") == 3 and items_waiting(worker) == 6,
            what="the second request to be read",
        )
        serving.gate.set()
        assert [t.result() for t in tickets] == [results_of(first), results_of(second)]
    else:
        a = Caller(client, serving, first)
        wait_until(
            lambda: pending("hooked") == 2 and items_waiting(worker) == 3,
            what="the first request to be read",
        )
        b = Caller(client, serving, second)
        wait_until(
            lambda: pending("hooked") == 3 and items_waiting(worker) == 6,
            what="the second request to be read",
        )
        serving.gate.set()
        assert a.join()[-1] == qs.Output(results_of(first), 0, 3)
        assert b.join()[-1] == qs.Output(results_of(second), 0, 3)
    assert blocker.result() == ["r:z"]

    # Then they run in batches of 3 and 3 where a request may not be split, else 4 and 2
    assert [len(b) for b in serving.record.batches] == expected_sizes


def test_a_request_larger_than_batch_size_of_a_hook_serving_is_refused_before_sending(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0)
    stream = stream_key(prefix, "hooked")

    # The client knows from the Serving object (no worker needed)...
    with pytest.raises(qs.BadRequest, match=r"5 items, more than batch_size=4"):
        client.dispatch_many(serving, list(range(5)))
    # ...and from the options the workers declared, given only the name
    start_worker(serving)
    with qs.Client(client.url, prefix=prefix) as by_name:
        with pytest.raises(qs.BadRequest, match=r"5 items, more than batch_size=4"):
            by_name.dispatch_many("hooked", list(range(5)))
        # a smaller request to the same serving goes through
        assert by_name.dispatch_many("hooked", [1, 2]) == ["r:1", "r:2"]
    assert redis_client.xlen(stream) == 0  # nothing oversized was ever enqueued
    assert serving.record.batches == [[1, 2]]


@pytest.mark.parametrize(
    ("hooks", "with_events"),
    [
        pytest.param(["start"], True, id="hook-serving-7-field-header"),
        pytest.param(["start"], False, id="hook-serving-6-field-header"),
        pytest.param(None, True, id="plain-serving-7-field-header"),
    ],
)
def test_a_worker_refuses_an_oversized_request_that_must_run_whole(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
    hooks: list[str] | None,
    with_events: bool,
) -> None:
    # Given a worker for a serving of batch_size 4
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0, hooks=hooks)
    start_worker(serving)
    keys = Keys(prefix, "hooked")

    # When a request of 5 items is written to the stream by hand (no client checks), with an
    # event channel in its header (7 fields) or to a hook serving without one (6 fields)
    inbox = f"{prefix}:inbox:by-hand"
    header = [WIRE_VERSION, 77, 5, inbox, 0, "msgpack"]
    if with_events:
        header.append(f"{prefix}:events:by-hand")
    redis_client.incrby(keys.queued, 5)
    redis_client.xadd(
        keys.stream("default"),
        {"h": msgpack.packb(header), "p": msgpack.packb(list(range(5)))},
    )

    # Then the worker answers every item with BadRequest and runs nothing
    reply = redis_client.blpop([inbox], timeout=WAIT_S)
    assert reply is not None, "no reply in the inbox"
    message = cast(bytes, reply[1])
    [row] = codec_for_tag(message[0]).loads(message[1:])
    rid, offset, count, kind, body = row[:5]
    assert (rid, offset, count, kind) == (77, 0, 5, ERROR)
    assert body[3] == ERR_BAD_REQUEST
    assert "5 items, more than batch_size=4" in body[1]
    wait_until(lambda: redis_client.xlen(keys.stream("default")) == 0, what="the entry acked")
    assert serving.record.batches == []


# --- generator steps ----------------------------------------------------------------------------
def test_each_generator_step_reaches_the_caller_as_it_is_produced(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a generator serving with a hook per step, held before each step
    serving = Steps(name="steps", batch_size=2, batch_timeout=0, hooks=["step"], gated=True)
    start_worker(serving)
    items = ["a:3", "b:3"]
    caller = Caller(client, serving, items)

    for k in range(3):
        # When step k may be produced
        serving.gate.open(k)
        # Then its hook and its output arrive, and nothing more while step k+1 is held
        assert caller.next_event() == qs.Hook("step", k, 0, 2)
        assert caller.next_event() == qs.Output(steps_for(items, k), 0, 2)
        if k < 2:
            assert not caller.has_pending_event()
            assert not caller.finished.is_set()
    # and the stream ends after the last step, with nothing repeated
    assert len(caller.join()) == 6


def test_steps_of_an_item_that_ended_early_come_as_runs_of_the_items_still_going(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Steps(name="steps", batch_size=4, batch_timeout=0)
    start_worker(serving)

    events = list(client.stream(serving, ["a:3", "b:1", "c:3", "d:2"], timeout=30))

    assert events == [
        qs.Output(["a:3#0", "b:1#0", "c:3#0", "d:2#0"], 0, 4),
        qs.Output(["a:3#1"], 0, 1),
        qs.Output(["c:3#1", "d:2#1"], 2, 2),
        qs.Output(["a:3#2"], 0, 1),
        qs.Output(["c:3#2"], 2, 1),
    ]


def test_no_output_in_a_step_sends_and_keeps_nothing_for_that_item(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Item n has nothing to show for its first n steps (say, it reads a prompt), then 2 values
    def steps(batch: qs.Batch) -> Iterator[list[Any]]:
        for k in range(max(batch) + 3):
            yield [qs.NO_OUTPUT if k < n else k if k < n + 2 else qs.END for n in batch]

    serving = qs.Serving(steps, name="reads", batch_size=4, batch_timeout=0)
    start_worker(serving)

    events = list(client.stream(serving, [0, 2, 1], timeout=30))

    assert events == [
        qs.Output([0], 0, 1),
        qs.Output([1], 0, 1),
        qs.Output([1], 2, 1),
        qs.Output([2, 2], 1, 2),
        qs.Output([3], 1, 1),
    ]
    assert client.dispatch_many(serving, [0, 2, 1], timeout=30) == [[0, 1], [2, 3], [1, 2]]
    assert serving.inline_many([0, 2, 1]) == [[0, 1], [2, 3], [1, 2]]


def test_dispatch_on_a_generator_serving_returns_each_items_steps(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Steps(name="steps", batch_size=4, batch_timeout=0)
    start_worker(serving)
    expected = [["a:2#0", "a:2#1"], ["b:3#0", "b:3#1", "b:3#2"], []]

    assert client.dispatch_many(serving, ["a:2", "b:3", "c:0"], timeout=30) == expected
    assert client.dispatch(serving, "d:1", timeout=30) == ["d:1#0"]
    # the same as running it inline
    assert serving.inline_many(["a:2", "b:3", "c:0"]) == expected


def test_an_error_mid_stream_comes_after_the_steps_before_it(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a generator that raises at its third step
    serving = Steps(name="steps", batch_size=2, batch_timeout=0)
    start_worker(serving)
    caller = Caller(client, serving, ["boom:2", "b:5"])

    # Then both earlier steps are delivered, then the error is raised
    with pytest.raises(qs.RemoteError) as raised:
        caller.join()
    assert raised.value.remote_type == "ValueError"
    assert "boom at step 2" in raised.value.remote_message
    assert caller.received == [
        qs.Output(["boom:2#0", "b:5#0"], 0, 2),
        qs.Output(["boom:2#1", "b:5#1"], 0, 2),
    ]


def test_a_per_item_end_ends_one_callers_stream_while_another_caller_goes_on(
    start_worker: StartWorker, make_client: Callable[[], qs.Client]
) -> None:
    # Given two callers whose items share one batch of a gated generator serving (the batch
    # is full with both, so it runs at once)
    serving = Steps(name="steps", batch_size=2, batch_timeout=30, gated=True)
    start_worker(serving)
    short = Caller(make_client(), serving, ["a:1"])
    long = Caller(make_client(), serving, ["b:3"])

    # When the first step is produced, both get it
    serving.gate.open(0)
    assert short.next_event() == qs.Output(["a:1#0"], 0, 1)
    assert long.next_event() == qs.Output(["b:3#0"], 0, 1)

    # When the second step ends the short item
    serving.gate.open(1)
    # Then the short caller's stream ends while the generator is still held before step 3
    assert short.join() == [qs.Output(["a:1#0"], 0, 1)]
    assert long.next_event() == qs.Output(["b:3#1"], 0, 1)
    assert not long.finished.is_set()
    assert [sorted(b) for b in serving.record.batches] == [["a:1", "b:3"]]

    # and the other caller goes on to its end
    serving.gate.open(2)
    assert long.join() == [qs.Output(steps_for(["b:3"], k), 0, 1) for k in range(3)]


def test_a_caller_that_stops_iterating_is_dropped_from_later_steps(
    start_worker: StartWorker,
    make_client: Callable[[], qs.Client],
    redis_client: redis.Redis,
    prefix: str,
    pending: Pending,
) -> None:
    # Given two callers (two clients, two event channels) sharing one batch of a gated
    # generator, and a subscriber of our own on both channels
    serving = Steps(name="steps", batch_size=2, batch_timeout=30, gated=True)
    start_worker(serving)
    quitter_client, stayer_client = make_client(), make_client()
    quitter_channel = events_channel(prefix, quitter_client.client_id)
    stayer_channel = events_channel(prefix, stayer_client.client_id)
    tap = EventTap(redis_client, [quitter_channel, stayer_channel])
    try:
        quitter = Caller(quitter_client, serving, ["a:10"], stop_after=1)
        stayer = Caller(stayer_client, serving, ["b:20"])

        # When both got the first step and one caller then stops iterating
        serving.gate.open(0)
        assert quitter.join() == [qs.Output(["a:10#0"], 0, 1)]
        assert stayer.next_event() == qs.Output(["b:20#0"], 0, 1)

        # and the generator goes on, a step at a time, until the worker drops the quitter's
        # request (it acks it without an answer: one entry left pending)
        dropped_at = None
        for k in range(1, 20):
            serving.gate.open(k)
            assert stayer.next_event() == qs.Output(["b:20#" + str(k)], 0, 1)
            if pending("steps") == 1:
                dropped_at = k
                break
        serving.gate.set()

        # Then the other caller still gets every step
        assert stayer.join()[-1] == qs.Output(["b:20#19"], 0, 1)
        tap.wait_for(
            "the last step on the wire",
            lambda: ["o", RESULTS, ["b:20#19"], 0, 1] in tap.bodies(stayer_channel),
        )
        # and the quitter was dropped before its item's end, with no step published after it
        quitter_steps = [b[2][0] for b in tap.bodies(quitter_channel)]
        assert dropped_at is not None
        assert len(quitter_steps) < 10, quitter_steps
        assert quitter_steps == [f"a:10#{k}" for k in range(len(quitter_steps))]
        assert len(quitter_steps) <= dropped_at
    finally:
        tap.close()


def test_closing_a_stream_withdraws_the_requests_still_queued_behind_the_current_one(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    worker_runner: Callable[[qs.Worker], Any],
) -> None:
    # Given a stream of three requests (batch_size 2) whose first batch is held
    serving = Hooks(name="hooked", batch_size=2, batch_timeout=0, gated=True)
    runner = worker_runner(start_worker(serving))
    items = ["a0", "a1", "b0", "b1", "c0", "c1"]

    # When the caller stops after the first event (the first batch's start hook)
    caller = Caller(client, serving, items, stop_after=1)
    assert caller.join() == [qs.Hook("start", ["a0", "a1"], 0, 2)]

    # (a request the worker had read already is withdrawn by a message it must have seen
    # before its batch may start: every entry it holds besides the running one, the oldest)
    def queued_behind_are_cancelled() -> bool:
        with runner.ledger.cond:
            held = sorted(runner.ledger.held, key=entry_order)
            return set(held[1:]) <= set(runner.ledger.cancelled)

    wait_until(queued_behind_are_cancelled, what="the worker to learn of the cancels")
    serving.gate.set()

    # Then the running batch finishes and nothing queued behind it ever runs
    stream = stream_key(prefix, "hooked")
    wait_until(lambda: redis_client.xlen(stream) == 0, what="every entry to be gone")
    assert serving.record.batches == [["a0", "a1"]]


def test_closing_a_stream_drops_its_running_later_request_from_the_steps_to_come(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    worker_runner: Callable[[qs.Worker], Any],
) -> None:
    # Given a stream of two one-item requests whose generator batches run side by side (two
    # executors), both held before their second step, and a subscriber on the caller's channel
    serving = Steps(name="steps", batch_size=1, batch_timeout=0, gated=True)
    runner = worker_runner(start_worker(serving, max_concurrent_batches=2))
    channel = events_channel(prefix, client.client_id)
    tap = EventTap(redis_client, [channel])
    try:
        caller = Caller(client, serving, ["a:10", "b:10"], stop_after=1)
        wait_until(lambda: len(serving.record.batches) == 2, what="both batches to start")

        # When both produced their first step and the caller stops after the first event
        serving.gate.open(0)
        assert caller.join() == [qs.Output(["a:10#0"], 0, 1)]

        # (the worker hears of the later request's cancel before the next step is made)
        def later_request_cancelled() -> bool:
            with runner.ledger.cond:
                return len(runner.ledger.held) == 2 and max(
                    runner.ledger.held, key=entry_order
                ) in set(runner.ledger.cancelled)

        wait_until(later_request_cancelled, what="the worker to learn of the cancel")
        serving.gate.set()

        # Then the later request is dropped: acked, and no step after the first published
        stream = stream_key(prefix, "steps")
        wait_until(lambda: redis_client.xlen(stream) == 0, what="both entries acked")
        tap.drain(redis_client, channel)
        published = [b[2] for b in tap.bodies(channel) if b[0] == "o"]
        assert [v for v in published if v[0].startswith("b:")] == [["b:10#0"]]
    finally:
        tap.close()


def entry_order(ref: tuple[str, bytes]) -> tuple[int, ...]:
    """Order of (stream, entry id) references of one stream, by entry id."""
    return tuple(map(int, ref[1].split(b"-")))


@pytest.fixture
def worker_runner() -> Callable[[qs.Worker], Any]:
    """The serving runner of an in-process worker with one serving: its ``held`` and
    ``cancelled`` (stream, entry id) references are the only view of what a worker learned from
    a cancel."""

    def runner(worker: qs.Worker) -> Any:
        host = worker._host
        assert host is not None
        [only] = host.runners
        return only

    return runner


# --- lost events never lose results (RequestStream, no Redis) -----------------------------------
def hook(name: str, payload: Any, start: int, size: int) -> list[Any]:
    return ["h", name, payload, start, size]


def step(values: list[Any], first: int) -> list[Any]:
    return ["o", RESULTS, values, first, len(values)]


def answered(
    results: list[Any],
    kind: int = STEPS,
    events_total: int = 0,
    error: qs.QueueServeError | None = None,
) -> Call:
    call = Call(1, len(results), Keys("qs", "steps"), "default")
    call.results, call.kind, call.events_total, call.error = results, kind, events_total, error
    return call


def test_out_of_order_events_are_yielded_in_sequence_and_duplicates_dropped() -> None:
    rs = RequestStream(answered([["a0", "a1"]], events_total=3), offset=0)

    assert rs.add(2, hook("h", 2, 0, 1)) == []
    assert rs.add(1, step(["a1"], 0)) == []
    assert rs.waiting_for_events
    assert rs.add(0, step(["a0"], 0)) == [
        qs.Output(["a0"], 0, 1),
        qs.Output(["a1"], 0, 1),
        qs.Hook("h", 2, 0, 1),
    ]
    assert rs.add(1, step(["a1"], 0)) == []  # a duplicate
    assert rs.next_seq == rs.call.events_total  # nothing more to wait for
    assert rs.complete() == ([], None)


def test_lost_trailing_steps_are_rebuilt_from_the_answer_in_order() -> None:
    # Items a (1 step) and b (3 steps), the request's first item being the caller's 5th
    rs = RequestStream(answered([["a0"], ["b0", "b1", "b2"]], events_total=3), offset=4)
    assert rs.add(0, step(["a0", "b0"], 0)) == [qs.Output(["a0", "b0"], 4, 2)]

    # When the events of steps 1 and 2 never arrive
    events, error = rs.complete()

    assert events == [qs.Output(["b1"], 5, 1), qs.Output(["b2"], 5, 1)]
    assert error is None


def test_every_step_is_rebuilt_when_no_event_arrived() -> None:
    rs = RequestStream(answered([["a0"], ["b0", "b1"], ["c0", "c1"]], events_total=3), offset=0)

    events, _ = rs.complete()

    assert events == [qs.Output(["a0", "b0", "c0"], 0, 3), qs.Output(["b1", "c1"], 1, 2)]


def test_a_step_lost_between_two_that_arrived_is_rebuilt_in_its_place() -> None:
    rs = RequestStream(answered([["a0", "a1", "a2"]], events_total=3), offset=0)
    assert rs.add(0, step(["a0"], 0)) == [qs.Output(["a0"], 0, 1)]
    assert rs.add(2, step(["a2"], 0)) == []  # held: seq 1 is missing

    events, error = rs.complete()

    # every step exactly once, in order
    assert events == [qs.Output(["a1"], 0, 1), qs.Output(["a2"], 0, 1)]
    assert error is None


def test_a_lost_hook_is_simply_absent_and_the_result_still_comes() -> None:
    rs = RequestStream(answered(["r:a", "r:b"], kind=RESULTS, events_total=2), offset=3)
    assert rs.add(1, hook("done", 2, 0, 2)) == []  # seq 0 (the start hook) was lost

    events, error = rs.complete()

    assert events == [qs.Hook("done", 2, 0, 2), qs.Output(["r:a", "r:b"], 3, 2)]
    assert error is None


def test_an_error_answer_comes_after_the_events_received() -> None:
    failed = qs.RemoteError("ValueError", "boom")
    rs = RequestStream(answered([failed], kind=RESULTS, events_total=1), offset=0)
    assert rs.add(0, hook("start", None, 0, 1)) == [qs.Hook("start", None, 0, 1)]

    assert rs.complete() == ([], failed)
    whole = qs.Timeout("too late")
    rs = RequestStream(answered([None], events_total=0, error=whole), offset=0)
    assert rs.complete() == ([], whole)


# --- the AsyncClient --------------------------------------------------------------------------
async def test_async_stream_yields_each_requests_hooks_then_output_in_input_order(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Hooks(name="hooked", batch_size=4, batch_timeout=0)
    start_worker(serving)
    items = [f"x{i}" for i in range(6)]

    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        events = [e async for e in aclient.stream("hooked", items, timeout=30)]

    assert events == [
        qs.Hook("start", items[:4], 0, 4),
        qs.Hook("done", 4, 0, 4),
        qs.Output(results_of(items[:4]), 0, 4),
        qs.Hook("start", items[4:], 0, 2),
        qs.Hook("done", 2, 0, 2),
        qs.Output(results_of(items[4:]), 4, 2),
    ]


async def test_async_stream_of_a_generator_serving_with_hooks(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Steps(name="steps", batch_size=2, batch_timeout=0, hooks=["step"])
    start_worker(serving)

    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        events = [e async for e in aclient.stream(serving, ["a:1", "b:3"], timeout=30)]

    # the hook of each step precedes its output; item a ends after its first step
    assert events == [
        qs.Hook("step", 0, 0, 2),
        qs.Output(["a:1#0", "b:3#0"], 0, 2),
        qs.Hook("step", 1, 0, 2),
        qs.Output(["b:3#1"], 1, 1),
        qs.Hook("step", 2, 0, 2),
        qs.Output(["b:3#2"], 1, 1),
    ]


async def test_async_stream_raises_a_mid_stream_error_after_the_earlier_steps(
    start_worker: StartWorker, redis_url: str, prefix: str
) -> None:
    serving = Steps(name="steps", batch_size=2, batch_timeout=0)
    start_worker(serving)
    events: list[qs.Hook | qs.Output] = []

    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        with pytest.raises(qs.RemoteError, match="boom at step 1"):
            async for event in aclient.stream(serving, ["boom:1"], timeout=30):
                events.append(event)

    assert events == [qs.Output(["boom:1#0"], 0, 1)]
