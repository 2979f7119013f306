"""What the OpenAI routes promise beyond tests/integration/test_openai_contract.py and
test_gateway_params.py, each written for a mutant of queueserve/gateway/openai_api.py that
survived them (docs/testing.md), through a real ``queueserve gateway`` and worker processes:
what a completion request becomes as an item, a streamed completion of more prompts than a
request holds, finish reasons in a stream, the models list's fields, each 404 and 502 saying
what is wrong, a call withdrawn when its client goes, and a generation whose partition died
ending its stream with the error ``restarted`` and ``[DONE]``."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
import redis

from queueserve.wire.keys import Keys
from tests.support.fault_app import WorkerProc
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import pending_requests, stream_key, wait_until
from tests.support.redis_server import prefixed_client

SERVINGS = [
    "tests.support.gateway_app:spell",
    "tests.support.gateway_app:gated",
    "tests.support.openai_probe_app:parrot",
    "tests.support.openai_probe_app:paced",
    "tests.support.openai_probe_app:matrices",
]
NAMES = ["spell", "gated", "parrot", "paced", "matrices"]
UNMAPPED = "gpt-probe"  # --model gpt-probe=nosuch: an alias of a serving nobody declared
SPELL_SLOTS = 8  # spell's max_slots: a streamed request holds at most that many prompts


@dataclass
class Stack:
    redis: redis.Redis
    prefix: str
    worker: WorkerProc
    gateway: GatewayProc

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, timeout=60)

    def pending(self, serving: str) -> int:
        return pending_requests(self.redis, stream_key(self.prefix, serving))

    def queued(self, serving: str) -> int:
        return int(self.redis.get(f"{self.prefix}:{{{serving}}}:queued") or 0)

    def batches(self) -> list[list[Any]]:
        return [json.loads(b) for b in self.redis.lrange(f"{self.prefix}:gw:batches", 0, -1)]


def stack_of(redis_server: str, logs: Path, *args: str) -> Iterator[Stack]:
    prefix = f"qsom{uuid4().hex[:10]}"
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(redis_server, prefix, logs, SERVINGS, NAMES, *args) as (worker, gateway),
    ):
        yield Stack(r, prefix, worker, gateway)


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from stack_of(
        redis_server, tmp_path_factory.mktemp("openai-mutants"), "--model", f"{UNMAPPED}=nosuch"
    )


def completion(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    with stack.http() as http:
        answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["type"] == kind, body
    message: str = body["message"]
    return message


def stream_chunks(stack: Stack, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed completion, which must end with ``[DONE]``."""
    with (
        stack.http() as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


# --- what a completion request becomes ---------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "item"),
    [
        ({}, {"max_new": 16, "temperature": 1.0, "seed": 0, "stop": None}),
        (
            {"max_tokens": 5, "temperature": 0.5, "seed": 7, "stop": "ab"},
            {"max_new": 5, "temperature": 0.5, "seed": 7, "stop": "ab"},
        ),
        ({"max_tokens": 0, "seed": 0, "stop": ["x"]}, {"max_new": 0, "seed": 0, "stop": "x"}),
        ({"stop": []}, {"stop": None}),
        ({"stop": ""}, {"stop": None}),
    ],
    ids=["defaults", "each-set", "stop-list", "stop-empty-list", "stop-empty"],
)
def test_a_completions_fields_reach_the_serving_as_its_item_says(
    stack: Stack, fields: dict[str, Any], item: dict[str, Any]
) -> None:
    # OpenAI's defaults where a field is left out: 16 tokens, temperature 1, no stop; seed 0
    answer = completion(stack, {"model": "parrot", "prompt": "p", **fields})
    sent = json.loads(answer["choices"][0]["text"])
    assert {k: sent[k] for k in item} == item
    assert sent["prompt"] == "p"


def test_a_completion_without_max_tokens_is_16_tokens(stack: Stack) -> None:
    answer = completion(stack, {"model": "spell", "prompt": "abc"})
    assert answer["choices"][0]["text"] == "abc" * 5 + "a"


# --- streams -----------------------------------------------------------------------------------
def test_a_stream_of_more_prompts_than_a_request_holds_keeps_each_choice_its_own(
    stack: Stack,
) -> None:
    # Given more prompts than one streamed request holds (spell's max_slots): two requests,
    # the second's events counted from its own first prompt; the last prompt's text, 'kbk',
    # ends with the stop string
    prompts = [f"{chr(97 + i)}b" for i in range(SPELL_SLOTS + 3)]
    body = {"model": "spell", "prompt": prompts, "max_tokens": 3, "stop": "kbk"}
    *steps, last = stream_chunks(stack, body)
    texts = [""] * len(prompts)
    for chunk in steps:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    # Then each choice holds its own prompt's text, whatever request carried it, and finishes
    # by its own text
    assert texts == [(p * 2)[:3] for p in prompts]
    assert texts[-1] == "kbk"
    finished = [(c["index"], c["finish_reason"]) for c in last["choices"]]
    assert finished == [(i, "length") for i in range(len(prompts) - 1)] + [
        (len(prompts) - 1, "stop")
    ]


def test_a_streamed_choice_finishes_stop_when_its_whole_text_ends_with_the_stop_string(
    stack: Stack,
) -> None:
    # 'aba' ends with 'ba' (its last piece, 'a', alone does not); 'xyz' does not
    body = {"model": "spell", "prompt": ["ab", "xyz"], "max_tokens": 3, "stop": "ba"}
    last = stream_chunks(stack, body)[-1]
    assert [(c["index"], c["finish_reason"]) for c in last["choices"]] == [
        (0, "stop"),
        (1, "length"),
    ]
    # and a choice with no text at all ends with no stop string
    body = {"model": "spell", "prompt": "ab", "max_tokens": 0, "stop": "X"}
    chunks = stream_chunks(stack, body)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == ""
    assert [c["finish_reason"] for c in chunks[-1]["choices"]] == ["length"]


# --- the models list, and what each error says -------------------------------------------------
def test_each_model_is_listed_owned_by_queueserve_and_created_at_0(stack: Stack) -> None:
    with stack.http() as http:
        listed = http.get("/v1/models").json()["data"]
    assert sorted(m["id"] for m in listed) == sorted(NAMES)  # (the unmapped alias is not)
    for m in listed:
        assert m == {"id": m["id"], "object": "model", "created": 0, "owned_by": "queueserve"}


def test_a_404_names_the_model_asked_for_and_the_serving_it_maps_to(stack: Stack) -> None:
    with stack.http() as http:
        mapped = http.post("/v1/embeddings", json={"model": UNMAPPED, "input": "a"})
        named = http.post("/v1/completions", json={"model": "nosuch", "prompt": "a"})
        # a stream is refused before its answer starts, with the same words
        streamed = http.post(
            "/v1/completions", json={"model": "nosuch", "prompt": "a", "stream": True}
        )
    assert "serving 'nosuch', which model 'gpt-probe' maps to (--model)," in error(
        mapped, 404, "unknown_serving"
    )
    for refused in (named, streamed):
        assert "model 'nosuch' (taken as a serving's name: no --model maps it)" in error(
            refused, 404, "unknown_serving"
        )


def test_dimensions_is_refused_saying_to_leave_it_out(stack: Stack) -> None:
    with stack.http() as http:
        answer = http.post("/v1/embeddings", json={"model": "spell", "input": "a", "dimensions": 2})
    assert error(answer, 400, "bad_request") == (
        "dimensions is not supported: leave it out (a serving's vectors have the width its "
        "model makes)"
    )


def test_a_result_that_is_no_vector_is_502_saying_what_it_is(stack: Stack) -> None:
    with stack.http() as http:
        text = http.post("/v1/embeddings", json={"model": "gated", "input": "a"})
        matrix = http.post("/v1/embeddings", json={"model": "matrices", "input": "a"})
    assert error(text, 502, "unencodable_result").startswith(
        "the serving's result is not a vector of numbers: could not convert string to float"
    )
    assert error(matrix, 502, "unencodable_result") == (
        "the serving's result has shape (2, 2), not a vector's"
    )


# --- a client that goes --------------------------------------------------------------------------
def send_and_leave(stack: Stack, path: str, body: dict[str, Any], running: Any) -> None:
    """POST ``body`` over a raw socket, wait until ``running()`` holds, and close the socket."""
    data = json.dumps(body).encode()
    host, port = stack.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_until(running, f"the request to {path} to be in the worker")


def test_a_completion_whose_client_disconnects_is_withdrawn(stack: Stack) -> None:
    # Given a generation of 100,000 steps (1,000 s), its client gone
    body = {"model": "paced", "prompt": "ab", "max_tokens": 10**5}
    send_and_leave(stack, "/v1/completions", body, lambda: stack.pending("paced") == 1)
    # Then it leaves the running set
    wait_until(
        lambda: stack.pending("paced") == 0 and stack.queued("paced") == 0,
        "the disconnected completion to leave the running set",
    )


def test_an_embeddings_call_whose_client_disconnects_never_runs(stack: Stack) -> None:
    # Given the serving's one partition held by a batch, and an embeddings call queued behind
    # it whose client goes
    held: list[httpx.Response] = []

    def hold() -> None:
        with stack.http() as http:
            held.append(http.post("/v1/embeddings", json={"model": "gated", "input": "hold:e"}))

    cancels = stack.redis.pubsub(ignore_subscribe_messages=True)
    cancels.subscribe(Keys(stack.prefix, "gated").cancel)
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        wait_until(lambda: ["hold:e"] in stack.batches(), "the holding batch to run")
        body = {"model": "gated", "input": "left behind"}
        send_and_leave(stack, "/v1/embeddings", body, lambda: stack.queued("gated") == 2)
        # Then it is withdrawn: taken out of its stream unread, or the worker that read it
        # told to drop it
        wait_until(
            lambda: stack.queued("gated") == 1 or cancels.get_message(timeout=0.01),
            "the disconnected call's withdrawal",
        )
    finally:
        cancels.close()
        stack.redis.set(f"{stack.prefix}:gw:open:e", 1)
        holder.join(60)
    assert held and held[0].status_code == 502  # (gated answers text: no vector)
    # and it never runs
    wait_until(lambda: stack.queued("gated") == 0, "the holding batch to end")
    assert not any("left behind" in batch for batch in stack.batches())


# --- a generation whose partition dies -----------------------------------------------------------
@pytest.fixture
def own_stack(redis_server: str, tmp_path: Path) -> Iterator[Stack]:
    yield from stack_of(redis_server, tmp_path)


@pytest.mark.timeout(180)
def test_a_stream_whose_partition_dies_ends_with_the_error_restarted_then_done(
    own_stack: Stack,
) -> None:
    stack = own_stack
    pid_key = f"{stack.prefix}:gw:paced_pid"
    body = {"model": "paced", "prompt": "ab", "max_tokens": 3000, "stream": True}
    with (
        stack.http() as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        # Given a generation under way (a chunk of it received)
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] == "a"
        # When the partition running it is SIGKILLed, and the worker's next one runs it again
        stack.worker.kill_partition(int(stack.redis.get(pid_key) or 0))
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    # Then what was streamed is void: the stream ends with the error, then [DONE]
    assert rest[-1] == "[DONE]", rest[-3:]
    last = json.loads(rest[-2])
    assert last == {
        "error": {
            "type": "restarted",
            "status": 502,
            "message": "the worker generating this completion died and another runs it again "
            "from the start: what was streamed is void; ask again",
            "param": None,
            "code": None,
        }
    }
