"""Idempotency keys across processes (tests/faults/test_once.py): a serving that counts the
side effects of its batch function, and a sender that runs as a process of its own.

``counted`` runs in ``queueserve worker tests.support.once_app:counted`` processes. Each run of
a batch records its items when it starts (``started``) and, as a batch function's side effect
(a row written, a document indexed), when it completes (``effects``); a batch holding an item
that starts with ``hold`` waits for the ``go`` gate between the two, so a kill can land inside
it. Both lists live under ``$QS_TEST_PREFIX:fault:`` (fault_app.py's recording).

``python -m tests.support.once_app KEY ITEM [hang]`` submits ITEM to ``counted`` with
idempotency key KEY, once the ``start`` gate exists (pushing its pid to ``ready`` first), and
prints ``sent <ticket id>`` once the request is in Redis; then, with ``hang``, it waits to be
killed, else it prints ``result <json>``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import queueserve as qs
from tests.support.fault_app import _connect, _Recorded, wait_for_key


class Counted(_Recorded):
    name = "counted"
    batch_size = 8
    batch_timeout = 0.001
    max_deliveries = 1000  # kills are the point here, not dead letters

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        self.r.rpush(f"{self.rec}:started", *batch)
        if any(str(x).startswith("hold") for x in batch):
            wait_for_key(self.r, f"{self.rec}:go")
        self.r.rpush(f"{self.rec}:effects", *batch)  # committed at the end of the batch
        return [f"done:{x}" for x in batch]


counted = Counted()


def main(key: str, item: str, hang: bool) -> None:
    r, rec = _connect()
    r.rpush(f"{rec}:ready", os.getpid())
    wait_for_key(r, f"{rec}:start")
    with qs.Client(os.environ["QS_TEST_URL"], prefix=os.environ["QS_TEST_PREFIX"]) as client:
        ticket = client.submit("counted", [item], idempotency_key=key)
        print("sent", ticket.id, flush=True)
        if hang:
            threading.Event().wait()  # until the test's SIGKILL
        print("result", json.dumps(ticket.result(60)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["hang"])
