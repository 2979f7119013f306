"""Tenants (docs/gateway.md, "Tenants"; issue 38): a real ``queueserve gateway --tenants FILE``
in front of a real worker. Each tenant's token names it and its requests carry its name to the
worker; its jobs are its own (another tenant's GET, result, cancel and DELETE answer 404 as for
an id that never existed, and ids cannot be walked back from one's own); its priority ceiling
and queue limit refuse it alone; SIGHUP reloads the file on the same connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

import httpx
import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.client.async_client import job_id_secret
from queueserve.wire.tenants import lane_key
from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import REPO, child_env, stream_key, wait_until
from tests.support.redis_server import prefixed_client

ACME, GLOBEX = "tok-acme-" + uuid4().hex, "tok-globex-" + uuid4().hex
TENANTS = f"""
[tenants.acme]
token = "{ACME}"
weight = 2
max_queued = 2
max_priority = 5

[tenants.globex]
token_sha256 = "{hashlib.sha256(GLOBEX.encode()).hexdigest()}"
"""


@dataclass
class Stack:
    redis: redis.Redis
    redis_url: str
    prefix: str
    worker: WorkerProc
    gateway: GatewayProc
    tenants: Path

    def http(self, token: str | None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.gateway.url, headers=headers, timeout=60)

    def open(self, gate: str) -> None:
        self.redis.set(f"{self.prefix}:gw:open:{gate}", 1)

    def idle(self, name: str) -> str:
        """A serving declared (gated's meta, copied) and never read: what is sent waits."""
        meta = self.redis.hgetall(f"{self.prefix}:{{gated}}:meta")
        self.redis.hset(f"{self.prefix}:{{{name}}}:meta", mapping=meta)
        return name


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix = f"qsten{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("tenants")
    tenants = logs / "tenants.toml"
    tenants.write_text(TENANTS)
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server,
            prefix,
            logs,
            ["tests.support.gateway_app:gated"],
            ["gated"],
            "--tenants",
            str(tenants),
        ) as (worker, gateway),
    ):
        yield Stack(r, redis_server, prefix, worker, gateway, tenants)


def error_of(response: httpx.Response) -> dict[str, Any]:
    return dict(response.json()["error"])


def test_each_token_names_its_tenant_and_a_request_carries_it_to_the_worker(stack: Stack) -> None:
    name = stack.idle(f"idle{uuid4().hex[:6]}")
    jobs = {}
    for token, tenant in ((ACME, "acme"), (GLOBEX, "globex")):
        with stack.http(token) as http:
            submitted = http.post(f"/v1/servings/{name}/jobs", json={"items": [tenant]})
            assert submitted.status_code == 202, submitted.text
            jobs[token] = submitted.json()["id"]
    # Each in its tenant's lane of the batch key, its header naming the tenant
    for tenant in ("acme", "globex"):
        lane = stream_key(stack.prefix, name, lane_key("default", tenant))
        ((_, fields),) = stack.redis.xrange(lane)
        assert msgpack.unpackb(fields[b"h"])[8]["tenant"] == tenant
    assert stack.redis.xlen(stream_key(stack.prefix, name)) == 0
    for token in (None, "tok-nobody", ACME + "x"):
        with stack.http(token) as http:
            refused = http.post(f"/v1/servings/{name}/dispatch", json={"item": 1})
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert stack.redis.get(f"{stack.prefix}:{{{name}}}:queued") == b"2"  # nothing more sent
    for token, job_id in jobs.items():  # (acme's waiting item stops counting against it)
        with stack.http(token) as http:
            assert http.post(f"/v1/jobs/{job_id}/cancel", json={}).json()["cancelled"] is True


def test_the_gateway_writes_its_tenants_weights_where_workers_read_them(stack: Stack) -> None:
    weights = stack.redis.hgetall(f"{stack.prefix}:tenants")
    assert weights == {b"acme": b"2", b"globex": b"1"}


def test_a_tenants_job_is_unknown_to_another_tenant_and_ids_cannot_be_walked(
    stack: Stack,
) -> None:
    # Given a job of acme's, held running, and a second one of acme's after it
    with stack.http(ACME) as acme, stack.http(GLOBEX) as globex:
        first = acme.post("/v1/servings/gated/jobs", json={"items": ["hold:t1"], "keep": 60})
        second = acme.post("/v1/servings/gated/jobs", json={"items": ["x"], "keep": 60})
        first_id, second_id = first.json()["id"], second.json()["id"]
        # Its ids hold a 128-bit tag: the client's counter alone names no job
        counter_id, _, tag = second_id.rpartition(".")
        assert len(tag) == 26 and tag != first_id.rpartition(".")[2]
        # When globex asks for acme's job in every way, or acme walks back from its own id
        never = "0123456789abcdef-1." + "a" * 26
        misses = {
            "globex get": globex.get(f"/v1/jobs/{first_id}"),
            "globex result": globex.get(f"/v1/jobs/{first_id}/result"),
            "globex cancel": globex.post(f"/v1/jobs/{first_id}/cancel", json={}),
            "globex delete": globex.delete(f"/v1/jobs/{first_id}"),
            "walked back": acme.get(f"/v1/jobs/{first_id.rpartition('.')[0]}.{tag}"),
            "no tag": acme.get(f"/v1/jobs/{counter_id}"),
            "never": globex.get(f"/v1/jobs/{never}"),
        }
        # Then each is a 404 as for an id that never existed, naming only the id asked for
        for what, response in misses.items():
            assert response.status_code == 404, (what, response.text)
            error = error_of(response)
            assert error["type"] == "unknown_job", what
            asked = response.request.url.path.split("/")[3]
            assert error["message"] == error_of(misses["never"])["message"].replace(never, asked), (
                what
            )
        # And acme's job was neither cancelled nor forgotten: it runs (once a worker read it:
        # on a busy machine it may still wait), and acme gets its result
        wait_until(
            lambda: acme.get(f"/v1/jobs/{first_id}").json()["status"] == "running",
            "acme's held job running",
        )
        stack.open("t1")
        done = acme.get(f"/v1/jobs/{first_id}/result", params={"timeout": 60})
        assert done.json() == {"id": first_id, "status": "done", "results": ["r:hold:t1"]}


def test_a_tenants_limits_refuse_that_tenant_alone(stack: Stack) -> None:
    with stack.http(ACME) as acme, stack.http(GLOBEX) as globex:
        # Above its max_priority (5): 403, whatever the route
        for path, body in (
            ("/v1/servings/gated/dispatch", {"item": "p", "priority": 6}),
            ("/v1/servings/gated/jobs", {"items": ["p"], "priority": 9}),
        ):
            refused = acme.post(path, json=body)
            assert refused.status_code == 403, refused.text
            assert error_of(refused)["type"] == "priority_not_allowed"
        assert acme.post("/v1/servings/gated/dispatch", json={"item": "p5", "priority": 5}).json()
        assert globex.post("/v1/servings/gated/dispatch", json={"item": "p", "priority": 9}).json()
        # Given acme's 2 items waiting (its max_queued)
        held = acme.post(
            "/v1/servings/gated/jobs", json={"items": ["hold:q1", "hold:q2"], "keep": 60}
        )
        assert held.status_code == 202
        # When acme sends one more: 429 with Retry-After; globex is served meanwhile
        over = acme.post("/v1/servings/gated/jobs", json={"items": ["q3"]})
        assert over.status_code == 429 and over.headers["retry-after"] == "1", over.text
        assert error_of(over)["type"] == "tenant_queue_full"
        assert globex.post("/v1/servings/gated/jobs", json={"items": ["g"]}).status_code == 202
        # Then once its items are answered, acme is admitted again
        stack.open("q1")
        stack.open("q2")
        acme.get(f"/v1/jobs/{held.json()['id']}/result", params={"timeout": 60})
        wait_until(
            lambda: acme.post("/v1/servings/gated/dispatch", json={"item": "a"}).status_code == 200,
            "acme to be admitted again",
        )


def request_on(conn: http.client.HTTPConnection, token: str) -> int:
    conn.request(
        "POST",
        "/v1/servings/gated/dispatch",
        body=json.dumps({"item": "h"}),
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    response = conn.getresponse()
    response.read()
    return response.status


def test_sighup_reloads_the_tenants_on_the_same_connection_and_a_bad_file_changes_nothing(
    stack: Stack,
) -> None:
    url = urlsplit(stack.gateway.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    try:
        assert request_on(conn, ACME) == 200
        sock = conn.sock
        # When the file gives acme a new token and the gateway gets SIGHUP
        rotated = "tok-acme-2-" + uuid4().hex
        original = stack.tenants.read_text()
        stack.tenants.write_text(original.replace(ACME, rotated))
        stack.gateway.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "tenants reloaded" in stack.gateway.output(), "the reload")
        # Then the new token is acme's and the old one no one's, on the same connection
        assert request_on(conn, rotated) == 200
        assert request_on(conn, ACME) == 401
        # And a file that does not load leaves the tenants in force
        stack.tenants.write_text("[tenants.acme]\nweight = -1\n")
        stack.gateway.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "tenants not reloaded" in stack.gateway.output(), "the refusal")
        assert request_on(conn, rotated) == 200
        assert conn.sock is sock  # never reconnected
    finally:
        conn.close()
        stack.tenants.write_text(TENANTS)
        stack.gateway.proc.send_signal(signal.SIGHUP)


def test_tenants_and_token_together_or_a_bad_file_stop_the_gateway_at_start(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.toml"
    cases = {
        "both": ["--tenants", str(bad), "--token", "t"],
        "same token twice": ["--tenants", str(bad)],
    }
    bad.write_text('[tenants.a]\ntoken = "t"\n[tenants.b]\ntoken = "t"\n')
    for what, args in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "queueserve", "gateway", "--port", "0", *args],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0, what
        assert ("both given" if what == "both" else "same token") in done.stderr, done.stderr


def test_the_job_id_key_is_made_once_and_a_forged_one_replaced(redis_server: str) -> None:
    async def secrets_of(prefix: str, callers: int) -> list[bytes]:
        clients = [qs.AsyncClient(redis_server, prefix=prefix) for _ in range(callers)]
        try:
            return list(await asyncio.gather(*(job_id_secret(c) for c in clients)))
        finally:
            for c in clients:
                await c.aclose()

    prefix = f"qsjk{uuid4().hex[:10]}"
    with prefixed_client(redis_server, prefix) as r:
        # Many gateways asking at once for a key no one made get one and the same key
        made = asyncio.run(secrets_of(prefix, 8))
        assert len(set(made)) == 1 and len(made[0]) == 32
        assert r.get(f"{prefix}:jobkey") == made[0]
        # A value anyone wrote that is no key (too short, of another type) is replaced
        for forge in (lambda k: r.set(k, b"short"), lambda k: r.hset(k, "f", "v")):
            r.delete(f"{prefix}:jobkey")
            forge(f"{prefix}:jobkey")
            (fresh,) = asyncio.run(secrets_of(prefix, 1))
            assert len(fresh) == 32 and r.get(f"{prefix}:jobkey") == fresh
