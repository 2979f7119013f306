"""The character transformer (tasks/chartf.py) for tests in worker processes, importable as
``tests.support.chartf_app:NAME``.

``paced`` takes a little real time per step (so a SIGKILL lands mid-generation) and records
the pid that ran each step in the test's Redis, as ``tests.support.step_app:paced`` does.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from tasks.chartf import CharTF, State


class PacedCharTF(CharTF):
    name = "chartf-paced"
    step_s = 0.01

    def decode(self, states: list[State]) -> list[Any]:
        r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
        r.set(f"{os.environ['QS_TEST_PREFIX']}:steps:pid", os.getpid())
        r.close()
        time.sleep(self.step_s)
        return super().decode(states)


# A pool of 40 blocks (640 positions) for 4 slots of up to 256 positions each.
paced = PacedCharTF(max_slots=4, kv_blocks=40, prefix_cache_bytes=0)
