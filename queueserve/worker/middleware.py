"""Middleware: cross-cutting features (metrics, tracing) hooked into the worker loop.

Every hook is a no-op here; subclasses override what they need. Hooks are called per batch or
per event, never per item, and a hook that raises is logged and otherwise ignored: a metrics
bug must not stop a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from queueserve.serving import Partition, Serving

if TYPE_CHECKING:
    from queueserve.worker.pipeline.batching import Slice
    from queueserve.worker.stepping.joins import StepRecord

log = logging.getLogger(__name__)


class Middleware:
    """Base class with no-op hooks."""

    def wants(self, hook: str) -> bool:
        """Whether ``hook`` does anything here, so a caller can skip building its arguments
        (requests_answered costs a list per reply)."""
        return getattr(type(self), hook) is not getattr(Middleware, hook)

    def partition_started(self, servings: Sequence[Serving], partition: Partition) -> None:
        """The partition process is serving (after every serving's setup())."""

    def batch_opened(
        self, serving: Serving, key: str, partition: Partition, slices: Sequence[Slice]
    ) -> None:
        """A batch of these requests' slices is about to start (just before batch_started,
        on the same thread); for a step serving, the sequences of one decode step."""

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        """A batch of ``size`` items starts; ``waited`` seconds since its clock started."""

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        """The batch function returned (or failed) after ``seconds``."""

    def batch_model(
        self, serving: Serving, partition: Partition, a: float, b: float, slack: float
    ) -> None:
        """With max_latency set, after each batch: the learned batch time (``a + b*n``
        seconds, n in items or cost units) and the batch's ``slack``: max_latency less its
        oldest item's wait and run (negative: the target was missed)."""

    def replied(self, serving: Serving, items: int, requests: int, errors: dict[str, int]) -> None:
        """Answers were written: ``items`` answered, ``requests`` finished, errors by kind."""

    def requests_answered(self, serving: Serving, entry_ids: Sequence[bytes]) -> None:
        """These requests' last answers were written; each stream entry id's milliseconds
        are when Redis enqueued it (end to end: now minus that). Only called when wanted."""

    def redelivered(self, serving: Serving, entries: int) -> None:
        """Entries of dead consumers were reclaimed."""

    def step(self, serving: Serving, partition: Partition, record: StepRecord) -> None:
        """A step serving ran one step (its joins' prefill, then one decode of the running
        set); ``record`` has its slots, token budget, prefill and prefix-cache figures."""

    def dead_lettered(self, serving: Serving, entries: int) -> None:
        """Entries went to the dead-letter stream."""

    def cache_counts(self, serving: Serving, counts: Mapping[str, int]) -> None:
        """The result cache's counts of a serving that caches results, all workers' and
        clients' together (wire/cache.py's STATS: hits, misses, stored, bytes, too_big),
        read at each heartbeat."""

    def redis_errors(self, partition: Partition, errors: int) -> None:
        """The partition's loops met ``errors`` more failed Redis attempts (an outage, a
        dropped connection: each retried with backoff), told at its next heartbeat."""

    def key_loaded(
        self, serving: Serving, key: str, partition: Partition, seconds: float, ok: bool
    ) -> None:
        """The serving's ``load_key(key)`` returned (``ok``) or raised after ``seconds``."""

    def key_evicted(self, serving: Serving, key: str, partition: Partition) -> None:
        """A key's state left the partition's LRU (``unload_key`` had it)."""

    def key_used(self, serving: Serving, partition: Partition, hit: bool, held: int) -> None:
        """A batch took its key's state: held already (``hit``) or loaded for it; ``held``:
        the states the partition holds now."""


class Middlewares(Middleware):
    """Calls each middleware's hook in turn, logging (not raising) their failures."""

    def __init__(self, middlewares: Sequence[Middleware] = ()) -> None:
        self.middlewares = list(middlewares)
        self._wanted = {"requests_answered": any(m.wants("requests_answered") for m in middlewares)}

    def wants(self, hook: str) -> bool:
        return self._wanted.get(hook, True)

    def _each(self, hook: str, *args: object) -> None:
        for m in self.middlewares:
            try:
                getattr(m, hook)(*args)
            except Exception:
                log.exception("middleware %s.%s failed", type(m).__name__, hook)

    def partition_started(self, servings: Sequence[Serving], partition: Partition) -> None:
        self._each("partition_started", servings, partition)

    def batch_opened(
        self, serving: Serving, key: str, partition: Partition, slices: Sequence[Slice]
    ) -> None:
        self._each("batch_opened", serving, key, partition, slices)

    def batch_started(
        self, serving: Serving, key: str, partition: Partition, size: int, waited: float
    ) -> None:
        self._each("batch_started", serving, key, partition, size, waited)

    def batch_finished(
        self, serving: Serving, key: str, partition: Partition, size: int, seconds: float
    ) -> None:
        self._each("batch_finished", serving, key, partition, size, seconds)

    def batch_model(
        self, serving: Serving, partition: Partition, a: float, b: float, slack: float
    ) -> None:
        self._each("batch_model", serving, partition, a, b, slack)

    def replied(self, serving: Serving, items: int, requests: int, errors: dict[str, int]) -> None:
        self._each("replied", serving, items, requests, errors)

    def requests_answered(self, serving: Serving, entry_ids: Sequence[bytes]) -> None:
        self._each("requests_answered", serving, entry_ids)

    def redelivered(self, serving: Serving, entries: int) -> None:
        self._each("redelivered", serving, entries)

    def step(self, serving: Serving, partition: Partition, record: StepRecord) -> None:
        self._each("step", serving, partition, record)

    def dead_lettered(self, serving: Serving, entries: int) -> None:
        self._each("dead_lettered", serving, entries)

    def redis_errors(self, partition: Partition, errors: int) -> None:
        self._each("redis_errors", partition, errors)

    def cache_counts(self, serving: Serving, counts: Mapping[str, int]) -> None:
        self._each("cache_counts", serving, counts)

    def key_loaded(
        self, serving: Serving, key: str, partition: Partition, seconds: float, ok: bool
    ) -> None:
        self._each("key_loaded", serving, key, partition, seconds, ok)

    def key_evicted(self, serving: Serving, key: str, partition: Partition) -> None:
        self._each("key_evicted", serving, key, partition)

    def key_used(self, serving: Serving, partition: Partition, hit: bool, held: int) -> None:
        self._each("key_used", serving, partition, hit, held)
