"""Serving options changed at run time, cluster-wide (``queueserve config set square
batch_size=64``); workers pick them up within a second, without restart.

Overrides live in the hash ``P:{S}:config`` (no TTL: they are configuration). Setting them also
updates ``P:{S}:meta`` so clients see a new ``max_queue`` at once. Values are read through
``options/stored.py`` (validated and bounded; a refused one is logged and ignored).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from queueserve.serving import Serving
from queueserve.steps import StepServing

log = logging.getLogger(__name__)


def apply_overrides(serving: Serving, overrides: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set the options on ``serving``; returns {option: (old, new)} for those that changed."""
    changed = {}
    for name, value in overrides.items():
        if name == "max_latency" and isinstance(serving, StepServing):  # refused when declared
            log.warning("serving %s: max_latency does not apply to a step serving", serving.name)
            continue
        old = getattr(serving, name)
        if old != value:
            setattr(serving, name, value)
            changed[name] = (old, value)
    return changed
