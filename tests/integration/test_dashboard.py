"""``queueserve dashboard`` in a real headless Chromium against a real worker process
(docs/operations.md, "Dashboard"): the page shows the serving, its workers and its numbers
moving under load, replays a dead letter (the request is then served) and sets an option; and
it asks a slow server for one overview at a time.

(docs/img/dashboard.png is taken by test_dashboard_health.py, with a failing, a busy and an
idle serving.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys as Key
from selenium.webdriver.remote.webdriver import WebDriver

import queueserve as qs
from queueserve.wire.keys import Keys
from tests.support.dashboard_proc import DashboardProc, chromium, dashboard_over_a_worker
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import stream_key, wait_until

TOKEN = "dash-token"


@pytest.fixture
def dashboard(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[DashboardProc]:
    with dashboard_over_a_worker(redis_url, prefix, tmp_path, TOKEN) as proc:
        yield proc


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


# The page draws itself again each second: elements are read and clicked in one script each,
# never held across a redraw.
SECTION = 'section[data-serving="square"]'


def figure(browser: WebDriver, name: str) -> str:
    text = browser.execute_script(
        "const b = document.querySelector(arguments[0]); return b ? b.textContent : '';",
        f"{SECTION} .{name} b",
    )
    return str(text)


def exists(browser: WebDriver, selector: str) -> bool:
    return bool(browser.execute_script("return !!document.querySelector(arguments[0]);", selector))


def click(browser: WebDriver, selector: str) -> None:
    browser.execute_script("document.querySelector(arguments[0]).click();", selector)


def forge_dead_letter(r: redis.Redis, prefix: str, inbox: RawInbox, rid: int) -> str:
    """A dead letter as a worker writes one (ops/deadletter.py reads it): one item, 7."""
    record = {
        "stream": stream_key(prefix, "square"),
        "entry_id": "1-0",
        "reason": "the batch function timed out 3 times",
        "deliveries": 3,
        "at_ms": int(time.time() * 1000) - 90_000,
        "field:h": header(rid, 1, inbox.key),
        "field:p": msgpack.packb([7]),
    }
    return str(r.xadd(Keys(prefix, "square").dead, record).decode())


def test_the_page_shows_numbers_moving_replays_a_dead_letter_and_sets_an_option(
    dashboard: DashboardProc,
    browser: WebDriver,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given the page of a live worker's serving
    browser.get(dashboard.url)
    wait_until(lambda: figure(browser, "items-run"), "the serving's section", process=dashboard)
    before = int(figure(browser, "items-run"))
    assert exists(browser, f"{SECTION} td"), "no worker row"

    # When callers send load, the items run move on the page
    stop = threading.Event()

    def load() -> None:
        with qs.Client(redis_url, prefix=prefix) as client:
            while not stop.is_set():
                client.dispatch_many("square", list(range(32)), timeout=60)

    sender = threading.Thread(target=load)
    sender.start()
    try:
        wait_until(lambda: int(figure(browser, "items-run") or 0) > before, "the numbers to move")
        wait_until(
            lambda: figure(browser, "throughput") not in ("", "\u2013", "0.0"), "a throughput"
        )

        # and a dead letter shows with its replay button
        inbox = RawInbox(redis_client, prefix)
        dead_id = forge_dead_letter(redis_client, prefix, inbox, 41)
        replay = f'button.replay[data-id="{dead_id}"]'
        wait_until(lambda: exists(browser, replay), "the dead letter")
    finally:
        stop.set()
        sender.join(90)

    # Then replaying it through the page (with the token) serves the request
    browser.find_element(By.ID, "token").send_keys(TOKEN, Key.TAB)
    click(browser, replay)
    wait_until(lambda: inbox.answered([41]), "the replayed request's answer")
    assert inbox.slices[41][0][3] == [49]
    wait_until(lambda: figure(browser, "dead") == "0", "the dead letter gone from the page")

    # and an option set on the page reaches the serving's workers
    browser.execute_script(
        "const s = document.querySelector(arguments[0]);"
        "s.querySelector('input.config').value = 'batch_size=16';"
        "s.querySelector('.config-set').click();",
        SECTION,
    )
    keys = Keys(prefix, "square")
    wait_until(lambda: redis_client.hget(keys.config, "batch_size") == b"16", "the option set")
    assert "Traceback" not in dashboard.output(), dashboard.output()


# Wraps the page's fetch before its script runs: each read of the overview answers after
# SLOW_MS, longer than the page's poll period, and the page records how many were in flight.
SLOW_MS = 1500
SLOW_OVERVIEW = f"""
window.overviewReads = {{ inFlight: 0, most: 0, done: 0 }};
const plainFetch = window.fetch.bind(window);
window.fetch = async (...args) => {{
  if (!String(args[0]).includes("api/overview")) return plainFetch(...args);
  const reads = window.overviewReads;
  reads.inFlight += 1;
  reads.most = Math.max(reads.most, reads.inFlight);
  try {{
    await new Promise((resolve) => setTimeout(resolve, {SLOW_MS}));
    return await plainFetch(...args);
  }} finally {{
    reads.inFlight -= 1;
    reads.done += 1;
  }}
}};
"""


def test_a_slow_server_gets_one_overview_read_at_a_time(
    browser: WebDriver, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given a dashboard whose overview answers slower than the page polls
    proc = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log")
    try:
        browser.execute_cdp_cmd(  # type: ignore[attr-defined]
            "Page.addScriptToEvaluateOnNewDocument", {"source": SLOW_OVERVIEW}
        )
        browser.get(proc.url)

        # When the page has read it three times, and a change asks for a redraw meanwhile
        def reads() -> dict[str, int]:
            return dict(browser.execute_script("return window.overviewReads;"))

        wait_until(lambda: reads()["done"] >= 1, "the first read", process=proc)
        browser.execute_script("refresh();")
        wait_until(lambda: reads()["done"] >= 3, "three reads", process=proc)

        # Then no read of it ever began before the one in flight had ended (polling each
        # second regardless, three were in flight at once)
        assert reads()["most"] == 1, reads()
    finally:
        proc.stop()
