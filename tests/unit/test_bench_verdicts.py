"""The verdicts the benchmarks print stand on completed, checked work (issue 37): a worker
thread's error fails the run, a stream with no output is a failure and never a time to first
output of 0, a time or ratio of 0 or below meets no budget, every counted answer is checked
(the model alone's text, the cold run's, the item sent), and each bench's budgets are judged
from synthetic figures as they would be from measured ones."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

import queueserve as qs
from bench import fairness, generate, jobs, latency
from bench._verdict import (
    EXIT_FAILED,
    EXIT_MET,
    EXIT_MISSED,
    Threads,
    Verdict,
    WorkFailed,
    at_least,
    at_most,
    exit_status,
    run,
    within,
)

# --- the verdict rule ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [-5.0, 0.0, float("nan"), float("-inf")])
def test_a_time_or_ratio_of_zero_or_below_meets_no_upper_budget(value: float) -> None:
    assert not at_most("TTFT p99 <= 0.33x", value, 1 / 3).met


def test_an_upper_budget_is_met_by_a_positive_value_within_it_only() -> None:
    assert at_most("p99 <= 3", 2.9, 3.0).met
    assert at_most("p99 <= 3", 3.0, 3.0).met
    assert not at_most("p99 <= 3", 3.1, 3.0).met


def test_a_quantity_that_may_be_negative_says_so() -> None:
    # memory left after expiry may be below what it was before
    assert at_most("left <= 0.5 MB", -0.2, 0.5, positive=False).met
    assert not at_most("left <= 0.5 MB", float("nan"), 0.5, positive=False).met


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_lower_budget_needs_a_finite_positive_value(value: float) -> None:
    assert not at_least("chars/s >= 1.0x", value, 1.0).met


def test_a_range_holds_its_ends_and_nothing_else() -> None:
    assert within("3.5-4.5x", 3.5, 3.5, 4.5).met
    assert within("3.5-4.5x", 4.5, 3.5, 4.5).met
    assert not within("3.5-4.5x", 3.4, 3.5, 4.5).met
    assert not within("3.5-4.5x", float("nan"), 3.5, 4.5).met


def test_a_verdict_line_says_met_or_missed_with_the_measured_value() -> None:
    assert at_most("p99 <= 3", 2.5, 3.0).line() == "verdict: p99 <= 3: 2.50: met"
    line = at_least("x >= 2", 1.0, 2.0, judged=False, note="a GPU's").line()
    assert line == "verdict: x >= 2: 1.00: MISSED (a GPU's)"


def test_the_exit_status_counts_judged_budgets_only() -> None:
    met, missed = Verdict("a", "1", True), Verdict("b", "1", False)
    assert exit_status([met]) == EXIT_MET
    assert exit_status([met, missed]) == EXIT_MISSED
    assert exit_status([met, Verdict("c", "1", False, judged=False)]) == EXIT_MET


def test_a_run_whose_work_failed_exits_2_saying_what_failed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def body() -> int:
        raise WorkFailed("charlm_cold: 3 of 40 streams failed")

    assert run(body) == EXIT_FAILED
    assert "FAILED: charlm_cold: 3 of 40 streams failed" in capsys.readouterr().err
    assert run(lambda: EXIT_MISSED) == EXIT_MISSED


# --- worker threads ------------------------------------------------------------------------


def test_a_worker_threads_error_fails_the_join_with_it_as_the_cause() -> None:
    threads = Threads("3 streams")
    threads.start(lambda: None)
    threads.start(lambda: (_ for _ in ()).throw(ConnectionError("stream broke")))
    threads.start(lambda: None)
    with pytest.raises(WorkFailed, match=r"3 streams: 1 of 3 threads failed.*stream broke") as e:
        threads.join(30)
    assert isinstance(e.value.__cause__, ConnectionError)


def test_a_join_fails_at_the_first_error_without_waiting_for_a_stuck_thread() -> None:
    stuck, fail = threading.Event(), threading.Event()

    def boom() -> None:
        fail.wait(30)
        raise ValueError("wrong answer")

    threads = Threads("work")
    threads.start(stuck.wait, 60)
    threads.start(boom)
    fail.set()
    with pytest.raises(WorkFailed, match="wrong answer"):
        threads.join(60)  # the test's own timeout (120 s) would end it if this waited
    stuck.set()


def test_a_thread_still_running_at_the_deadline_fails_the_join() -> None:
    release = threading.Event()
    threads = Threads("backlog")
    threads.start(release.wait, 60)
    with pytest.raises(WorkFailed, match=r"backlog: 1 of 1 threads still running after 0\.1 s"):
        threads.join(0.1)
    release.set()


def test_check_raises_a_failure_so_far_and_nothing_before_one() -> None:
    gate = threading.Event()

    def body() -> None:
        gate.wait(30)
        raise RuntimeError("keys1000: wrong answers")

    threads = Threads("keys1000: the backlog")
    threads.start(body)
    threads.check()
    gate.set()
    with pytest.raises(WorkFailed, match="wrong answers"):
        threads.join(30)
    with pytest.raises(WorkFailed, match="wrong answers"):
        threads.check()


# --- bench/generate.py ---------------------------------------------------------------------


def test_a_stream_with_no_output_has_no_time_to_first_output() -> None:
    with pytest.raises(WorkFailed, match="no output"):
        generate.Stream(sent=1.0).ttft()


def test_a_run_with_a_stream_that_wrote_nothing_fails_instead_of_counting_0() -> None:
    good = generate.Stream(sent=1.0)
    good.took(["a", "b"])
    with pytest.raises(WorkFailed, match="no output"):
        generate.summarize("continuous", [good, generate.Stream(sent=1.0)], 1.0)


def test_a_first_output_before_the_send_is_refused() -> None:
    stream = generate.Stream(sent=1e12)  # perf_counter is nowhere near
    stream.took(["a"])
    with pytest.raises(WorkFailed, match="before it was sent"):
        stream.ttft()


def test_outputs_are_timed_from_the_first_non_empty_one() -> None:
    stream = generate.Stream(sent=0.0)
    stream.took([])
    assert stream.first is None
    stream.took(["x"])
    stream.took(["y", "z"])
    assert stream.n == 3 and stream.ttft() > 0
    assert stream.per_output() is not None


class FakeClient:
    """``stream`` yields what ``events(item)`` gives, from the caller's thread."""

    def __init__(self, events: Any) -> None:
        self.events = events

    def stream(self, serving: str, items: list[Any], timeout: float) -> Iterator[Any]:
        yield from self.events(items[0])


def one(text: str) -> qs.Output:
    return qs.Output([text], 0, 1)


def test_a_failed_stream_fails_the_load() -> None:
    def events(item: Any) -> Iterator[Any]:
        yield one("a")
        if item["n"] == 2:
            raise qs.Timeout("no answer in time")

    load = [(0.0, {"n": n}) for n in range(4)]
    with pytest.raises(WorkFailed, match="s: 4 streams: 1 of 4 threads failed"):
        generate.run_load(FakeClient(events), "s", load)  # type: ignore[arg-type]


def test_a_restarted_stream_fails_the_load() -> None:
    def events(item: Any) -> Iterator[Any]:
        yield one("a")
        yield qs.Restart(0, 1)
        yield one("a")

    with pytest.raises(WorkFailed, match="restarted"):
        generate.run_load(FakeClient(events), "s", [(0.0, {})])  # type: ignore[arg-type]


def test_a_load_keeps_each_streams_text_and_a_served_text_must_be_the_models_alone() -> None:
    def events(item: Any) -> Iterator[Any]:
        yield from (one(c) for c in item["say"])

    load = [(0.0, {"say": "abc"}), (0.0, {"say": "hello"})]
    streams, _ = generate.run_load(FakeClient(events), "s", load)  # type: ignore[arg-type]
    generate.check_texts("s", streams, [list("abc"), list("hello")])
    with pytest.raises(WorkFailed, match=r"1 of 2 .* request 1 first differs at character 3"):
        generate.check_texts("s", streams, [list("abc"), list("helium")])
    with pytest.raises(WorkFailed, match="request 0 first differs at character 3"):
        generate.check_texts("s", streams, [list("abcd"), list("hello")])  # cut short


def test_a_cached_text_is_checked_against_the_cold_one() -> None:
    cold, cached = generate.Stream(), generate.Stream()
    cold.took(list("the cat"))
    cached.took(list("the car"))
    with pytest.raises(WorkFailed, match=r"what charlm_cold .* writes; request 0"):
        generate.check_texts("charlm", [cached], [cold.text], reference="charlm_cold (cache off)")


def test_the_reference_text_is_the_models_steps_alone_without_end_or_no_output() -> None:
    class Steps:
        def static_steps(self, items: list[Any]) -> Iterator[list[Any]]:
            yield [qs.NO_OUTPUT]
            yield from ([c] for c in items[0]["say"])
            yield [qs.END]

    assert generate.texts_alone(Steps(), [{"say": "ok"}, {"say": ""}]) == [["o", "k"], []]


def test_generate_judges_each_budget_from_its_figure() -> None:
    figures = {
        "mixed_ttft_p99_ratio": -3.0,  # a stream with no output, counted as 0, gave this
        "saturating_ratio": 1.1,
        "end_to_end_over_model_alone": 0.95,
        "cache_saved": 0.6,
        "null_saturating_ratio": 1.02,
    }
    on_cpu = {v.budget: v for v in generate.judge("chartf", figures, on_gpu=False)}
    assert not on_cpu["chartf mixed load, continuous TTFT p99 <= 0.33x static's"].met
    two_x = on_cpu["chartf saturating, continuous chars/s >= 2x static's"]
    assert not two_x.met and not two_x.judged
    assert on_cpu["chartf end to end / model alone >= 0.9"].met
    assert not on_cpu["chartf prefix cache saves >= 80% of prefill time"].met
    assert on_cpu["null transformer saturating, continuous chars/s >= 1.0x static's"].met
    on_gpu = generate.judge("chartf", {**figures, "mixed_ttft_p99_ratio": 0.2}, on_gpu=True)
    judged = {v.budget: (v.met, v.judged) for v in on_gpu}
    assert judged["chartf mixed load, continuous TTFT p99 <= 0.33x static's"] == (True, True)
    assert judged["chartf saturating, continuous chars/s >= 2x static's"] == (False, True)
    assert generate.judge("charlm", {}, on_gpu=False) == []


# --- bench/jobs.py -------------------------------------------------------------------------


def jobs_run(**changes: Any) -> dict[str, Any]:
    out = {
        "jobs": 100_000,
        "bytes_kept": 11_100_000,
        "job_groups_kept": 1563,
        "job_groups_left_after_expiry": 0,
        "bytes_left_after_expiry": 200_000,
    }
    return {**out, **changes}


def test_jobs_meets_its_budgets_when_all_goes_after_keep() -> None:
    assert all(v.met for v in jobs.judge(jobs_run()))


@pytest.mark.parametrize(
    ("changes", "missed"),
    [
        ({"bytes_left_after_expiry": 3_000_000}, "no memory left after keep"),
        ({"job_groups_left_after_expiry": 2}, "no group left after keep"),
        ({"bytes_kept": 41_000_000}, "Redis memory held by 100,000 finished jobs <= 40 MB"),
        ({"job_groups_kept": 0}, "every job's record kept until its keep"),
    ],
)
def test_jobs_misses_the_budget_its_figure_breaks(changes: dict[str, Any], missed: str) -> None:
    verdicts = jobs.judge(jobs_run(**changes))
    assert [v.budget.split(":")[0] for v in verdicts if not v.met] == [missed]


# --- bench/latency.py ----------------------------------------------------------------------


def test_a_config_change_is_applied_when_the_meta_hash_declares_its_values() -> None:
    options = {"batch_timeout": "2ms", "max_latency": "0"}
    assert latency.applied({b"batch_timeout": b"0.002", b"max_latency": b"0.0"}, options)
    assert not latency.applied({b"batch_timeout": b"0.0", b"max_latency": b"0.0"}, options)
    assert not latency.applied({b"max_latency": b"0.0"}, options)


def test_configure_returns_once_the_worker_wrote_the_values_back(
    fake_redis: fakeredis.FakeServer,
) -> None:
    r = fakeredis.FakeRedis(server=fake_redis)
    meta, config = f"{latency.PREFIX}:{{blat}}:meta", f"{latency.PREFIX}:{{blat}}:config"
    r.hset(meta, mapping={"batch_timeout": "0.0", "max_latency": "0.0"})
    stop = threading.Event()

    def worker() -> None:  # applies the config hash it finds, then declares what it has
        while not stop.wait(0.01):
            found = r.hgetall(config)
            if found:
                r.hset(meta, mapping={"batch_timeout": "0.05", "max_latency": "0.1"})
                return

    thread = threading.Thread(target=worker)
    thread.start()
    latency.configure(r, "blat", {"batch_timeout": "50ms", "max_latency": "100ms"})
    assert r.hget(meta, "max_latency") == b"0.1"
    stop.set()
    thread.join()


def test_configure_fails_when_the_worker_never_applies_the_change(
    fake_redis: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(latency, "CONFIG_WAIT_S", 0.2)
    r = fakeredis.FakeRedis(server=fake_redis)
    r.hset(f"{latency.PREFIX}:{{blat}}:meta", mapping={"batch_timeout": "0.0"})
    with pytest.raises(RuntimeError, match="waiting for the worker to apply"):
        latency.configure(r, "blat", {"batch_timeout": "2ms"})


def test_affine_answers_must_echo_their_items() -> None:
    answers = latency.Answers("affine")
    answers.check(3, 3)
    with pytest.raises(WorkFailed, match="item 3 was answered 4, not 3"):
        answers.check(3, 4)


def latency_cells(**p99: float) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for load in (0.1, 0.5):
        for policy in latency.policies(0.1):
            cells[f"{load:.0%} {policy}"] = {"p50_ms": 10.0, "p99_ms": 20.0, "items_s": 100.0}
    for key, value in p99.items():
        cells[key.replace("_", " ")]["p99_ms"] = value
    return cells


def test_latency_judges_each_load_from_its_cells() -> None:
    cells = latency_cells()
    cells["50% max_latency 100ms"]["p99_ms"] = 150.0
    cells["50% timeout 2ms"]["items_s"] = 120.0
    verdicts = {v.budget: v.met for v in latency.judge(cells, (0.1, 0.5), 0.1)}
    assert verdicts == {
        "10% load: max_latency p99 <= 100 ms": True,
        "10% load: max_latency items/s >= 0.95x the best fixed timeout's": True,
        "50% load: max_latency p99 <= 100 ms": False,
        "50% load: max_latency items/s >= 0.95x the best fixed timeout's": False,
        "10% load: max_latency p50 <= 1.5x timeout 0's": True,
    }


# --- bench/fairness.py ---------------------------------------------------------------------


def test_batches_are_counted_while_both_keys_had_work_after_the_first_ten() -> None:
    # heavy runs 4 batches to light's 1 after a first turn each; light goes on alone after
    order = ["heavy", "light"] * 5 + ["heavy"] * 4 + ["light"] + ["heavy"] * 4 + ["light"] * 6
    ran: dict[str, set[int]] = {"heavy": set(), "light": set()}
    for n, key in enumerate(order):
        ran[key].add(n)
    counted = fairness.batches_while_both_had_work(ran)
    assert counted == {"heavy": 8, "light": 1}


def test_stamped_answers_must_be_their_items() -> None:
    assert fairness.stamps("w", [1, 2], [[1, 7, 0.5], [2, 8, 0.6]]) == [(7, 0.5), (8, 0.6)]
    with pytest.raises(WorkFailed, match="item 2 was answered"):
        fairness.stamps("w", [1, 2], [[1, 7, 0.5], [3, 8, 0.6]])
    with pytest.raises(WorkFailed, match="1 answers for 2 items"):
        fairness.stamps("w", [1, 2], [[1, 7, 0.5]])


def test_fairness_judges_the_budgets_and_leaves_keys1000new_uncounted() -> None:
    row = {"quiet_p99": 2.2, "p9_p99": 3.4}
    results = {
        "submit": row,
        "keys1000new": {"quiet_p99": 524.0, "p9_p99": 1.8},
        "weights": {"heavy_per_light": 3.0, "left_per_right": 1.05},
        "ageing": {"start_p99_s": 0.95, "bound_s": 0.93},
    }
    verdicts = fairness.judge(results)
    missed = [v.budget for v in verdicts if v.judged and not v.met]
    assert missed == [
        "submit: priority 9 p99 <= 3 batch times (2 of waiting, its own)",
        "weights: heavy (weight 4) gets 3.5-4.5x light's batches",
        "ageing: priority-0 p99 wait for its batch under a priority-9 flood <= 9 x 100 ms + 3 "
        "batches (930 ms)",
    ]
    new = [v for v in verdicts if v.budget.startswith("keys1000new")]
    assert [(v.met, v.judged) for v in new] == [(False, False), (True, False)]
