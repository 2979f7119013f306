"""Servings and processes for the gateway tests (tests/integration/test_gateway.py).

Servings run in a real worker process (``queueserve worker tests.support.gateway_app:NAME``)
and record into Redis under ``$QS_TEST_PREFIX:gw:*`` on ``$QS_TEST_URL``:

- ``gated``: records each batch's items (``batches``, JSON lists); an item ``"hold:X"`` waits
  for the key ``open:X``, so a test decides when its batch ends; ``"bad"`` raises (a
  RemoteError for that item alone); answers ``"r:<item>"``.
- ``limited``: ``gated`` with ``max_queue=1`` (the 429 test).
- ``hooked``: emits ``start`` (the batch's items) and ``done`` (its size), answers ``r:x``.
- ``ticker``: a step serving; an item ``{"n": N}`` outputs 0..N-1, one per step, every step
  taking STEP_S: a request of a million steps runs until it is cancelled; with
  ``"fail_at": K`` its decode raises at step K.
- ``vectors`` and ``spell``: cheap stand-ins for the embedding and text models behind the
  OpenAI endpoints (the fuzzer's): a text's vector is ``[len(text), 1.0]``; a completion item
  (tasks/charlm.py's form) spells its prompt's characters over and over, ``max_new`` of them.

The test side: ``GatewayProc``, a ``queueserve gateway`` process on a free loopback port, and
``gateway_stack``, a worker process with one in front of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

import queueserve as qs
from tests.support.fault_app import WorkerProc, _Recorded, wait_for_key
from tests.support.helpers import REPO, child_env, wait_until

STEP_S = 0.005  # a ticker step: keeps a running sequence from spinning a core


class Gated(_Recorded):
    name = "gated"
    batch_size = 64
    batch_timeout = 0.02

    @property
    def gw(self) -> str:
        return f"{os.environ['QS_TEST_PREFIX']}:gw"

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.r.rpush(f"{self.gw}:batches", json.dumps(list(batch)))
        for x in batch:
            if isinstance(x, str) and x.startswith("hold:"):
                wait_for_key(self.r, f"{self.gw}:open:{x[5:]}")
        if "bad" in batch:
            raise ValueError("the item 'bad' is refused")
        return [f"r:{x}" for x in batch]


class Limited(Gated):
    name = "limited"
    max_queue = 1


class Hooked(qs.Serving):
    name = "hooked"
    batch_size = 16
    batch_timeout = 0.005

    def handle_batch(self, batch: qs.Batch) -> list[str]:
        qs.emit("start", list(batch))
        qs.emit("done", len(batch))
        return [f"r:{x}" for x in batch]


class Ticker(qs.StepServing):
    name = "ticker"
    max_slots = 8
    max_batch_tokens = 10**9
    max_prefill_tokens = 10**9

    def tokens(self, item: Any) -> tuple[int, int]:
        return 0, int(item["n"])

    def prefill(self, items: list[Any]) -> list[dict[str, int]]:
        return [
            {"n": int(item["n"]), "at": 0, "fail_at": int(item.get("fail_at", -1))}
            for item in items
        ]

    def decode(self, states: list[dict[str, int]]) -> list[Any]:
        time.sleep(STEP_S)
        for s in states:  # the whole step is checked before any state changes
            if s["at"] == s["fail_at"]:
                raise ValueError(f"ticker failed at step {s['at']}")
        out: list[Any] = []
        for s in states:
            if s["at"] >= s["n"]:
                out.append(qs.END)
            else:
                out.append(s["at"])
                s["at"] += 1
        return out


class Vectors(qs.Serving):
    name = "vectors"
    batch_size = 32
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> list[list[float]]:
        return [[float(len(str(x))), 1.0] for x in batch]


class Spell(qs.StepServing):
    name = "spell"
    max_slots = 8
    max_batch_tokens = 10**6
    max_prefill_tokens = 10**6

    def tokens(self, item: Any) -> tuple[int, int]:
        return len(item["prompt"]), int(item["max_new"])

    def prefill(self, items: list[Any]) -> list[dict[str, Any]]:
        return [
            {"text": item["prompt"] or " ", "left": int(item["max_new"]), "at": 0} for item in items
        ]

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for s in states:
            if s["left"] <= 0:
                out.append(qs.END)
                continue
            out.append(s["text"][s["at"] % len(s["text"])])
            s["at"] += 1
            s["left"] -= 1
        return out


gated = Gated()
limited = Limited()
hooked = Hooked().streaming(hooks=["start", "done"])
ticker = Ticker()
vectors = Vectors()
spell = Spell()


# --- test side ---------------------------------------------------------------------------
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@contextlib.contextmanager
def gateway_stack(
    redis_url: str,
    prefix: str,
    logs: Path,
    servings: list[str],
    names: list[str],
    *gateway_args: str,
) -> Iterator[tuple[WorkerProc, GatewayProc]]:
    """A worker process serving ``servings`` (module:attr) and a gateway in front of it, once
    the worker declared every serving of ``names``; both stopped after."""
    worker = WorkerProc(
        [*servings, "--redis-url", redis_url, "--prefix", prefix, "--partitions", "1"],
        redis_url,
        prefix,
        logs / "worker.log",
    )
    gateway = None
    try:
        r = redis.Redis.from_url(redis_url)
        try:
            wait_until(
                lambda: all(r.exists(f"{prefix}:{{{n}}}:meta") for n in names),
                "the worker to declare its servings",
                timeout=180,
                process=worker,
            )
        finally:
            r.close()
        gateway = GatewayProc(redis_url, prefix, logs / "gateway.log", *gateway_args)
        yield worker, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        worker.kill_group()


class GatewayProc:
    """``python -m queueserve gateway --port 0 ...``; ``url`` once it listens. Subclasses
    name another command that serves HTTP the same way (``command``)."""

    command = "gateway"

    def __init__(self, redis_url: str, prefix: str, log: Path, *args: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "queueserve", self.command, "--port", "0"),
                    *("--redis-url", redis_url, "--prefix", prefix, *args),
                ],
                cwd=REPO,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        port = wait_until(
            lambda: LISTENING.search(self.output()), f"the {self.command} to listen", process=self
        ).group(1)
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)
