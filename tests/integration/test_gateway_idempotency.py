"""The gateway's ``Idempotency-Key`` header (docs/http.md, "Idempotency keys") against a real
worker process and a real ``queueserve gateway`` process: the same key gets the same job and
answer, runs once, and a reuse for other items is 422."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
import redis

from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import wait_until
from tests.support.redis_server import prefixed_client

TOKEN = "test-token-idem"


@pytest.fixture(scope="module")
def stack(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[redis.Redis, str, GatewayProc]]:
    prefix = f"qsgi{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway-idem")
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server, prefix, logs, ["tests.support.gateway_app:gated"], ["gated"],
            "--token", TOKEN,
        ) as (_, gateway),
    ):  # fmt: skip
        yield r, prefix, gateway


def http(gateway: GatewayProc) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
    )


def ran(r: redis.Redis, prefix: str) -> list[str]:
    return [x for b in r.lrange(f"{prefix}:gw:batches", 0, -1) for x in json.loads(b)]


def test_the_same_idempotency_key_gets_the_same_job_and_answer_and_runs_once(
    stack: tuple[redis.Redis, str, GatewayProc],
) -> None:
    r, prefix, gateway = stack
    with http(gateway) as client:
        # Given a job submitted with a key, held running
        key = {"Idempotency-Key": '"job-1"'}  # the draft's form: a quoted string
        first = client.post("/v1/servings/gated/jobs", json={"items": ["hold:i1"]}, headers=key)
        assert first.status_code == 202, first.text
        wait_until(lambda: "hold:i1" in ran(r, prefix), "the job to run")
        # When the same key is sent again (the bare form too): the same job
        again = client.post(
            "/v1/servings/gated/jobs",
            json={"items": ["hold:i1"]},
            headers={"Idempotency-Key": "job-1"},
        )
        assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
        # and a reuse of the key for other items is refused
        other = client.post("/v1/servings/gated/jobs", json={"items": ["x"]}, headers=key)
        assert other.status_code == 422, other.text
        assert other.json()["error"]["type"] == "idempotency_conflict"
        r.set(f"{prefix}:gw:open:i1", 1)
        result = client.get(f"/v1/jobs/{again.json()['id']}/result", params={"timeout": 60})
        assert result.json()["results"] == ["r:hold:i1"]

        # The dispatch routes (the fast one included) take the header alike
        for path, body, answer in (
            ("dispatch", {"item": "d"}, {"result": "r:d"}),
            ("dispatch_many", {"items": ["m", "n"]}, {"results": ["r:m", "r:n"]}),
        ):
            for _ in range(2):
                sent = client.post(
                    f"/v1/servings/gated/{path}", json=body, headers={"Idempotency-Key": path}
                )
                assert sent.status_code == 200 and sent.json() == answer, sent.text
        conflict = client.post(
            "/v1/servings/gated/dispatch",
            json={"item": "e"},
            headers={"Idempotency-Key": "dispatch"},
        )
        assert conflict.status_code == 422
        bad = client.post(
            "/v1/servings/gated/dispatch", json={"item": "e"}, headers={"Idempotency-Key": '""'}
        )
        assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["error"]["message"]
    # Then each key ran once
    assert sorted(ran(r, prefix)) == ["d", "hold:i1", "m", "n"]
