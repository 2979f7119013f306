"""Taking a batch's slices from a priority level's run of one key (the assembler's step)."""

from __future__ import annotations

from collections import deque
from typing import Any

Slice = Any  # batching.Slice (this module is below batching.py, which imports it)


def take_run(
    slices: deque[Slice], room: float, taken: list[Slice], one: bool
) -> tuple[float, bool]:
    """Move slices from the front of one level's run into ``taken`` while they fit in
    ``room``, splitting one that does not (``one``: its head only). Returns the room left and
    whether the batch may take more: not after a request that runs alone, a split, or a
    request that must run whole and does not fit."""
    while slices and room > 0:
        head = slices[0]
        if head.request.alone and taken:
            return room, False  # it runs in the next batch, by itself
        weight = head.weight
        if weight <= room:
            slices.popleft()
            taken.append(head)
            room -= weight
            if head.request.alone:
                return room, False
            if one:
                return room, True
            continue
        if head.request.no_split:
            return room, False
        first, rest = head.split(room)
        if not first.items:
            return room, False
        slices[0] = rest
        taken.append(first)
        return room - first.weight, False
    return room, True
