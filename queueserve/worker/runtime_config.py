"""Serving options changed at run time, cluster-wide (``queueserve config set square
batch_size=64``); workers pick them up within a second, without restart.

Overrides live in the hash ``P:{S}:config`` (no TTL: they are configuration). Setting them also
updates ``P:{S}:meta`` so clients see a new ``max_queue`` at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from queueserve._durations import parse_duration
from queueserve.serving import (
    Serving,
    _check_batch_size,
    _check_max_queue,
    _check_positive,
    _check_reply_bytes,
)

# option -> parser of its text form; each raises ValueError/TypeError saying what was wrong
_PARSERS: dict[str, Any] = {
    "batch_size": lambda v: _check_batch_size(_int(v, "batch_size")),
    "batch_timeout": lambda v: parse_duration(v, what="batch_timeout"),
    "max_queue": lambda v: _check_max_queue(_int(v, "max_queue")),
    "max_deliveries": lambda v: _check_positive("max_deliveries", _int(v, "max_deliveries")),
    "max_payload_bytes": lambda v: _check_positive(
        "max_payload_bytes", _int(v, "max_payload_bytes")
    ),
    "max_reply_bytes": lambda v: _check_reply_bytes(_int(v, "max_reply_bytes")),
    "key_idle_ttl": lambda v: parse_duration(v, what="key_idle_ttl"),
}
OPTIONS = tuple(_PARSERS)


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["batch_size=64", "batch_timeout=5ms"]`` -> validated values; errors name the bad one."""
    parsed: dict[str, Any] = {}
    for assignment in assignments:
        name, sep, text = assignment.partition("=")
        if not sep:
            raise ValueError(f"{assignment!r} is not option=value (for example batch_size=64)")
        if name not in _PARSERS:
            raise ValueError(
                f"{name!r} cannot be changed at run time; choose from {', '.join(OPTIONS)}"
            )
        parsed[name] = _PARSERS[name](text)
    return parsed


def parse_overrides(raw: Mapping[str, str]) -> dict[str, Any]:
    """Overrides as stored in Redis; unknown or invalid fields are skipped (reported by caller)."""
    out: dict[str, Any] = {}
    for name, text in raw.items():
        if name in _PARSERS:
            try:
                out[name] = _PARSERS[name](text)
            except (TypeError, ValueError):
                continue
    return out


def apply_overrides(serving: Serving, overrides: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set the options on ``serving``; returns {option: (old, new)} for those that changed."""
    changed = {}
    for name, value in overrides.items():
        old = getattr(serving, name)
        if old != value:
            setattr(serving, name, value)
            changed[name] = (old, value)
    return changed
