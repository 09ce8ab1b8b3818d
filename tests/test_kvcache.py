"""The KV block allocator: every block is free or held once, and a failed grow takes nothing."""
import pytest

from poot.engine.kvcache import BlockAllocator, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_hands_out_blocks_as_positions_need_them():
    kv = BlockAllocator(num_blocks=8, block_size=4)
    table = []
    assert kv.grow(table, 1) and table == [0]
    assert kv.grow(table, 4) and table == [0]          # still inside the first block
    assert kv.grow(table, 9) and table == [0, 1, 2]
    assert (kv.num_used, kv.num_free, kv.capacity_tokens) == (3, 5, 32)


def test_a_grow_that_does_not_fit_takes_nothing():
    kv = BlockAllocator(num_blocks=4, block_size=2)
    first, second = [], []
    assert kv.grow(first, 6)
    assert not kv.grow(second, 4)                      # needs 2 blocks, 1 is free
    assert second == [] and kv.num_free == 1
    assert kv.grow(second, 2) and second == [3]


def test_release_returns_every_block_and_empties_the_table():
    kv = BlockAllocator(num_blocks=4, block_size=2)
    a, b = [], []
    kv.grow(a, 4)
    kv.grow(b, 4)
    kv.release(a)
    assert a == [] and kv.num_free == 2 and kv.num_used == 2
    kv.release(b)
    assert kv.num_free == 4 and kv.num_used == 0
    reused = []
    assert kv.grow(reused, 8) and sorted(reused) == [0, 1, 2, 3]


def test_releasing_a_block_not_held_is_an_error():
    kv = BlockAllocator(num_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="not held"):
        kv.release([1])
    table = []
    kv.grow(table, 2)
    stale = list(table)
    kv.release(table)
    with pytest.raises(ValueError, match="not held"):
        kv.release(stale)                              # a double free is caught


def test_an_empty_cache_is_refused():
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=0, block_size=16)
