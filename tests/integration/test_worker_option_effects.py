"""The worker's option-effect table (tests/integration/test_option_effects.py's twin): every
field of WorkerOptions, set each way the docs allow, acts through a real worker.

First row: ``QUEUESERVE_PARTITIONS`` sets ``qs.Worker``'s partitions, as every other
``QUEUESERVE_<NAME>`` variable sets its option.
"""

from __future__ import annotations

import pytest

import queueserve as qs


def _echo(items: list[object]) -> list[object]:
    return items


def test_qs_worker_serves_one_partition_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    # qs.Worker's default is 1 (queueserve worker's: auto); QUEUESERVE_PARTITIONS wins over
    # it (it did not: the keyword's default of 1 was taken as given), and a keyword over that
    monkeypatch.delenv("QUEUESERVE_PARTITIONS", raising=False)
    serving = qs.Serving(_echo, name="echo")
    assert qs.Worker(serving).options.partitions == 1
    for text, value in (("2", 2), ("auto", "auto")):
        monkeypatch.setenv("QUEUESERVE_PARTITIONS", text)
        assert qs.Worker(serving).options.partitions == value
    assert qs.Worker(serving, partitions=3).options.partitions == 3
