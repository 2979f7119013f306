"""Per-key weights and the priority ageing step (serving options batch_key_weights and
priority_age): how the assembler ranks keys with them, and how the options are read. Pure
logic: the clock is passed in."""

from __future__ import annotations

from collections import Counter

import pytest

from queueserve.options.serving import ServingOptions, validated
from queueserve.wire.options import parse_assignments
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
