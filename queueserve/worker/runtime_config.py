"""Serving options changed at run time, cluster-wide (``queueserve config set square
batch_size=64``); workers pick them up within a second, without restart.

Overrides live in the hash ``P:{S}:config`` (no TTL: they are configuration). Setting them also
updates ``P:{S}:meta`` so clients see a new ``max_queue`` at once. Values are read through
``wire/options.py`` (validated and bounded; a refused one is logged and ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from queueserve.serving import Serving


def apply_overrides(serving: Serving, overrides: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set the options on ``serving``; returns {option: (old, new)} for those that changed."""
    changed = {}
    for name, value in overrides.items():
        old = getattr(serving, name)
        if old != value:
            setattr(serving, name, value)
            changed[name] = (old, value)
    return changed
