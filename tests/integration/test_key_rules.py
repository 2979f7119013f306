"""Batch-key rules reach every door (wire/key_rules.py; docs/usage.md, "Batch keys"): a serving
whose ``batch_key`` is ``qs.LengthBuckets`` declares it, and a client that names the serving
by name, or the gateway's JSON and OpenAI routes, group texts by it as a caller holding the
serving object does. Before, a caller without the object sent every text under one key: its
short texts were padded to its longest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
import redis

import queueserve as qs
from tests.support.gateway_app import GatewayProc, gateway_stack
from tests.support.key_rule_app import RULE
from tests.support.redis_server import prefixed_client

TEXTS = ["a", "abcd", "abcde", "x" * 9, "y" * 20, "z" * 33, "w" * 500, "q" * 7]


@pytest.fixture(scope="module")
def stack(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, GatewayProc]]:
    prefix = f"qsrule{uuid4().hex[:10]}"
    logs: Path = tmp_path_factory.mktemp("rules")
    with (
        prefixed_client(redis_server, prefix),
        gateway_stack(
            redis_server, prefix, logs, ["tests.support.key_rule_app:lengths"], ["lengths"]
        ) as (_, gateway),
    ):
        yield redis_server, prefix, gateway


def batches_since(url: str, prefix: str, start: int) -> list[tuple[str, list[str]]]:
    with redis.Redis.from_url(url) as r:
        return [tuple(json.loads(b)) for b in r.lrange(f"{prefix}:fault:batches", start, -1)]


def recorded(url: str, prefix: str) -> int:
    with redis.Redis.from_url(url) as r:
        return int(r.llen(f"{prefix}:fault:batches"))


def assert_grouped_by_the_rule(batches: list[tuple[str, list[str]]]) -> None:
    """Every text ran in a batch of its own bucket, once."""
    ran = sorted(text for _, texts in batches for text in texts)
    assert ran == sorted(TEXTS)
    for key, texts in batches:
        assert {RULE(t) for t in texts} == {key}, (key, texts)
    assert {key for key, _ in batches} == {"n4", "n8", "n16", "n32", "n64"}


def test_a_client_that_names_the_serving_groups_its_items_by_the_declared_rule(
    stack: tuple[str, str, GatewayProc],
) -> None:
    url, prefix, _ = stack
    start = recorded(url, prefix)
    with qs.Client(url, prefix=prefix) as client:
        answers = client.dispatch_many("lengths", TEXTS, timeout=30)
    assert answers == [f"{RULE(t)}:{t}" for t in TEXTS]
    assert_grouped_by_the_rule(batches_since(url, prefix, start))


def test_the_gateway_groups_a_calls_texts_by_the_declared_rule(
    stack: tuple[str, str, GatewayProc],
) -> None:
    url, prefix, gateway = stack
    start = recorded(url, prefix)
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        many = http.post("/v1/servings/lengths/dispatch_many", json={"items": TEXTS})
        assert many.status_code == 200, many.text
        assert many.json() == {"results": [f"{RULE(t)}:{t}" for t in TEXTS]}
        assert_grouped_by_the_rule(batches_since(url, prefix, start))
        # an explicit batch_key still wins: one key for the whole call
        start = recorded(url, prefix)
        keyed = http.post(
            "/v1/servings/lengths/dispatch_many", json={"items": TEXTS, "batch_key": "mine"}
        )
        assert keyed.status_code == 200, keyed.text
        assert {key for key, _ in batches_since(url, prefix, start)} == {"mine"}


def test_a_forged_rule_is_refused_and_the_client_sends_under_one_key(
    stack: tuple[str, str, GatewayProc], caplog: pytest.LogCaptureFixture
) -> None:
    url, prefix, _ = stack
    with redis.Redis.from_url(url) as r:
        forged = f"{prefix}:{{forged}}:meta"
        r.hset(forged, mapping={"batch_key_rule": "length smallest=0 largest=9999999999"})
    with qs.Client(url, prefix=prefix) as client:
        target = client._target("forged")  # what a send would plan with
    assert target.key_rule is None
    assert "ignored batch_key_rule=" in caplog.text
