"""How a client cuts a call into requests of at most a batch (docs/usage.md, "Batch keys,
fairness and priorities"): results go back by position, whatever the batch keys."""

from __future__ import annotations

from typing import Any

import pytest

import queueserve as qs
from queueserve.client.core import ClientCore
from queueserve.client.targets import in_batches, plan


def noop(xs: list[Any]) -> list[Any]:
    return xs


def _target(**options: Any) -> Any:
    return _base().targets.remember(qs.Serving(noop, name="cut", **options), {})


def _base() -> ClientCore:
    return ClientCore("redis://localhost:6379/0", "qsu")


def test_a_call_goes_as_requests_of_a_batch_each_with_the_callers_positions() -> None:
    # Given a serving of batch_size 4 whose batch key is the item's parity
    target = _target(batch_size=4, batch_key=lambda x: f"k{x % 2}")
    parts = plan(target, list(range(11)), None)

    # When the call is cut
    cut = in_batches(target, parts, job=False)

    # Then each request holds at most a batch of one key, and the positions cover the call
    assert [(p.batch_key, p.items) for p in cut] == [
        ("k0", [0, 2, 4, 6]),
        ("k0", [8, 10]),
        ("k1", [1, 3, 5, 7]),
        ("k1", [9]),
    ]
    assert all(p.positions == p.items for p in cut)  # item i is at position i here


def test_one_key_in_order_gets_positions_when_cut() -> None:
    target = _target(batch_size=3)
    cut = in_batches(target, plan(target, list("abcdefg"), None), job=False)
    assert [(p.positions, p.items) for p in cut] == [
        ([0, 1, 2], list("abc")),
        ([3, 4, 5], list("def")),
        ([6], list("g")),
    ]


@pytest.mark.parametrize("job", [True, False], ids=["a job", "a serving that streams events"])
def test_what_must_run_as_one_request_is_not_cut(job: bool) -> None:
    target = _target(batch_size=3)
    target.hooks = not job  # as a serving declared with hooks (streaming) has it
    parts = plan(target, list(range(7)), None)
    assert in_batches(target, parts, job=job) is parts


def test_a_call_within_a_batch_is_sent_as_planned() -> None:
    target = _target(batch_size=8)
    parts = plan(target, list(range(8)), None)
    assert in_batches(target, parts, job=False) is parts


def test_a_part_refused_before_sending_leaves_no_call_of_its_call_behind() -> None:
    # Given a call cut into two requests whose second is over max_payload_bytes
    base = _base()
    target = base.targets.remember(
        qs.Serving(noop, name="cut", batch_size=2, max_payload_bytes=64), {}
    )
    parts = in_batches(target, plan(target, ["a", "b", "c", "x" * 100], None), job=False)

    # When its requests are made, the second is refused
    with pytest.raises(qs.BadRequest, match="max_payload_bytes=64"):
        base.requests(target, parts, None, 0)

    # Then the first one's call went too: nothing waits for an answer that will never come
    assert base.table.calls == {}
