"""``python -m queueserve dashboard --port 0 ...`` for the dashboard's tests, and a headless
Chromium driving its page (Debian's chromium and chromium-driver: scripts/_install.sh)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import LISTENING
from tests.support.helpers import REPO, child_env, wait_until


class DashboardProc:
    """The dashboard process; ``url`` once it listens."""

    def __init__(self, redis_url: str, prefix: str, log: Path, *args: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "queueserve", "dashboard", "--port", "0"),
                    *("--redis-url", redis_url, "--prefix", prefix, *args),
                ],
                cwd=REPO,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        port = wait_until(
            lambda: LISTENING.search(self.output()), "the dashboard to listen", process=self
        ).group(1)
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


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
    redis_url: str, prefix: str, directory: Path, token: str
) -> Iterator[DashboardProc]:
    """A worker serving ``tests.support.cli_app:square`` and, once it declared the serving, a
    dashboard process over it that takes ``token``; both stopped on the way out."""
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
        proc = DashboardProc(redis_url, prefix, directory / "dashboard.log", "--token", token)
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        worker.kill_group()
