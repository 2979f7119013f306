"""The worker's logs: text or JSON lines, the ids every record carries, one WARNING per failed
batch function call, and redis-py's noise kept out.

Every record gets ``partition`` (the process's partition index, or ``-`` in the supervisor),
``batch_id`` and ``request_ids`` (the batch running on the logging thread, ``-`` outside one):
the batch function's own log lines carry them too. The ids are only formatted when a record is
emitted, so a batch costs one context-variable set and reset whatever the log level.

JSON lines (``--log-format json``) use python-json-logger: it is a ``logging.Formatter``, so
the stdlib records of queueserve, redis-py and the served code keep their loggers, levels and
handlers, where structlog would ask the application to log through its own API to get the
same fields (docs/operations.md, "Logs").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(processName)s %(message)s"
FAILURE_INTERVAL_S = 1.0  # per serving, at most one failed-batch WARNING this often
MAX_IDS = 8  # request ids named in one line; the rest are counted
# redis-py >= 6 asks every new connection for maintenance notifications, and logs each refusal
# of a server that has none (every Redis before 8.x) at DEBUG.
REDIS_NOISE = "MAINT_NOTIFICATIONS"


# (batch id, its slices): the request ids are read off the slices only when a record is emitted
_batch: ContextVar[tuple[str, Sequence[Any]] | None] = ContextVar("queueserve_batch", default=None)
_batch_numbers = itertools.count(1)
_partition = "-"


def request_ids(entry_ids: Iterable[bytes], most: int = MAX_IDS) -> str:
    """Stream entry ids (the ids ``queueserve dead-letter`` and Redis show), comma-separated,
    each once, at most ``most`` of them and a count of the others."""
    ids = list(dict.fromkeys(e.decode("ascii", "replace") for e in entry_ids))
    shown = ",".join(ids[:most])
    return shown if len(ids) <= most else f"{shown},+{len(ids) - most} more"


class batch_scope:  # (lower case: a context manager used as a function)
    """Records logged in the block (on this thread) carry a new batch id (``batch_id``: that
    one, for lines about a batch said after its scope ended) and the requests of ``slices``
    (the pipeline's Slice: ``.request.entry_id``); ``with batch_scope(...) as batch_id``. A
    class, not a ``contextlib.contextmanager``: every batch enters one."""

    __slots__ = ("_scope", "_token")

    def __init__(self, slices: Sequence[Any], batch_id: str | None = None) -> None:
        if batch_id is None:
            batch_id = f"{_partition}.{next(_batch_numbers)}"
        self._scope = (batch_id, slices)

    def __enter__(self) -> str:
        self._token = _batch.set(self._scope)
        return self._scope[0]

    def __exit__(self, *_: object) -> None:
        _batch.reset(self._token)


class IdsFilter(logging.Filter):
    """Adds partition, batch_id and request_ids to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.partition = _partition
        batch = _batch.get()
        record.batch_id = batch[0] if batch else "-"
        record.request_ids = request_ids(s.request.entry_id for s in batch[1]) if batch else "-"
        return True


class RedisNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return REDIS_NOISE not in record.getMessage()


def configure(
    level: int | str, log_format: LogFormat = "text", partition: int | None = None
) -> None:
    """Set up the process's root handler (the CLI's and each partition process's only call):
    ``log_format`` text or JSON lines, with the ids above in every record."""
    global _partition
    if partition is not None:
        _partition = str(partition)
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _Handler)]
    if root.handlers and not ours:  # configured by someone else (an embedding app, a test
        return  # runner): left alone, as logging.basicConfig does
    for old in ours:  # the CLI's first, text, handler, before the options said json
        root.removeHandler(old)
    handler = _Handler()
    handler.addFilter(IdsFilter())
    handler.addFilter(RedisNoiseFilter())
    handler.setFormatter(_formatter(log_format, partition))
    root.addHandler(handler)
    root.setLevel(level)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Stderr, as configure() installs it (so that a second call replaces it)."""


def _formatter(log_format: LogFormat, partition: int | None) -> logging.Formatter:
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(
            JSON_FIELDS + " %(partition)s %(batch_id)s %(request_ids)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    name = "%(processName)s" if partition is None else f"partition-{partition}"
    return logging.Formatter(TEXT_FORMAT.replace("%(processName)s", name))


class FailureLog:
    """One WARNING per failed batch function call of a serving, at most one a second; a line
    says how many were not logged since the one before (a serving failing every batch would
    otherwise bury everything else)."""

    def __init__(self, serving: str, log: logging.Logger) -> None:
        self.serving = serving
        self.log = log
        self._lock = threading.Lock()
        self._next_at = 0.0
        self._suppressed = 0

    def note(
        self,
        slices: Sequence[Any],
        segments: Sequence[tuple[int, int, Any]],
        batch_id: str,
    ) -> None:
        """Log the batch's failure, if a call of its batch function raised: ``segments`` are
        (offset, count, result) over the items of ``slices``, an error result being the body
        its requests get (type, message, traceback, kind). The line carries ``batch_id`` (the
        batch's, from ``batch_scope``) and the batch's requests, as its other lines do."""
        failed = [(a, n, body) for a, n, body in segments if isinstance(body, list)]
        if not failed:
            return
        culprits, offset = [], 0
        for piece in slices:
            end = offset + len(piece.items)
            if any(a < end and offset < a + n for a, n, _ in failed):
                culprits.append(piece.request.entry_id)
            offset = end
        with batch_scope(slices, batch_id):
            self.failed(offset, culprits, failed[0][2])

    def failed(self, size: int, culprits: Sequence[bytes], error: Sequence[Any]) -> None:
        """A call on ``size`` items failed for the requests ``culprits`` with ``error`` (the
        error body sent to them: type, message, traceback, kind)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_at:
                self._suppressed += 1
                return
            self._next_at = now + FAILURE_INTERVAL_S
            suppressed, self._suppressed = self._suppressed, 0
        message = str(error[1]).partition("\n")[0] if len(error) > 1 else ""
        self.log.warning(
            "serving %s: batch function failed on a batch of %d item%s (requests %s): %s%s%s",
            self.serving,
            size,
            "" if size == 1 else "s",
            request_ids(culprits),
            error[0] if error else "error",
            f": {message}" if message else "",
            f" ({suppressed} more failed batches not logged since the last line)"
            if suppressed
            else "",
        )
