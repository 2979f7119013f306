"""queueserve: batch work from many producers over Redis Streams.

>>> import queueserve as qs
>>> square = qs.Serving(lambda xs: [x * x for x in xs], name="square", batch_size=10)
>>> square.inline(3)
9
"""

from queueserve.client.async_client import AsyncClient, AsyncTicket
from queueserve.client.sync import Client
from queueserve.client.ticket import Ticket
from queueserve.errors import (
    BadRequest,
    Cancelled,
    ConnectionPoolExhausted,
    DeadLettered,
    IdempotencyConflict,
    NotReplicated,
    QueueFull,
    QueueServeError,
    RedisCommandError,
    RedisUnavailable,
    RemoteError,
    Timeout,
    UnknownServing,
)
from queueserve.hooks import END, NO_OUTPUT, Hook, Output, Restart, emit
from queueserve.serving import Batch, Partition, Serving, serving
from queueserve.settings import Settings
from queueserve.steps import Resume, StepServing, step_serving
from queueserve.wire.key_rules import LengthBuckets
from queueserve.worker.worker import Worker

__all__ = [  # noqa: RUF022 - grouped by use, as the docs present them
    # defining servings
    "Batch",
    "Partition",
    "Serving",
    "serving",
    "LengthBuckets",
    # generation (continuous batching)
    "Resume",
    "StepServing",
    "step_serving",
    # streaming
    "END",
    "NO_OUTPUT",
    "Hook",
    "Output",
    "Restart",
    "emit",
    # producing
    "AsyncClient",
    "AsyncTicket",
    "Client",
    "Ticket",
    # consuming
    "Worker",
    # configuration
    "Settings",
    # errors
    "BadRequest",
    "Cancelled",
    "ConnectionPoolExhausted",
    "DeadLettered",
    "IdempotencyConflict",
    "NotReplicated",
    "QueueFull",
    "QueueServeError",
    "RedisCommandError",
    "RedisUnavailable",
    "RemoteError",
    "Timeout",
    "UnknownServing",
]
