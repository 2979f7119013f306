"""Codecs: how items and results become bytes.

The default, ``msgpack``, carries numpy arrays and torch tensors as dtype + shape + raw bytes
(msgpack extension types), so nothing from the queue is ever unpickled. ``pickle`` exists for
trusted deployments that need arbitrary objects and must be chosen explicitly: anyone who can
write to the queue can run code in a worker that unpickles.
"""

from __future__ import annotations

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
    return msgpack.ExtType(
        _EXT_NDARRAY, msgpack.packb([arr.dtype.str, arr.shape, arr.tobytes()])
    )


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
    module = type(obj).__module__
    if (module == "torch" or module.startswith("torch.")) and hasattr(obj, "untyped_storage"):
        return _encode_tensor(obj)
    raise TypeError(
        f"cannot encode {type(obj).__qualname__} with codec 'msgpack'; send str, bytes, numbers, "
        "bool, None, lists, dicts, numpy arrays or torch tensors, or choose codec='pickle'"
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _EXT_TORCH:
        try:
            import torch
        except ImportError:
            raise TypeError(
                "received a torch tensor but torch is not installed; "
                "install queueserve[torch]"
            ) from None
        dtype_name, shape, raw = msgpack.unpackb(data)
        dtype = getattr(torch, dtype_name)
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
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
        raise ValueError(
            f"unknown codec {name!r}; choose one of {sorted(CODECS)}"
        ) from None


def codec_for_tag(tag: int) -> Codec:
    try:
        return _BY_TAG[tag]
    except KeyError:
        raise ValueError(f"unknown codec tag {tag!r} in reply") from None
