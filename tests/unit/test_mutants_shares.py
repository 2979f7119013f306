"""What queueserve/worker/pipeline/shares.py promises beyond tests/unit/test_tenant_lane_batches.py,
each written for a mutant that survived it and the other named tests (docs/testing.md): an
assembler starts with no weights; the reader's hand-over of the tenants' weights (``share_tenants``)
changes them only when they changed, says so once in the log an operator reads, reaches a step
serving's queue (its joins follow them), and passes over what has no shares."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from queueserve.worker.pipeline.batching import Assembler
from queueserve.worker.pipeline.shares import share_tenants
from queueserve.worker.stepping.joins import StepQueue

LOGGER = "queueserve.worker.pipeline.shares"


def test_an_assembler_starts_with_no_weights_and_no_marks() -> None:
    a = Assembler(capacity=10, timeout=0.0)
    assert a.weights == {} and a.shares.tenants == {} and a.shares.marks == []


def test_changed_weights_are_handed_over_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    a, cond = Assembler(capacity=10, timeout=0.0), threading.Condition()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        share_tenants(a, {"acme": 2.0}, cond, "embed")
        assert a.shares.tenants == {"acme": 2.0}
        share_tenants(a, {"acme": 2.0}, cond, "embed")  # unchanged: nothing more to say
        share_tenants(a, {}, cond, "embed")
    assert a.shares.tenants == {} and a.shares.marks == []
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "serving embed: tenants' weights now {'acme': 2.0}",
        "serving embed: tenants' weights now all 1",
    ]


def test_a_step_serving_queue_takes_the_weights_and_what_has_no_shares_is_passed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = StepQueue(4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        share_tenants(queue, {"acme": 2.0}, threading.Condition(), "gen")
        share_tenants(SimpleNamespace(shares=None), {"acme": 2.0}, threading.Condition(), "x")
        share_tenants(object(), {"acme": 2.0}, threading.Condition(), "x")  # no shares at all
    assert queue.shares.tenants == {"acme": 2.0} and queue.read_marks() == ["~acme=2.0"]
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "serving gen: tenants' weights now {'acme': 2.0}"
    ]
