"""The character-level GRU's decode steps without Redis (tasks/charlm.py): how a joining
sequence reads its prompt, and that its text does not depend on how that reading was cut."""

from __future__ import annotations

import random

import pytest

# The dev install includes torch: a broken one fails here, it is not skipped.
import torch

import queueserve as qs
from tasks.charlm import CACHE_EVERY, CharLM, State
from tasks.charlm_model import CharGRU, Stepper, encode, load


@pytest.fixture(scope="module")
def model() -> CharGRU:
    return load()


def serving(**options: object) -> CharLM:
    lm = CharLM(prefix_cache_bytes=0, **options)  # type: ignore[arg-type]
    lm.setup(qs.Partition())
    return lm


def generating(lm: CharLM, count: int) -> list[State]:
    """``count`` sequences that have read their prompts and emit one character per step."""
    states = lm.prefill([{"prompt": f"Return {i} ", "max_new": 50} for i in range(count)])
    outs = lm.decode(states)  # nobody emitted before: each reads its whole prompt at once
    assert all(isinstance(o, str) for o in outs)
    return states


def test_a_joiner_reads_one_prompt_position_per_step_while_the_running_set_is_full() -> None:
    # Given a running set of 4 slots, 3 of them generating
    lm = serving(max_slots=4, prompt_chunk=16)
    running = generating(lm, 3)
    # When a sequence with a 40-character prompt joins and fills the set
    joiner = lm.prefill(["x" * 40])[0]
    outs = lm.decode([*running, joiner])
    # Then it reads one prompt character in that step (shared with the others' decode),
    # and the others emit as usual
    assert joiner.pos == 1 and outs[-1] is qs.NO_OUTPUT
    assert all(isinstance(o, str) for o in outs[:-1])
    assert lm.reading_chunk(4) == 1


def test_a_joiner_reads_a_whole_chunk_per_step_while_slots_are_free() -> None:
    # Given 2 of 4 slots generating
    lm = serving(max_slots=4, prompt_chunk=16)
    running = generating(lm, 2)
    # When a sequence with a 40-character prompt joins (a slot stays free)
    joiner = lm.prefill(["x" * 40])[0]
    lm.decode([*running, joiner])
    # Then it reads up to prompt_chunk characters, ending on a multiple of it
    assert joiner.pos == 16
    lm.decode([*running, joiner])
    assert joiner.pos == 32
    assert lm.reading_chunk(3) == 16


def test_a_step_in_which_nobody_emits_reads_whole_prompts() -> None:
    lm = serving(max_slots=2, prompt_chunk=4)
    states = lm.prefill(["y" * 30, "z" * 20])
    outs = lm.decode(states)  # a full set, but no one emits: no one is kept waiting
    assert [s.pos for s in states] == [30, 20]
    assert all(isinstance(o, str) for o in outs)


def test_text_does_not_depend_on_how_prompts_were_cut_into_steps() -> None:
    """Sequences joining a full set read one position per step, in a free one in chunks, and
    alone whole: greedy and seeded sampling give the same characters every way."""
    rng = random.Random(5)
    items = [
        {
            "prompt": "The object's attributes, sorted"[: rng.randint(3, 30)],
            "max_new": rng.randint(1, 25),
            "temperature": 0.7 * (i % 2),
            "seed": i,
        }
        for i in range(12)
    ]
    alone = serving()
    expected = [alone.inline(item) for item in items]
    lm = serving(max_slots=4, prompt_chunk=8)
    waiting, running, texts = list(range(len(items))), [], {}
    states: dict[int, State] = {}
    while waiting or running:
        while waiting and len(running) < lm.max_slots:
            i = waiting.pop(0)
            states[i] = lm.prefill([items[i]])[0]
            running.append(i)
            texts[i] = []
        outs = lm.decode([states[i] for i in running])
        for i, out in zip(list(running), outs, strict=True):
            if out is qs.END:
                running.remove(i)
            elif out is not qs.NO_OUTPUT:
                texts[i].append(out)
    assert [texts[i] for i in range(len(items))] == expected


def test_the_stepper_cell_is_the_grus_step(model: CharGRU) -> None:
    ids = torch.tensor([encode("Return the list of names")])
    with torch.inference_mode():
        _, h_n = model.gru(model.embed(ids))
        stepper = Stepper(model)
        h = torch.zeros(1, model.hidden)
        for t in range(ids.shape[1]):
            h = stepper.cell(ids[:, t], h)
        assert torch.allclose(h, h_n[0], atol=1e-5)
        assert torch.allclose(stepper.logits(h), model.head(h_n[0]), atol=1e-5)


def test_a_joiner_reading_one_character_per_step_offers_its_prefixes_to_the_cache() -> None:
    # Given a full running set, and a joiner whose prompt is cached from nothing
    lm = serving(max_slots=3, prompt_chunk=16)
    running = generating(lm, 2)
    prompt = "abcdefghij" * 3
    resume = qs.Resume(tuple(encode(prompt)[:-1]))
    joiner = lm.prefill_from([prompt], [resume])[0]
    # When it reads its prompt one character per step
    offered = []
    while joiner.pos < len(prompt):
        lm.decode([*running, joiner])
        offered += resume.kept
        resume.kept.clear()
    # Then the states after every CACHE_EVERY characters were offered, each the state a
    # whole read reaches there
    assert [length for length, _, _ in offered] == list(
        range(CACHE_EVERY, len(prompt), CACHE_EVERY)
    )
    alone = serving()
    whole = qs.Resume(tuple(encode(prompt)[:-1]))
    alone.decode(alone.prefill_from([prompt], [whole]))
    assert [length for length, _, _ in whole.kept] == [length for length, _, _ in offered]
    for (_, state, _), (_, expected, _) in zip(offered, whole.kept, strict=True):
        assert torch.allclose(state, expected, atol=1e-5)
