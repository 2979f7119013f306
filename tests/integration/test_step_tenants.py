"""Tenants on a step serving (issue 38; docs/gateway.md, "Tenants"): tenants' lanes of one key
share its prefill and decode calls, a tenant's request joins before another's backlog, and
while a tenant is active another does not take its last slot, so its request joins at the next
boundary instead of waiting a whole generation of someone else's (stepping.py, rule 1).

The worker runs in this process (``start_worker``); held requests (``hold``) keep their slots
until the serving's gate opens, so "while" below is a condition, never a sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import queueserve as qs
from queueserve.wire.tenants import lane_key
from queueserve.worker.stepping import joins as stepping
from tests.support.callers import Caller
from tests.support.helpers import WAIT_S, wait_until
from tests.support.step_app import Count, Records, expected

StartWorker = Callable[..., qs.Worker]


class Calls(Count):
    """``Count`` that keeps, per decode call, whose sequences it decoded (items' ``who``)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[list[str]] = []  # a list: the worker's copy records into the test's
        self._calls_lock = threading.Lock()

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        with self._calls_lock:
            self.calls.append(sorted(s["item"].get("who", "") for s in states))
        return super().decode(states)

    def snapshot(self) -> list[list[str]]:
        with self._calls_lock:
            return list(self.calls)


@pytest.fixture
def no_reserve_lapse(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A tenant stays active for the whole test, however slow the machine."""
    monkeypatch.setattr(stepping, "RESERVE_FOR_S", 3600.0)
    yield


def test_tenants_lanes_of_one_key_share_its_decode_calls(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given tenant a's request generating (held), on the default key
    serving = Calls(max_slots=4)
    start_worker(serving)
    held = Caller(client, "count", [{"n": 2, "hold": True, "who": "a"}], tenant="a")
    held.next_event()
    # When tenant b's request joins while it runs
    got = client.dispatch("count", {"n": 3, "base": 7, "who": "b"}, tenant="b", timeout=30)
    # Then b's answer is its own, and its steps were decoded in the same calls as a's: the
    # serving sees one key (a call per lane would take a step's time per tenant)
    assert got == expected({"n": 3, "base": 7})
    shared = [who for who in serving.snapshot() if who == ["a", "b"]]
    assert len(shared) >= 3, serving.snapshot()
    assert all(len(who) == len(set(who)) for who in serving.snapshot())
    serving.gate.set()
    assert held.finished.wait(WAIT_S) and held.error is None


def test_an_active_tenants_request_joins_while_another_tenant_holds_the_other_slots(
    start_worker: StartWorker,
    client: qs.Client,
    no_reserve_lapse: None,
    pending: Callable[..., int],
) -> None:
    # Given a quiet tenant that sent a request (it is active), and a flood tenant that then
    # sends more held requests than the serving has slots, all six read by the worker
    records = Records()
    serving = Calls(max_slots=4)
    start_worker(serving, middleware=[records])
    assert client.dispatch("count", {"n": 1, "who": "quiet"}, tenant="quiet", timeout=30) == [0]
    flood = [
        Caller(client, "count", [{"n": 1, "hold": True, "who": "flood"}], tenant="flood")
        for _ in range(6)
    ]
    wait_until(lambda: pending("count", lane_key("default", "flood")) == 6, "the flood read")
    wait_until(lambda: any(r.slots >= 3 for r in records.snapshot()), "the flood in 3 slots")
    seen = len(records.snapshot())
    wait_until(lambda: len(records.snapshot()) >= seen + 5, "a few steps more of the flood")
    # Then the flood holds 3 of the 4 slots: one stays free for the quiet tenant
    assert max(r.slots for r in records.snapshot()) == 3
    # When the quiet tenant sends a request while the flood's run (and more of them wait)
    got = client.dispatch("count", {"n": 2, "base": 5, "who": "quiet"}, tenant="quiet", timeout=30)
    # Then it is answered while every held request still runs or waits, from calls it shared
    assert got == expected({"n": 2, "base": 5})
    assert not any(c.finished.is_set() for c in flood)
    assert ["flood", "flood", "flood", "quiet"] in serving.snapshot()
    serving.gate.set()
    for c in flood:
        assert c.finished.wait(WAIT_S) and c.error is None


def test_one_tenant_alone_fills_every_slot(start_worker: StartWorker, client: qs.Client) -> None:
    # Given one tenant only (none other sent anything): no slot is kept for anyone
    records = Records()
    serving = Calls(max_slots=4)
    start_worker(serving, middleware=[records])
    flood = [
        Caller(client, "count", [{"n": 1, "hold": True, "who": "flood"}], tenant="flood")
        for _ in range(4)
    ]
    wait_until(lambda: any(r.slots == 4 for r in records.snapshot()), "all four slots running")
    serving.gate.set()
    for c in flood:
        assert c.finished.wait(WAIT_S) and c.error is None
