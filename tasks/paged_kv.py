"""A paged KV cache in vLLM's manner: a pool of fixed-size blocks, a block table per sequence,
blocks shared by reference count, copy on write.

- ``BlockPool``: ``blocks`` blocks of ``block_size`` positions, each holding the keys and
  values of every layer for those positions (``k``/``v``: layers x blocks x block_size x heads
  x head size). A block has a reference count; one whose count drops to 0 is free again. The
  pool never grows: what a running set holds is bounded by it.
- ``BlockTable``: one sequence's positions, ``table[p // block_size]`` holding position ``p``
  at offset ``p % block_size``. ``reserve(n)`` makes room for ``n`` positions (new blocks, and
  a private copy of a shared last block before it is written: copy on write);
  ``release()`` gives every block back.
- ``CachedPrefix``: the blocks of a prompt prefix kept for other sequences (one reference on
  each); ``BlockTable.share`` starts a sequence on them. Its references are given back when
  nobody holds it any more (the prefix cache dropped it), by a finalizer.

Pure bookkeeping plus tensor storage; no model. One thread owns a pool (a partition's executor):
nothing here locks.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch


class PoolExhausted(Exception):
    """Not enough free blocks for what was asked (the caller preempts or waits)."""


class BlockPool:
    """``blocks`` KV blocks of ``block_size`` positions with reference counts."""

    def __init__(
        self,
        blocks: int,
        block_size: int,
        layers: int,
        heads: int,
        head_size: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs blocks >= 1 and block_size >= 1, got "
                f"{blocks} blocks of {block_size}"
            )
        self.blocks = blocks
        self.block_size = block_size
        shape = (layers, blocks, block_size, heads, head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.refs = [0] * blocks
        self.copies = 0  # blocks copied on write, ever
        self._free = list(range(blocks - 1, -1, -1))  # a stack: low ids first

    @staticmethod
    def block_bytes(
        block_size: int, layers: int, heads: int, head_size: int, dtype: torch.dtype = torch.float32
    ) -> int:
        """Memory of one block: keys and values of every layer for ``block_size`` positions."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * block_size * heads * head_size * itemsize

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted(f"all {self.blocks} KV blocks are in use")
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} is free: only a held block can be shared")
            self.refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than it was held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)

    def copy(self, block: int) -> int:
        """A new block holding ``block``'s keys and values (copy on write); ``block`` keeps
        its references."""
        new = self.allocate()
        self.copies += 1
        self.k[:, new] = self.k[:, block]
        self.v[:, new] = self.v[:, block]
        return new


class CachedPrefix:
    """The blocks holding the first ``length`` positions of a prompt, kept for other sequences:
    one reference on each block while this object lives."""

    __slots__ = ("__weakref__", "blocks", "length", "nbytes")

    def __init__(self, pool: BlockPool, blocks: Sequence[int], length: int) -> None:
        if pool.blocks_for(length) != len(blocks):
            raise ValueError(
                f"{length} positions fill {pool.blocks_for(length)} blocks, not {len(blocks)}"
            )
        self.blocks = tuple(blocks)
        self.length = length
        pool.incref(self.blocks)
        # Given back when the cache drops it (or whatever held it last), on that thread: the
        # executor's, which owns the pool.
        weakref.finalize(self, pool.release, self.blocks)


class BlockTable:
    """One sequence's blocks: ``length`` positions stored, in ``blocks``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        # A sequence dropped without release() (cancelled, timed out, its caller gone) still
        # gives its blocks back; the list is shared, so release() empties what it would free.
        weakref.finalize(self, pool.release, self.blocks)

    def share(self, prefix: CachedPrefix) -> None:
        """Start on a cached prefix: its blocks, one more reference each (nothing copied)."""
        if self.blocks:
            raise ValueError("only an empty block table can start on a cached prefix")
        self.pool.incref(prefix.blocks)
        self.blocks.extend(prefix.blocks)
        self.length = prefix.length

    def needs(self, positions: int) -> int:
        """Free blocks that ``reserve(positions)`` would take."""
        size = self.pool.block_size
        new = self.pool.blocks_for(self.length + positions) - len(self.blocks)
        writes_shared = (
            positions > 0 and self.length % size != 0 and self.pool.refs[self.blocks[-1]] > 1
        )
        return new + writes_shared

    def reserve(self, positions: int) -> None:
        """Room for the next ``positions`` positions: new blocks at the end, and a private copy
        of the last block if it is shared and will be written (copy on write). All or
        nothing: PoolExhausted leaves the table as it was."""
        size = self.pool.block_size
        if self.length + positions <= len(self.blocks) * size and (
            self.length % size == 0 or self.pool.refs[self.blocks[-1]] == 1
        ):
            return  # room already there, nothing shared written: most decode steps
        need = self.needs(positions)
        if need > self.pool.free:
            raise PoolExhausted(f"{need} blocks needed, {self.pool.free} free")
        if (
            positions > 0
            and self.length % self.pool.block_size
            and self.pool.refs[self.blocks[-1]] > 1
        ):
            shared = self.blocks[-1]
            self.blocks[-1] = self.pool.copy(shared)
            self.pool.release([shared])
        while len(self.blocks) < self.pool.blocks_for(self.length + positions):
            self.blocks.append(self.pool.allocate())

    def stored(self, positions: int) -> None:
        """``positions`` more positions were written (into room ``reserve`` made)."""
        if self.pool.blocks_for(self.length + positions) > len(self.blocks):
            raise ValueError(
                f"{positions} positions written past the {len(self.blocks)} blocks reserved"
            )
        self.length += positions

    def slots(self, start: int, stop: int) -> tuple[list[int], list[int]]:
        """(block, offset) of positions ``start..stop-1``, as two lists."""
        size = self.pool.block_size
        return (
            [self.blocks[p // size] for p in range(start, stop)],
            [p % size for p in range(start, stop)],
        )

    def release(self) -> None:
        self.pool.release(self.blocks)
        self.blocks.clear()
        self.length = 0

    def prefix(self, length: int) -> CachedPrefix:
        """The first ``length`` stored positions as a cached prefix (shares the blocks)."""
        if not 0 < length <= self.length:
            raise ValueError(f"a prefix of {length} positions is outside the {self.length} stored")
        return CachedPrefix(self.pool, self.blocks[: self.pool.blocks_for(length)], length)
