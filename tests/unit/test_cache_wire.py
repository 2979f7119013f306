"""wire/cache.py against its documented format: the digest (BLAKE2b-128 of version, batch key
and payload, zero bytes between), the value a worker writes and what a client takes from
enqueue.lua's answer, the stats a reader takes, and enqueue.lua's lookup spec."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest

from queueserve.options.serving_options import ServingOptions
from queueserve.wire import cache as C
from queueserve.wire.codec import MsgpackCodec, PickleCodec
from queueserve.wire.kinds import BATCHED, ERROR, RESULTS


def test_the_digest_is_the_documented_blake2b_of_version_key_and_payload() -> None:
    payload = msgpack.packb(["a"])
    expected = hashlib.blake2b(b"v1\0default\0" + payload, digest_size=16).digest()
    assert C.digest("v1", "default", payload) == expected
    assert len({C.digest(v, k, p) for v, k, p in [("v1", "k", b"x"), ("v2", "k", b"x"),
                                                  ("v1", "k2", b"x"), ("v1", "k", b"y"),
                                                  ("v1k", "", b"x")]}) == 5  # fmt: skip


def test_a_value_answers_with_the_result_it_was_written_with() -> None:
    codec = MsgpackCodec()
    digest = C.digest("", "default", b"p")
    for kind, body, want in [
        (RESULTS, ["r:a"], "r:a"),
        (BATCHED, np.arange(3, dtype=np.float32).reshape(1, 3), None),
    ]:
        value = C.value(digest, codec, kind, body)
        assert value[:16] == digest and value[16] == codec.tag
        got_kind, values = C.answer(value[16:], {codec.tag})
        assert got_kind == kind and len(values) == 1
        if want is not None:
            assert values == [want]
        else:
            assert np.array_equal(values[0], np.arange(3, dtype=np.float32))


@pytest.mark.parametrize(
    ("tail", "why"),
    [
        (b"", "codec"),
        (bytes((PickleCodec().tag,)) + b"anything", "codec"),  # never unpickled
        (b"m\xc1", "decode"),
        (b"m" + msgpack.packb([ERROR, ["x"]]), "result"),
        (b"m" + msgpack.packb([RESULTS, ["a", "b"]]), "2 results"),
        (b"m" + msgpack.packb({"kind": 0}), "result"),
    ],
)
def test_a_value_no_worker_writes_is_refused_with_why(tail: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        C.answer(tail, {MsgpackCodec.tag})


def test_stats_take_decimal_counts_only() -> None:
    raw = {b"hits": b"12", b"misses": b"x", "bytes": "7", b"fuzz": b"1", b"stored": b"-3"}
    assert C.stats(raw) == {"hits": 12, "misses": 0, "stored": 0, "bytes": 7, "too_big": 0}


def test_the_lookup_spec_carries_digests_as_msgpack_str_for_redis_cmsgpack() -> None:
    digest = bytes(range(16))
    spec = C.lookup_spec([(1, digest), (3, digest)])
    assert spec[0] == 0x94 and spec[2] == 0xB0  # a fixarray of 4; a fixstr of 16, not bin
    assert msgpack.unpackb(spec, raw=True) == [1, digest, 3, digest]


def test_cache_version_is_bounded_text() -> None:
    assert ServingOptions(cache_version="minilm@2").cache_version == "minilm@2"
    for bad in ("x" * 201, "a\nb", 3):
        with pytest.raises(ValueError, match="cache_version"):
            ServingOptions(cache_version=bad)
