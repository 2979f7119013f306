"""Per-key weights and the priority ageing step (serving options batch_key_weights and
priority_age): how the assembler ranks keys with them, and how the options are read. Pure
logic: the clock is passed in."""

from __future__ import annotations

from collections import Counter

import pytest

from queueserve.options.serving_options import ServingOptions, validated
from queueserve.options.stored import parse_assignments
from queueserve.worker.pipeline.batching import Assembler, Request, Slice

_ids = iter(range(1, 10**9))


def piece(items: list[str], priority: int = 0) -> Slice:
    rid = next(_ids)
    request = Request(f"{rid}-0".encode(), "qs:{s}:in:k", rid, "qs:inbox:c", 0.0, len(items))
    request.priority = priority
    return Slice(request, 0, items)


def turns(a: Assembler, keys: list[str], batches: int) -> Counter[str]:
    """Which key each of ``batches`` batches came from, every key holding a backlog, one
    batch a second."""
    for key in keys:
        for _ in range(batches):
            a.add(key, piece([key, key]), now=0.0)
    ran: Counter[str] = Counter()
    for t in range(1, batches + 1):
        chosen, _ = a.pick(now=float(t))
        assert chosen is not None
        ran[a.take(chosen, now=float(t)).key] += 1
    return ran


def test_without_weights_busy_keys_take_turns_by_batch() -> None:
    ran = turns(Assembler(capacity=2, timeout=0.0), ["bulk", "vip"], 40)
    assert ran["vip"] == ran["bulk"] == 20


def test_a_key_of_weight_4_gets_about_4_times_the_batches_of_a_weight_1_key() -> None:
    a = Assembler(capacity=2, timeout=0.0)
    a.weights = {"vip": 4.0}
    ran = turns(a, ["bulk", "vip"], 40)
    assert 3 <= ran["vip"] / ran["bulk"] <= 5, ran


def test_the_ageing_step_sets_how_long_a_priority_level_waits_for_a_key() -> None:
    # Given a key with a batch of priority 0 due since t=0, and another with priority 2 since
    # t=1.5: with a step of 1 s the priority-2 key goes first, with 0.5 s the older one does
    for step, first in ((1.0, "urgent"), (0.5, "old")):
        a = Assembler(capacity=1, timeout=0.0, age_per_priority=step)
        a.add("old", piece(["o"]), now=0.0)
        a.add("urgent", piece(["u"], priority=2), now=1.5)
        chosen, _ = a.pick(now=2.0)
        assert chosen is not None and chosen.key == first


def test_the_options_are_read_from_text_and_checked() -> None:
    parsed = parse_assignments(
        ["batch_key_weights=vip=4,bulk=0.5", "priority_age=100ms", "max_latency=50ms"]
    )
    assert parsed == {
        "batch_key_weights": {"vip": 4.0, "bulk": 0.5},
        "priority_age": 0.1,
        "max_latency": 0.05,
    }
    # the meta hash holds them as config set writes them, so a client reads them back
    assert str(parsed["batch_key_weights"]) == "vip=4,bulk=0.5"
    assert validated(ServingOptions, {}).batch_key_weights == {}
    for bad, says in (
        ("vip=0", "above 0"),
        ("vip", "key=weight pairs"),
        ("vip=lots", "above 0"),
        ("=2", "not a batch key"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_assignments([f"batch_key_weights={bad}"])
    with pytest.raises(ValueError, match="max_latency"):
        parse_assignments(["max_latency=-1s"])


def test_a_request_that_came_during_a_busy_keys_batch_goes_in_the_next_batch() -> None:
    # Given a key with a backlog whose batches take 1 s, one taken at t=10
    a = Assembler(capacity=2, timeout=0.5)
    a.batch_times.observe(2, 1.0)
    for _ in range(10):
        a.add("bulk", piece(["b", "b"]), now=0.0)
    chosen, _ = a.pick(now=10.0)
    assert chosen is not None and a.take(chosen, now=10.0).key == "bulk"
    # When a lone request comes on a quiet key during that batch
    a.add("quiet", piece(["q"]), now=10.2)
    # Then the next batch is its own, though its batch_timeout has not passed yet
    chosen, _ = a.pick(now=11.0)
    assert chosen is not None and a.take(chosen, now=11.0).key == "quiet"
    chosen, _ = a.pick(now=11.5)
    assert chosen is not None and chosen.key == "bulk"


def test_a_key_sending_one_batch_per_request_gives_its_turn_as_a_long_request_would() -> None:
    # Given a key whose requests hold one batch each (the batch takes 1 s), one taken at t=10
    a = Assembler(capacity=2, timeout=0.0)
    a.batch_times.observe(2, 1.0)
    a.add("bulk", piece(["b", "b"]), now=0.0)
    chosen, _ = a.pick(now=10.0)
    assert chosen is not None and a.take(chosen, now=10.0).key == "bulk"
    # When the key's next request is read during that batch, and then a quiet one comes
    a.add("bulk", piece(["b", "b"]), now=10.1)
    a.add("quiet", piece(["q"]), now=10.2)
    # Then the quiet one runs next
    chosen, _ = a.pick(now=11.0)
    assert chosen is not None and chosen.key == "quiet"


def pipeline_turns(
    weights: dict[str, float], keys: list[str], batches: int, batch_s: float = 0.01
) -> Counter[str]:
    """As a worker's pipeline holds work: at most one batch per key (the reader reads a key
    again once its batch left), batches of ``batch_s`` that the assembler measures, and each
    key's queue emptied by each batch it gives."""
    a = Assembler(capacity=2, timeout=0.0)
    a.weights = weights
    now = 100.0
    for key in keys:
        a.add(key, piece([key, key]), now=now)
    ran: Counter[str] = Counter()
    for _ in range(batches):
        chosen, _ = a.pick(now=now)
        assert chosen is not None
        taken = a.take(chosen, now=now)
        ran[taken.key] += 1
        a.add(taken.key, piece([taken.key] * 2), now=now + batch_s / 10)  # read again at once
        now += batch_s
        a.batch_times.observe(2, batch_s)
    return ran


@pytest.mark.parametrize("batch_s", [0.001, 0.01, 1.0])
def test_a_weight_4_key_gets_4_times_the_batches_in_the_pipelines_shape(batch_s: float) -> None:
    # Given two keys with work, each holding one batch at a time, as the reader keeps them
    ran = pipeline_turns({"heavy": 4.0}, ["light", "heavy"], 200, batch_s)
    # Then the heavy one runs about 4 batches to the light one's 1 (3.5-4.5 in the terms)
    assert 3.5 <= ran["heavy"] / ran["light"] <= 4.5, ran


def test_weights_share_batches_among_many_keys_in_proportion() -> None:
    ran = pipeline_turns({"heavy": 4.0, "half": 0.5}, ["a", "b", "heavy", "c", "half"], 850)
    # weights 4 + 1 + 1 + 1 + 0.5 = 7.5: heavy 4/7.5 of the batches, each of a, b, c 1/7.5
    for key in ("a", "b", "c"):
        assert 3.5 <= ran["heavy"] / ran[key] <= 4.5, ran
        assert 1.7 <= ran[key] / ran["half"] <= 2.3, ran


def test_without_weights_the_pipelines_shape_takes_turns_exactly() -> None:
    ran = pipeline_turns({}, ["a", "b", "c"], 300)
    assert ran == Counter({"a": 100, "b": 100, "c": 100})


def test_a_quiet_weighted_key_keeps_no_lead_after_its_first_batch() -> None:
    # Given two busy keys taking turns, and a weighted key that comes back quiet (a lead)
    a = Assembler(capacity=2, timeout=0.0)
    a.weights = {"heavy": 4.0}
    now = 100.0
    for key in ("a", "b"):
        a.add(key, piece([key, key]), now=now)
    a.add("heavy", piece(["heavy"] * 2), now=now, lead=True)
    ran = []
    for _ in range(40):
        chosen, _ = a.pick(now=now)
        assert chosen is not None
        key = a.take(chosen, now=now).key
        ran.append(key)
        a.add(key, piece([key] * 2), now=now + 0.001)
        now += 0.01
        a.batch_times.observe(2, 0.01)
    # Then its lead runs its first batch at once, and then it takes its 4 in 6 as a weight of
    # 4 among 1 and 1 does, not a run of batches paid for by the 60 s lead
    assert ran[0] == "heavy"
    assert "a" in ran[1:6] and "b" in ran[1:6], ran
    assert 3.5 <= ran.count("heavy") / ran.count("a") <= 4.5, ran
