"""The celery-batches app of the peer benchmark: one task whose calls are run as batches of up
to 256 requests, or whatever arrived within 10 ms (queueserve's noop serving batches 256).

celery-batches needs the prefetch multiplier at 0 (no limit) or flush_every can never fill, and
the batch function stores each request's result itself (``mark_as_done``).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery_batches import Batches

URL = os.environ["PEERS_REDIS_URL"]

app = Celery("peers_batches", broker=URL, backend=URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=0,
)


@app.task(name="identity_batch", base=Batches, flush_every=256, flush_interval=0.01)
def identity_batch(requests: list[Any]) -> None:
    for request in requests:
        app.backend.mark_as_done(request.id, request.args[0], request=request)
