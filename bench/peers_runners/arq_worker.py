"""The arq worker of the peer benchmark: ``arq bench.peers_runners.arq_worker.WorkerSettings``.

Tuned, as arq's defaults cannot be compared: arq polls its queue every ``poll_delay`` (0.5 s by
default) and runs at most ``max_jobs`` (10) jobs at once, so out of the box it tops out near
20 jobs/s. Here it polls every 5 ms and runs up to 100 jobs at once.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from arq.connections import RedisSettings

POLL_DELAY_S = 0.005
MAX_JOBS = 100


async def identity(ctx: dict[str, Any], x: int) -> int:
    return x


class WorkerSettings:
    functions: ClassVar[list[Any]] = [identity]
    redis_settings = RedisSettings.from_dsn(os.environ["PEERS_REDIS_URL"])
    poll_delay = POLL_DELAY_S
    max_jobs = MAX_JOBS
    handle_signals = True
