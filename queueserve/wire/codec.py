"""Codecs: how items and results become bytes.

The default, ``msgpack``, carries numpy arrays and torch tensors as dtype + shape + raw bytes
(msgpack extension types), so nothing from the queue is ever unpickled. ``pickle`` exists for
trusted deployments that need arbitrary objects and must be chosen explicitly: anyone who can
write to the queue can run code in a worker that unpickles.
"""

from __future__ import annotations

import math
import pickle
import threading
from typing import Any, Final, Protocol

import msgpack
import numpy as np

_EXT_NDARRAY: Final = 1
_EXT_TORCH: Final = 2


class Codec(Protocol):
    name: str
    tag: int  # first byte of every reply, so a client can decode without asking the worker

    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes | memoryview) -> Any: ...


def _encode_ndarray(arr: np.ndarray[Any, Any]) -> msgpack.ExtType:
    if arr.dtype.hasobject:
        raise TypeError(
            "cannot encode a numpy array of dtype object with codec 'msgpack'; "
            "use a numeric dtype, lists, or codec='pickle'"
        )
    if not arr.flags.c_contiguous:  # np.ascontiguousarray would also make 0-d arrays 1-d
        arr = arr.copy(order="C")
    return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([arr.dtype.str, arr.shape, arr.tobytes()]))


def _encode_tensor(tensor: Any) -> msgpack.ExtType:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype_name = str(t.dtype).removeprefix("torch.")
    # Viewing as bytes also covers dtypes numpy lacks (bfloat16).
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return msgpack.ExtType(_EXT_TORCH, msgpack.packb([dtype_name, list(t.shape), data]))


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _encode_ndarray(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, int):  # msgpack hands back only the ints it could not pack
        raise TypeError(_int_message(obj))
    module = type(obj).__module__
    if (module == "torch" or module.startswith("torch.")) and hasattr(obj, "untyped_storage"):
        return _encode_tensor(obj)
    raise TypeError(
        f"cannot encode {type(obj).__qualname__} with codec 'msgpack'; send str, bytes, numbers, "
        "bool, None, lists, dicts, numpy arrays or torch tensors, or choose codec='pickle'"
    )


def _int_message(value: int) -> str:
    # str() of a huge int is slow and, past 4300 digits, refused: show its size instead.
    shown = str(value) if value.bit_length() <= 128 else f"of {value.bit_length()} bits"
    return (
        f"cannot encode int {shown} with codec 'msgpack': it exceeds 64 bits (msgpack integers "
        "range from -2**63 to 2**64-1); send it as a str (str(n)) or bytes, or choose "
        "codec='pickle'"
    )


def _array_header(data: bytes, what: str) -> tuple[str, tuple[int, ...], bytes]:
    """dtype name, shape and body of an encoded array, checked before anything is allocated:
    the header comes from whoever wrote the bytes, so a 25-byte message must not be able to
    describe a 4 GiB array."""
    header = msgpack.unpackb(data)
    if not (isinstance(header, list) and len(header) == 3):
        raise ValueError(f"malformed {what}: expected [dtype, shape, bytes], got {header!r:.100}")
    dtype, shape, raw = header
    if not (
        isinstance(dtype, str)
        and isinstance(raw, bytes)
        and isinstance(shape, list | tuple)
        and len(shape) <= 64
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ValueError(f"malformed {what} header: dtype {dtype!r:.40}, shape {shape!r:.100}")
    return dtype, tuple(shape), raw


def _check_body(what: str, shape: tuple[int, ...], itemsize: int, raw: bytes) -> None:
    expected = math.prod(shape) * itemsize
    if expected != len(raw):
        raise ValueError(
            f"malformed {what}: shape {list(shape)} of {itemsize}-byte elements needs "
            f"{expected} bytes, the message carries {len(raw)}"
        )


def _decode_ndarray(data: bytes) -> np.ndarray[Any, Any]:
    name, shape, raw = _array_header(data, "numpy array")
    try:
        dtype = np.dtype(name)
    except Exception:  # numpy parses dtype strings with several error types
        raise ValueError(f"malformed numpy array: unknown dtype {name!r:.40}") from None
    if dtype.hasobject:  # object arrays would unpickle: never from the queue
        raise ValueError(f"numpy arrays of dtype {name!r} cannot be decoded with codec 'msgpack'")
    _check_body("numpy array", shape, dtype.itemsize, raw)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _decode_tensor(data: bytes) -> Any:
    try:
        import torch
    except ImportError:
        raise TypeError(
            "received a torch tensor but torch is not installed; install queueserve[torch]"
        ) from None
    name, shape, raw = _array_header(data, "torch tensor")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"malformed torch tensor: unknown dtype {name!r:.40}")
    _check_body("torch tensor", shape, dtype.itemsize, raw)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY:
        return _decode_ndarray(data)
    if code == _EXT_TORCH:
        return _decode_tensor(data)
    return msgpack.ExtType(code, data)


class _Packers(threading.local):
    """One msgpack Packer per thread: packb() builds a new one (and its buffer) per call,
    which on the per-item path costs more than the packing."""

    def __init__(self) -> None:
        self.with_default = msgpack.Packer(default=_default, use_bin_type=True)
        self.plain = msgpack.Packer(use_bin_type=True)


_packers = _Packers()


def pack_plain(obj: Any) -> bytes:
    """msgpack of builtin types only (headers), with this thread's packer."""
    data: bytes = _packers.plain.pack(obj)
    return data


class MsgpackCodec:
    name = "msgpack"
    tag = ord("m")

    def dumps(self, obj: Any) -> bytes:
        data: bytes = _packers.with_default.pack(obj)
        return data

    def loads(self, data: bytes | memoryview) -> Any:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


class PickleCodec:
    name = "pickle"
    tag = ord("p")

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes | memoryview) -> Any:
        return pickle.loads(data)


CODECS: Final[dict[str, Codec]] = {"msgpack": MsgpackCodec(), "pickle": PickleCodec()}
_BY_TAG: Final[dict[int, Codec]] = {c.tag: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}") from None


def codec_for_tag(tag: int) -> Codec:
    try:
        return _BY_TAG[tag]
    except KeyError:
        raise ValueError(f"unknown codec tag {tag!r} in reply") from None


def loads_tagged(message: bytes, accepted: set[int], what: str) -> Any:
    """A reply or event message (a codec tag byte, then the codec's encoding), decoded only
    with a codec the reader accepts: a client that never chose pickle never unpickles what
    someone pushed into its inbox."""
    if message[0] not in accepted:
        raise ValueError(f"{what} uses codec tag {message[0]!r}, which this client never sent")
    return codec_for_tag(message[0]).loads(memoryview(message)[1:])
