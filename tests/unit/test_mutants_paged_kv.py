"""What the paged KV cache promises beyond tests/unit/test_paged_kv.py, test_paged_dense.py and
test_chartf.py, each written for a mutant of tasks/paged_kv.py that survived them
(docs/testing.md): a pool made on the device and in the dtype asked, holding ``block_bytes``
per block; the smallest pool; ``needs`` telling what ``reserve`` takes in every state a
table can be in (the scheduler admits and preempts by it), and leaving every block a write
goes to private to the table; growing a table that owns its last block copies nothing;
prefixes of one position and of none; and errors that name the numbers."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from tasks.paged_kv import BlockPool, BlockTable, CachedPrefix, PoolExhausted

SIZE = 4  # positions per block in these tests


def pool(blocks: int = 16, size: int = SIZE) -> BlockPool:
    return BlockPool(blocks, size, layers=2, heads=1, head_size=2)


def written(p: BlockPool, length: int) -> BlockTable:
    """A table holding ``length`` positions of its own."""
    t = BlockTable(p)
    t.reserve(length)
    t.stored(length)
    return t


def sharing(p: BlockPool, length: int, readers: int = 1) -> tuple[BlockTable, list[object]]:
    """A table started on a cached prefix of ``length`` positions that ``readers`` tables share
    (the writer's table released, as after its request ended), and what holds the rest."""
    writer = written(p, length)
    prefix = writer.prefix(length)
    writer.release()
    tables = [BlockTable(p) for _ in range(readers)]
    for t in tables:
        t.share(prefix)
    return tables[0], [prefix, *tables[1:]]


# Each: a table and what must stay alive with it, on a fresh pool of 16 blocks of 4
STATES: dict[str, Callable[[BlockPool], tuple[BlockTable, list[object]]]] = {
    "empty": lambda p: (BlockTable(p), []),
    "own-partial": lambda p: (written(p, 5), []),
    "own-full": lambda p: (written(p, 8), []),
    "shared-full": lambda p: sharing(p, 8),
    "shared-at-offset-1": lambda p: sharing(p, 5),
    "shared-at-offset-2": lambda p: sharing(p, 6),
    "shared-by-3-at-offset-3": lambda p: sharing(p, 7, readers=2),
}


@pytest.mark.parametrize("positions", [0, 1, 3, 4, 7])
@pytest.mark.parametrize("state", list(STATES))
def test_needs_is_what_reserve_takes_and_every_block_written_is_the_tables_own(
    state: str, positions: int
) -> None:
    p = pool()
    table, _held = STATES[state](p)
    length, free = table.length, p.free
    needs = table.needs(positions)
    table.reserve(positions)
    assert free - p.free == needs
    blocks, _ = table.slots(length, length + positions)  # room for each position asked
    assert all(p.refs[b] == 1 for b in blocks), "a write would go to a block others read"


def test_a_write_after_a_prefix_ending_one_position_into_a_block_leaves_the_prefix_as_it_was() -> (
    None
):
    # Given a prefix of 5 positions (one into its second block), shared by a second table
    p = pool()
    writer = BlockTable(p)
    writer.reserve(5)
    blocks, offsets = writer.slots(0, 5)
    p.k[:, blocks, offsets] = 1.0
    writer.stored(5)
    prefix = writer.prefix(5)
    reader = BlockTable(p)
    reader.share(prefix)
    # When the second table writes its sixth position
    reader.reserve(1)
    blocks, offsets = reader.slots(5, 6)
    p.k[:, blocks, offsets] = 2.0
    reader.stored(1)
    # Then the prefix's (and the writer's) sixth slot is untouched
    shared_blocks, shared_offsets = writer.slots(5, 6)
    assert p.k[:, shared_blocks, shared_offsets].eq(0.0).all()
    assert p.copies == 1


def test_growing_a_table_that_owns_its_last_block_copies_nothing() -> None:
    # Given a table of 3 positions in a pool with one block free
    p = pool(blocks=2)
    t = written(p, 3)
    first = t.blocks[0]
    # When it grows past its block
    t.reserve(5)
    # Then it takes the free block, and its stored positions stay where they were
    assert p.free == 0 and p.copies == 0 and t.blocks[0] == first


def test_reserve_of_nothing_on_an_empty_table_does_nothing() -> None:
    p = pool()
    t = BlockTable(p)
    t.reserve(0)
    assert t.blocks == [] and p.free == 16


def test_reserving_exactly_the_free_blocks_succeeds() -> None:
    p = pool(blocks=3)
    t = written(p, 4)
    t.reserve(8)  # two more blocks: all that is free
    assert p.free == 0 and len(t.blocks) == 3


def test_a_pool_of_one_block_of_one_position_holds_one_position() -> None:
    p = BlockPool(1, 1, layers=1, heads=1, head_size=1)
    t = written(p, 1)
    assert p.free == 0 and t.length == 1
    with pytest.raises(PoolExhausted):
        t.reserve(1)


@pytest.mark.parametrize(("blocks", "size"), [(0, 4), (4, 0)])
def test_a_pool_of_no_blocks_or_blocks_of_no_positions_is_refused(blocks: int, size: int) -> None:
    with pytest.raises(ValueError, match=f"got {blocks} blocks of {size}"):
        BlockPool(blocks, size, layers=1, heads=1, head_size=1)


def test_the_pool_is_made_on_the_device_and_in_the_dtype_asked_at_block_bytes_a_block() -> None:
    # ("meta" is a device with no memory: what a GPU pool would be, without a GPU)
    p = BlockPool(3, 4, layers=2, heads=3, head_size=5, device="meta", dtype=torch.float16)
    per_block = BlockPool.block_bytes(4, 2, 3, 5, dtype=torch.float16)
    assert per_block == 2 * 2 * 4 * 3 * 5 * 2
    for kv in (p.k, p.v):
        assert kv.device.type == "meta" and kv.dtype == torch.float16
    assert p.k.nelement() * p.k.element_size() * 2 == 3 * per_block


def test_a_prefix_of_one_position_is_kept_and_one_of_none_refused() -> None:
    p = pool()
    t = written(p, 3)
    one = t.prefix(1)
    assert isinstance(one, CachedPrefix) and one.length == 1 and one.blocks == (t.blocks[0],)
    assert p.refs[t.blocks[0]] == 2
    with pytest.raises(ValueError, match="a prefix of 0 positions is outside the 3 stored"):
        t.prefix(0)


def test_a_block_released_more_often_than_held_is_refused() -> None:
    p = pool()
    block = p.allocate()
    p.release([block])
    with pytest.raises(ValueError, match=f"block {block} released more often than it was held"):
        p.release([block])
    assert p.free == 16 and p.refs[block] == 0


def test_exhaustion_and_misuse_say_what_was_wrong() -> None:
    p = pool(blocks=2)
    t = written(p, 4)
    with pytest.raises(PoolExhausted, match=r"^2 blocks needed, 1 free$"):
        t.reserve(5)
    p.allocate()
    with pytest.raises(PoolExhausted, match=r"^all 2 KV blocks are in use$"):
        p.allocate()
    other = written(pool(), 4)
    with pytest.raises(ValueError, match=r"^only an empty block table can start on a cached"):
        other.share(t.prefix(4))
    del other
    gc.collect()
