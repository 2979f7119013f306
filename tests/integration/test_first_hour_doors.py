"""The first hour without a wrong turn (issue 36), at the doors other than the worker: the job
CLI, the dashboard and the gateway. Each test runs the real command (a worker, a gateway or a
dashboard process) against a real Redis and checks what a new user sees: the exit code and the
JSON a script reads, the page's words, the probe a load balancer asks, the startup log and the
error body. Nothing waits on a sleep: every wait is for a condition with a deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from selenium.webdriver.remote.webdriver import WebDriver

import queueserve as qs
from queueserve.settings import redact_url
from tests.support.dashboard_proc import DashboardProc, chromium
from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc
from tests.support.helpers import REPO, WAIT_S, child_env, wait_until
from tests.support.redis_server import RedisServer

EXIT_JOB_FAILED = 5  # docs/operations.md, "Supervision and exit codes"
TOKEN = "doors-token"


# --- queueserve job wait -------------------------------------------------------------------
def job_cli(redis_url: str, prefix: str, *args: str) -> tuple[int, Any, str]:
    """``queueserve job ARGS`` as a user types it: its exit code, its stdout read as JSON
    (None when it is not), and its stderr."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "job",
            *args,
            *("--redis-url", redis_url, "--prefix", prefix),
        ],
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    try:
        out = json.loads(done.stdout)
    except ValueError:
        out = None
    return done.returncode, out, done.stdout + done.stderr


@pytest.fixture
def gated_worker(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> Iterator[None]:
    """A worker process serving tests.support.gateway_app:gated (the item "bad" raises)."""
    worker = WorkerProc.one_partition(
        ["tests.support.gateway_app:gated"], redis_url, prefix, tmp_path / "worker.log"
    )
    try:
        wait_until(
            lambda: redis_client.exists(f"{prefix}:{{gated}}:meta"), "the worker", process=worker
        )
        yield
    finally:
        worker.kill_group()


def test_job_wait_exits_with_the_failed_code_and_json_for_a_failed_job_and_0_for_a_good_one(
    gated_worker: None, redis_url: str, prefix: str
) -> None:
    # Given a job one of whose items fails, and a job whose items all succeed
    with qs.Client(redis_url, prefix=prefix) as client:
        failed = client.submit("gated", ["a", "bad"], keep=60).id
        good = client.submit("gated", ["b"], keep=60).id

    # When a script waits for each with `queueserve job wait`
    code, out, text = job_cli(redis_url, prefix, "wait", failed, "--timeout", "60")

    # Then the failed one exits with the documented code, and its JSON holds the good item's
    # result and the failed item's error as JSON (not a Python repr)
    assert code == EXIT_JOB_FAILED, text
    assert out == {
        "id": failed,
        "status": "failed",
        "progress": {"done": 2, "total": 2},
        "result": [
            "r:a",
            {"error": {"type": "ValueError", "message": "the item 'bad' is refused"}},
        ],
    }, text

    # and the good one exits 0 with its results
    code, out, text = job_cli(redis_url, prefix, "wait", good, "--timeout", "60")
    assert code == 0, text
    assert out == {
        "id": good,
        "status": "done",
        "progress": {"done": 1, "total": 1},
        "result": ["r:b"],
    }, text


def test_the_failed_job_exit_code_is_in_the_help_and_the_docs() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "queueserve", "--help"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    ).stdout
    assert f"{EXIT_JOB_FAILED} `job wait`: the job failed" in help_text
    operations = (REPO / "docs" / "operations.md").read_text()
    assert f"| {EXIT_JOB_FAILED} | `queueserve job wait`: the job ended failed" in operations


# --- queueserve dashboard ------------------------------------------------------------------
def declare(r: redis.Redis, prefix: str, names: list[str]) -> None:
    """Declarations as workers write them (a meta hash holding the codec, and the serving in
    the registry the listings read), without workers."""
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hset(f"{prefix}:{{{name}}}:meta", mapping={"codec": "msgpack", "batch_size": "8"})
        pipe.zadd(f"{prefix}:servings", {name: int(time.time() * 1000)})
    pipe.execute()


@pytest.fixture
def dashboard(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> Iterator[DashboardProc]:
    """A dashboard process over the test's prefix, where no worker declared anything yet."""
    proc = DashboardProc(redis_url, prefix, tmp_path / "dashboard.log")
    try:
        yield proc
    finally:
        proc.stop()


def overview(dashboard: DashboardProc, **query: str) -> dict[str, Any]:
    response = httpx.get(f"{dashboard.url}/api/overview", params=query, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_overview_of_a_prefix_without_servings_says_where_it_looked(
    dashboard: DashboardProc, redis_url: str, prefix: str
) -> None:
    answer = overview(dashboard)
    assert answer["servings"] == []
    assert (answer["total"], answer["matched"], answer["prefix"]) == (0, 0, prefix)
    assert answer["redis"] == redact_url(redis_url)


def test_past_a_hundred_servings_the_overview_says_how_many_and_pages_and_filters_them(
    dashboard: DashboardProc, redis_client: redis.Redis, prefix: str
) -> None:
    # Given 105 servings under the prefix
    names = [f"s-{i:03d}" for i in range(105)]
    declare(redis_client, prefix, names)

    # Then the first page holds 100 of them and says there are 105
    first = overview(dashboard)
    assert (first["total"], first["matched"], first["offset"], first["limit"]) == (105, 105, 0, 100)
    assert [s["name"] for s in first["servings"]] == names[:100]
    # the next page holds the rest
    rest = overview(dashboard, offset="100")
    assert [s["name"] for s in rest["servings"]] == names[100:]
    # and a filter keeps the names that hold it
    some = overview(dashboard, filter="10")
    assert (some["total"], some["matched"]) == (105, 6)
    assert [s["name"] for s in some["servings"]] == [names[10], *names[100:]]

    # A bad offset is refused, naming it
    response = httpx.get(f"{dashboard.url}/api/overview?offset=-1", timeout=WAIT_S)
    assert response.status_code == 400
    assert "offset must be a whole number" in response.json()["error"]["message"]
    assert "'-1'" in response.json()["error"]["message"]


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def text_of(browser: WebDriver, selector: str) -> str:
    text = browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", selector
    )
    return str(text)


def sections(browser: WebDriver) -> int:
    return int(
        browser.execute_script("return document.querySelectorAll('section.serving').length;")
    )


def test_the_page_says_no_serving_is_declared_then_pages_past_a_hundred(
    dashboard: DashboardProc,
    browser: WebDriver,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given the page of a prefix where no worker declared a serving
    browser.get(dashboard.url)

    # Then it says so, where it looked, and how to start one (not a blank page)
    said = f"no serving has been declared under prefix {prefix} on {redact_url(redis_url)}"
    wait_until(lambda: said in text_of(browser, "#notice"), "the notice", process=dashboard)
    assert "queueserve worker" in text_of(browser, "#notice code")

    # When 105 servings are declared
    declare(redis_client, prefix, [f"s-{i:03d}" for i in range(105)])

    # Then the page shows 100 and says there are 105
    wait_until(lambda: "servings 1 to 100 of 105" in text_of(browser, "#notice"), "the count")
    wait_until(lambda: sections(browser) == 100, "a page of servings")
    # and its next page shows the other 5
    browser.execute_script("document.getElementById('next').click();")
    wait_until(lambda: "servings 101 to 105 of 105" in text_of(browser, "#notice"), "page two")
    wait_until(lambda: sections(browser) == 5, "the rest")
    assert "Traceback" not in dashboard.output(), dashboard.output()


# --- queueserve gateway --------------------------------------------------------------------
def status(url: str, **headers: str) -> int:
    try:
        return httpx.get(url, headers=headers, timeout=10).status_code
    except httpx.TransportError:
        return 0


def test_readyz_is_503_while_redis_is_down_and_200_again_once_it_answers(
    redis_tmp_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    # Given a gateway (with a token) on a Redis of the test's own
    gateway = GatewayProc(redis_tmp_server.url, prefix, tmp_path / "gateway.log", "--token", TOKEN)
    try:
        # Then /readyz answers 200 without the token, as a load balancer asks
        assert status(f"{gateway.url}/readyz") == 200, gateway.output()

        # When Redis stops
        redis_tmp_server.stop()
        # Then /readyz answers 503 (in the gateway's error shape), /healthz still 200
        wait_until(
            lambda: status(f"{gateway.url}/readyz") == 503, "/readyz to say 503", process=gateway
        )
        body = httpx.get(f"{gateway.url}/readyz", timeout=10).json()
        assert body["error"]["type"] == "redis_unavailable"
        assert status(f"{gateway.url}/healthz") == 200
        wait_until(lambda: "gateway: not ready" in gateway.output(), "the outage logged")

        # When Redis is back on its port
        redis_tmp_server.start()
        # Then /readyz answers 200 again, and the recovery is logged
        wait_until(
            lambda: status(f"{gateway.url}/readyz") == 200, "/readyz to say 200", process=gateway
        )
        wait_until(lambda: "gateway: ready again" in gateway.output(), "the recovery logged")
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.output(), gateway.output()


def test_the_gateway_logs_its_redis_and_auth_and_warns_of_a_model_mapped_to_no_serving(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given a serving declared under the prefix
    declare(redis_client, prefix, ["declared"])
    # When a gateway starts mapping one model to it and one to a serving no worker declared
    gateway = GatewayProc(
        redis_url,
        prefix,
        tmp_path / "gateway.log",
        *("--model", "gpt-4=nosuch", "--model", "my-embedder=declared", "--token", TOKEN),
    )
    try:
        log = gateway.output()
    finally:
        gateway.stop()
    # Then its startup log names the Redis (redacted), the prefix and that auth is on
    started = f"gateway: Redis {redact_url(redis_url)} (given), prefix {prefix!r}, auth on"
    assert started in log, log
    # and warns of the model mapped to a serving no worker declared (only), naming both
    warned = [line for line in log.splitlines() if "WARNING" in line and "--model" in line]
    assert len(warned) == 1, log
    assert "gpt-4=nosuch" in warned[0] and "'nosuch'" in warned[0], warned
    assert "servings declared there: declared" in warned[0], warned


def test_the_404_for_a_mapped_model_names_the_model_asked_for_and_its_serving(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given a gateway mapping model gpt-4 to a serving no worker declared
    gateway = GatewayProc(redis_url, prefix, tmp_path / "gateway.log", "--model", "gpt-4=nosuch")
    try:
        # When a caller asks for that model
        response = httpx.post(
            f"{gateway.url}/v1/embeddings", json={"model": "gpt-4", "input": "a"}, timeout=WAIT_S
        )
    finally:
        gateway.stop()
    # Then the 404 names the model it asked for and the serving that model maps to
    assert response.status_code == 404, response.text
    message = response.json()["error"]["message"]
    assert "model 'gpt-4'" in message and "serving 'nosuch'" in message, message
    assert "model 'nosuch'" not in message, message


def test_a_gateway_without_a_token_says_auth_is_off(
    redis_client: redis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    gateway = GatewayProc(redis_url, prefix, tmp_path / "gateway.log")
    try:
        assert "auth off: every route is open" in gateway.output(), gateway.output()
    finally:
        gateway.stop()
