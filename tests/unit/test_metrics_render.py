"""/metrics collections: concurrent scrapes share one, a later scrape never reads an older one."""

from __future__ import annotations

import threading

import pytest

from queueserve.worker.metrics_server import _Rendered
from tests.support.helpers import wait_until


def test_a_scrape_after_another_collects_afresh() -> None:
    # Given a registry whose reading changes between two scrapes
    readings = iter([b"busy 1\n", b"busy 2\n"])
    rendered = _Rendered(lambda: next(readings))
    # When one scrape follows the other at once
    # Then the second reads the registry as it is now, not the first one's collection
    assert rendered() == b"busy 1\n"
    assert rendered() == b"busy 2\n"


def test_scrapes_that_arrive_during_a_collection_share_it() -> None:
    # Given a collection held open
    started, release = threading.Event(), threading.Event()
    calls = []

    def render() -> bytes:
        calls.append(1)
        started.set()
        assert release.wait(10)
        return b"once\n"

    rendered = _Rendered(render)
    first = threading.Thread(target=rendered)
    first.start()
    assert started.wait(10)
    # When four more scrapes arrive meanwhile
    results: list[bytes] = []
    others = [threading.Thread(target=lambda: results.append(rendered())) for _ in range(4)]
    for t in others:
        t.start()
    # (Condition keeps its waiters in _waiters: the one way to know all four are inside)
    assert wait_until(lambda: len(rendered._cond._waiters) == 4, "four scrapes waiting")
    release.set()
    for t in [first, *others]:
        t.join(10)
    # Then the registry was read once, and every scrape got that reading
    assert results == [b"once\n"] * 4
    assert len(calls) == 1


def test_a_failed_collection_fails_its_scrape_and_the_next_one_collects() -> None:
    attempts = iter([RuntimeError("redis down"), b"ok\n"])

    def render() -> bytes:
        outcome = next(attempts)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    rendered = _Rendered(render)
    with pytest.raises(RuntimeError, match="redis down"):
        rendered()
    assert rendered() == b"ok\n"
