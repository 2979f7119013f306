"""A producer written from docs/protocol.md alone: plain Redis commands, msgpack and the Lua
script the document specifies, no queueserve import in ``Producer``. A real worker process
answers it: results, a per-item error, a deadline, and a request larger than a batch.
"""

from __future__ import annotations

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

ENQUEUE_LUA = REPO / "queueserve" / "broker" / "lua" / "enqueue.lua"


class Producer:
    """docs/protocol.md, "A producer in five steps", in Python."""

    def __init__(self, r: redis.Redis, prefix: str) -> None:
        self.r = r
        self.prefix = prefix
        self.client_id = uuid.uuid4().hex[:16]  # [A-Za-z0-9_.-]{1,64}
        self.inbox = f"{prefix}:inbox:{self.client_id}"
        self.enqueue = r.register_script(ENQUEUE_LUA.read_text())
        self.next_id = 1
        self.answers: dict[int, list[list[Any]]] = {}

    def send(
        self,
        serving: str,
        items: list[Any],
        batch_key: str = "default",
        priority: int = 0,
        deadline_ms: int = 0,
    ) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        header: list[Any] = [1, rid, len(items), self.inbox, deadline_ms, "msgpack"]
        if priority:
            header += ["", priority]
        tag = f"{self.prefix}:{{{serving}}}"
        stream = f"{tag}:in:{batch_key}" if priority == 0 else f"{tag}:p{priority}:{batch_key}"
        keys = [
            f"{tag}:queued",
            f"{tag}:seen",
            f"{tag}:meta",
            f"{tag}:ready",
            f"{tag}:wake",
            f"{tag}:depth",
            stream,
            f"{tag}:pdepth",
        ]
        args = [
            0,
            "qs",
            1000,
            1,
            batch_key,
            priority,
            1,
            len(items),
            msgpack.packb(header),
            msgpack.packb(items),
        ]
        limit, queued, entry = self.enqueue(keys=keys, args=args)
        if entry == 0:
            raise RuntimeError(f"queue full: {queued} items queued, max_queue {limit}")
        return rid

    def wait(self, rid: int, count: int, timeout: float = 60) -> list[list[Any]]:
        """The reply slices of request ``rid`` until they cover its ``count`` items."""
        deadline = time.monotonic() + timeout
        while sum(s[2] for s in self.answers.get(rid, [])) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete answer to request {rid}")
            popped = self.r.blpop([self.inbox], timeout=max(1, int(left)))
            if popped is None or not popped[1]:  # an empty message only wakes a reader
                continue
            message = popped[1]
            assert message[0] == ord("m"), "msgpack replies start with the byte 'm'"
            for row in msgpack.unpackb(message[1:], raw=False, strict_map_key=False):
                self.answers.setdefault(row[0], []).append(row)
        return sorted(self.answers.pop(rid), key=lambda s: s[1])


@pytest.fixture
def producer(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Producer]:
    with prefixed_client(redis_url, prefix) as r:
        worker = WorkerProc.one_partition(
            ["tests.support.servings:square", "tests.support.gateway_app:gated"],
            redis_url,
            prefix,
            tmp_path / "worker.log",
        )
        try:
            wait_until(
                lambda: (
                    r.exists(f"{prefix}:{{square}}:meta") and r.exists(f"{prefix}:{{gated}}:meta")
                ),
                "the worker to declare its servings",
                process=worker,
            )
            yield Producer(r, prefix)
        finally:
            worker.kill_group()


def results(slices: list[list[Any]]) -> list[Any]:
    out: list[Any] = []
    for _rid, _offset, count, kind, body, *_ in slices:
        assert kind == 0, f"kind {kind}: {body}"  # RESULTS
        assert len(body) == count
        out += body
    return out


def test_a_producer_written_from_the_document_is_answered(producer: Producer) -> None:
    rid = producer.send("square", [2, 3, 4])
    assert results(producer.wait(rid, 3)) == [4, 9, 16]
    urgent = producer.send("square", [5], batch_key="other", priority=9)
    assert results(producer.wait(urgent, 1)) == [25]


def test_a_request_larger_than_a_batch_is_answered_in_slices(producer: Producer) -> None:
    rid = producer.send("square", list(range(25)))  # square's batch_size is 10
    slices = producer.wait(rid, 25)
    assert results(slices) == [x * x for x in range(25)]
    assert [s[1] for s in slices] == sorted({s[1] for s in slices})  # offsets, no overlap


def test_errors_come_as_error_slices(producer: Producer) -> None:
    rid = producer.send("gated", ["ok", "bad"])
    by_item = {}
    for _, offset, count, kind, body, *_ in producer.wait(rid, 2):
        for i in range(offset, offset + count):
            by_item[i] = (kind, body[i - offset] if kind == 0 else body)
    assert by_item[0] == (0, "r:ok")
    kind, (remote_type, message, _traceback, error_kind) = by_item[1]
    assert (kind, remote_type, error_kind) == (2, "ValueError", "remote")
    assert "refused" in message


def test_an_expired_deadline_is_answered_with_a_timeout_error(producer: Producer) -> None:
    past = int(time.time() * 1000) - 1000
    rid = producer.send("square", [7], deadline_ms=past)
    (slice_,) = producer.wait(rid, 1)
    assert slice_[3] == 2 and slice_[4][3] == "timeout"
