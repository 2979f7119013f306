"""Progress reporting for long ``map`` runs: a tqdm bar on a terminal, and/or a callback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

ProgressCallback = Callable[[int, int | None], None]


class Progress:
    """Counts finished items and tells whoever asked: ``on_progress(done, total)`` (total is
    None when the input has no len()), and a tqdm bar when ``bar`` and stderr is a terminal."""

    def __init__(self, total: int | None, bar: bool, callback: ProgressCallback | None) -> None:
        self.total = total
        self.done = 0
        self.callback = callback
        self._bar: Any = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                raise ImportError(
                    "progress=True needs tqdm: pip install queueserve[progress]"
                ) from None
            self._bar = tqdm(total=total, unit="item", dynamic_ncols=True)

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def total_of(items: object) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None
