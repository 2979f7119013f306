"""``python -m queueserve dashboard --port 0 ...`` for the dashboard's tests, and a headless
Chromium driving its page (Debian's chromium and chromium-driver: scripts/_install.sh)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

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
