"""The Celery app of the peer benchmark: ``celery -A bench.peers_runners.celery_app worker``.

Redis is broker and result backend (the private server named by ``PEERS_REDIS_URL``); Celery's
defaults otherwise (JSON, prefetch multiplier 4, acks on receipt).
"""

from __future__ import annotations

import os

from celery import Celery

URL = os.environ["PEERS_REDIS_URL"]

app = Celery("peers", broker=URL, backend=URL)
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@app.task(name="identity")
def identity(x: int) -> int:
    return x
