"""Durations as people write them: ``10ms``, ``2s``, ``1.5m``, or plain seconds."""

from __future__ import annotations

import re

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s|m|h)?\s*$")


def parse_duration(value: str | float | int, *, what: str = "duration") -> float:
    """Seconds from ``value``; strings take a unit (us, ms, s, m, h; seconds without one)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be seconds or a string like '10ms', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise ValueError(
                f"{what} {value!r} is not a duration; write it like '10ms', '2s', '1.5m' or '0.1'"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise TypeError(f"{what} must be seconds or a string like '10ms', got {value!r}")
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return seconds
