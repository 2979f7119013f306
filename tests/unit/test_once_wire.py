"""wire/once.py alone: what an idempotency key may be, the digest that tells a retry from a
reuse, and the bounds enqueue.lua repeats (a script cannot import them)."""

from __future__ import annotations

import re

import msgpack
import pytest

from queueserve.options.serving_options import MAX_IDEMPOTENCY_TTL_S
from queueserve.wire import once as O
from tests.support.helpers import REPO

ENQUEUE = (REPO / "queueserve" / "broker" / "lua" / "enqueue.lua").read_text()


@pytest.mark.parametrize("key", ["doc-42", "é" * 100, "k" * O.MAX_KEY_BYTES, "a b:c/{d}"])
def test_keys_of_up_to_200_bytes_of_printable_text_are_taken(key: str) -> None:
    assert O.check_key(key) == key


@pytest.mark.parametrize("key", ["", "k" * (O.MAX_KEY_BYTES + 1), "é" * 101, "a\nb", 7, None, b"k"])
def test_anything_else_is_refused_saying_what_a_key_is(key: object) -> None:
    with pytest.raises(ValueError, match="idempotency_key must be a str of 1 to 200 bytes"):
        O.check_key(key)


def test_the_digest_tells_items_and_batch_keys_apart() -> None:
    digest = O.request_digest("default", b"\x91\xa1a")
    assert re.fullmatch(r"[0-9a-f]{32}", digest)
    assert digest == O.request_digest("default", b"\x91\xa1a")
    assert digest != O.request_digest("default", b"\x91\xa1b")
    assert digest != O.request_digest("other", b"\x91\xa1a")
    # the separator keeps a batch key's end from passing for the payload's start
    assert O.request_digest("ab", b"c") != O.request_digest("a", b"bc")


def test_a_key_maps_to_one_shard_whoever_computes_it() -> None:
    shards = {O.shard_of_key(f"k{i}", 3) for i in range(30)}
    assert shards == {0, 1, 2}
    assert O.shard_of_key("k1", 3) == O.shard_of_key("k1", 3)
    assert O.shard_of_key("k1", 1) == 0


def test_the_spec_is_the_ttl_then_number_digest_and_job_id_per_request() -> None:
    spec = O.once_spec(
        [(0, "P:{S}:once:a", "d" * 32, "c-1", 500), (2, "P:{S}:once:b", "e" * 32, "c-3", 500)]
    )
    assert msgpack.unpackb(spec) == [500, 1, "d" * 32, "c-1", 3, "e" * 32, "c-3"]


def test_enqueue_lua_holds_the_bounds_of_the_python_side() -> None:
    assert f"#value > {O.RECORD_MAX_BYTES} then return '?'" in ENQUEUE
    assert f"seconds <= {int(MAX_IDEMPOTENCY_TTL_S)} then" in ENQUEUE
    assert f"#digest ~= {O.DIGEST_HEX} then return '?'" in ENQUEUE
