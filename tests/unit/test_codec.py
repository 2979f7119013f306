"""Codecs (docs/design.md §6): msgpack carries arrays and tensors without pickle; pickle is
opt-in."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from queueserve.wire.codec import CODECS, codec_for_tag, get_codec

MSGPACK = get_codec("msgpack")
PICKLE = get_codec("pickle")


def roundtrip(obj: Any) -> Any:
    data = MSGPACK.dumps(obj)
    assert isinstance(data, bytes)
    return MSGPACK.loads(data)


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling while this fixture is active fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used to decode a msgpack payload")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


# -- plain values ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        0,
        -(2**63),
        2**64 - 1,
        1.5,
        True,
        None,
        "",
        "héllo ✓",
        b"",
        b"\x00\xff raw",
        [],
        [1, "two", b"three", None, [4, [5, [6]]]],
        {"a": 1, "b": [1, 2], "c": {"d": None}},
        {1: "one", 2: {3: [b"x"]}, -7: "neg"},
    ],
    ids=repr,
)
def test_msgpack_round_trips_plain_values(value: Any) -> None:
    assert roundtrip(value) == value
    assert type(roundtrip(value)) is type(value)


def test_msgpack_keeps_str_and_bytes_apart() -> None:
    out = roundtrip(["abc", b"abc"])
    assert out == ["abc", b"abc"]
    assert type(out[0]) is str
    assert type(out[1]) is bytes


def test_msgpack_turns_tuples_into_lists() -> None:
    assert roundtrip((1, (2, 3))) == [1, [2, 3]]


# -- numpy -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(24, dtype=np.float64).reshape(2, 3, 4),
        np.arange(5, dtype=np.int8),
        np.arange(5, dtype=np.uint16),
        np.arange(5, dtype=np.int64) - 2,
        np.array([1.5, -2.25], dtype=np.float16),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.array([True, False, True]),
        np.array([1, 2, 3], dtype=">i4"),  # non-native byte order survives
        np.array(["ab", "c"]),
        np.array(["2020-01-01", "2024-02-29"], dtype="datetime64[D]"),
        np.zeros((0,), dtype=np.float32),
        np.zeros((0, 3), dtype=np.int32),
        np.zeros((2, 0, 4), dtype=np.uint8),
    ],
    ids=lambda a: f"{a.dtype.str}-{a.shape}",
)
def test_msgpack_round_trips_numpy_arrays(arr: np.ndarray[Any, Any]) -> None:
    out = roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_decoded_numpy_arrays_are_writable_copies() -> None:
    out = roundtrip(np.arange(4, dtype=np.float32))
    assert out.flags.writeable
    out[0] = 42.0  # would raise on a read-only view of the message bytes


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_msgpack_round_trips_zero_dim_numpy_arrays(dtype: Any) -> None:
    arr = np.array(1, dtype=dtype)
    out = roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.shape == ()
    assert out.dtype == arr.dtype
    assert out == arr


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float64).reshape(3, 4).T,
        np.arange(20, dtype=np.int32)[::3],
        np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2, 1:],
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    ],
    ids=["transposed", "strided", "sliced-3d", "fortran"],
)
def test_msgpack_round_trips_non_contiguous_numpy_arrays(arr: np.ndarray[Any, Any]) -> None:
    assert not arr.flags.c_contiguous
    out = roundtrip(arr)
    assert out.shape == arr.shape
    assert out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)


def test_numpy_arrays_nested_in_containers() -> None:
    value = {"emb": np.ones((2, 3), dtype=np.float32), 7: [np.arange(3), "x"]}
    out = roundtrip(value)
    np.testing.assert_array_equal(out["emb"], value["emb"])
    np.testing.assert_array_equal(out[7][0], np.arange(3))
    assert out[7][1] == "x"


@pytest.mark.parametrize(
    ("scalar", "expected"),
    [
        (np.int64(7), 7),
        (np.int8(-3), -3),
        (np.uint32(4_000_000_000), 4_000_000_000),
        (np.float32(1.5), 1.5),
        (np.float64(2.25), 2.25),
        (np.bool_(True), True),
        (np.str_("s"), "s"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_numpy_scalars_become_python_scalars(scalar: Any, expected: Any) -> None:
    out = roundtrip(scalar)
    assert out == expected
    assert type(out) is type(expected)
    assert not isinstance(out, np.generic)


# -- torch -------------------------------------------------------------------------------------
def _assert_same_tensor(out: Any, t: torch.Tensor) -> None:
    assert isinstance(out, torch.Tensor)
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert torch.equal(out, t.detach())


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(6, dtype=torch.float64),
        torch.tensor([1.5, -2.0, 0.25], dtype=torch.float16),
        torch.tensor([[1.5, -2.0], [3.0, 1e30]], dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int8) - 2,
        torch.arange(5, dtype=torch.uint8),
        torch.arange(5, dtype=torch.int64) * 2**40,
        torch.tensor([1 + 2j], dtype=torch.complex64),
        torch.tensor(3.5),
        torch.tensor(7, dtype=torch.int32),
        torch.tensor(True),
        torch.tensor(2.0, dtype=torch.bfloat16),
        torch.zeros(0),
        torch.zeros(0, 3, dtype=torch.float16),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_msgpack_round_trips_torch_tensors(t: torch.Tensor) -> None:
    _assert_same_tensor(roundtrip(t), t)


def test_msgpack_round_trips_non_contiguous_tensors() -> None:
    transposed = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    strided = torch.arange(20, dtype=torch.int16)[::3]
    half_t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).T
    for t in (transposed, strided, half_t):
        assert not t.is_contiguous()
        _assert_same_tensor(roundtrip(t), t)


def test_tensors_requiring_grad_travel_as_plain_data() -> None:
    t = torch.ones(2, 3, requires_grad=True) * 2  # a non-leaf with a grad_fn
    out = roundtrip(t)
    _assert_same_tensor(out, t)
    assert not out.requires_grad
    assert out.grad_fn is None


def test_decoded_tensors_are_writable() -> None:
    out = roundtrip(torch.arange(3, dtype=torch.float32))
    out[0] = 5.0
    assert out.tolist() == [5.0, 1.0, 2.0]


def test_msgpack_encodes_torch_parameters() -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    out = roundtrip(p)
    _assert_same_tensor(out, p)


def test_tensors_and_arrays_in_one_message() -> None:
    value = [torch.ones(2, dtype=torch.bfloat16), np.zeros(3, dtype=np.uint8), {"n": 1}]
    out = roundtrip(value)
    _assert_same_tensor(out[0], value[0])
    np.testing.assert_array_equal(out[1], value[1])
    assert out[2] == {"n": 1}


# -- what msgpack refuses ----------------------------------------------------------------------
class Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [
        Opaque(),
        [1, {"nested": Opaque()}],
        {1, 2},
        np.array([1, "a", None], dtype=object),
        np.zeros(3, dtype=[("a", "O"), ("b", "i4")]),
        object(),
    ],
    ids=["object", "nested-object", "set", "object-array", "struct-with-object", "bare-object"],
)
def test_msgpack_refuses_arbitrary_objects_and_points_to_pickle(value: Any) -> None:
    with pytest.raises(TypeError, match="pickle"):
        MSGPACK.dumps(value)


def test_refusal_names_the_offending_type() -> None:
    with pytest.raises(TypeError, match="Opaque"):
        MSGPACK.dumps(Opaque())
    with pytest.raises(TypeError, match="dtype object"):
        MSGPACK.dumps(np.array([Opaque()], dtype=object))


# -- no pickle on the msgpack path -------------------------------------------------------------
SAMPLES: list[Any] = [
    [1, "x", b"y", None],
    {"arr": np.arange(6, dtype=np.float32).reshape(2, 3).T, 3: np.array(["a"])},
    [torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor(True), torch.zeros(0, 2)],
    [np.int64(3), np.float32(0.5), np.bool_(False)],
]


@pytest.mark.parametrize("value", SAMPLES, ids=["plain", "numpy", "torch", "numpy-scalars"])
def test_msgpack_bytes_hold_no_pickle(value: Any, no_unpickling: None) -> None:
    data = MSGPACK.dumps(value)
    for opcode in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        assert not data.startswith(opcode)
    # Every extension payload is itself plain msgpack: [dtype, shape, raw bytes].
    exts: list[msgpack.ExtType] = []

    def collect(code: int, payload: bytes) -> msgpack.ExtType:
        exts.append(msgpack.ExtType(code, payload))
        return msgpack.ExtType(code, payload)

    msgpack.unpackb(data, ext_hook=collect, strict_map_key=False)
    for ext in exts:
        dtype, shape, raw = msgpack.unpackb(ext.data)
        assert isinstance(dtype, str)
        assert isinstance(shape, list)
        assert isinstance(raw, bytes)
        assert "O" not in dtype
    MSGPACK.loads(data)  # decoding calls no pickle function (the fixture would raise)


def test_msgpack_decodes_from_memoryview_without_pickle(no_unpickling: None) -> None:
    data = MSGPACK.dumps([np.arange(3), torch.arange(2)])
    out = MSGPACK.loads(memoryview(data))
    np.testing.assert_array_equal(out[0], np.arange(3))
    assert out[1].tolist() == [0, 1]


def test_msgpack_refuses_a_pickle_payload(no_unpickling: None) -> None:
    evil = pickle.dumps(Opaque())
    with pytest.raises(Exception) as info:
        MSGPACK.loads(evil)
    assert not isinstance(info.value, AssertionError)


def test_msgpack_refuses_object_dtype_smuggled_in_an_extension(no_unpickling: None) -> None:
    """A hand-written array extension claiming dtype object must not produce objects."""
    forged = msgpack.packb(
        msgpack.ExtType(1, msgpack.packb(["|O", [1], b"\x00" * 8])), use_bin_type=True
    )
    with pytest.raises(Exception) as info:
        MSGPACK.loads(forged)
    assert not isinstance(info.value, AssertionError)


def test_unknown_extension_types_come_back_untouched() -> None:
    data = msgpack.packb(msgpack.ExtType(42, b"abc"))
    assert MSGPACK.loads(data) == msgpack.ExtType(42, b"abc")


# -- pickle, only when chosen ------------------------------------------------------------------
class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]


def test_pickle_codec_round_trips_arbitrary_objects() -> None:
    value = [Point(1, 2), {3, 4}, np.array([Point(0, 0)], dtype=object), (1, 2)]
    out = PICKLE.loads(PICKLE.dumps(value))
    assert out[0] == Point(1, 2)
    assert out[1] == {3, 4}
    assert out[2].dtype == object and out[2][0] == Point(0, 0)
    assert out[3] == (1, 2)


def test_pickle_codec_round_trips_tensors() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert torch.equal(PICKLE.loads(PICKLE.dumps(t)), t)


def test_msgpack_is_the_default_codec_of_a_serving() -> None:
    import queueserve as qs

    s = qs.Serving(lambda b: b, name="default-codec")
    assert s.codec == "msgpack"
    assert qs.Serving(lambda b: b, name="p", codec="pickle").codec == "pickle"


def test_codecs_have_distinct_tags_and_are_found_by_them() -> None:
    assert {c.name for c in CODECS.values()} == {"msgpack", "pickle"}
    assert MSGPACK.tag != PICKLE.tag
    assert codec_for_tag(MSGPACK.tag) is MSGPACK
    assert codec_for_tag(PICKLE.tag) is PICKLE
    with pytest.raises(ValueError, match="unknown codec tag"):
        codec_for_tag(0)


@pytest.mark.parametrize("name", ["json", "", "Pickle", "MSGPACK"])
def test_unknown_codec_names_list_the_valid_ones(name: str) -> None:
    with pytest.raises(ValueError, match="unknown codec") as info:
        get_codec(name)
    assert "msgpack" in str(info.value)
    assert "pickle" in str(info.value)


def test_serving_with_unknown_codec_is_refused() -> None:
    import queueserve as qs

    with pytest.raises(ValueError, match="msgpack"):
        qs.Serving(lambda b: b, name="c", codec="json")
