"""docs/design.md §3 batching semantics, and the dispatch API of §2, against a real worker and
Redis.

Each test runs a ``Recording`` serving (tests/support/servings.py) in a worker thread of this
process, so it can see exactly which items ran together. Holding the serving's gate keeps the
executor busy; ``pending`` (entries read by the worker and not acked) tells when the worker has
read items it has not executed yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
import torch

import queueserve as qs
from tests.support.helpers import items_waiting, stream_key, wait_until
from tests.support.servings import Recording, drop_last, square_items, tag_items, upper_items

RESULT_WAIT_S = 10.0  # a result that does not come within this is a hang, not a slow machine
FOREVER = 3600.0  # a batch_timeout that never passes during a test

StartWorker = Callable[..., qs.Worker]
Pending = Callable[..., int]


def hold_executor(serving: Recording, client: qs.Client, blocker: list[Any]) -> qs.Ticket:
    """Shut the gate and send ``blocker``; return once its batch waits in the executor."""
    serving.hold()
    before = len(serving.batches)
    ticket = client.submit(serving, blocker)
    wait_until(lambda: len(serving.batches) > before, what="the blocker batch to start")
    return ticket


# --- §3.1 capacity -------------------------------------------------------------------------


def test_capacity_by_count_caps_every_batch_and_answers_in_order(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving of batch_size 10 whose executor is busy with a first batch
    serving = Recording(tag_items, name="cap", batch_size=10, batch_timeout=0.02)
    start_worker(serving)
    blocker = hold_executor(serving, client, [-1])

    # When 25 items arrive meanwhile, as one request of 15 and ten single-item requests
    big = client.submit(serving, list(range(15)))
    singles = [client.submit(serving, [100 + i]) for i in range(10)]
    serving.release()

    # Then no batch holds more than 10 items, and every caller gets its results in order
    assert blocker.result(RESULT_WAIT_S) == ["r:-1"]
    assert big.result(RESULT_WAIT_S) == [f"r:{i}" for i in range(15)]
    assert [t.result(RESULT_WAIT_S) for t in singles] == [[f"r:{100 + i}"] for i in range(10)]
    sizes = [len(items) for items in serving.item_batches]
    assert max(sizes) <= 10, sizes
    assert sorted(serving.items_run) == sorted([-1, *range(15), *range(100, 110)])
    # a request's items run in its own order (a split keeps the order)
    ran = serving.items_run
    assert [x for x in ran if 0 <= x < 15] == list(range(15))


def test_capacity_by_cost_caps_the_total_cost_of_every_batch(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving whose capacity is 10 characters (cost=len), busy with a first batch
    serving = Recording(upper_items, name="costly", batch_size=10, batch_timeout=0.02, cost=len)
    start_worker(serving)
    blocker = hold_executor(serving, client, ["x"])

    # When strings of many lengths arrive, in one request and in single-item requests
    words = ["aaa", "bb", "cccc", "d", "eeeeeee", "ff", "ggg", "hhhhh", "i", "jjjjjjjjjj", "kk"]
    request = client.submit(serving, words)
    singles = [client.submit(serving, [w * 2]) for w in ["p", "qq", "rrr", "ssss"]]
    serving.release()

    # Then every batch costs at most 10, and every caller gets its results in order
    assert blocker.result(RESULT_WAIT_S) == ["X"]
    assert request.result(RESULT_WAIT_S) == [w.upper() for w in words]
    assert [t.result(RESULT_WAIT_S)[0] for t in singles] == ["PP", "QQQQ", "RRRRRR", "SSSSSSSS"]
    costs = [sum(len(s) for s in items) for items in serving.item_batches]
    assert max(costs) <= 10, costs
    assert any(len(items) > 1 for items in serving.item_batches), "no batch held two items"


def test_item_costing_more_than_capacity_fails_alone_and_blocks_nothing(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(upper_items, name="costly", batch_size=10, batch_timeout=0.01, cost=len)
    start_worker(serving)
    too_big = "z" * 15

    # When one item of a request costs 15 and capacity is 10, next to another request
    ticket = client.submit(serving, ["ab", too_big, "cd"])
    other = client.submit(serving, ["ef"])

    # Then that item alone gets a clear error naming its cost and the capacity
    results = ticket.result(RESULT_WAIT_S, return_exceptions=True)
    assert results[0] == "AB" and results[2] == "CD"
    error = results[1]
    assert isinstance(error, qs.BadRequest), error
    assert "15" in str(error) and "batch_size=10" in str(error), str(error)
    assert other.result(RESULT_WAIT_S) == ["EF"]
    # and raising it is the default
    with pytest.raises(qs.BadRequest, match="costs 15"):
        client.dispatch_many(serving, [too_big], timeout=RESULT_WAIT_S)
    # and it never reached the batch function, nor blocked the queue behind it
    assert too_big not in serving.items_run
    assert client.dispatch(serving, "gh", timeout=RESULT_WAIT_S) == "GH"


def test_full_batch_of_cheap_items_executes_at_once(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given capacity 2 cost units, items costing 0.5 each, and a timeout that never passes
    serving = Recording(name="cheap", batch_size=2, batch_timeout=FOREVER, cost=lambda _item: 0.5)
    start_worker(serving)
    # When 4 single-item requests arrive (2 cost units: a full batch)
    tickets = [client.submit(serving, [i]) for i in range(4)]
    # Then they run at once, together
    assert [t.result(2.0) for t in tickets] == [[0], [1], [2], [3]]
    assert serving.item_batches == [[0, 1, 2, 3]]


# --- §3.2 full batches run at once; §3.3 greedy ----------------------------------------------


def test_full_batch_executes_at_once_without_waiting_for_the_timeout(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    serving = Recording(square_items, name="full", batch_size=3, batch_timeout=FOREVER)
    start_worker(serving)

    # 3 items fill a batch: they run now, not in an hour
    assert client.dispatch_many(serving, [1, 2, 3], timeout=RESULT_WAIT_S) == [1, 4, 9]
    assert serving.item_batches == [[1, 2, 3]]

    # Given 2 single items the worker has read
    first = [client.submit(serving, [x]) for x in (4, 5)]
    wait_until(lambda: pending("full") == 2, what="the worker to read 2 entries")
    # Then they wait: a batch of 2 is neither full nor due
    assert serving.item_batches == [[1, 2, 3]]
    assert not any(t.done() for t in first)

    # When a third arrives, the batch of exactly 3 runs
    third = client.submit(serving, [6])
    assert [t.result(RESULT_WAIT_S) for t in [*first, third]] == [[16], [25], [36]]
    assert serving.item_batches == [[1, 2, 3], [4, 5, 6]]


def test_zero_batch_timeout_is_greedy(start_worker: StartWorker, client: qs.Client) -> None:
    serving = Recording(square_items, name="greedy", batch_size=10, batch_timeout=0)
    start_worker(serving)

    assert client.dispatch(serving, 7, timeout=RESULT_WAIT_S) == 49
    assert serving.batches == [("default", [7])]


def test_batches_grow_while_the_executor_is_busy(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given a small batch_timeout and an executor busy with a first batch
    serving = Recording(tag_items, name="grow", batch_size=10, batch_timeout=0.01)
    worker = start_worker(serving)
    blocker = hold_executor(serving, client, [0])

    # When 8 single-item requests are read while it is busy (their timeout passes meanwhile)
    tickets = [client.submit(serving, [i]) for i in range(1, 9)]
    wait_until(
        lambda: pending("grow") == 9 and items_waiting(worker) == 8,
        what="the worker to read all 9 entries",
    )
    serving.release()

    # Then they did not queue as small batches: the next batch holds all 8
    assert blocker.result(RESULT_WAIT_S) == ["r:0"]
    assert [t.result(RESULT_WAIT_S) for t in tickets] == [[f"r:{i}"] for i in range(1, 9)]
    assert serving.item_batches == [[0], list(range(1, 9))]


# --- §3.4 splitting ------------------------------------------------------------------------


def test_request_larger_than_the_room_left_is_split_aab_bcc(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given batch_size 4, a timeout that never passes, and an executor busy with a full batch
    serving = Recording(tag_items, name="split", batch_size=4, batch_timeout=FOREVER)
    worker = start_worker(serving)
    blocker = hold_executor(serving, client, ["z0", "z1", "z2", "z3"])

    # When request A (3 items) and then request B (5 items: a job, which the client never
    # cuts into batches) are both read meanwhile
    a = client.submit(serving, ["a0", "a1", "a2"])
    b = client.submit(serving, ["b0", "b1", "b2", "b3", "b4"], keep=60)
    wait_until(
        lambda: pending("split") == 3 and items_waiting(worker) == 8,
        what="the worker to read A and B",
    )
    serving.release()

    # Then B is split over two full batches, [A0 A1 A2 B0] [B1 B2 B3 B4] ...
    assert blocker.result(RESULT_WAIT_S) == ["r:z0", "r:z1", "r:z2", "r:z3"]
    assert a.result(RESULT_WAIT_S) == ["r:a0", "r:a1", "r:a2"]
    # ... and each caller still gets its own results, in order
    assert b.result(RESULT_WAIT_S) == ["r:b0", "r:b1", "r:b2", "r:b3", "r:b4"]
    assert serving.item_batches[1:] == [["a0", "a1", "a2", "b0"], ["b1", "b2", "b3", "b4"]]


def test_one_request_larger_than_batch_size_runs_as_several_batches_in_order(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(square_items, name="split10", batch_size=4, batch_timeout=0.01)
    start_worker(serving)

    # A job is one request whatever its size (the client cuts other calls into batches)
    job = client.submit(serving, list(range(10)), timeout=RESULT_WAIT_S, keep=60)
    assert job.result(RESULT_WAIT_S) == [x * x for x in range(10)]
    assert serving.item_batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_call_bigger_than_a_batch_goes_as_requests_of_a_batch_each_in_order(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a serving of batch_size 4 that a worker declared, its executor held
    serving = Recording(square_items, name="cut10", batch_size=4, batch_timeout=0.01, gated=True)
    start_worker(serving)

    # When a caller sends 10 items in one call (by name: the size comes from the declaration)
    ticket = client.submit("cut10", list(range(10)), timeout=RESULT_WAIT_S)

    # Then they went as three requests, a batch at most each (a worker holds a request whole
    # once read; requests of a batch keep their key's turn in Redis) ...
    stream = stream_key(prefix, "cut10")
    wait_until(lambda: redis_client.xlen(stream) == 3, what="three requests in the stream")
    serving.release()
    # ... whose results come back in the caller's order
    assert ticket.result(RESULT_WAIT_S) == [x * x for x in range(10)]
    assert serving.item_batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# --- §3.5 batch keys -----------------------------------------------------------------------


def test_batch_keys_never_share_a_batch(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given a worker that knows keys "a" and "b", busy with a batch of key "a"
    serving = Recording(tag_items, name="keys", batch_size=16, batch_timeout=0.01)
    start_worker(serving, batch_keys=["a", "b"])
    serving.hold()
    blocker = client.submit(serving, ["a-blocker"], batch_key="a")
    wait_until(lambda: serving.batches, what="the blocker batch to start")

    # When requests of keys a and b arrive interleaved while it is busy
    tickets = []
    for i in range(12):
        key = "ab"[i % 2]
        tickets.append((key, i, client.submit(serving, [f"{key}{i}"], batch_key=key)))
    wait_until(
        lambda: pending("keys", "a") == 7 and pending("keys", "b") == 6,
        what="the worker to read every entry of both keys",
    )
    serving.release()

    # Then each caller gets its result, and no batch mixed keys
    assert blocker.result(RESULT_WAIT_S) == ["r:a-blocker"]
    for key, i, ticket in tickets:
        assert ticket.result(RESULT_WAIT_S) == [f"r:{key}{i}"]
    for key, items in serving.batches:
        assert {item[0] for item in items} == {key}, (key, items)
    assert {key for key, _ in serving.batches} == {"a", "b"}
    assert max(len(items) for items in serving.item_batches) > 1, "no coalescing happened"


def test_a_key_fills_its_batch_while_another_key_waits(
    start_worker: StartWorker, client: qs.Client, pending: Pending
) -> None:
    # Given batch_size 2, a timeout that never passes, and one item read for each of keys a, b
    serving = Recording(tag_items, name="hol", batch_size=2, batch_timeout=FOREVER)
    start_worker(serving, batch_keys=["a", "b"])
    a1 = client.submit(serving, ["a1"], batch_key="a")
    wait_until(lambda: pending("hol", "a") == 1, what="the worker to read a1")
    b1 = client.submit(serving, ["b1"], batch_key="b")
    wait_until(lambda: pending("hol", "b") == 1, what="the worker to read b1")

    # When a second item of key a arrives, key a holds a full batch
    a2 = client.submit(serving, ["a2"], batch_key="a")

    # Then it runs at once: keys are independent queues, b's lone item must not hold a back
    assert a1.result(2.0) + a2.result(2.0) == ["r:a1", "r:a2"]
    assert serving.batches == [("a", ["a1", "a2"])]
    assert not b1.done()


def test_declared_and_dynamic_batch_keys_are_both_served(
    start_worker: StartWorker, client: qs.Client, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker started with key "x" declared
    serving = Recording(tag_items, name="dyn", batch_size=4, batch_timeout=0.01)
    start_worker(serving, batch_keys=["x"])
    # Then it consumes "x" before anyone sent to it
    groups = redis_client.xinfo_groups(stream_key(prefix, "dyn", "x"))
    assert [g["name"] for g in groups] == [b"qs"]

    assert client.dispatch(serving, 1, batch_key="x", timeout=RESULT_WAIT_S) == "r:1"
    # and a key nobody declared, appearing later, is found and served too
    assert client.dispatch(serving, 2, batch_key="later", timeout=RESULT_WAIT_S) == "r:2"
    assert serving.batches == [("x", [1]), ("later", [2])]


def test_serving_batch_key_function_groups_items_but_keeps_input_order(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving that keys items by their length, on the client side
    serving = Recording(
        upper_items,
        name="bylen",
        batch_size=16,
        batch_timeout=0.01,
        batch_key=lambda s: f"len{len(s)}",
    )
    start_worker(serving)
    words = ["a", "bb", "c", "ddd", "ee", "f", "ggg", "hh"]

    # When one dispatch_many mixes keys
    results = client.dispatch_many(serving, words, timeout=RESULT_WAIT_S)

    # Then results come in input order, and every batch held one key only
    assert results == [w.upper() for w in words]
    for key, items in serving.batches:
        assert {f"len{len(s)}" for s in items} == {key}, (key, items)
    assert sorted(serving.items_run) == sorted(words)
    assert {key for key, _ in serving.batches} == {"len1", "len2", "len3"}


# --- §3.6 results --------------------------------------------------------------------------


def test_wrong_result_length_fails_every_item_of_the_batch(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a batch function that returns one result too few, and a batch of 5 from 2 callers
    serving = Recording(drop_last, name="short", batch_size=5, batch_timeout=FOREVER)
    start_worker(serving)
    first = client.submit(serving, [1, 2])
    second = client.submit(serving, [3, 4, 5])

    # Then every item of that batch gets a RemoteError naming both counts
    errors = first.result(RESULT_WAIT_S, return_exceptions=True) + second.result(
        RESULT_WAIT_S, return_exceptions=True
    )
    assert serving.item_batches == [[1, 2, 3, 4, 5]]
    assert len(errors) == 5
    for e in errors:
        assert isinstance(e, qs.RemoteError), e
        assert "returned 4 results for a batch of 5 items" in e.remote_message
    with pytest.raises(qs.RemoteError, match="returned 4 results"):
        first.result(RESULT_WAIT_S)


def _rows(items: list[int]) -> np.ndarray[Any, Any]:
    return np.array([[x, x + 1, x + 2] for x in items], dtype=np.int64)


def test_numpy_array_results_are_split_per_item(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a function returning one (B, 3) array for the batch, and a batch of 2 callers
    serving = Recording(_rows, name="nprows", batch_size=4, batch_timeout=FOREVER)
    start_worker(serving)
    first = client.submit(serving, [10, 20])
    second = client.submit(serving, [30, 40])

    # Then each caller gets its own rows
    for ticket, values in ((first, [10, 20]), (second, [30, 40])):
        rows = ticket.result(RESULT_WAIT_S)
        assert len(rows) == 2
        for row, x in zip(rows, values, strict=True):
            assert isinstance(row, np.ndarray) and row.shape == (3,)
            assert row.tolist() == [x, x + 1, x + 2]
    assert serving.item_batches == [[10, 20, 30, 40]]


def _columns(items: list[int]) -> dict[str, np.ndarray[Any, Any]]:
    xs = np.array(items, dtype=np.float32)
    return {"score": xs / 10, "pair": np.stack([xs, -xs], axis=1)}


def test_dict_of_arrays_results_are_split_per_item(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(_columns, name="npdict", batch_size=3, batch_timeout=FOREVER)
    start_worker(serving)
    first = client.submit(serving, [1])
    second = client.submit(serving, [2, 3])

    results = first.result(RESULT_WAIT_S) + second.result(RESULT_WAIT_S)
    assert serving.item_batches == [[1, 2, 3]]
    for result, x in zip(results, [1, 2, 3], strict=True):
        assert set(result) == {"score", "pair"}
        assert float(result["score"]) == pytest.approx(x / 10)
        assert np.asarray(result["pair"]).tolist() == [x, -x]


def _tensor(items: list[int]) -> torch.Tensor:
    xs = torch.tensor(items, dtype=torch.float32)
    return torch.stack([xs, xs * 2, xs * 3], dim=1)


def test_torch_tensor_results_are_split_per_item(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = Recording(_tensor, name="tensor", batch_size=4, batch_timeout=FOREVER)
    start_worker(serving)
    first = client.submit(serving, [1, 2, 3])
    second = client.submit(serving, [4])

    results = first.result(RESULT_WAIT_S) + second.result(RESULT_WAIT_S)
    assert serving.item_batches == [[1, 2, 3, 4]]
    for row, x in zip(results, [1, 2, 3, 4], strict=True):
        assert isinstance(row, torch.Tensor) and tuple(row.shape) == (3,)
        assert row.tolist() == [x, 2 * x, 3 * x]


# --- §2 dispatch API -----------------------------------------------------------------------


def test_dispatch_methods_and_ticket(start_worker: StartWorker, client: qs.Client) -> None:
    serving = Recording(square_items, name="api", batch_size=64, batch_timeout=0.005)
    start_worker(serving)

    # by name and by object
    assert client.dispatch("api", 3, timeout=RESULT_WAIT_S) == 9
    assert client.dispatch(serving, 4, timeout=RESULT_WAIT_S) == 16
    assert client.dispatch_many("api", [1, 2, 3], timeout=RESULT_WAIT_S) == [1, 4, 9]

    ticket = client.submit("api", [5, 6])
    other = client.submit("api", [7])
    assert ticket.result(RESULT_WAIT_S) == [25, 36]
    assert ticket.done()
    assert other.result(RESULT_WAIT_S) == [49]
    assert ticket.id.startswith(client.client_id) and other.id.startswith(client.client_id)
    assert ticket.id != other.id


def test_dispatch_many_of_no_items_returns_no_results(
    start_worker: StartWorker, client: qs.Client
) -> None:
    start_worker(qs.Serving(square_items, name="empty", batch_size=4, batch_timeout=0.005))

    assert client.dispatch_many("empty", [], timeout=2.0) == []


def test_map_returns_results_in_input_order(start_worker: StartWorker, client: qs.Client) -> None:
    serving = Recording(square_items, name="map", batch_size=32, batch_timeout=0.002)
    start_worker(serving)

    results = list(client.map("map", range(1000), chunk_size=7, timeout=RESULT_WAIT_S))

    assert results == [x * x for x in range(1000)]
    # 7-item requests were coalesced by the worker into bigger batches
    assert max(len(items) for items in serving.item_batches) > 7


class LeadCounter:
    """Wraps an input generator; records how far input consumption ran ahead of the results."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.consumed = 0
        self.yielded = 0
        self.max_lead = 0

    def inputs(self) -> Iterator[int]:
        for i in range(self.n):
            self.consumed += 1
            yield i

    def results(self, it: Iterator[Any]) -> Iterator[Any]:
        for r in it:
            self.yielded += 1
            self.max_lead = max(self.max_lead, self.consumed - self.yielded)
            yield r


def test_map_over_a_large_generator_keeps_a_bounded_window(
    start_worker: StartWorker, client: qs.Client
) -> None:
    serving = qs.Serving(square_items, name="bigmap", batch_size=1024, batch_timeout=0)
    start_worker(serving)
    chunk_size, max_in_flight = 250, 4
    counter = LeadCounter(100_000)

    results = counter.results(
        client.map(
            "bigmap",
            counter.inputs(),
            chunk_size=chunk_size,
            max_in_flight=max_in_flight,
            timeout=30,
        )
    )
    checked = 0
    for expected, got in zip((x * x for x in range(100_000)), results, strict=True):
        assert got == expected
        checked += 1

    assert checked == 100_000
    # constant memory: the input is never read more than the in-flight window ahead
    assert counter.max_lead <= chunk_size * max_in_flight + chunk_size, counter.max_lead


def test_dispatch_with_serving_object_maps_inputs_and_results_in_the_caller(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given a serving with client-side maps
    serving = Recording(square_items, name="mapped", batch_size=8, batch_timeout=0.005)
    serving.map_inputs(lambda x: x + 100).map_results(lambda r: f"<{r}>")
    start_worker(serving)

    # When dispatched with the object, the maps run in the caller around the worker's batch
    assert client.dispatch(serving, 1, timeout=RESULT_WAIT_S) == "<10201>"
    assert client.dispatch_many(serving, [2, 3], timeout=RESULT_WAIT_S) == ["<10404>", "<10609>"]
    assert list(client.map(serving, [4], timeout=RESULT_WAIT_S)) == ["<10816>"]
    assert sorted(serving.items_run) == [101, 102, 103, 104]

    # and by name the worker sees the raw item: the maps live in the client
    assert client.dispatch("mapped", 5, timeout=RESULT_WAIT_S) == 25
    assert serving.items_run[-1] == 5


def test_key_function_and_maps_combine(start_worker: StartWorker, client: qs.Client) -> None:
    serving = Recording(
        tag_items,
        name="combo",
        batch_size=8,
        batch_timeout=0.005,
        batch_key=lambda x: "even" if x % 2 == 0 else "odd",
    ).map_inputs(lambda x: x * 3)
    start_worker(serving)

    assert client.dispatch_many(serving, [1, 2, 3, 4], timeout=RESULT_WAIT_S) == [
        "r:3",
        "r:6",
        "r:9",
        "r:12",
    ]
    keyed = {key: items for key, items in serving.batches}
    assert sorted(itertools.chain(*keyed.values())) == [3, 6, 9, 12]
    assert all(x % 2 == (key == "odd") for key, items in keyed.items() for x in items)
