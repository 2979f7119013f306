"""Progress of long ``map`` runs (issue 5): ``on_progress(done, total)`` and the tqdm bar."""

from __future__ import annotations

import io
import re
from collections.abc import Callable

import pytest

import queueserve as qs
from queueserve.client.progress import Progress
from tests.support.servings import square_items

StartWorker = Callable[..., qs.Worker]


@pytest.fixture
def square(start_worker: StartWorker) -> qs.Serving:
    serving = qs.Serving(square_items, name="square", batch_size=4, batch_timeout=0)
    start_worker(serving)
    return serving


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def assert_counts_rise_to(
    calls: list[tuple[int, int | None]], done: int, total: int | None
) -> None:
    counts = [d for d, _ in calls]
    assert counts == sorted(set(counts)), f"not strictly increasing: {calls}"
    assert counts[-1] == done
    assert {t for _, t in calls} == {total}


def test_on_progress_counts_reach_the_total_of_a_list(
    square: qs.Serving, client: qs.Client
) -> None:
    calls: list[tuple[int, int | None]] = []
    items = list(range(10))

    results = list(
        client.map(
            square,
            items,
            chunk_size=3,
            max_in_flight=2,
            on_progress=lambda d, t: calls.append((d, t)),
        )
    )

    assert results == [x * x for x in items]
    assert calls == [(3, 10), (6, 10), (9, 10), (10, 10)]
    assert_counts_rise_to(calls, 10, 10)


def test_on_progress_total_is_none_for_an_input_without_len(
    square: qs.Serving, client: qs.Client
) -> None:
    calls: list[tuple[int, int | None]] = []

    results = list(
        client.map(
            square,
            (x for x in range(7)),
            chunk_size=3,
            on_progress=lambda d, t: calls.append((d, t)),
        )
    )

    assert results == [x * x for x in range(7)]
    assert calls == [(3, None), (6, None), (7, None)]


def test_progress_without_a_terminal_draws_nothing_and_does_not_fail(
    square: qs.Serving, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    stderr = io.StringIO()  # not a TTY, as under cron, Celery or a pipe
    monkeypatch.setattr("sys.stderr", stderr)

    results = list(client.map(square, range(9), chunk_size=4, progress=True))

    assert results == [x * x for x in range(9)]
    assert stderr.getvalue() == ""


def test_progress_on_a_terminal_draws_a_bar_that_reaches_the_total(
    square: qs.Serving, client: qs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    stderr = Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    calls: list[tuple[int, int | None]] = []

    results = list(
        client.map(
            square,
            range(9),
            chunk_size=4,
            progress=True,
            on_progress=lambda d, t: calls.append((d, t)),
        )
    )

    assert results == [x * x for x in range(9)]
    assert re.search(r"100%.*\b9/9 .*item/s", stderr.getvalue()), stderr.getvalue()
    assert calls == [(4, 9), (8, 9), (9, 9)]  # the bar and the callback together


async def test_async_map_reports_progress_too(
    square: qs.Serving, redis_url: str, prefix: str
) -> None:
    calls: list[tuple[int, int | None]] = []

    async with qs.AsyncClient(redis_url, prefix=prefix) as aclient:
        results = [
            r
            async for r in aclient.map(
                square,
                list(range(10)),
                chunk_size=4,
                progress=True,
                on_progress=lambda d, t: calls.append((d, t)),
            )
        ]

    assert results == [x * x for x in range(10)]
    assert calls == [(4, 10), (8, 10), (10, 10)]


def test_progress_counts_without_a_worker() -> None:
    calls: list[tuple[int, int | None]] = []
    meter = Progress(5, bar=True, callback=lambda d, t: calls.append((d, t)))  # stderr: no TTY
    meter.advance(2)
    meter.advance(3)
    meter.close()
    assert calls == [(2, 5), (5, 5)]
