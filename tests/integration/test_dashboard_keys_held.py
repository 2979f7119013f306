"""The dashboard shows which partition holds which keys (issue 41; docs/usage.md, "Many models
behind one serving"): a worker of a serving with ``load_key`` says in its heartbeat record the
batch keys whose state it holds, and the dashboard's workers table names them, through its API
and in a real Chromium; a serving without ``load_key`` has no such column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import queueserve as qs
from queueserve.wire.figures import HELD_KEY_SHOWN, HELD_SHOWN, held_keys
from tests.support.dashboard_proc import DashboardProc, chromium
from tests.support.fault_app import WorkerProc
from tests.support.helpers import wait_until


@pytest.fixture
def served(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[DashboardProc]:
    """A worker of ``keyed`` (max_loaded_keys 2) that ran keys a, b and c, and a dashboard."""
    worker = WorkerProc.one_partition(
        ["tests.support.key_app:keyed", "tests.support.cli_app:square"],
        redis_url,
        prefix,
        tmp_path / "worker.log",
    )
    proc = None
    try:
        with qs.Client(redis_url, prefix=prefix) as client:
            for key in ("a", "b", "c"):  # c's load evicts a, the least recently used
                assert client.dispatch("keyed", 1, batch_key=key, timeout=60) == f"model-{key}:1"
            assert client.dispatch("square", 3, timeout=60) == 9
        proc = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log")
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        worker.kill_group()


def workers_of(url: str, serving: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/api/overview", timeout=30)
    assert response.status_code == 200, response.text[:500]
    (row,) = [s for s in response.json()["servings"] if s["name"] == serving]
    workers: list[dict[str, Any]] = row["workers"]
    return workers


def test_the_workers_table_names_the_keys_each_partition_holds(served: DashboardProc) -> None:
    # Given a partition holding b and c (a was evicted), its heartbeat says so within a beat
    held = wait_until(
        lambda: (
            (w := workers_of(served.url, "keyed")) and sorted(w[0]["keys_held"]) == ["b", "c"] and w
        ),
        "the keys held in the dashboard's API",
        process=served,
    )
    assert held[0]["keys_held_count"] == 2
    assert workers_of(served.url, "square")[0]["keys_held_count"] == 0  # no load_key
    # Then the page's workers table of keyed has a column naming them; square's has none
    browser = chromium()
    try:
        browser.get(served.url)

        def column(serving: str) -> list[str] | None:
            found: list[str] | None = browser.execute_script(
                "const s = document.querySelector(`section[data-serving='${arguments[0]}']`);"
                "if (!s) return null;"
                "const t = [...s.querySelectorAll('table')].find((t) =>"
                "  t.querySelector('th') && t.querySelector('th').textContent === 'consumer');"
                "if (!t) return null;"
                "return [...t.querySelectorAll('tr')].map((tr) =>"
                "  [...tr.children].map((c) => c.textContent).join('|'));",
                serving,
            )
            return found

        rows = wait_until(lambda: column("keyed"), "keyed's workers table", process=served)
        assert rows[0].endswith("|failed|keys held"), rows
        assert rows[1].split("|")[-1] in ("b, c", "c, b"), rows
        square = wait_until(lambda: column("square"), "square's workers table", process=served)
        assert square[0].endswith("|failed"), square
    finally:
        browser.quit()


def test_a_held_field_is_read_as_far_as_it_is_shown_whatever_a_stranger_wrote() -> None:
    assert held_keys("") == ([], 0)
    assert held_keys("a\nb\n") == (["a", "b"], 2)
    many = "\n".join(f"k{i}" for i in range(10_000))
    assert held_keys(many) == ([f"k{i}" for i in range(HELD_SHOWN)], 10_000)
    assert held_keys("x" * 5000) == (["x" * HELD_KEY_SHOWN], 1)
