"""Servings (docs/design.md §2/§3): construction checks, the three ways to define one, inline
runs."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import queueserve as qs
from queueserve.options.units import parse_duration
from queueserve.results import BatchResultError, BatchResults, unbatch
from queueserve.wire.kinds import BATCHED, RESULTS


def square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


class Recorder:
    """A batch function that records each batch (its items, key and partition)."""

    def __init__(self, fn: Any = None) -> None:
        self.batches: list[qs.Batch] = []
        self.fn = fn or (lambda batch: [x * 10 for x in batch])
        self.__name__ = "recorder"

    def __call__(self, batch: qs.Batch) -> Any:
        self.batches.append(batch)
        return self.fn(batch)

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


# -- construction ------------------------------------------------------------------------------
def test_defaults_and_name_from_function() -> None:
    s = qs.Serving(square)
    assert s.name == "square"
    assert s.batch_size >= 1
    assert s.batch_timeout >= 0
    assert s.codec == "msgpack"
    assert s.on_error == "isolate"
    assert s.cost is None
    assert "square" in repr(s)


def test_options_are_kept() -> None:
    s = qs.Serving(
        square,
        name="sq",
        batch_size=10,
        batch_timeout=0.1,
        max_queue=5,
        codec="pickle",
        on_error="fail",
    )
    assert (s.name, s.batch_size, s.batch_timeout) == ("sq", 10, 0.1)
    expected = {
        "batch_size": 10,
        "batch_timeout": 0.1,
        "max_queue": 5,
        "codec": "pickle",
        "on_error": "fail",
        "cost": False,
    }
    assert s.options().items() >= expected.items()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (1.1, TypeError),
        (2.0, TypeError),
        ("4", TypeError),
        (True, TypeError),
        (False, TypeError),
        (0, ValueError),
        (-3, ValueError),
    ],
    ids=repr,
)
def test_batch_size_is_checked(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="batch_size"):
        qs.Serving(square, batch_size=value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0, 0.0), (0.25, 0.25), (2, 2.0), ("10ms", 0.01), ("1.5s", 1.5), ("0", 0.0), ("1m", 60.0)],
)
def test_batch_timeout_accepts_seconds_and_durations(value: Any, seconds: float) -> None:
    assert qs.Serving(square, batch_timeout=value).batch_timeout == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (-1, ValueError),
        (-0.001, ValueError),
        ("abc", ValueError),
        ("-5ms", ValueError),
        ("10 parsecs", ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        (False, TypeError),
        ([0.1], TypeError),
    ],
    ids=repr,
)
def test_batch_timeout_is_checked(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="batch_timeout"):
        qs.Serving(square, batch_timeout=value)


def test_cost_must_be_callable() -> None:
    with pytest.raises(TypeError, match="cost"):
        qs.Serving(square, cost=3)  # type: ignore[arg-type]
    assert qs.Serving(square, cost=len).cost is len


@pytest.mark.parametrize("value", [3, 1.5, ["a"], b"key"], ids=repr)
def test_batch_key_must_be_str_or_callable(value: Any) -> None:
    with pytest.raises(TypeError, match="batch_key"):
        qs.Serving(square, batch_key=value)


@pytest.mark.parametrize("value", ["ignore", "", "ISOLATE", 1])
def test_on_error_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="on_error"):
        qs.Serving(square, on_error=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"], ids=repr)
def test_max_queue_is_checked(value: Any) -> None:
    with pytest.raises(ValueError, match="max_queue"):
        qs.Serving(square, max_queue=value)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="batchsize"):
        qs.Serving(square, batchsize=3)  # type: ignore[call-arg]


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="fn"):
        qs.Serving(42, name="x")  # type: ignore[arg-type]


def test_no_function_and_no_handle_batch_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="handle_batch"):
        qs.Serving(name="nothing")


def test_a_lambda_needs_a_name() -> None:
    with pytest.raises(ValueError, match="name"):
        qs.Serving(lambda xs: xs)
    assert qs.Serving(lambda xs: xs, name="ident").name == "ident"


@pytest.mark.parametrize("name", ["a:b", "a{b", "a}b", "{x}", ":"])
def test_names_that_break_key_layout_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="may not contain"):
        qs.Serving(square, name=name)


@pytest.mark.parametrize("name", ["embed", "embed-v2", "my_model.large", "UPPER9"])
def test_ordinary_names_are_accepted(name: str) -> None:
    assert qs.Serving(square, name=name).name == name


# -- decorator form ----------------------------------------------------------------------------
def test_decorator_with_options() -> None:
    @qs.serving(name="dec", batch_size=3, batch_timeout="5ms")
    def doubled(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    assert isinstance(doubled, qs.Serving)
    assert (doubled.name, doubled.batch_size, doubled.batch_timeout) == ("dec", 3, 0.005)
    assert doubled.inline(4) == 8
    assert doubled.inline_many([1, 2, 3, 4]) == [2, 4, 6, 8]


def test_decorator_without_arguments_uses_the_function_name() -> None:
    @qs.serving
    def tripled(xs: list[int]) -> list[int]:
        return [3 * x for x in xs]

    assert isinstance(tripled, qs.Serving)
    assert tripled.name == "tripled"
    assert tripled.inline(2) == 6


def test_decorator_checks_options_too() -> None:
    with pytest.raises(ValueError, match="batch_size"):

        @qs.serving(name="bad", batch_size=0)
        def bad(xs: list[int]) -> list[int]:
            return xs


# -- subclass form -----------------------------------------------------------------------------
class Model(qs.Serving):
    name = "model"
    batch_size = 4
    batch_timeout = 0.002
    on_error = "fail"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.setup_calls: list[qs.Partition] = []
        self.batches: list[qs.Batch] = []
        self.weight = 0

    def setup(self, partition: qs.Partition) -> None:
        self.setup_calls.append(partition)
        self.weight = 3

    def handle_batch(self, batch: qs.Batch) -> list[int]:
        self.batches.append(batch)
        return [self.weight * x for x in batch]


def test_subclass_takes_class_attributes() -> None:
    m = Model()
    assert (m.name, m.batch_size, m.batch_timeout, m.on_error) == ("model", 4, 0.002, "fail")
    assert m.fn is None


def test_subclass_keywords_override_class_attributes() -> None:
    m = Model(name="model2", batch_size=2)
    assert (m.name, m.batch_size) == ("model2", 2)


def test_subclass_class_attributes_are_checked() -> None:
    class Bad(Model):
        batch_size = 0

    with pytest.raises(ValueError, match="batch_size"):
        Bad()


def test_subclass_without_name_uses_the_class_name() -> None:
    class Embedder(qs.Serving):
        def handle_batch(self, batch: qs.Batch) -> list[Any]:
            return list(batch)

    assert Embedder().name == "embedder"


def test_subclass_setup_runs_once_before_the_first_inline_batch() -> None:
    m = Model()
    assert m.setup_calls == []
    assert m.inline(2) == 6  # uses the weight that setup() loaded
    assert m.inline_many(list(range(10))) == [3 * x for x in range(10)]
    assert m.inline(1) == 3
    assert len(m.setup_calls) == 1
    partition = m.setup_calls[0]
    assert isinstance(partition, qs.Partition)
    assert partition.device == "cpu"
    assert len(m.batches) == 1 + 3 + 1  # 10 items in batches of 4


def test_subclass_setup_runs_once_under_concurrent_inline_calls() -> None:
    entered = threading.Event()
    release = threading.Event()

    class Slow(qs.Serving):
        name = "slow"
        calls = 0

        def setup(self, partition: qs.Partition) -> None:
            type(self).calls += 1
            entered.set()
            assert release.wait(10), "the test never released setup()"

        def handle_batch(self, batch: qs.Batch) -> list[Any]:
            return list(batch)

    s = Slow()
    results: list[Any] = []
    threads = [threading.Thread(target=lambda i=i: results.append(s.inline(i))) for i in range(4)]
    for t in threads:
        t.start()
    assert entered.wait(10)
    release.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert Slow.calls == 1
    assert sorted(results) == [0, 1, 2, 3]


def test_setup_that_fails_is_retried_next_time() -> None:
    class Flaky(qs.Serving):
        name = "flaky"
        attempts = 0

        def setup(self, partition: qs.Partition) -> None:
            type(self).attempts += 1
            if type(self).attempts == 1:
                raise RuntimeError("model file missing")

        def handle_batch(self, batch: qs.Batch) -> list[Any]:
            return list(batch)

    s = Flaky()
    with pytest.raises(RuntimeError, match="model file missing"):
        s.inline(1)
    assert s.inline(2) == 2
    assert Flaky.attempts == 2


def test_subclass_cost_and_batch_key_as_class_attributes() -> None:
    class Tokens(qs.Serving):
        name = "tokens"
        batch_size = 10
        batch_key = "gpu"

        def cost(self, item: str) -> float:
            return len(item)

        def handle_batch(self, batch: qs.Batch) -> list[Any]:
            return [batch.key] * len(batch)

    t = Tokens()
    assert t.batch_key == "gpu"
    assert t.item_cost("abcd") == 4
    assert t.inline("abc") == "gpu"


# -- inline runs -------------------------------------------------------------------------------
def test_inline_runs_one_item() -> None:
    assert qs.Serving(square, batch_size=10).inline(3) == 9


def test_inline_many_keeps_order_and_splits_into_batch_size_chunks() -> None:
    rec = Recorder()
    s = qs.Serving(rec, name="rec", batch_size=3)
    assert s.inline_many(range(8)) == [x * 10 for x in range(8)]
    assert rec.sizes == [3, 3, 2]
    assert [list(b) for b in rec.batches] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_inline_many_of_nothing_runs_nothing() -> None:
    rec = Recorder()
    assert qs.Serving(rec, name="rec").inline_many([]) == []
    assert rec.batches == []


def test_inline_many_accepts_any_iterable() -> None:
    s = qs.Serving(square, batch_size=2)
    assert s.inline_many(x for x in (1, 2, 3)) == [1, 4, 9]


def test_inline_many_chunks_by_cost() -> None:
    rec = Recorder(lambda batch: [len(x) for x in batch])
    s = qs.Serving(rec, name="tok", batch_size=10, cost=len)
    items = ["aaaa", "bbbb", "cc", "dddddd", "eeee", "f", "gggggggggg", "h"]
    assert s.inline_many(items) == [len(x) for x in items]
    assert [list(b) for b in rec.batches] == [
        ["aaaa", "bbbb", "cc"],  # 10
        ["dddddd", "eeee"],  # 10
        ["f"],  # 1 + 10 would not fit
        ["gggggggggg"],
        ["h"],
    ]
    for batch in rec.batches:
        assert sum(len(x) for x in batch) <= 10


def test_inline_many_refuses_an_item_costlier_than_capacity() -> None:
    rec = Recorder()
    s = qs.Serving(rec, name="tok", batch_size=5, cost=len)
    with pytest.raises(ValueError, match=r"item 1 costs 6.*batch_size=5"):
        s.inline_many(["ab", "abcdef"])


def test_item_cost() -> None:
    assert qs.Serving(square).item_cost("anything") == 1.0
    assert qs.Serving(square, cost=len).item_cost("abc") == 3.0


def test_inline_results_from_a_numpy_array_are_split_per_item() -> None:
    s = qs.Serving(
        lambda xs: np.asarray(xs, dtype=np.float32)[:, None] * [1, 2], name="np", batch_size=3
    )
    out = s.inline_many([1, 2, 3, 4])
    assert len(out) == 4
    for x, row in zip([1, 2, 3, 4], out, strict=True):
        assert isinstance(row, np.ndarray)
        np.testing.assert_array_equal(row, [x, 2 * x])
    one = s.inline(5)
    np.testing.assert_array_equal(one, [5, 10])


def test_inline_results_from_a_tensor_are_split_per_item() -> None:
    s = qs.Serving(lambda xs: torch.tensor(xs).repeat(2, 1).T, name="t", batch_size=2)
    out = s.inline_many([1, 2, 3])
    assert [r.tolist() for r in out] == [[1, 1], [2, 2], [3, 3]]
    assert all(isinstance(r, torch.Tensor) for r in out)


def test_inline_results_from_a_dict_of_arrays_are_split_into_dicts() -> None:
    def fn(xs: list[int]) -> dict[str, Any]:
        arr = np.asarray(xs)
        return {"value": arr * 2, "emb": torch.ones(len(xs), 3) * torch.tensor(xs)[:, None]}

    s = qs.Serving(fn, name="d", batch_size=2)
    out = s.inline_many([1, 2, 3])
    assert [set(r) for r in out] == [{"value", "emb"}] * 3
    assert [int(r["value"]) for r in out] == [2, 4, 6]
    assert [r["emb"].tolist() for r in out] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


def test_inline_accepts_a_tuple_of_results() -> None:
    s = qs.Serving(lambda xs: tuple(str(x) for x in xs), name="tup", batch_size=2)
    assert s.inline_many([1, 2, 3]) == ["1", "2", "3"]


@pytest.mark.parametrize(
    "returned",
    [
        lambda xs: xs[:-1],
        lambda xs: [*xs, 0],
        lambda xs: np.zeros(len(xs) + 1),
        lambda xs: {"a": np.zeros(len(xs)), "b": np.zeros(len(xs) + 1)},
        lambda xs: 42,
        lambda xs: None,
    ],
    ids=["short-list", "long-list", "array-rows", "dict-rows", "scalar", "none"],
)
def test_inline_wrong_result_count_is_an_error(returned: Any) -> None:
    s = qs.Serving(returned, name="wrong", batch_size=4)
    with pytest.raises(BatchResultError, match="'wrong'"):
        s.inline_many([1, 2, 3])


def test_inline_errors_of_the_batch_function_propagate() -> None:
    def boom(xs: list[Any]) -> list[Any]:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        qs.Serving(boom).inline(1)


def test_map_inputs_and_map_results_apply_inline_in_order() -> None:
    rec = Recorder(lambda batch: [x * x for x in batch])
    s = (
        qs.Serving(rec, name="mapped", batch_size=2)
        .map_inputs(int)
        .map_inputs(lambda x: x + 1)
        .map_results(str)
        .map_results(lambda r: r + "!")
    )
    assert s.has_client_maps
    assert s.inline_many(["1", "2", "3"]) == ["4!", "9!", "16!"]
    assert [list(b) for b in rec.batches] == [[2, 3], [4]]  # the function saw mapped items


def test_map_inputs_run_before_cost_chunking() -> None:
    rec = Recorder(lambda batch: list(batch))
    s = qs.Serving(rec, name="m", batch_size=4, cost=len).map_inputs(lambda x: x * 2)
    assert s.inline_many(["a", "b", "c"]) == ["aa", "bb", "cc"]
    assert rec.sizes == [2, 1]


def test_map_functions_return_the_serving_for_chaining() -> None:
    s = qs.Serving(square)
    assert s.map_inputs(abs) is s
    assert s.map_results(abs) is s
    assert not qs.Serving(square).has_client_maps


# -- batches -----------------------------------------------------------------------------------
def test_batch_is_a_list_with_key_and_partition() -> None:
    p = qs.Partition(index=1, device="cuda:1", count=2)
    b = qs.Batch([1, 2, 3], "len8", p)
    assert isinstance(b, list)
    assert b == [1, 2, 3]
    assert b.key == "len8"
    assert b.partition is p
    default = qs.Batch(iter([4]))
    assert default.key == "default"
    assert default.partition == qs.Partition()
    assert (default.partition.index, default.partition.device, default.partition.count) == (
        0,
        "cpu",
        1,
    )


def test_inline_batches_carry_the_static_key_and_a_cpu_partition() -> None:
    rec = Recorder()
    s = qs.Serving(rec, name="keyed", batch_size=2, batch_key="tenant-a")
    s.inline_many([1, 2, 3])
    assert [b.key for b in rec.batches] == ["tenant-a", "tenant-a"]
    assert all(isinstance(b, qs.Batch) for b in rec.batches)
    assert all(b.partition.device == "cpu" for b in rec.batches)


def test_key_for() -> None:
    s = qs.Serving(square, batch_key=lambda item: f"len{len(item)}")
    assert s.key_for("abc", None) == "len3"
    assert s.key_for("abc", "explicit") == "explicit"
    assert qs.Serving(square).key_for("x", None) == "default"
    assert qs.Serving(square, batch_key="k").key_for("x", None) == "k"
    assert qs.Serving(square, batch_key=lambda item: 7).key_for("x", None) == "7"


def test_inline_many_never_mixes_batch_keys() -> None:
    rec = Recorder()
    s = qs.Serving(
        rec, name="parity", batch_size=10, batch_key=lambda x: "even" if x % 2 == 0 else "odd"
    )
    assert s.inline_many([1, 2, 3, 4]) == [10, 20, 30, 40]
    for batch in rec.batches:
        assert {s.key_for(x, None) for x in batch} == {batch.key}


# -- durations ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("10ms", 0.01),
        ("2s", 2.0),
        ("1.5m", 90.0),
        ("1h", 3600.0),
        ("250us", 0.00025),
        ("0.1", 0.1),
        ("3", 3.0),
        (".5s", 0.5),
        ("5.", 5.0),
        ("0", 0.0),
        ("  7 ms ", 0.007),
        (4, 4.0),
        (0.5, 0.5),
        (0, 0.0),
    ],
    ids=repr,
)
def test_parse_duration(text: Any, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    assert isinstance(parse_duration(text), float)


@pytest.mark.parametrize(
    "text", ["", "ms", "abc", "10 parsecs", "1e3", "-5", "-5ms", "1,5s", "10ms10", "5 d", "1.2.3"]
)
def test_parse_duration_rejects_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="timeout"):
        parse_duration(text, what="timeout")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (-1, ValueError),
        (-0.5, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        (None, TypeError),
        (b"1s", TypeError),
    ],
    ids=repr,
)
def test_parse_duration_rejects_bad_values(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="shutdown_timeout"):
        parse_duration(value, what="shutdown_timeout")


# -- batch results -----------------------------------------------------------------------------
def test_batch_results_from_a_list() -> None:
    r = BatchResults(["a", "b", "c", "d"], 4, "s")
    assert len(r) == 4
    assert r.body(1, 2) == (RESULTS, ["b", "c"])
    assert r.as_list() == ["a", "b", "c", "d"]
    kind, body = r.body(0, 4)
    assert unbatch(kind, body) == ["a", "b", "c", "d"]


def test_batch_results_from_a_tuple() -> None:
    r = BatchResults((1, None, [2]), 3, "s")
    assert len(r) == 3
    kind, body = r.body(1, 2)
    assert kind == RESULTS
    assert unbatch(kind, body) == [None, [2]]
    assert r.as_list() == [1, None, [2]]


def test_batch_results_from_an_ndarray() -> None:
    value = np.arange(12).reshape(4, 3)
    r = BatchResults(value, 4, "s")
    assert len(r) == 4
    kind, body = r.body(1, 2)
    assert kind == BATCHED
    np.testing.assert_array_equal(body, value[1:3])
    rows = unbatch(kind, body)
    assert len(rows) == 2
    np.testing.assert_array_equal(rows[0], [3, 4, 5])
    np.testing.assert_array_equal(rows[1], [6, 7, 8])


def test_batch_results_from_a_1d_ndarray_give_scalars_per_item() -> None:
    r = BatchResults(np.array([1.5, 2.5, 3.5]), 3, "s")
    assert [float(x) for x in r.as_list()] == [1.5, 2.5, 3.5]


def test_batch_results_from_a_tensor() -> None:
    value = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    r = BatchResults(value, 3, "s")
    assert len(r) == 3
    kind, body = r.body(2, 1)
    assert kind == BATCHED
    assert body.shape == (1, 2)
    rows = unbatch(kind, body)
    assert [row.tolist() for row in rows] == [[4.0, 5.0]]
    assert [row.tolist() for row in r.as_list()] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_batch_results_from_a_dict_of_arrays_and_tensors() -> None:
    value = {"ids": np.array([10, 11, 12]), "emb": torch.ones(3, 2) * torch.arange(3)[:, None]}
    r = BatchResults(value, 3, "s")
    assert len(r) == 3
    kind, body = r.body(1, 2)
    assert kind == BATCHED
    assert set(body) == {"ids", "emb"}
    np.testing.assert_array_equal(body["ids"], [11, 12])
    assert body["emb"].tolist() == [[1.0, 1.0], [2.0, 2.0]]
    rows = unbatch(kind, body)
    assert [int(row["ids"]) for row in rows] == [11, 12]
    assert [row["emb"].tolist() for row in rows] == [[1.0, 1.0], [2.0, 2.0]]
    assert [int(row["ids"]) for row in r.as_list()] == [10, 11, 12]


def test_batch_result_slices_cover_the_batch_exactly() -> None:
    value = np.arange(10)
    r = BatchResults(value, 10, "s")
    pieces = [r.body(0, 3), r.body(3, 1), r.body(4, 6)]
    joined = [x for kind, body in pieces for x in unbatch(kind, body)]
    assert [int(x) for x in joined] == list(range(10))


@pytest.mark.parametrize(
    ("value", "size", "match"),
    [
        ([1, 2], 3, "2 results for a batch of 3"),
        ((1, 2, 3, 4), 3, "4 results for a batch of 3"),
        ([], 1, "0 results for a batch of 1"),
        (np.zeros((2, 4)), 3, "2 rows for a batch of 3"),
        (torch.zeros(4), 3, "4 rows for a batch of 3"),
        (np.float64(1.0), 1, "float64"),
        (np.array(1.0), 1, "ndarray"),
        (torch.tensor(1.0), 1, "Tensor"),
        (7, 1, "int"),
        (None, 1, "NoneType"),
        ("ab", 2, "str"),
        ({"a": np.zeros(3), "b": np.zeros(2)}, 3, "first axes"),
        ({"a": np.zeros(3), "b": [1, 2, 3]}, 3, "first axes"),
        ({"a": np.zeros(2)}, 3, "first axes"),
        ({}, 1, "dict"),
    ],
    ids=[
        "short-list",
        "long-tuple",
        "empty-list",
        "array-rows",
        "tensor-rows",
        "np-scalar",
        "0d-array",
        "0d-tensor",
        "int",
        "none",
        "str",
        "dict-mismatch",
        "dict-list",
        "dict-rows",
        "empty-dict",
    ],
)
def test_batch_results_errors(value: Any, size: int, match: str) -> None:
    with pytest.raises(BatchResultError, match=match) as info:
        BatchResults(value, size, "myserving")
    assert "'myserving'" in str(info.value)


def test_unbatch_of_an_error_free_results_body_is_a_list() -> None:
    assert unbatch(RESULTS, (1, 2)) == [1, 2]
    assert unbatch(RESULTS, [3]) == [3]
