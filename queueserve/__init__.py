"""queueserve: batch work from many producers over Redis Streams.

>>> import queueserve as qs
>>> square = qs.Serving(lambda xs: [x * x for x in xs], name="square", batch_size=10)
>>> square.inline(3)
9
"""

from ._streams import Hook, Output
from .aio import AsyncClient, AsyncTicket
from .client import Client, Ticket
from .errors import (
    BadRequest,
    Cancelled,
    DeadLettered,
    QueueFull,
    QueueServeError,
    RedisUnavailable,
    RemoteError,
    Timeout,
)
from .serving import Batch, Partition, Serving, serving
from .settings import Settings
from .streaming import END, emit
from .worker import Worker

__all__ = [  # noqa: RUF022 - grouped by use, as the docs present them
    # defining servings
    "Batch",
    "Partition",
    "Serving",
    "serving",
    # streaming
    "END",
    "Hook",
    "Output",
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
    "DeadLettered",
    "QueueFull",
    "QueueServeError",
    "RedisUnavailable",
    "RemoteError",
    "Timeout",
]
