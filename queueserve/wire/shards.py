"""Redis Cluster hash tags of a serving's shards: pure functions of the name and count, which
every client and worker computes alike (wire/keys.py's layout: ``{S}``, ``{S#i}``, ``{S#i.k}``)."""

from __future__ import annotations

import binascii
import functools
from typing import Final

MAX_SHARDS: Final = 1024
CLUSTER_SLOTS: Final = 16384
_TAG_SEARCH_LIMIT: Final = 20 * CLUSTER_SLOTS


def check_shards(shards: object) -> int:
    """``shards`` if it is an int from 1 to MAX_SHARDS, else ValueError saying so."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(
            f"shards must be an int from 1 (the default: one Redis Cluster slot) to "
            f"{MAX_SHARDS}, got {shards!r}"
        )
    return shards


def key_slot(tag: str) -> int:
    """The Redis Cluster slot of keys whose hash tag is ``tag`` (CRC16/XMODEM mod 16384)."""
    return binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS


@functools.lru_cache(maxsize=256)
def shard_tags(serving: str, shards: int) -> tuple[str, ...]:
    """The hash tags of a serving's shards: ``S`` for shard 0, then ``S#i`` or ``S#i.k``.

    Shard i's tag is the first of ``S#i``, ``S#i.1``, ``S#i.2``... whose slot is
    ``slot(S) + i * 16384 / shards`` (mod 16384): the shards sit evenly around the slot ring,
    so on a cluster whose slots are split evenly over its masters (``redis-cli --cluster
    create``, ``rebalance``) ``shards`` = masters puts one shard on each master, whatever the
    serving's name. (Plain ``S#i`` tags land on random slots: 3 shards would share a master
    most of the time.) A pure function of the name and count: every client and worker agrees.
    """
    return (serving, *(shard_tag(serving, shards, i) for i in range(1, shards)))


@functools.lru_cache(maxsize=1024)
def shard_tag(serving: str, shards: int, i: int) -> str:
    """Shard i's tag alone (``shard_tags``): a client checking a declared shard count needs
    only the last one, a few ms, not all of them (seconds for MAX_SHARDS)."""
    if i == 0:
        return serving
    target = (key_slot(serving) + round(i * CLUSTER_SLOTS / shards)) % CLUSTER_SLOTS
    best, best_gap = f"{serving}#{i}", CLUSTER_SLOTS
    for k in range(_TAG_SEARCH_LIMIT):  # about 16384 tries (a few ms), found every time
        tag = f"{serving}#{i}" if k == 0 else f"{serving}#{i}.{k}"
        gap = abs(key_slot(tag) - target)
        if gap < best_gap:
            best, best_gap = tag, gap
            if gap == 0:
                break
    return best
