"""The HTTP gateway (docs/gateway.md) against a real worker process and a real
``queueserve gateway`` process on a loopback port: each endpoint, each error status, SSE order,
disconnects that cancel, auth, the body limit, batches shared by concurrent HTTP clients, and
the OpenAI endpoints through the official ``openai`` package.

One worker (tests/support/gateway_app.py's servings, tasks.charlm:charlm, tasks.embed:embed)
and one gateway serve the whole module: loading the models once keeps it short.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import numpy as np
import openai
import pytest
import redis
from starlette.applications import Starlette
from starlette.routing import Mount

import queueserve as qs
from queueserve.gateway import create_app
from queueserve.gateway.job_ids import JobIds
from queueserve.gateway.tenants import Tenant
from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import pending_requests, stream_key, wait_until
from tests.support.redis_server import prefixed_client

TOKEN = "test-token-1"
MAX_BODY = 64 * 1024
SERVINGS = [
    "tests.support.gateway_app:gated",
    "tests.support.gateway_app:limited",
    "tests.support.gateway_app:hooked",
    "tests.support.gateway_app:ticker",
    "tasks.charlm:charlm",
    "tasks.embed:embed",
]
NAMES = ["gated", "limited", "hooked", "ticker", "charlm", "embed"]
LONG = {"n": 10**6}  # a ticker request that runs until it is cancelled (about 80 minutes)


@dataclass
class Stack:
    redis: redis.Redis
    redis_url: str
    prefix: str
    worker: WorkerProc
    gateway: GatewayProc

    @property
    def url(self) -> str:
        return self.gateway.url

    def http(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)

    def key(self, name: str) -> str:
        return f"{self.prefix}:gw:{name}"

    def open(self, gate: str) -> None:
        self.redis.set(self.key(f"open:{gate}"), 1)

    def batches(self) -> list[list[Any]]:
        return [json.loads(b) for b in self.redis.lrange(self.key("batches"), 0, -1)]

    def queued(self, serving: str) -> int:
        return int(self.redis.get(f"{self.prefix}:{{{serving}}}:queued") or 0)

    def pending(self, serving: str) -> int:
        return pending_requests(self.redis, stream_key(self.prefix, serving))


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix = f"qsgw{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway")
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server,
            prefix,
            logs,
            SERVINGS,
            NAMES,
            "--token",
            TOKEN,
            "--max-body-bytes",
            str(MAX_BODY),
        ) as (worker, gateway),
    ):
        yield Stack(r, redis_server, prefix, worker, gateway)


def sse(response: httpx.Response) -> Iterator[tuple[str | None, Any]]:
    """(event name, decoded data) of each event of a text/event-stream response."""
    event: str | None = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            yield event, (data if data == "[DONE]" else json.loads(data))
            event = None


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert error["status"] == response.status_code
    return error


# --- JSON endpoints --------------------------------------------------------------------------
def test_dispatch_and_dispatch_many_answer_json(stack: Stack) -> None:
    with stack.http() as http:
        one = http.post("/v1/servings/gated/dispatch", json={"item": "a", "priority": 3})
        many = http.post(
            "/v1/servings/gated/dispatch_many",
            json={"items": ["b", {"x": 1}, [1, 2]], "batch_key": "k", "timeout": 30},
        )
        mixed = http.post(
            "/v1/servings/gated/dispatch_many",
            json={"items": ["c", "bad"], "return_exceptions": True},
        )
    assert one.status_code == 200 and one.json() == {"result": "r:a"}
    assert many.json() == {"results": ["r:b", "r:{'x': 1}", "r:[1, 2]"]}
    ok, failed = mixed.json()["results"]
    assert ok == "r:c"
    assert (
        failed["error"]["type"] == "remote_error"
        and "'bad' is refused" in failed["error"]["message"]
    )


def test_bad_bodies_are_400_saying_what_was_wrong(stack: Stack) -> None:
    with stack.http() as http:
        cases = {
            "not json": http.post(
                "/v1/servings/gated/dispatch",
                content=b"{nope",
                headers={"content-type": "application/json"},
            ),
            "priority": http.post("/v1/servings/gated/dispatch", json={"item": 1, "priority": 10}),
            "unknown field": http.post(
                "/v1/servings/gated/dispatch", json={"item": 1, "colour": "red"}
            ),
            "no items": http.post("/v1/servings/gated/dispatch_many", json={"items": []}),
            "huge int": http.post("/v1/servings/gated/dispatch", json={"item": 10**30}),
            "timeout": http.post("/v1/servings/gated/dispatch", json={"item": 1, "timeout": -1}),
        }
    for what, response in cases.items():
        assert response.status_code == 400, (what, response.text)
        assert error_of(response)["type"] == "bad_request", what
    assert "priority" in error_of(cases["priority"])["message"]
    assert "colour" in error_of(cases["unknown field"])["message"]


def test_unknown_servings_and_routes_are_404(stack: Stack) -> None:
    with stack.http() as http:
        serving = http.post("/v1/servings/nosuch/dispatch", json={"item": 1})
        forbidden_name = http.post("/v1/servings/a:b/dispatch", json={"item": 1})
        route = http.get("/v1/nothing-here")
        method = http.get("/v1/servings/gated/dispatch")
    assert serving.status_code == 404 and error_of(serving)["type"] == "unknown_serving"
    assert "'nosuch'" in error_of(serving)["message"]
    assert forbidden_name.status_code == 404
    assert route.status_code == 404 and error_of(route)["type"] == "not_found"
    assert method.status_code == 405 and error_of(method)["type"] == "method_not_allowed"
    # nothing was queued for the unknown name
    assert not stack.redis.exists(stream_key(stack.prefix, "nosuch"))


def test_a_remote_error_is_502_and_a_timeout_504(stack: Stack) -> None:
    with stack.http() as http:
        remote = http.post("/v1/servings/gated/dispatch", json={"item": "bad"})
        late = http.post("/v1/servings/gated/dispatch", json={"item": "hold:t1", "timeout": 0.5})
        stack.open("t1")
    assert remote.status_code == 502
    assert error_of(remote)["type"] == "remote_error"
    assert "ValueError" in error_of(remote)["message"]
    assert late.status_code == 504 and error_of(late)["type"] == "timeout"


def test_a_full_queue_is_429_with_retry_after(stack: Stack) -> None:
    # Given a request held running on a serving with max_queue=1 (admitted, not acked)
    with ThreadPoolExecutor(1) as pool, stack.http() as http:
        held = pool.submit(http.post, "/v1/servings/limited/dispatch", json={"item": "hold:q"})
        wait_until(lambda: ["hold:q"] in stack.batches(), "the held batch to run")
        # When another request comes, or a job
        refused = http.post("/v1/servings/limited/dispatch", json={"item": "x"})
        job = http.post("/v1/servings/limited/jobs", json={"items": ["y"]})
        stack.open("q")
        # Then each is refused at once, and told when to come back
        for response in (refused, job):
            assert response.status_code == 429, response.text
            assert error_of(response)["type"] == "queue_full"
            assert int(response.headers["retry-after"]) >= 1
        assert held.result().json() == {"result": "r:hold:q"}


async def test_the_app_mounts_in_another_with_a_client_of_yours(stack: Stack) -> None:
    async with qs.AsyncClient(stack.redis_url, prefix=stack.prefix) as client:
        outer = Starlette(routes=[Mount("/qs", app=create_app(client))])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=outer), base_url="http://app"
        ) as http:
            answer = await http.post("/qs/v1/servings/gated/dispatch", json={"item": "m"})
            job = await http.post("/qs/v1/servings/gated/jobs", json={"items": ["j"]})
            where = job.headers["location"]
            result = await http.get(f"{where}/result", params={"timeout": 30})
        assert answer.json() == {"result": "r:m"}
        assert where == f"/qs/v1/jobs/{job.json()['id']}"  # under the mount point
        assert result.json()["results"] == ["r:j"]
        assert await client.dispatch("gated", "still open") == "r:still open"  # not closed


# --- auth, limits, health, metrics ---------------------------------------------------------
def test_auth_is_refused_without_the_token(stack: Stack) -> None:
    with stack.http(token=None) as anonymous, stack.http(token="wrong") as wrong:
        missing = anonymous.post("/v1/servings/gated/dispatch", json={"item": 1})
        bad = wrong.post("/v1/servings/gated/dispatch", json={"item": 1})
        models = anonymous.get("/v1/models")
        health = anonymous.get("/healthz")
    for response in (missing, bad, models):
        assert response.status_code == 401
        assert error_of(response)["type"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    with (
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_a_body_over_the_limit_is_413(stack: Stack) -> None:
    big = json.dumps({"item": "x" * MAX_BODY}).encode()

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    with stack.http() as http:
        declared = http.post(
            "/v1/servings/gated/dispatch", content=big, headers={"content-type": "application/json"}
        )
        streamed = http.post(
            "/v1/servings/gated/dispatch",
            content=chunked(),
            headers={"content-type": "application/json"},
        )
        fits = http.post("/v1/servings/gated/dispatch", json={"item": "x" * 1000})
    for response in (declared, streamed):
        assert response.status_code == 413
        assert error_of(response)["type"] == "body_too_large"
        assert str(MAX_BODY) in error_of(response)["message"]
    assert fits.status_code == 200


def test_metrics_count_http_requests_by_route_and_status(stack: Stack) -> None:
    with stack.http() as http:
        http.post("/v1/servings/gated/dispatch", json={"item": "m"})
        http.post("/v1/servings/nosuch/dispatch", json={"item": "m"})
        http.get(f"/random/{uuid4().hex}")
        for _ in range(2):  # a route per template, whatever the job's id
            http.get(f"/v1/jobs/nobody{uuid4().hex[:8]}-1/result")
        text = http.get("/metrics").text
    assert (
        'queueserve_http_requests_total{method="POST",'
        'route="/v1/servings/{name}/dispatch",status="200"}'
    ) in text
    assert 'route="/v1/servings/{name}/dispatch",status="404"' in text
    assert 'route="other",status="404"' in text
    assert 'method="GET",route="/v1/jobs/{id}/result",status="404"} 2.0' in text
    assert "queueserve_http_request_seconds_bucket" in text


# --- batching ------------------------------------------------------------------------------
def test_concurrent_http_clients_share_batches(stack: Stack) -> None:
    # Given the serving's executor held busy by one request
    items = [f"c{i}" for i in range(32)]
    with ThreadPoolExecutor(len(items) + 1) as pool, stack.http() as http:
        held = pool.submit(http.post, "/v1/servings/gated/dispatch", json={"item": "hold:c"})
        wait_until(lambda: ["hold:c"] in stack.batches(), "the held batch to run")

        def one(item: str) -> Any:
            with stack.http() as own:  # a client, and a connection, of its own
                return own.post("/v1/servings/gated/dispatch", json={"item": item}).json()

        # When 32 HTTP clients send one item each while it runs
        answers = [pool.submit(one, item) for item in items]
        wait_until(lambda: stack.queued("gated") == len(items) + 1, "all 32 to be queued")
        stack.open("c")
        # Then each gets its own answer, and they ran in batches of more than one item
        assert [a.result() for a in answers] == [{"result": f"r:{x}"} for x in items]
        assert held.result().json() == {"result": "r:hold:c"}
    ran = [b for b in stack.batches() if any(x in items for x in b)]
    assert sorted(x for b in ran for x in b) == sorted(items)
    assert max(len(b) for b in ran) > 1, ran


# --- streams ---------------------------------------------------------------------------------
def test_stream_sends_hooks_then_outputs_then_the_result(stack: Stack) -> None:
    with (
        stack.http() as http,
        http.stream("POST", "/v1/servings/hooked/stream", json={"items": ["a", "b"]}) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse(response))
    assert [name for name, _ in events] == ["hook", "hook", "output", "result"]
    assert events[0][1] == {"name": "start", "payload": ["a", "b"], "start": 0, "size": 2}
    assert events[1][1]["name"] == "done" and events[1][1]["payload"] == 2
    assert events[2][1] == {"results": ["r:a", "r:b"], "start": 0, "size": 2}
    assert events[3][1] == {"outputs": [["r:a"], ["r:b"]]}


def test_stream_of_a_step_serving_sends_each_step(stack: Stack) -> None:
    with (
        stack.http() as http,
        http.stream("POST", "/v1/servings/ticker/stream", json={"items": [{"n": 3}]}) as response,
    ):
        events = list(sse(response))
    assert events == [
        ("output", {"results": [0], "start": 0, "size": 1}),
        ("output", {"results": [1], "start": 0, "size": 1}),
        ("output", {"results": [2], "start": 0, "size": 1}),
        ("result", {"outputs": [[0, 1, 2]]}),
    ]


def test_an_error_mid_stream_is_the_last_event_after_the_outputs_before_it(
    stack: Stack,
) -> None:
    with (
        stack.http() as http,
        http.stream(
            "POST", "/v1/servings/ticker/stream", json={"items": [{"n": 5, "fail_at": 2}]}
        ) as response,
    ):
        assert response.status_code == 200  # sent with the first event
        events = list(sse(response))
    assert [name for name, _ in events] == ["output", "output", "error"]
    assert [data["results"] for _, data in events[:2]] == [[0], [1]]
    error = events[2][1]["error"]
    assert error["type"] == "remote_error" and "failed at step 2" in error["message"]


def test_stream_errors_before_the_first_event_get_their_status(stack: Stack) -> None:
    with stack.http() as http:
        unknown = http.post("/v1/servings/nosuch/stream", json={"items": [1]})
        remote = http.post("/v1/servings/gated/stream", json={"items": ["bad"]})
    assert unknown.status_code == 404
    assert remote.status_code == 502 and error_of(remote)["type"] == "remote_error"


def test_a_stream_whose_client_disconnects_leaves_the_running_set(stack: Stack) -> None:
    # Given a step request that would run for a million steps, streaming
    with (
        stack.http() as http,
        http.stream("POST", "/v1/servings/ticker/stream", json={"items": [LONG]}) as response,
    ):
        events = sse(response)
        assert [next(events)[1]["results"] for _ in range(3)] == [[0], [1], [2]]
        assert stack.pending("ticker") == 1
    # When its HTTP client disconnects, Then the worker drops it and acks it
    wait_until(
        lambda: stack.pending("ticker") == 0 and stack.queued("ticker") == 0,
        "the disconnected stream's request to leave the running set",
    )
    with stack.http() as http:  # and the serving goes on serving
        after = http.post("/v1/servings/ticker/dispatch", json={"item": {"n": 2}})
    assert after.json() == {"result": [0, 1]}


def test_a_dispatch_whose_client_disconnects_is_cancelled(stack: Stack) -> None:
    # Given a running step request sent by a raw HTTP client
    body = json.dumps({"item": LONG}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            b"POST /v1/servings/ticker/dispatch HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        wait_until(lambda: stack.pending("ticker") == 1, "the request to run")
    # When the client goes, Then the request leaves the running set
    wait_until(
        lambda: stack.pending("ticker") == 0 and stack.queued("ticker") == 0,
        "the disconnected dispatch's request to leave the running set",
    )


# --- jobs -------------------------------------------------------------------------------------
def test_a_job_submitted_over_http_is_followed_by_id_from_a_python_client(stack: Stack) -> None:
    # Given a job submitted over HTTP, held running
    with stack.http() as http, qs.Client(stack.redis_url, prefix=stack.prefix) as client:
        submitted = http.post(
            "/v1/servings/gated/jobs", json={"items": ["hold:j1", "b"], "keep": 60}
        )
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        assert submitted.headers["location"] == f"/v1/jobs/{job_id}"
        # The part before the tag is the job's id for Python clients (this process is not
        # the gateway's)
        job = client.job(job_id.rpartition(".")[0])
        wait_until(lambda: job.status() == "running", "the job to run")
        shown = http.get(f"/v1/jobs/{job_id}").json()
        assert shown == {"id": job_id, "status": "running", "done": 0, "total": 2}
        # When it is not done, its result is 202 with where it stands
        early = http.get(f"/v1/jobs/{job_id}/result", params={"timeout": 0})
        assert early.status_code == 202 and early.json()["status"] == "running"
        # Then once it ends, the Python client and HTTP both get its results
        stack.open("j1")
        assert job.result(timeout=60) == ["r:hold:j1", "r:b"]
        done = http.get(f"/v1/jobs/{job_id}/result", params={"timeout": 60})
        assert done.json() == {"id": job_id, "status": "done", "results": ["r:hold:j1", "r:b"]}
        assert http.get(f"/v1/jobs/{job_id}").json()["done"] == 2
        # And forgetting it over HTTP deletes it for everyone
        assert http.delete(f"/v1/jobs/{job_id}").json() == {"id": job_id, "forgotten": True}
        assert job.status() == "expired"
        for gone in (http.get(f"/v1/jobs/{job_id}"), http.delete(f"/v1/jobs/{job_id}")):
            assert gone.status_code == 404 and error_of(gone)["type"] == "unknown_job"


def test_a_job_submitted_from_python_is_answered_over_http_with_its_errors(stack: Stack) -> None:
    with stack.http() as http, qs.Client(stack.redis_url, prefix=stack.prefix) as client:
        job_id = client.submit("gated", ["bad", "c"], keep=60).id
        # Its Python id is no HTTP id: no tenant sees it
        assert http.get(f"/v1/jobs/{job_id}/result").status_code == 404
        # Its HTTP id, minted for the tenant that --token names, is followed over HTTP
        path = f"/v1/jobs/{http_id(stack, 'default', job_id)}/result"
        failed = http.get(path, params={"timeout": 60})
        assert failed.status_code == 502 and error_of(failed)["type"] == "remote_error"
        each = http.get(path, params={"return_exceptions": "true"}).json()
        assert each["status"] == "failed" and each["results"][1] == "r:c"
        assert each["results"][0]["error"]["type"] == "remote_error"


def test_cancel_over_http_of_a_queued_job(stack: Stack) -> None:
    # Given a serving declared but not consumed (its worker's meta hash, copied): jobs wait
    idle = f"{stack.prefix}:{{idle}}:meta"
    stack.redis.hset(idle, mapping=stack.redis.hgetall(f"{stack.prefix}:{{gated}}:meta"))
    with stack.http() as http:
        job_id = http.post("/v1/servings/idle/jobs", json={"items": ["x"]}).json()["id"]
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        assert stack.redis.xlen(stream_key(stack.prefix, "idle")) == 1
        # When it is cancelled over HTTP
        cancelled = http.post(f"/v1/jobs/{job_id}/cancel").json()
        # Then it leaves its stream, never to run, and says so to every reader
        assert cancelled == {
            "id": job_id,
            "cancelled": True,
            "status": "cancelled",
            "done": 0,
            "total": 1,
        }
        assert stack.redis.xlen(stream_key(stack.prefix, "idle")) == 0
        assert http.post(f"/v1/jobs/{job_id}/cancel").json()["cancelled"] is False
        result = http.get(f"/v1/jobs/{job_id}/result")
        assert result.status_code == 409 and error_of(result)["type"] == "cancelled"


def test_job_ids_that_are_wrong_are_404_as_unknown_ones_and_wrong_queries_400(
    stack: Stack,
) -> None:
    with stack.http() as http:
        for forged in ("a:b-1", "x-1,x-2", "{x}-1", "a%20b-1", "x" * 100 + "-1", "nodash"):
            refused = http.get(f"/v1/jobs/{forged}")
            assert refused.status_code == 404, forged
            assert error_of(refused)["type"] == "unknown_job"
        assert http.get("/v1/jobs/nobody-1").status_code == 404
        for query in ({"timeout": "-1"}, {"timeout": "nan"}, {"return_exceptions": "1"}, {"x": 1}):
            assert http.get("/v1/jobs/nobody-1/result", params=query).status_code == 400
        no_keep = http.post("/v1/servings/gated/jobs", json={"items": ["a"], "keep": 0})
        assert no_keep.status_code == 400 and "keep" in error_of(no_keep)["message"]
        unknown = http.post("/v1/servings/nope/jobs", json={"items": ["a"]})
        assert unknown.status_code == 404


# --- OpenAI-compatible endpoints, through the official client --------------------------------
def test_openai_embeddings(stack: Stack) -> None:
    with stack.openai() as client:
        texts = ["a cat sat on the mat", "queues of work, served in batches"]
        floats = client.embeddings.create(
            model="all-MiniLM-L6-v2", input=texts, encoding_format="float"
        )
        packed = client.embeddings.create(model="embed", input=texts, encoding_format="base64")
        one = client.embeddings.create(model="embed", input=texts[0])
        assert [d.index for d in floats.data] == [0, 1]
        for a, b in zip(floats.data, packed.data, strict=True):
            assert len(a.embedding) == 384
            assert math.isclose(sum(x * x for x in a.embedding), 1.0, rel_tol=1e-4)
            # asked for explicitly, base64 comes as it was sent: little-endian float32
            unpacked = np.frombuffer(base64.b64decode(str(b.embedding)), dtype="<f4")
            assert a.embedding == pytest.approx(unpacked.tolist(), abs=1e-6)
        assert one.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-5)
        assert floats.model == "all-MiniLM-L6-v2"
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="text-embedding-3-small", input="x")


def test_openai_completions_with_and_without_stream(stack: Stack) -> None:
    with stack.openai() as client:
        whole = client.completions.create(
            model="charlm", prompt="The queue ", max_tokens=24, temperature=0
        )
        chunks = list(
            client.completions.create(
                model="charlm", prompt="The queue ", max_tokens=24, temperature=0, stream=True
            )
        )
        text = whole.choices[0].text
        assert len(text) == 24 and whole.choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks) == text  # greedy: the same text
        assert len(chunks) == 25  # a chunk per character, then the finish reason
        assert chunks[-1].choices[0].finish_reason == "length"
        both = client.completions.create(
            model="charlm", prompt=["The queue ", "A"], max_tokens=5, temperature=0
        )
        assert [c.index for c in both.choices] == [0, 1]
        assert both.choices[0].text == text[:5]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="charlm", prompt="x", n=2)


def test_openai_models_lists_the_servings_and_aliases(stack: Stack) -> None:
    with stack.openai() as client:
        ids = {m.id for m in client.models.list()}
    assert set(NAMES) | {"all-MiniLM-L6-v2"} <= ids


def test_many_threads_of_openai_clients_at_once(stack: Stack) -> None:
    with stack.openai() as client:
        results: list[Any] = []
        lock = threading.Lock()

        def embed(i: int) -> None:
            vector = client.embeddings.create(model="embed", input=f"text {i}").data[0].embedding
            with lock:
                results.append(len(vector))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(embed, range(16)))
        assert results == [384] * 16


def http_id(stack: Stack, tenant: str, job_id: str) -> str:
    """The id over HTTP of a job made from Python, for ``tenant`` (gateway/job_ids.py)."""

    async def mint() -> str:
        async with qs.AsyncClient(stack.redis_url, prefix=stack.prefix) as client:
            return await JobIds(client).http_id(Tenant(tenant), job_id)

    return asyncio.run(mint())
