"""What a worker hands each partition process besides its servings, and how servings named
``module:attr`` are loaded with the worker's batch_size and batch_timeout."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from queueserve.serving import Serving
from queueserve.worker.loading import load_servings
from queueserve.worker.middleware import Middleware
from queueserve.worker.options import WorkerOptions
from queueserve.worker.watchdog import Limits

ServingSource = Serving | str  # a Serving, or "module:attr" that names servings


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a partition process needs besides its servings (picklable)."""

    redis_url: str
    prefix: str
    options: WorkerOptions
    threads_per_partition: int
    log_level: int
    middleware: tuple[Middleware, ...] = ()

    @property
    def limits(self) -> Limits:
        o = self.options
        return Limits(o.max_batch_seconds, o.max_batches_per_partition, o.max_partition_memory)

    def servings(self, sources: Sequence[ServingSource]) -> list[Serving]:
        loaded = [s for src in sources for s in load(src)]
        return [with_overrides(s, self.options) for s in loaded]


def load(source: ServingSource) -> list[Serving]:
    if isinstance(source, Serving):
        return [source]
    if isinstance(source, str):
        return load_servings(source)
    raise TypeError(f"expected a qs.Serving or a 'module:attr' string, got {source!r}")


def with_overrides(serving: Serving, options: WorkerOptions) -> Serving:
    """``serving``, or a copy of it with the worker's batch_size and batch_timeout."""
    overrides = {
        k: v for k in ("batch_size", "batch_timeout") if (v := getattr(options, k)) is not None
    }
    if not overrides:
        return serving
    changed = copy.copy(serving)
    vars(changed).update(overrides)
    return changed
