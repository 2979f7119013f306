"""Servings whose partition process breaks one of its own long-lived threads when the test says
so (``queueserve worker tests.support.thread_app:NAME``, with ``QS_TEST_BREAK=<thread>``).

setup(), which runs in the partition process, wraps the function that thread calls on every
turn of its loop. The wrapper raises ``InjectedBug`` the first time it finds the key
``$QS_TEST_PREFIX:break`` in the test's Redis, and deletes the key, so the partition that the
supervisor starts in its place serves normally. The reader's bug fires only on a turn of its
loop where an executor holds the reader's lent blocking read (a reader that died then used to
wait for that read for ever); on an idle worker the reader turns every RECLAIM_EVERY_S while the
read is lent, so such a turn comes. It does not wait inside a turn: the request the test sends
as the key is set may come back on the lent read undrained, and then nobody lends it again
until the reader, waiting, reads on.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import redis

import queueserve as qs
from queueserve.worker.partition import PartitionHost
from queueserve.worker.pipeline.cancels import CancelListener
from queueserve.worker.pipeline.reader import Reader
from queueserve.worker.pipeline.runner import ServingRunner
from queueserve.worker.stepping.executor import StepExecutor
from tests.support.step_app import Count

# QS_TEST_BREAK -> (class, method) run by that thread on every turn of its loop
TARGETS: dict[str, tuple[type, str]] = {
    "reader": (Reader, "_housekeeping"),
    "reply": (ServingRunner, "_send"),  # the replier's, or an idle executor's own reply
    "heartbeat": (PartitionHost, "_beat"),
    "cancels": (CancelListener, "_on_cancel"),  # on each message of the cancel channel
    "stepper": (StepExecutor, "_cycle"),
}


class InjectedBug(RuntimeError):
    """What the broken thread raises."""


def _break_when_told() -> None:
    role = os.environ.get("QS_TEST_BREAK")
    if not role:
        return
    cls, name = TARGETS[role]
    original = getattr(cls, name)
    if getattr(original, "broken", False):  # another serving of this process wrapped it
        return
    r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
    key = f"{os.environ['QS_TEST_PREFIX']}:break"

    @functools.wraps(original)
    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (role != "reader" or self.lease.borrowed) and r.delete(key):
            raise InjectedBug(f"injected bug in the {role} thread (QS_TEST_BREAK)")
        return original(self, *args, **kwargs)

    broken.broken = True  # type: ignore[attr-defined]
    setattr(cls, name, broken)


class Plain(qs.Serving):
    name = "plain"
    batch_size = 4
    batch_timeout = 0.0

    def setup(self, partition: qs.Partition) -> None:
        _break_when_told()

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return [x * 2 for x in batch]


class Steps(Count):
    name = "steps"

    def setup(self, partition: qs.Partition) -> None:
        _break_when_told()


plain = Plain()
steps = Steps()
