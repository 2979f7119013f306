"""The servings of bench/once.py's cache figure: one embedding model, with the result cache
on and off. Each batch costs simulated device time (DEVICE_S_PER_BATCH plus
DEVICE_S_PER_ITEM per item, slept: the worker's CPU stays free, as a GPU's would) and returns
a float32 vector of DIM per item, a pure function of the item (``vector``), so every answer
is checked against it."""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

import queueserve as qs

DIM = 384  # all-MiniLM-L6-v2's
DEVICE_S_PER_ITEM = 0.001
DEVICE_S_PER_BATCH = 0.002
BATCH_SIZE = 64


def vector(text: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The embedding of ``text``: the same for the same text, in any process."""
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    return rng.standard_normal(DIM, dtype=np.float32)


def embed(texts: list[str]) -> np.ndarray[Any, np.dtype[np.float32]]:
    time.sleep(DEVICE_S_PER_BATCH + DEVICE_S_PER_ITEM * len(texts))
    return np.stack([vector(t) for t in texts])


embed_cached = qs.Serving(
    embed, name="embed_cached", batch_size=BATCH_SIZE, batch_timeout=0.002, cache_ttl="1h"
)
embed_plain = qs.Serving(embed, name="embed_plain", batch_size=BATCH_SIZE, batch_timeout=0.002)
