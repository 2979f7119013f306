"""``queueserve dashboard --read-token`` (QUEUESERVE_DASHBOARD_READ_TOKEN): reading the
dashboard's data needs that token (or --token), the page and its script are served to anyone
and render once the token is entered in a real Chromium; without it reading stays open, and a
bind beyond loopback without one is a warning (docs/operations.md, "Dashboard"; issue 38).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys as Key
from selenium.webdriver.remote.webdriver import WebDriver
from starlette.testclient import TestClient

from queueserve.ops import cli
from tests.support.dashboard_proc import DashboardProc, chromium, dashboard_over_a_worker
from tests.support.helpers import wait_until

TOKEN, READ_TOKEN = "dash-token", "read-token"
READS = ("/api/overview", "/api/dead-letters/square", "/metrics")


@pytest.fixture
def dashboard(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[DashboardProc]:
    with dashboard_over_a_worker(
        redis_url, prefix, tmp_path, TOKEN, "--read-token", READ_TOKEN
    ) as proc:
        yield proc


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_reads_need_the_read_token_or_the_token(dashboard: DashboardProc) -> None:
    with httpx.Client(base_url=dashboard.url, timeout=30) as http:
        for path in READS:
            # Without a token, or with another, a read is refused
            for headers in ({}, bearer("nope"), bearer(READ_TOKEN + "x")):
                response = http.get(path, headers=headers)
                assert response.status_code == 401, (path, headers, response.text[:300])
                assert "--read-token" in response.json()["error"]["message"]
            # With the read token, or the token that allows changes, it is answered
            for token in (READ_TOKEN, TOKEN):
                response = http.get(path, headers=bearer(token))
                assert response.status_code == 200, (path, response.text[:300])
        # The page and its script hold no data: served to anyone, they ask for the token
        for path in ("/", "/dashboard.js"):
            assert http.get(path).status_code == 200
        # and the read token changes nothing
        change = http.post(
            "/api/config",
            json={"serving": "square", "assignments": ["batch_size=4"]},
            headers=bearer(READ_TOKEN),
        )
        assert change.status_code == 401, change.text[:300]


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_renders_once_the_read_token_is_entered(
    dashboard: DashboardProc, browser: WebDriver
) -> None:
    # Given the page of a dashboard that needs its read token
    browser.get(dashboard.url)

    def status() -> str:
        return str(browser.execute_script("return document.getElementById('status').textContent"))

    wait_until(lambda: "--read-token" in status(), "the page to say what it needs")
    assert not browser.execute_script("return !!document.querySelector('section.serving')")

    # When the read token is entered, the serving is drawn with its worker
    browser.find_element(By.ID, "token").send_keys(READ_TOKEN, Key.TAB)
    wait_until(
        lambda: browser.execute_script(
            "return document.querySelectorAll('section[data-serving=\"square\"] td').length"
        ),
        "the serving's section",
        process=dashboard,
    )


def served_app(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Any:
    """The app ``queueserve dashboard ARGV`` would serve (uvicorn.run stands in)."""
    found: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: found.update(app=app, **kw))
    assert cli.main(["dashboard", *argv]) == 0
    return found["app"]


def test_the_variable_sets_the_read_token_and_an_open_bind_beyond_loopback_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, redis_url: str
) -> None:
    common = ["--redis-url", redis_url, "--prefix", "qsreadtok"]
    # Given QUEUESERVE_DASHBOARD_READ_TOKEN, the dashboard refuses reads without it
    monkeypatch.setenv("QUEUESERVE_DASHBOARD_READ_TOKEN", READ_TOKEN)
    with TestClient(served_app(monkeypatch, *common)) as http:
        assert http.get("/api/overview").status_code == 401
        assert http.get("/api/overview", headers=bearer(READ_TOKEN)).status_code == 200
    monkeypatch.delenv("QUEUESERVE_DASHBOARD_READ_TOKEN")

    # and without a read token, reading is open; bound beyond loopback, that is a warning
    with caplog.at_level(logging.WARNING, logger="queueserve.dashboard"):
        app = served_app(monkeypatch, *common, "--host", "127.0.0.1")
        assert "without a read token" not in caplog.text
        served_app(monkeypatch, *common, "--host", "0.0.0.0")
    assert "listening on 0.0.0.0 without a read token" in caplog.text
    with TestClient(app) as http:
        assert http.get("/api/overview").status_code == 200
