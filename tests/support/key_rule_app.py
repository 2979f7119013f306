"""A serving whose batch key is a rule (wire/key_rules.py), for tests/integration/
test_key_rules.py, run in a real worker process: ``lengths`` records each batch as
``[its batch key, its items]`` under ``$QS_TEST_PREFIX:fault:batches``. A text counts its
characters: the keys are n4, n8, n16, n32 and n64."""

from __future__ import annotations

import json
from typing import Any

import queueserve as qs
from tests.support.fault_app import _Recorded

RULE = qs.LengthBuckets(smallest=4, largest=64, chars_per_unit=1, extra=0, prefix="n")


class Lengths(_Recorded):
    name = "lengths"
    batch_size = 64
    batch_timeout = 0.05
    batch_key = RULE

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.r.rpush(f"{self.rec}:batches", json.dumps([batch.key, list(batch)]))
        return [f"{batch.key}:{text}" for text in batch]


lengths = Lengths()
