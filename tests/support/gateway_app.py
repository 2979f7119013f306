"""Servings and processes for the gateway tests (tests/integration/test_gateway.py).

Servings run in a real worker process (``queueserve worker tests.support.gateway_app:NAME``)
and record into Redis under ``$QS_TEST_PREFIX:gw:*`` on ``$QS_TEST_URL``:

- ``gated``: records each batch's items (``batches``, JSON lists); an item ``"hold:X"`` waits
  for the key ``open:X``, so a test decides when its batch ends; ``"bad"`` raises (a
  RemoteError for that item alone); answers ``"r:<item>"``.
- ``limited``: ``gated`` with ``max_queue=1`` (the 429 test).
- ``hooked``: emits ``start`` (the batch's items) and ``done`` (its size), answers ``r:x``.
- ``ticker``: a step serving; an item ``{"n": N}`` outputs 0..N-1, one per step, every step
  taking STEP_S: a request of a million steps runs until it is cancelled.

The test side: ``GatewayProc``, a ``queueserve gateway`` process on a free loopback port.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import queueserve as qs
from tests.support.fault_app import _Recorded, wait_for_key
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
        return [{"n": int(item["n"]), "at": 0} for item in items]

    def decode(self, states: list[dict[str, int]]) -> list[Any]:
        time.sleep(STEP_S)
        out: list[Any] = []
        for s in states:
            if s["at"] >= s["n"]:
                out.append(qs.END)
            else:
                out.append(s["at"])
                s["at"] += 1
        return out


gated = Gated()
limited = Limited()
hooked = Hooked().streaming(hooks=["start", "done"])
ticker = Ticker()


# --- test side ---------------------------------------------------------------------------
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class GatewayProc:
    """``python -m queueserve gateway --port 0 ...``; ``url`` once it listens."""

    def __init__(self, redis_url: str, prefix: str, log: Path, *args: str) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "queueserve", "gateway", "--port", "0", "--redis-url",
                 redis_url, "--prefix", prefix, *args],
                cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
            )
        port = wait_until(lambda: LISTENING.search(self.output()), "the gateway to listen",
                          process=self).group(1)
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
