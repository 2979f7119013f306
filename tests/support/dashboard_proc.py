"""``python -m queueserve dashboard --port 0 ...`` for the dashboard's tests, and a headless
Chromium driving its page (Debian's chromium and chromium-driver: scripts/_install.sh)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import redis
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc
from tests.support.helpers import wait_until


class DashboardProc(GatewayProc):
    """``python -m queueserve dashboard --port 0 ...``; ``url`` once it listens."""

    command = "dashboard"


def chromium() -> webdriver.Chrome:
    """A headless Chromium (Debian's binary and its driver, found on PATH)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        raise RuntimeError(
            "chromium and chromedriver are needed: scripts/test installs them "
            "(apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1100")
    return webdriver.Chrome(options=options, service=Service(driver))


@contextlib.contextmanager
def dashboard_over_a_worker(
    redis_url: str, prefix: str, directory: Path, token: str, *args: str
) -> Iterator[DashboardProc]:
    """A worker serving ``tests.support.cli_app:square`` and, once it declared the serving, a
    dashboard process over it that takes ``token`` (and ``args``); both stopped on the way
    out."""
    worker = WorkerProc(
        [
            "tests.support.cli_app:square",
            *("--redis-url", redis_url, "--prefix", prefix, "--partitions", "1"),
        ],
        redis_url,
        prefix,
        directory / "worker.log",
    )
    proc = None
    try:
        with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
            wait_until(lambda: r.exists(f"{prefix}:{{square}}:meta"), "the worker", process=worker)
        proc = DashboardProc(
            redis_url, prefix, directory / "dashboard.log", "--token", token, *args
        )
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        worker.kill_group()
