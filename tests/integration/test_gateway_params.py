"""The gateway's parameters are checked the same way whatever else the body says (issue 38's
"smaller" findings): a number OpenAI bounds is refused past its bound with and without
``stream`` (10**30 as max_tokens or seed answered a stream 500 with a traceback, a plain call
400), a temperature too small to divide by samples greedily, NaN and Infinity (not JSON) are
refused instead of reaching a serving and coming back as null, and ``true`` is no number of
seconds (``keep: true`` was a job kept 1 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest

from queueserve.gateway.openai_api import GREEDY_BELOW, Completions
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.redis_server import prefixed_client

SERVINGS = ["tests.support.gateway_app:spell", "tests.support.gateway_app:gated"]
NAMES = ["spell", "gated"]


@pytest.fixture(scope="module")
def gateway(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    prefix = f"qsgp{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("gateway-params")
    with (
        prefixed_client(redis_server, prefix),
        gateway_stack(redis_server, prefix, logs, SERVINGS, NAMES) as (_, gw),
    ):
        yield gw


def post(gw: GatewayProc, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 10**30), ("max_tokens", 2**31), ("seed", 10**30), ("seed", -(2**63) - 1)],
)
def test_a_number_past_openais_bound_is_400_with_and_without_stream(
    gateway: GatewayProc, field: str, value: int, stream: bool
) -> None:
    body = {"model": "spell", "prompt": "ab", "stream": stream, field: value}
    answer = post(gateway, "/v1/completions", body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]
    assert "Traceback" not in answer.text


@pytest.mark.parametrize("stream", [False, True])
def test_the_bounds_themselves_are_taken(gateway: GatewayProc, stream: bool) -> None:
    body = {"model": "spell", "prompt": "ab", "stream": stream, "max_tokens": 3}
    answer = post(gateway, "/v1/completions", {**body, "seed": 2**63 - 1})
    assert answer.status_code == 200, answer.text
    assert "Completions" in repr(Completions.model_validate({**body, "max_tokens": 2**31 - 1}))


def test_a_temperature_too_small_to_divide_by_decodes_greedily() -> None:
    def temperature(value: float | None) -> float:
        body = {"model": "m", "prompt": "p"} | ({} if value is None else {"temperature": value})
        return float(Completions.model_validate(body).items()[0]["temperature"])

    assert temperature(1e-300) == 0.0
    assert temperature(GREEDY_BELOW / 2) == 0.0
    assert temperature(GREEDY_BELOW) == GREEDY_BELOW
    assert temperature(0.7) == 0.7
    assert temperature(None) == 1.0  # OpenAI's default


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/servings/gated/dispatch", b'{"item": NaN}'),
        ("/v1/servings/gated/dispatch_many", b'{"items": [1, Infinity]}'),
        ("/v1/servings/gated/jobs", b'{"items": [-Infinity]}'),
        ("/v1/completions", b'{"model": "spell", "prompt": "ab", "temperature": NaN}'),
    ],
)
def test_nan_and_infinity_are_not_json_and_are_refused(
    gateway: GatewayProc, path: str, body: bytes
) -> None:
    answer = post(gateway, path, body)
    assert answer.status_code == 400, answer.text
    assert "not JSON" in answer.json()["error"]["message"]


def test_nan_inside_a_string_is_a_string(gateway: GatewayProc) -> None:
    answer = post(gateway, "/v1/servings/gated/dispatch", {"item": "NaN and Infinity"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"] == "r:NaN and Infinity"  # gated answers "r:<item>"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/servings/gated/jobs", {"items": [1], "keep": True}),
        ("/v1/servings/gated/dispatch", {"item": 1, "timeout": True}),
        ("/v1/completions", {"model": "spell", "prompt": "ab", "max_tokens": True}),
    ],
)
def test_true_is_not_a_number(gateway: GatewayProc, path: str, body: dict[str, Any]) -> None:
    answer = post(gateway, path, body)
    assert answer.status_code == 400, answer.text
    assert "true is not a number" in answer.json()["error"]["message"]
