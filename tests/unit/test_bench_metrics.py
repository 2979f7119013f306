"""bench/generate.py reads its prefill and prefix-cache figures from the worker's /metrics: a
metric with no sample for the serving is an error, never 0 (it read as 0, which printed a
missing metric as a 100% saving)."""

from __future__ import annotations

import pytest

from bench.generate import metric

TEXT = """\
# TYPE queueserve_prefix_cache_lookups_total counter
queueserve_prefix_cache_lookups_total{result="hit",serving="charlm"} 58.0
queueserve_prefix_cache_lookups_total{result="miss",serving="charlm"} 24.0
queueserve_prefill_seconds_total{serving="charlm_cold"} 1.5
queueserve_prefill_seconds_total{serving="charlm"} 0.25
"""


def test_a_metric_sums_the_samples_of_its_serving_only() -> None:
    assert metric(TEXT, "queueserve_prefix_cache_lookups_total", "charlm") == 82.0
    assert metric(TEXT, "queueserve_prefill_seconds_total", "charlm") == 0.25
    assert metric(TEXT, "queueserve_prefill_seconds_total", "charlm_cold") == 1.5


@pytest.mark.parametrize(
    ("name", "serving"),
    [
        ("queueserve_prefix_cache_saved_tokens_total", "charlm"),  # not exported
        ("queueserve_prefix_cache_lookups_total", "charlm_cold"),  # not for this serving
    ],
)
def test_a_missing_metric_is_an_error_not_zero(name: str, serving: str) -> None:
    with pytest.raises(RuntimeError, match=f"no sample of {name} for serving '{serving}'"):
        metric(TEXT, name, serving)
