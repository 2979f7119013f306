"""The paged KV cache's bookkeeping (tasks/paged_kv.py): blocks from a fixed pool, reference
counts, block tables, cached prefixes shared without copying, copy on write, nothing leaked."""

from __future__ import annotations

import gc

import pytest

# The dev install includes torch: a broken one fails here, it is not skipped.
import torch

from tasks.paged_kv import BlockPool, BlockTable, CachedPrefix, PoolExhausted


def pool(blocks: int = 8, size: int = 4) -> BlockPool:
    return BlockPool(blocks, size, layers=2, heads=1, head_size=2)


def write(p: BlockPool, table: BlockTable, values: list[float]) -> None:
    """Store one value per position (as keys, every layer) after what ``table`` holds."""
    table.reserve(len(values))
    blocks, offsets = table.slots(table.length, table.length + len(values))
    p.k[:, blocks, offsets] = torch.tensor(values, dtype=torch.float32)[None, :, None, None]
    table.stored(len(values))


def read(p: BlockPool, table: BlockTable) -> list[float]:
    blocks, offsets = table.slots(0, table.length)
    return p.k[0, blocks, offsets, 0, 0].tolist()


def test_a_table_takes_blocks_as_positions_need_them_and_gives_them_all_back() -> None:
    p = pool(blocks=8, size=4)
    t = BlockTable(p)
    write(p, t, [1, 2, 3])
    assert len(t.blocks) == 1 and p.free == 7
    write(p, t, [4, 5])  # crosses a block boundary
    assert len(t.blocks) == 2 and p.free == 6
    assert read(p, t) == [1, 2, 3, 4, 5]
    t.release()
    assert p.free == 8 and t.blocks == [] and t.length == 0


def test_reserving_more_than_is_free_fails_and_changes_nothing() -> None:
    p = pool(blocks=3, size=4)
    t = BlockTable(p)
    write(p, t, [1] * 6)  # 2 blocks
    with pytest.raises(PoolExhausted):
        t.reserve(7)  # 13 positions: 4 blocks, 2 more than the one free
    assert len(t.blocks) == 2 and p.free == 1 and t.length == 6


def test_a_cached_prefix_is_shared_by_reference_and_outlives_its_writer() -> None:
    p = pool(blocks=8, size=4)
    writer = BlockTable(p)
    write(p, writer, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefix = writer.prefix(8)  # two full blocks
    assert p.refs[writer.blocks[0]] == 2 and p.refs[writer.blocks[2]] == 1
    writer.release()
    assert p.free == 6  # the prefix's two blocks stay held
    # A new sequence starts on them: nothing copied, nothing allocated
    reader = BlockTable(p)
    reader.share(prefix)
    assert reader.length == 8 and p.free == 6 and read(p, reader) == [1, 2, 3, 4, 5, 6, 7, 8]
    write(p, reader, [10])  # the next position goes to a block of its own
    assert read(p, reader) == [1, 2, 3, 4, 5, 6, 7, 8, 10] and p.free == 5
    reader.release()
    del prefix
    gc.collect()
    assert p.free == 8


def test_the_first_write_into_a_shared_partial_block_copies_it() -> None:
    p = pool(blocks=8, size=4)
    a = BlockTable(p)
    write(p, a, [1, 2, 3, 4, 5, 6])
    prefix = a.prefix(6)  # ends inside the second block
    shared = a.blocks[1]
    b = BlockTable(p)
    b.share(prefix)
    assert b.needs(1) == 1  # the copy
    # When both go on, each writes into a private copy of the shared block (copy on write)
    write(p, b, [70])
    write(p, a, [60])
    assert b.blocks[1] != shared and a.blocks[1] != shared and a.blocks[1] != b.blocks[1]
    assert b.blocks[0] == a.blocks[0]  # the full block is still shared
    assert read(p, a) == [1, 2, 3, 4, 5, 6, 60] and read(p, b) == [1, 2, 3, 4, 5, 6, 70]
    # and the cached block still holds what the prefix saw
    assert p.k[0, shared, :2, 0, 0].tolist() == [5, 6] and p.refs[shared] == 1
    a.release()
    b.release()
    del prefix
    gc.collect()
    assert p.free == 8


def test_a_dropped_table_or_prefix_gives_its_blocks_back() -> None:
    """The executor tells a serving nothing when it drops a sequence (cancelled, timed out):
    the blocks come back when the table is garbage."""
    p = pool(blocks=4, size=2)
    t = BlockTable(p)
    write(p, t, [1, 2, 3])
    prefix = t.prefix(2)
    del t
    gc.collect()
    assert p.free == 3
    del prefix
    gc.collect()
    assert p.free == 4


def test_misuse_is_refused() -> None:
    p = pool(blocks=4, size=2)
    t = BlockTable(p)
    write(p, t, [1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        t.prefix(4)
    with pytest.raises(ValueError, match="only an empty block table"):
        t.share(t.prefix(2))
    with pytest.raises(ValueError, match="is free"):
        p.incref([3])
    with pytest.raises(ValueError, match="fill 1 blocks, not 2"):
        CachedPrefix(p, t.blocks, 2)
    with pytest.raises(ValueError, match="past the 2 blocks"):
        t.stored(2)
    with pytest.raises(ValueError, match="blocks >= 1"):
        BlockPool(0, 4, 1, 1, 1)


def test_block_bytes_is_keys_and_values_of_every_layer() -> None:
    assert BlockPool.block_bytes(16, layers=4, heads=4, head_size=32) == 2 * 4 * 16 * 128 * 4
