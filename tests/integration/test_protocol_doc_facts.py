"""The reply messages docs/protocol.md shows, read raw from Redis as a real worker wrote them:
an ERROR row holds one error for all its items (not one per item), and a request whose
deadline had passed is answered ``BadRequest`` with kind ``timeout``.

Each test finds the JSON block that follows the paragraph citing it in docs/protocol.md and
compares it with the first message in its inbox (the tag byte dropped, msgpack decoded); a
string the document ends with ``...`` matches any string starting with what precedes it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from tests.support.fault_app import WorkerProc
from tests.support.helpers import REPO, wait_until
from tests.support.redis_server import prefixed_client

PROTOCOL = REPO / "docs" / "protocol.md"
ENQUEUE_LUA = REPO / "queueserve" / "broker" / "lua" / "enqueue.lua"
SERVINGS = ["tests.support.servings:square", "tests.support.protocol_app:failing"]


def documented_message(test_name: str) -> Any:
    """The JSON block after the paragraph of docs/protocol.md that cites ``test_name``."""
    text = PROTOCOL.read_text()
    cited = text.find(f"test_protocol_doc_facts.py::{test_name}")
    assert cited >= 0, f"docs/protocol.md cites no {test_name}"
    block = re.compile(r"^\s*```json\n(.*?)^\s*```", re.M | re.S).search(text, cited)
    assert block is not None, f"docs/protocol.md shows no message after citing {test_name}"
    return json.loads(block.group(1))


def matches(documented: Any, sent: Any) -> bool:
    if isinstance(documented, str) and documented.endswith("..."):
        return isinstance(sent, str) and sent.startswith(documented[:-3])
    if isinstance(documented, list):
        return (
            isinstance(sent, list)
            and len(sent) == len(documented)
            and all(matches(d, s) for d, s in zip(documented, sent, strict=True))
        )
    return type(documented) is type(sent) and documented == sent


def send(r: redis.Redis, prefix: str, serving: str, items: list[Any], deadline_ms: int = 0) -> str:
    """Request 1 of a new client, of priority 0 on batch key ``default``, sent as
    docs/protocol.md says (enqueue.lua); returns the client's inbox."""
    inbox = f"{prefix}:inbox:{uuid.uuid4().hex[:16]}"
    tag = f"{prefix}:{{{serving}}}"
    keys = [f"{tag}:{k}" for k in ("queued", "seen", "meta", "ready", "wake", "depth")]
    keys += [f"{tag}:in:default", f"{tag}:pdepth"]
    header = msgpack.packb([1, 1, len(items), inbox, deadline_ms, "msgpack"])
    args = [0, "qs", 1000, 1, "default", 0, 1, len(items), header, msgpack.packb(items)]
    _limit, _queued, entry = r.register_script(ENQUEUE_LUA.read_text())(keys=keys, args=args)
    assert entry != 0, "queue full"
    return inbox


def first_message(r: redis.Redis, inbox: str) -> Any:
    """The first non-empty message of ``inbox`` (an empty one only wakes readers), decoded."""
    message = wait_until(lambda: r.lpop(inbox), "a reply in the inbox")
    assert message[:1] == b"m", "msgpack replies start with the byte 'm'"
    return msgpack.unpackb(message[1:], raw=False, strict_map_key=False)


@pytest.fixture
def worker(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[redis.Redis]:
    with prefixed_client(redis_url, prefix) as r:
        proc = WorkerProc.one_partition(SERVINGS, redis_url, prefix, tmp_path / "worker.log")
        try:
            wait_until(
                lambda: all(
                    r.exists(f"{prefix}:{{{name}}}:meta") for name in ("square", "failing")
                ),
                "the worker to declare its servings",
                process=proc,
            )
            yield r
        finally:
            proc.kill_group()


def test_an_error_row_holds_one_error_for_all_its_items(worker: redis.Redis, prefix: str) -> None:
    # Given a serving whose batches fail whole
    # When a producer sends it one request of three items, one of which makes the batch raise
    inbox = send(worker, prefix, "failing", [1, -2, 3])

    # Then one row answers all three with one error, as the document shows
    sent = first_message(worker, inbox)
    ((rid, offset, count, kind, body),) = sent
    assert (rid, offset, count, kind) == (1, 0, 3, 2)
    assert len(body) == 4 and all(isinstance(field, str) for field in body), body
    documented = documented_message("test_an_error_row_holds_one_error_for_all_its_items")
    assert matches(documented, sent), f"docs/protocol.md shows {documented}, the worker sent {sent}"


def test_an_expired_request_is_answered_bad_request_with_kind_timeout(
    worker: redis.Redis, prefix: str
) -> None:
    # When a producer sends a request of three items whose deadline has passed already
    past = int(time.time() * 1000) - 1000
    inbox = send(worker, prefix, "square", [2, 3, 4], deadline_ms=past)

    # Then one row answers all three: BadRequest, kind timeout, as the document shows
    sent = first_message(worker, inbox)
    assert sent == [[1, 0, 3, 2, sent[0][4]]], sent
    assert (sent[0][4][0], sent[0][4][3]) == ("BadRequest", "timeout")
    documented = documented_message(
        "test_an_expired_request_is_answered_bad_request_with_kind_timeout"
    )
    assert matches(documented, sent), f"docs/protocol.md shows {documented}, the worker sent {sent}"
