"""bench/guard.py's verdict, on synthetic figures: a hot-path figure fails only when its median
HEAD/BASE ratio is more than 5% worse, in its own direction, and the pairs agree; a run that
lacks a figure gives no verdict at all (exit 2), never a pass. The benchmark itself never runs
in the suite."""

from __future__ import annotations

import math

import pytest

from bench.guard import FIGURES, Figure, agreement, extract, judge, markdown, schedule

THROUGHPUT = Figure("shape", "x loop", lambda r: r["shape"])
LATENCY = Figure("round trip", "ms", lambda r: r["rt"], higher_is_better=False)
INFO = Figure("machine", "items/s", lambda r: r["machine"], hot=False, control=True)
FIGS = (THROUGHPUT, LATENCY, INFO)


def pairs_of(ratios: dict[Figure, list[float]]) -> list[tuple[dict[str, float], dict[str, float]]]:
    """BASE runs at 100 for every figure, HEAD runs at 100 x the given ratio (1.0 if none)."""
    n = max(len(r) for r in ratios.values())
    return [
        (
            {f.name: 100.0 for f in FIGS},
            {f.name: 100.0 * ratios.get(f, [1.0] * n)[i] for f in FIGS},
        )
        for i in range(n)
    ]


def verdict_of(ratios: dict[Figure, list[float]]) -> tuple[int, str, dict[str, str]]:
    v = judge(pairs_of(ratios), FIGS)
    return v.code, v.line, {c.figure.name: c.status for c in v.comparisons}


def test_a_throughput_worse_in_every_pair_is_a_regression() -> None:
    code, line, status = verdict_of({THROUGHPUT: [0.90, 0.88, 0.92]})
    assert code == 1
    assert line == "guard: REGRESSION in shape (x loop)"
    assert status == {
        "shape (x loop)": "REGRESSION",
        "round trip (ms)": "within 5%",
        "machine (items/s)": "within 5%",
    }


def test_a_noisy_figure_whose_pairs_disagree_is_not_a_regression() -> None:
    # the median is 15% worse, but one pair is better: noise, not a change
    code, line, status = verdict_of({THROUGHPUT: [0.80, 1.02, 0.85]})
    assert (code, line) == (0, "guard: ok")
    assert status["shape (x loop)"] == "worse, pairs disagree (2 of 3 worse)"


def test_every_pair_a_little_worse_is_within_the_limit() -> None:
    code, _, status = verdict_of({THROUGHPUT: [0.96, 0.97, 0.955]})
    assert code == 0
    assert status["shape (x loop)"] == "within 5%"


def test_an_improvement_is_no_regression() -> None:
    code, line, status = verdict_of({THROUGHPUT: [1.20, 1.15, 1.10], LATENCY: [0.8, 0.85, 0.9]})
    assert (code, line) == (0, "guard: ok")
    assert status["shape (x loop)"] == "better"
    assert status["round trip (ms)"] == "better"


def test_an_improvement_whose_pairs_disagree_says_so() -> None:
    code, _, status = verdict_of({THROUGHPUT: [1.3, 0.98, 1.2], LATENCY: [0.98, 0.8, 0.9]})
    assert code == 0
    assert status["shape (x loop)"] == "better, pairs disagree (2 of 3 better)"
    assert status["round trip (ms)"] == "better"


def test_a_higher_latency_is_worse() -> None:
    code, line, status = verdict_of({LATENCY: [1.10, 1.08, 1.12]})
    assert (code, line) == (1, "guard: REGRESSION in round trip (ms)")
    assert status["round trip (ms)"] == "REGRESSION"


def test_a_lower_throughput_and_a_higher_latency_are_both_named() -> None:
    code, line, _ = verdict_of({THROUGHPUT: [0.5, 0.6, 0.7], LATENCY: [1.5, 1.6, 1.7]})
    assert (code, line) == (1, "guard: REGRESSION in shape (x loop), round trip (ms)")


def test_a_figure_that_is_not_judged_never_fails_the_guard() -> None:
    code, line, status = verdict_of({INFO: [0.5, 0.6, 0.7]})
    assert (code, line) == (0, "guard: ok")
    assert status["machine (items/s)"] == "worse (not judged)"


@pytest.mark.parametrize(
    ("ratios", "code"),
    [
        ([0.9, 0.9, 0.9, 0.9, 1.1], 0),  # 4 of 5 worse: noise reaches that 3 times in 16
        ([0.9, 0.9, 0.9, 0.9, 0.9], 1),
        ([0.9, 0.9, 0.9, 0.9, 0.9, 1.1], 1),  # all but one of 6 agree
        ([0.9, 0.9, 0.9, 0.9, 1.1, 1.1], 0),
    ],
)
def test_from_six_pairs_all_but_one_must_agree(ratios: list[float], code: int) -> None:
    assert verdict_of({THROUGHPUT: ratios})[0] == code


def chance(k: int, n: int) -> float:
    """How often n coin tosses give k heads or more."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / (1 << n)


def test_agreement_is_what_noise_reaches_at_most_one_time_in_eight() -> None:
    assert [agreement(n) for n in range(3, 11)] == [3, 4, 5, 5, 6, 7, 7, 8]
    for n in range(3, 20):
        k = agreement(n)
        assert chance(k, n) <= 1 / 8 < chance(k - 1, n)


@pytest.mark.parametrize("side", [0, 1])
def test_a_missing_figure_is_a_failed_run_not_a_pass(side: int) -> None:
    pairs = pairs_of({THROUGHPUT: [0.99, 1.0, 1.01]})
    del pairs[1][side]["round trip (ms)"]
    v = judge(pairs, FIGS)
    which = ("BASE", "HEAD")[side]
    assert (v.code, v.comparisons) == (2, ())
    assert (
        v.line
        == f"guard: FAILED, no verdict: {which} run of pair 2 has no figure 'round trip (ms)'"
    )


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_figure_that_is_no_positive_number_is_a_failed_run(value: float) -> None:
    pairs = pairs_of({THROUGHPUT: [0.99, 1.0, 1.01]})
    pairs[0][0]["shape (x loop)"] = value
    v = judge(pairs, FIGS)
    assert v.code == 2
    assert "BASE run of pair 1 has 'shape (x loop)'" in v.line


def test_no_pairs_is_no_verdict() -> None:
    assert judge([], FIGS).code == 2


def test_the_runs_alternate_and_so_does_the_order_within_a_pair() -> None:
    assert schedule(3) == ["base", "head", "head", "base", "base", "head"]
    assert schedule(4)[6:] == ["head", "base"]


def results(**overrides: object) -> dict[str, object]:
    """A bench.throughput ``results`` document, the figures the guard reads."""
    doc: dict[str, object] = {
        "baseline": {"median": 100_000},
        "qs_submit_window": {"median": 80_000},
        "qs_submit_keep_window": {"median": 60_000},
        "qs_dispatch_64": {"median": 15_000},
        "baseline_dispatch_64": {"median": 5_000},
        "qs_dispatch_async_64": {"median": 20_000},
        "baseline_dispatch_async_64": {"median": 10_000},
        "qs_map_256_mif4": {"median": 400_000},
        "qs_map_256_mif16": {"median": 450_000},
        "qs_map_256_mif64": {"median": 460_000},
        "rt_qs": {
            "p50_ms": 0.6,
            "p99_ms": 1.2,
            "run_us_per_call": {"bench": 200.0, "consumer": 270.0, "redis": 250.0},
        },
        "rt_baseline": {"p50_ms": 0.4, "p99_ms": 0.8},
    }
    return doc | overrides


def test_the_single_item_shapes_and_round_trips_are_read_per_the_loop_of_the_same_run() -> None:
    figures = extract(results())
    assert figures == {
        "submit window (x loop)": 0.8,
        "dispatch-64 (x loop)": 3.0,
        "asyncio dispatch-64 (x loop)": 2.0,
        "packed map, 16 in flight (items/s)": 450_000,
        "round trip p50 (x loop)": pytest.approx(1.5),
        "round trip p99 (x loop)": pytest.approx(1.5),
        "submit keep=60 (x submit)": 0.75,
        "submit window (items/s)": 80_000,
        "packed map, 4 in flight (items/s)": 400_000,
        "packed map, 64 in flight (items/s)": 460_000,
        "round trip p50 (ms)": 0.6,
        "round trip p99 (ms)": 1.2,
        "round trip CPU, caller (µs)": 200.0,
        "round trip CPU, worker (µs)": 270.0,
        "round trip CPU, Redis (µs)": 250.0,
        "control: loop, 8 thr x 512 (items/s)": 100_000,
        "control: loop round trip p50 (ms)": 0.4,
    }
    assert [f.name for f in FIGURES if f.hot] == list(figures)[:6]


def test_the_round_trip_s_cpu_is_compared_when_both_runs_have_it_and_left_out_otherwise() -> None:
    doc = results()
    older = results(rt_qs={"p50_ms": 0.6, "p99_ms": 1.2})  # a checkout before the CPU split
    caller = "round trip CPU, caller (µs)"
    cpu = {"bench": 240.0, "consumer": 270.0, "redis": 250.0}  # the caller's 200 µs, +20%
    higher = results(rt_qs={"p50_ms": 0.6, "p99_ms": 1.2, "run_us_per_call": cpu})
    v = judge([(extract(doc), extract(higher))] * 3)
    shown = {c.figure.name: c for c in v.comparisons}
    assert shown[caller].median == pytest.approx(1.2)
    assert shown[caller].status == "worse (not judged)" and v.code == 0
    v = judge([(extract(older), extract(doc))] * 3)
    assert (v.code, v.line) == (0, "guard: ok")
    assert caller not in {c.figure.name for c in v.comparisons}


def test_a_section_the_run_lacks_leaves_its_figures_out_and_fails_the_verdict() -> None:
    doc = results()
    del doc["qs_dispatch_async_64"]
    figures = extract(doc)
    assert "asyncio dispatch-64 (x loop)" not in figures
    v = judge([(figures, extract(results()))] * 3)
    assert v.code == 2
    assert "has no figure 'asyncio dispatch-64 (x loop)'" in v.line


def test_the_same_figures_in_both_runs_pass() -> None:
    v = judge([(extract(results()), extract(results()))] * 3)
    assert (v.code, v.line) == (0, "guard: ok")
    assert {c.median for c in v.comparisons} == {1.0}


def test_the_table_puts_the_judged_figures_first_with_each_pair_s_ratio() -> None:
    v = judge(pairs_of({INFO: [1.0, 1.0, 1.0], LATENCY: [1.10, 1.08, 1.12]}), (INFO, LATENCY))
    lines = markdown(v.comparisons).splitlines()
    assert lines[0].startswith("| figure | better | BASE | HEAD | HEAD/BASE per pair |")
    assert lines[2] == (
        "| **round trip** (ms) | lower | 100.000 | 110.000 | 1.100, 1.080, 1.120 | 1.100"
        " | 1.080 .. 1.120 | REGRESSION |"
    )
    assert lines[3].startswith("| machine (items/s) | higher | 100 | 100 | 1.000, 1.000, 1.000 |")


@pytest.mark.parametrize(
    ("control", "noisy"),
    [([1.0, 1.04, 0.96], False), ([1.0, 1.2, 0.98], True), ([0.9, 1.0, 1.0], True)],
)
def test_a_control_figure_that_moves_more_than_the_limit_marks_the_verdict_noisy(
    control: list[float], noisy: bool
) -> None:
    # the control (the hand-written loop) is the same code on both sides: what it moves is noise
    v = judge(pairs_of({INFO: control, THROUGHPUT: [0.9, 0.9, 0.9]}), FIGS)
    assert v.code == 1  # the verdict stands; the note says how far to trust it
    assert (v.note is not None) == noisy
    if v.note is not None:
        assert f"moved by up to {v.noise:.0%} within a pair" in v.note
        assert v.noise == pytest.approx(max(abs(r - 1) for r in control))
