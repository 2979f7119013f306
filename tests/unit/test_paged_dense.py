"""The paged KV serving against the dense reference of the same weights.

tasks/chartf.py serves the character transformer over a paged KV cache (tasks/paged_kv.py):
prompts prefilled into blocks, decode steps that gather each row's blocks and mask what a row
may not see, admission, preemption and recompute. The reference is
``CharTransformer.forward`` (tasks/chartf_model.py) of the same weights: every sequence whole,
causal attention by ``is_causal``, no cache, no blocks, no masks of the serving's making.
Comparing the serving with itself run alone (tests/unit/test_chartf.py) cannot catch an
error in the paged code both runs share (a decode mask of ``<`` for ``<=`` passed it).

Checked at every step a sequence emits: its logits within ATOL of the dense forward's at the
same position; its greedy tokens exactly the dense greedy decoding's, and its sampled ones
exactly those that the same sampling (softmax at the temperature, ``torch.multinomial`` on a
generator seeded with the request's seed) draws from the dense logits. Several requests run
batched, of different lengths, joining and leaving (finished, or dropped as a cancelled one
is) between steps, and in a pool small enough to preempt and recompute.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import pytest

# The dev install includes torch: a broken one fails here, it is not skipped.
import torch

import queueserve as qs
from tasks.charlm import NEWLINE
from tasks.charlm_model import VOCAB, encode
from tasks.chartf import CharTF, State
from tasks.chartf_model import CharTransformer, load

BLOCK = 8  # small blocks: sequences span several, and a step's rows fall in several groups
# Paged and dense logits differ by float32 rounding of another order of sums: 5e-6 measured
# at logits up to 9. Greedy steps must lead by more than 2 * ATOL, so that no difference
# within ATOL could change the argmax (checked: the smallest lead here is 1e-3).
ATOL = 1e-4

WORK: list[dict[str, Any]] = [
    {"prompt": "Re", "max_new": 14, "temperature": 0.0},
    {"prompt": "The socket is closed when ", "max_new": 10, "temperature": 0.8, "seed": 1},
    {"prompt": "Return a list of the names of the attributes of ", "max_new": 16},
    {"prompt": "x", "max_new": 6, "temperature": 0.8, "seed": 2},  # decodes from position 0
    {"prompt": "If *strict* is true, raise ValueError when the ", "max_new": 12, "seed": 3},
    {"prompt": "Open the file ", "max_new": 20, "temperature": 1.2, "seed": 4},
    {"prompt": "A", "max_new": 9, "stop": " "},
    {"prompt": "Set the value of the option named by key, and return the ", "max_new": 8},
]
for item in WORK:
    item.setdefault("temperature", 0.0)


@pytest.fixture(scope="module")
def dense() -> CharTransformer:
    return load()  # the weights the serving loads


def serving(**options: Any) -> CharTF:
    lm = CharTF(prefix_cache_bytes=0, block_size=BLOCK, **options)
    lm.setup(qs.Partition())
    return lm


# --- the dense reference ---------------------------------------------------------------------
def ids_of(prompt: str) -> list[int]:
    return encode(prompt) or [NEWLINE]


@torch.inference_mode()
def dense_logits(model: CharTransformer, tokens: list[int]) -> torch.Tensor:
    """The dense forward's logits at every position of ``tokens``: (positions, vocab)."""
    return model(torch.tensor([tokens]))[0]


@torch.inference_mode()
def dense_generate(model: CharTransformer, item: dict[str, Any]) -> str:
    """``item``'s text by the dense forward over the whole sequence at every step, picking
    greedily at temperature 0, else drawing from its softmax at the temperature with a
    generator seeded with ``seed``; it ends after ``max_new`` characters, or when the text
    ends with ``stop``."""
    tokens = ids_of(item["prompt"])
    temperature = item["temperature"]
    rng = torch.Generator().manual_seed(item.get("seed", 0)) if temperature > 0 else None
    text = ""
    stop = item.get("stop")
    while len(text) < item["max_new"] and not (stop and text.endswith(stop)):
        logits = dense_logits(model, tokens)[-1]
        if rng is None:
            pick = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            pick = int(torch.multinomial(probs, 1, generator=rng))
        tokens.append(pick)
        text += VOCAB[pick]
    return text


# --- the paged serving, watched --------------------------------------------------------------
@dataclass
class Run:
    """What the serving did: each request's text, and every logits row a decode step
    computed, by request (the tokens its row was the next of, and the row)."""

    texts: list[str]
    rows: dict[int, list[tuple[list[int], torch.Tensor]]] = field(default_factory=dict)
    steps: list[list[int]] = field(default_factory=list)  # each decode step's rows' lengths
    preempted: dict[int, int] = field(default_factory=dict)  # request -> times preempted


def run(
    lm: CharTF,
    joins: dict[int, list[int]],
    drops: dict[int, list[int]] | None = None,
) -> Run:
    """WORK through ``lm`` as the executor schedules it: the requests ``joins[k]`` are
    prefilled before step ``k`` (beside those running), the requests ``drops[k]`` are dropped
    before it (as a cancelled one is: its state let go), each step's outputs kept."""
    drops = drops or {}
    result = Run([""] * len(WORK))
    index: dict[int, int] = {}  # State.serial -> request
    forward = lm._forward

    def watched(seqs: list[State]) -> torch.Tensor:
        logits = forward(seqs)
        result.steps.append([len(s.tokens) for s in seqs])
        for s, row in zip(seqs, logits, strict=True):
            result.rows.setdefault(index[s.serial], []).append((list(s.tokens), row.clone()))
        return logits

    lm._forward = watched  # type: ignore[method-assign]
    running: list[tuple[int, State]] = []
    everyone: list[State] = []
    step = 0
    while running or any(k >= step for k in joins):
        gone = set(drops.get(step, []))
        running = [(i, s) for i, s in running if i not in gone]
        joining = joins.get(step, [])
        for i, s in zip(joining, lm.prefill([WORK[i] for i in joining]), strict=True):
            index[s.serial] = i
            running.append((i, s))
            everyone.append(s)
        outs = lm.decode([s for _, s in running]) if running else []
        for (i, _), out in zip(running, outs, strict=True):
            if isinstance(out, str):
                result.texts[i] += out
        running = [r for r, out in zip(running, outs, strict=True) if out is not qs.END]
        step += 1
    result.preempted = {index[s.serial]: s.preempted for s in everyone if s.preempted}
    del running, everyone
    gc.collect()  # a dropped request's blocks come back when its state is let go
    assert lm.pool.free == lm.pool.blocks
    return result


def assert_equals_dense(
    model: CharTransformer, got: Run, dropped: frozenset[int] = frozenset()
) -> None:
    for i, item in enumerate(WORK):
        expected = dense_generate(model, item)
        text = got.texts[i]
        # Tokens: exactly the dense decoding's (a dropped request: its first ones)
        if i in dropped:
            assert 0 < len(text) < len(expected) and expected.startswith(text), (i, text)
        else:
            assert text == expected, (i, item, text, expected)
        # Logits: at every step that emitted a character, the dense forward's at that position
        rows = got.rows[i]
        assert len(rows) == len(text), (i, len(rows), len(text))  # one row per character
        full = dense_logits(model, rows[-1][0])
        for step, (tokens, row) in enumerate(rows):
            assert tokens == ids_of(item["prompt"]) + [VOCAB.index(c) for c in text[:step]]
            reference = full[len(tokens) - 1]
            worst = float((row - reference).abs().max())
            assert worst <= ATOL, (i, step, worst)
            if item["temperature"] == 0:
                lead = reference.topk(2).values
                assert float(lead[0] - lead[1]) > 2 * ATOL, (i, step)  # no near tie


# --- the tests -------------------------------------------------------------------------------
def test_batched_requests_joining_and_leaving_equal_the_dense_forward(
    dense: CharTransformer,
) -> None:
    # Given requests of 1 to 57 prompt characters, greedy and sampled, that join a running
    # batch at different steps, finish at different steps, and one dropped mid-generation
    lm = serving()
    joins = {0: [0, 1], 2: [2, 3], 3: [4], 5: [5, 6], 9: [7]}
    drops = {7: [5]}
    # When they run continuously
    got = run(lm, joins, drops)
    # Then each step's logits and each token are the dense forward's
    assert_equals_dense(dense, got, dropped=frozenset({5}))
    # and the steps did batch them: 6 rows at once, and in one step rows of four length
    # groups (1, 2, 3-4, 5-8, 9-16 blocks: each attended apart, padded to its own longest)
    assert max(len(rows) for rows in got.steps) >= 6
    groups = [{((n - 1) // BLOCK).bit_length() for n in rows} for rows in got.steps]
    assert max(len(g) for g in groups) >= 4
    assert lm.stats.preempted == 0


def test_after_preemption_and_recompute_the_outputs_still_equal_the_dense_forward(
    dense: CharTransformer,
) -> None:
    # Given a pool of 32 blocks of 8 (256 positions, the least that holds a context) for
    # eight requests of up to 65 positions, 291 in all
    lm = serving(kv_blocks=32)
    # When five come at once, two join at step 3 and one at step 4
    got = run(lm, {0: [0, 1, 2, 4, 7], 3: [3, 6], 4: [5]})
    # Then a sampled one was preempted and recomputed (its prompt and what it had made so
    # far, in one prefill), drawing on with its own generator
    assert lm.stats.preempted > 0 and lm.stats.recomputed == lm.stats.preempted
    assert any(WORK[i]["temperature"] > 0 for i in got.preempted), got.preempted
    # and still each step's logits and each token are the dense forward's
    assert_equals_dense(dense, got)
