"""A caller's stream follows one run of its request (client/events.py): a replay's restart marker,
events of a run it left, and an answer from a run it did not follow (issue 23, class 3; the
worker side is tests/faults/test_step_faults.py)."""

from __future__ import annotations

from typing import Any

import queueserve as qs
from queueserve.client.calls import Call
from queueserve.client.events import RequestStream
from queueserve.wire.keys import Keys
from queueserve.wire.kinds import RESULTS, STEPS

T = 77  # a replay's run token


def stream() -> RequestStream:
    return RequestStream(Call(1, 1, Keys("qs", "gen"), "default"), offset=0)


def step(value: Any, run: int = 0) -> list[Any]:
    return ["o", RESULTS, [value], 0, 1, *([run] if run else [])]


def answer(rs: RequestStream, result: Any, run: int, events: int, kind: int = STEPS) -> None:
    call = rs.call
    call.kind, call.run, call.events_total = kind, run, events
    call.apply(0, [result])


def values(events: list[Any]) -> list[Any]:
    return [e if isinstance(e, qs.Restart) else e.results[0] for e in events]


def test_a_replay_restarts_the_stream_and_the_run_it_left_is_dropped() -> None:
    rs = stream()
    shown = [e for seq, v in enumerate(["a0", "a1"]) for e in rs.add(seq, step(v))]
    # the replay announces itself (its event 0), then streams; the stalled first run resumes
    shown += rs.add(0, ["r", T])
    shown += rs.add(1, step("b0", T))
    shown += rs.add(2, step("a2"))
    shown += rs.add(2, step("b1", T))
    answer(rs, ["b0", "b1"], T, 3)
    ready, error = rs.complete()
    assert error is None
    assert values(shown + ready) == ["a0", "a1", qs.Restart(0, 1), "b0", "b1"]


def test_an_answer_from_the_run_the_stream_left_restarts_it_and_rebuilds_its_steps() -> None:
    rs = stream()
    shown = rs.add(0, step("a0")) + rs.add(0, ["r", T]) + rs.add(1, step("b0", T))
    # the first run resumed and answered first: its answer is the one the caller gets
    answer(rs, ["a0", "a1", "a2"], 0, 3)
    assert not rs.waiting_for_events
    ready, _ = rs.complete()
    assert values(shown + ready) == [
        "a0",
        qs.Restart(0, 1),
        "b0",
        qs.Restart(0, 1),
        "a0",
        "a1",
        "a2",
    ]


def test_a_replay_before_anything_was_shown_needs_no_restart() -> None:
    rs = stream()
    shown = rs.add(0, ["r", T]) + rs.add(1, step("b0", T))
    answer(rs, ["b0"], T, 2)
    ready, _ = rs.complete()
    assert values(shown + ready) == ["b0"]


def test_a_final_answer_from_another_run_restarts_the_stream_before_it() -> None:
    rs = stream()
    shown = rs.add(0, step("a0"))
    answer(rs, {"text": "b"}, T, 5, kind=RESULTS)
    ready, _ = rs.complete()
    assert shown + ready == [
        qs.Output(["a0"], 0, 1),
        qs.Restart(0, 1),
        qs.Output([{"text": "b"}], 0, 1),
    ]
