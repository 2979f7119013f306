"""Servings the benchmarks run in ``queueserve worker bench.servings:<name>`` processes."""

from __future__ import annotations

import queueserve as qs

# No work at all: what is measured is queueserve's own cost per item and per batch.
noop = qs.Serving(lambda xs: xs, name="noop", batch_size=256, batch_timeout=0)
