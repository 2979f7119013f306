"""Priorities: a request's urgency, 0 (the default) to 9 (most urgent), carried in its header
and in its stream's name (``P:{S}:pN:K``, wire/keys.py), and how waiting ages it."""

from __future__ import annotations

from typing import Final

MAX_PRIORITY: Final = 9
# Ageing: one priority level is worth this much waiting. A stream of priority 0 that waited
# 9 s goes before fresh priority-9 work, so a low priority is slowed, never starved.
PRIORITY_AGE_MS: Final = 1000


def check_priority(priority: object) -> int:
    """``priority`` if it is an int from 0 to 9, else ValueError saying so."""
    if type(priority) is int and 0 <= priority <= MAX_PRIORITY:  # every header's: at once
        return priority
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not (0 <= priority <= MAX_PRIORITY)
    ):
        raise ValueError(
            f"priority must be an int from 0 (the default) to {MAX_PRIORITY} (most urgent), "
            f"got {priority!r}"
        )
    return priority
