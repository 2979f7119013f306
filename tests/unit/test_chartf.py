"""The character transformer's steps over its paged KV cache, without Redis (tasks/chartf.py):
a continuous schedule (joins between steps, as the executor makes them) gives each request's
text alone; a pool too small for the load preempts and recomputes without losing or repeating
a step; cached prefixes are shared; blocks always come back."""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest

# The dev install includes torch: a broken one fails here, it is not skipped.
import torch

import queueserve as qs
from queueserve.worker.stepping.prefix_cache import PrefixCache
from tasks.chartf import CharTF, State, _attend, _attend_plain

PROMPTS = [
    "Return the ",
    "This module ",
    "Raise ValueError if ",
    "Open a file and ",
    "The socket ",
    "If *strict* is true, ",
    "A list of ",
    "Set the ",
]


def serving(**options: Any) -> CharTF:
    lm = CharTF(prefix_cache_bytes=0, **options)
    lm.setup(qs.Partition())
    return lm


def items(count: int, seed: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_new": rng.randint(5, 90),
            "temperature": 0.8 * (i % 2),
            "seed": i,
        }
        for i in range(count)
    ]


def continuous(
    lm: CharTF, work: list[dict[str, Any]], slots: int, cache: PrefixCache | None = None
) -> tuple[list[list[str]], int]:
    """Run ``work`` as the executor does: a request joins when a slot frees, between steps,
    every step's outputs kept. (outputs per item, steps taken)."""
    outputs: list[list[str]] = [[] for _ in work]
    waiting = list(range(len(work)))
    running: list[tuple[int, State]] = []
    steps = 0
    while waiting or running:
        joining, waiting = waiting[: slots - len(running)], waiting[slots - len(running) :]
        resumes = [resume(lm, cache, work[i]) for i in joining]
        states = lm.prefill_from([work[i] for i in joining], resumes)
        offered(cache, resumes)
        running += zip(joining, states, strict=True)
        outs = lm.decode([s for _, s in running])
        offered(cache, [s.resume for _, s in running])
        steps += 1
        for (i, _), out in zip(running, outs, strict=True):
            if out is not qs.END and out is not qs.NO_OUTPUT:
                outputs[i].append(out)
        running = [r for r, out in zip(running, outs, strict=True) if out is not qs.END]
    return outputs, steps


def resume(lm: CharTF, cache: PrefixCache | None, item: dict[str, Any]) -> qs.Resume:
    if cache is None:
        return qs.Resume(())
    tokens = tuple(lm.prompt_tokens(item))
    start, state = cache.lookup(tokens)
    return qs.Resume(tokens, start, state)


def offered(cache: PrefixCache | None, resumes: list[qs.Resume]) -> None:
    for r in resumes:
        for length, state, nbytes in r.kept:
            assert cache is not None
            cache.put(r.tokens, length, state, nbytes)
        r.kept.clear()


@pytest.fixture(scope="module")
def alone() -> list[list[str]]:
    lm = serving()
    return [lm.inline(item) for item in items(12)]


def test_joining_between_steps_gives_each_request_its_text_alone(alone: list[list[str]]) -> None:
    """Greedy and seeded sampling, batched with whatever runs beside them. Tolerance: exact
    characters (batched and one-row float kernels could differ in the last bits only at an
    exact tie of two logits; none occurs here)."""
    lm = serving()
    outputs, _ = continuous(lm, items(12), slots=4)
    assert outputs == alone
    assert lm.stats.preempted == 0
    assert lm.pool.free == lm.pool.blocks


def test_a_pool_too_small_for_the_load_preempts_and_recomputes_losing_nothing(
    alone: list[list[str]],
) -> None:
    # Given a pool of 24 blocks (384 positions) for 6 slots of sequences up to 110 positions
    lm = serving(kv_blocks=24)
    # When they run continuously
    outputs, _ = continuous(lm, items(12), slots=6)
    # Then sequences were preempted and recomputed, and each request's steps are its text
    # alone: none lost, none shown twice
    assert lm.stats.preempted > 0 and lm.stats.recomputed == lm.stats.preempted
    assert outputs == alone
    # and every block is back
    assert lm.pool.free == lm.pool.blocks


def test_what_runs_never_holds_more_blocks_than_the_pool() -> None:
    lm = serving(kv_blocks=18)
    work = items(10)
    states = lm.prefill(work)
    held = []
    while True:
        outs = lm.decode(states)
        held.append(lm.pool.used)
        if all(o is qs.END for o in outs):
            break
    assert max(held) <= lm.pool.blocks and lm.stats.preempted > 0
    assert lm.pool.free == lm.pool.blocks


def test_a_sequence_waits_for_free_blocks_answering_no_output_then_runs() -> None:
    # Given a pool of 17 blocks, 13 of them taken by a 200-character prompt
    lm = serving(kv_blocks=17)
    long, short = lm.prefill(
        [{"prompt": "x" * 200, "max_new": 20}, {"prompt": "y" * 60, "max_new": 5}]
    )
    # Then a 60-character prompt (4 blocks, and the watermark's 1 kept free) waits in line
    assert long.table is not None and short.table is None
    outs = lm.decode([long, short])
    assert isinstance(outs[0], str) and outs[1] is qs.NO_OUTPUT
    # and starts once the first has finished and given its blocks back
    texts: list[list[str]] = [[outs[0]], []]
    while not all(o is qs.END for o in outs):
        outs = lm.decode([long, short])
        for text, out in zip(texts, outs, strict=True):
            if isinstance(out, str):
                text.append(out)
    assert [len(t) for t in texts] == [20, 5]
    assert lm.pool.free == lm.pool.blocks


def test_prefix_sharing_computes_only_what_follows_the_cached_blocks() -> None:
    shared = "Return a list of the names of the attributes of the object, sorted. "
    work = [{"prompt": shared + q, "max_new": 20} for q in ("If ", "The ", "Raise ", "A")]
    cold = serving()
    expected = [cold.inline(item) for item in work]
    lm = CharTF(prefix_cache_bytes=4 << 20)
    lm.setup(qs.Partition())
    cache = PrefixCache(lm.prefix_cache_bytes)
    # When they come one after another, each offering its prompt's blocks to the cache
    got = [continuous(lm, [item], slots=1, cache=cache)[0][0] for item in work]
    # Then each is the cold run's text, and each later one computed only what follows the
    # shared prompt's last full block
    assert got == expected
    cached = len(shared) // lm.block_size * lm.block_size
    prompts = sum(len(item["prompt"]) - 1 for item in work)
    assert lm.stats.shared == cached * (len(work) - 1)
    assert lm.stats.computed == prompts - cached * (len(work) - 1)


def test_the_same_prompt_again_shares_its_partial_last_block_and_copies_it_on_write() -> None:
    lm = CharTF(prefix_cache_bytes=4 << 20)
    lm.setup(qs.Partition())
    cache = PrefixCache(lm.prefix_cache_bytes)
    item = {"prompt": "Open the file named by path and ", "max_new": 30}  # 31 cached: 2 blocks
    first = continuous(lm, [item], slots=1, cache=cache)[0]
    computed = lm.stats.computed
    second = continuous(lm, [item], slots=1, cache=cache)[0]
    assert second == first
    assert lm.stats.computed == computed  # the whole prompt was shared
    assert lm.stats.shared == len(item["prompt"]) - 1
    # the partial block was copied by each sequence's first write into it (the first one's
    # too: its own last block was shared with the cache from the moment it was offered)
    assert lm.pool.copies == 2


def test_cached_blocks_and_dropped_sequences_give_their_blocks_back() -> None:
    lm = CharTF(prefix_cache_bytes=4 << 20)
    lm.setup(qs.Partition())
    cache = PrefixCache(lm.prefix_cache_bytes)
    continuous(lm, items(4), slots=4, cache=cache)
    assert lm.pool.free < lm.pool.blocks  # the cache holds prompt blocks
    # A sequence dropped mid-generation (the executor drops a cancelled request's states)
    states = lm.prefill(items(2))
    lm.decode(states)
    del states
    del cache
    gc.collect()
    assert lm.pool.free == lm.pool.blocks


def test_a_request_beyond_the_context_is_refused_with_what_to_do() -> None:
    lm = serving()
    with pytest.raises(ValueError, match="more than the model's context of 256"):
        lm.tokens({"prompt": "x" * 200, "max_new": 100})
    assert lm.tokens({"prompt": "x" * 200, "max_new": 57}) == (200, 57)


def test_the_pool_is_sized_by_bytes_and_must_hold_a_context_beside_the_cache() -> None:
    lm = serving(kv_cache_bytes=10 << 20)
    assert lm.pool.blocks == (10 << 20) // lm.block_bytes
    with pytest.raises(ValueError, match="cannot hold one whole context"):
        CharTF(kv_blocks=20, prefix_cache_bytes=lm.block_bytes * 10).setup(qs.Partition())


def test_the_plain_attention_cuda_runs_equals_the_fused_one() -> None:
    """CUDA runs the attention as matmuls and a softmax (the fused kernels' mask rules vary
    with torch versions); on this CPU both run: they agree to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 32, generator=gen)
    keys, values = torch.randn(2, 3, 50, 4, 32, generator=gen)
    seen = (torch.arange(50)[None] <= torch.tensor([10, 30, 49])[:, None])[:, None, None, :]
    fused = _attend(q, keys, values, seen, 0.17)
    assert torch.allclose(_attend_plain(q, keys, values, seen, 0.17), fused, atol=1e-5)
    # and a prompt's positions, each seeing itself and those before it
    q = torch.randn(1, 4, 7, 32, generator=gen)
    keys, values = torch.randn(2, 1, 20, 4, 32, generator=gen)
    seen = (torch.arange(20)[None, :] <= torch.arange(13, 20)[:, None])[None, None]
    fused = _attend(q, keys, values, seen, 0.17)
    assert torch.allclose(_attend_plain(q, keys, values, seen, 0.17), fused, atol=1e-5)
