"""Servings for tests/integration/test_mutants_openai_api.py, beside tests/support/gateway_app.py's,
run by a real worker process (``queueserve worker tests.support.openai_probe_app:NAME``):

- ``parrot``: a completion serving whose one step is the item the gateway sent it, as JSON
  (``{"prompt", "max_new", "temperature", "seed", "stop"}``): what the gateway made of a
  request's fields, read back from the answer;
- ``paced``: ``spell`` (its prompt spelled over and over), a step every PACED_STEP_S, writing
  the pid of the partition that runs it to ``$QS_TEST_PREFIX:gw:paced_pid``: a generation
  long enough to kill its partition in the middle of;
- ``matrices``: an "embedding" serving whose result for each text is a 2 x 2 array, no vector.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from typing import Any

import numpy as np
import redis

import queueserve as qs
from tests.support.gateway_app import Spell

PACED_STEP_S = 0.01


@cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["QS_TEST_URL"])


class Parrot(qs.StepServing):
    name = "parrot"
    max_slots = 8
    max_batch_tokens = 10**6
    max_prefill_tokens = 10**6

    def tokens(self, item: Any) -> tuple[int, int]:
        return len(item["prompt"]), 1

    def prefill(self, items: list[Any]) -> list[dict[str, Any]]:
        return [{"item": item, "said": False} for item in items]

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for s in states:
            out.append(qs.END if s["said"] else json.dumps(s["item"], sort_keys=True))
            s["said"] = True
        return out


class Paced(Spell):
    name = "paced"

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        _redis().set(f"{os.environ['QS_TEST_PREFIX']}:gw:paced_pid", os.getpid())
        time.sleep(PACED_STEP_S)
        return super().decode(states)


class Matrices(qs.Serving):
    name = "matrices"
    batch_size = 8
    batch_timeout = 0.002

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return [np.ones((2, 2), dtype=np.float32) for _ in batch]


parrot = Parrot()
paced = Paced()
matrices = Matrices()
