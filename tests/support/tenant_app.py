"""A serving for the tenant-lane tests (tests/integration/test_tenant_lanes.py), run in a real
worker process: ``laned`` records each batch as ``[its batch key, its items]`` under
``$QS_TEST_PREFIX:fault:batches`` (items are ``"<tenant>:<n>"``), each batch taking WORK_S, so a
backlog builds while the test watches which tenant's batches run; a batch holding ``"hold"``
waits for the key ``$QS_TEST_PREFIX:fault:open``."""

from __future__ import annotations

import json
import time
from typing import Any

import queueserve as qs
from tests.support.fault_app import _Recorded, wait_for_key

WORK_S = 0.01


class Laned(_Recorded):
    name = "laned"
    batch_size = 8
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        if "hold" in batch:
            wait_for_key(self.r, f"{self.rec}:open")
        time.sleep(WORK_S)
        self.r.rpush(f"{self.rec}:batches", json.dumps([batch.key, list(batch)]))
        return list(batch)


laned = Laned()
