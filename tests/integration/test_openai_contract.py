"""The gateway's OpenAI answers against OpenAI's published schema, not against what a client
tolerates: tests/contracts/openai_schema.json is a trimmed copy of OpenAI's openapi.json (its
``x-source`` names the commit), and every JSON the OpenAI routes of a real ``queueserve
gateway`` process answer is validated against it with ``jsonschema``: embeddings (float and
base64), completions, each chunk of a completion stream and the ``data: [DONE]`` that must end
it, the models list, and the error body of each status the routes document.

The official ``openai`` client reads past a missing ``[DONE]``, a wrong ``object`` or a missing
``usage`` (tests/integration/test_gateway.py uses it): these tests read the bytes.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args
from uuid import uuid4

import httpx
import jsonschema
import numpy as np
import openai.types as oai
import pytest
import redis
from openai.types.shared import ErrorObject

from tests.contracts.openai_app import FAIL_AT
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.helpers import wait_until
from tests.support.redis_server import prefixed_client

SCHEMA_PATH = Path(__file__).parents[1] / "contracts" / "openai_schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
TOKEN = "contract-token"
MAX_BODY = 16 * 1024
SERVINGS = [
    "tests.support.gateway_app:vectors",
    "tests.support.gateway_app:spell",
    "tests.support.gateway_app:gated",
    "tests.support.gateway_app:limited",
    "tests.contracts.openai_app:faltering",
]
NAMES = ["vectors", "spell", "gated", "limited", "faltering"]
ALIAS = "text-embedding-3-small"  # --model ALIAS=vectors
JSON_TYPE = {"content-type": "application/json"}  # a body not sent as JSON is 415


def validate(instance: Any, name: str) -> None:
    """``instance`` against ``$defs[name]`` of the copied schema (every error at once)."""
    schema = {"$defs": SCHEMA["$defs"], "$ref": f"#/$defs/{name}"}
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, (name, instance, errors)


# --- the copy itself -------------------------------------------------------------------------
COPIED = {  # $defs name -> the openai package's type of the same object
    "CreateEmbeddingResponse": oai.CreateEmbeddingResponse,
    "Embedding": oai.Embedding,
    "CreateCompletionResponse": oai.Completion,
    "CompletionUsage": oai.CompletionUsage,
    "Model": oai.Model,
    "Error": ErrorObject,
}


def test_the_schema_copy_names_its_source_and_requires_what_the_openai_package_requires() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    source = SCHEMA["x-source"]
    assert source["repository"] == "https://github.com/openai/openai-openapi"
    assert len(source["commit"]) == 40 and source["info.version"]
    # An independent second source: each field the package's types require, the copy requires
    # (the package types a nullable required field, Error's param and code, as optional)
    for name, model in COPIED.items():
        required = {f for f, info in model.model_fields.items() if info.is_required()}
        assert required <= set(SCHEMA["$defs"][name]["required"]), name
        assert set(model.model_fields) >= set(SCHEMA["$defs"][name]["required"]), name
    # and each object's name is the one the package fixes
    for name, model in COPIED.items():
        field = model.model_fields.get("object")
        if field is not None:
            assert (
                list(get_args(field.annotation))
                == SCHEMA["$defs"][name]["properties"]["object"]["enum"]
            ), name


def test_the_stream_chunk_is_the_response_with_a_null_finish_reason_allowed() -> None:
    """CreateCompletionStreamChunk is the one schema not copied: nothing else may differ."""
    chunk = json.loads(json.dumps(SCHEMA["$defs"]["CreateCompletionStreamChunk"]))
    whole = SCHEMA["$defs"]["CreateCompletionResponse"]
    del chunk["$comment"]
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    assert reason["anyOf"][1] == {"type": "null"}
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = reason["anyOf"][0]
    assert chunk == whole


# --- a real gateway --------------------------------------------------------------------------
@dataclass
class Stack:
    redis: redis.Redis
    prefix: str
    gateway: GatewayProc

    def http(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.gateway.url, headers=headers, timeout=60)

    def batches(self) -> list[list[Any]]:
        return [json.loads(b) for b in self.redis.lrange(f"{self.prefix}:gw:batches", 0, -1)]


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix = f"qsoc{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("openai-contract")
    with (
        prefixed_client(redis_server, prefix) as r,
        gateway_stack(
            redis_server,
            prefix,
            logs,
            SERVINGS,
            NAMES,
            *("--token", TOKEN, "--max-body-bytes", str(MAX_BODY)),
            *("--model", f"{ALIAS}=vectors"),
        ) as (_, gateway),
    ):
        yield Stack(r, prefix, gateway)


def json_of(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def data_lines(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an OpenAI stream, checking its framing on the way: data-only
    events (no ``event:`` names), each one line followed by a blank line."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: ") :] for event in events]


def chunks_then_done(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of a stream that ends with ``data: [DONE]`` and nothing after it."""
    lines = data_lines(response)
    assert lines[-1] == "[DONE]", lines[-3:]
    assert "[DONE]" not in lines[:-1]
    return [json.loads(line) for line in lines[:-1]]


# --- each endpoint's answers -----------------------------------------------------------------
def test_embeddings_answer_the_published_shape_with_usage(stack: Stack) -> None:
    with stack.http() as http:
        many = json_of(http.post("/v1/embeddings", json={"model": "vectors", "input": ["a", "bc"]}))
        one = json_of(http.post("/v1/embeddings", json={"model": ALIAS, "input": "xyz"}))
        packed = json_of(
            http.post(
                "/v1/embeddings",
                json={"model": "vectors", "input": ["a", "bc"], "encoding_format": "base64"},
            )
        )
    for answer in (many, one):
        validate(answer, "CreateEmbeddingResponse")
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert [d["embedding"] for d in many["data"]] == [[1.0, 1.0], [2.0, 1.0]]
    assert one["model"] == ALIAS and one["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    # base64 (the spec types an embedding as floats only; OpenAI's API and clients send and
    # read a string then): the base64 of the float answer's little-endian float32, and with
    # it in place of the string, the published shape
    for d in packed["data"]:
        vector = np.frombuffer(base64.b64decode(d["embedding"], validate=True), dtype="<f4")
        d["embedding"] = vector.tolist()
    assert packed == many
    validate(packed, "CreateEmbeddingResponse")


def test_completions_answer_the_published_shape_with_usage_holding_zeros(stack: Stack) -> None:
    with stack.http() as http:
        one = json_of(
            http.post("/v1/completions", json={"model": "spell", "prompt": "ab", "max_tokens": 5})
        )
        two = json_of(
            http.post(
                "/v1/completions",
                json={"model": "spell", "prompt": ["ab", "xyz"], "max_tokens": 3, "stop": "a"},
            )
        )
    for answer in (one, two):
        validate(answer, "CreateCompletionResponse")
        assert answer["id"].startswith("cmpl-")
        # optional in the schema, sent always by OpenAI's API; docs/gateway.md says zeros
        assert answer["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert one["choices"] == [
        {"text": "ababa", "index": 0, "logprobs": None, "finish_reason": "length"}
    ]
    assert [(c["text"], c["finish_reason"]) for c in two["choices"]] == [
        ("aba", "stop"),  # spell does not stop: the text ends with the stop string
        ("xyz", "length"),
    ]


def test_every_chunk_of_a_completion_stream_has_the_published_shape_and_done_ends_it(
    stack: Stack,
) -> None:
    body = {"model": "spell", "prompt": ["ab", "xyz"], "max_tokens": 3, "stream": True}
    with stack.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        chunks = chunks_then_done(response)
    for chunk in chunks:
        validate(chunk, "CreateCompletionStreamChunk")
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    *steps, last = chunks
    texts = ["", ""]
    for chunk in steps:
        for c in chunk["choices"]:
            assert c["finish_reason"] is None
            texts[c["index"]] += c["text"]
    assert texts == ["aba", "xyz"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in last["choices"]] == [
        (0, "", "length"),
        (1, "", "length"),
    ]


def test_an_error_in_mid_stream_is_an_error_object_and_done_still_ends_the_stream(
    stack: Stack,
) -> None:
    body = {"model": "faltering", "prompt": "fail here", "max_tokens": 10, "stream": True}
    with stack.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = data_lines(response)
    assert lines[-1] == "[DONE]", lines
    *steps, error = (json.loads(line) for line in lines[:-1])
    assert len(steps) == FAIL_AT  # the steps made before it, then the error
    for chunk in steps:
        validate(chunk, "CreateCompletionStreamChunk")
    validate(error, "ErrorResponse")
    assert error["error"]["type"] == "remote_error"
    assert f"failed at step {FAIL_AT}" in error["error"]["message"]


def test_the_models_list_has_the_published_shape(stack: Stack) -> None:
    with stack.http() as http:
        answer = json_of(http.get("/v1/models"))
    validate(answer, "ListModelsResponse")
    assert {m["id"] for m in answer["data"]} == {*NAMES, ALIAS}


# --- errors ----------------------------------------------------------------------------------
def assert_error(response: httpx.Response, status: int, kind: str) -> None:
    body = json_of(response, status)
    validate(body, "ErrorResponse")
    assert body["error"]["type"] == kind and body["error"]["status"] == status, body


def test_each_documented_error_status_of_the_openai_routes_has_the_published_shape(
    stack: Stack,
) -> None:
    embed = {"model": "vectors", "input": "a"}
    with stack.http() as http, stack.http(token=None) as anonymous:
        for path, body in [
            ("/v1/embeddings", embed),
            ("/v1/completions", {"model": "spell", "prompt": "a"}),
        ]:
            assert_error(anonymous.post(path, json=body), 401, "unauthorized")
            assert_error(http.post(path, content=b"{nope", headers=JSON_TYPE), 400, "bad_request")
            assert_error(http.post(path, json={**body, "model": "nosuch"}), 404, "unknown_serving")
            assert_error(
                http.post(path, json={**body, "pad": "x" * MAX_BODY}), 413, "body_too_large"
            )
            assert_error(http.get(path), 405, "method_not_allowed")
        assert_error(anonymous.get("/v1/models"), 401, "unauthorized")
        assert_error(
            http.post("/v1/embeddings", json={**embed, "input": [[1, 2]]}), 400, "bad_request"
        )
        assert_error(
            http.post("/v1/embeddings", json={**embed, "dimensions": 8}), 400, "bad_request"
        )
        completion = {"model": "spell", "prompt": "a", "n": 2}
        assert_error(http.post("/v1/completions", json=completion), 400, "bad_request")
        # a serving that fails the item: 502, and one whose answer is no vector: 502
        bad = http.post("/v1/embeddings", json={"model": "gated", "input": "bad"})
        assert_error(bad, 502, "remote_error")
        not_a_vector = http.post("/v1/embeddings", json={"model": "gated", "input": "a"})
        assert_error(not_a_vector, 502, "unencodable_result")


def test_a_full_queue_is_429_with_the_published_error_shape(stack: Stack) -> None:
    # Given an embeddings request held running on a serving with max_queue=1
    held: list[httpx.Response] = []
    with stack.http() as http, stack.http() as other:
        request = {"model": "limited", "input": "hold:q"}
        thread = threading.Thread(
            target=lambda: held.append(other.post("/v1/embeddings", json=request))
        )
        thread.start()
        try:
            wait_until(lambda: ["hold:q"] in stack.batches(), "the held batch to run")
            # When another comes, and a completion stream (refused before its first chunk)
            refused = http.post("/v1/embeddings", json={"model": "limited", "input": "x"})
            stream = {"model": "limited", "prompt": "x", "stream": True}
            refused_stream = http.post("/v1/completions", json=stream)
        finally:
            stack.redis.set(f"{stack.prefix}:gw:open:q", 1)
            thread.join(60)
    # Then each is 429 with Retry-After and OpenAI's error object, the stream not begun
    for response in (refused, refused_stream):
        assert_error(response, 429, "queue_full")
        assert response.headers["retry-after"] == "1"
    # and the held one, answered "r:hold:q", is no vector: 502
    assert_error(held[0], 502, "unencodable_result")
