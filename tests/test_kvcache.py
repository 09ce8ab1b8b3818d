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


def test_a_shared_block_is_free_only_once_every_holder_has_released_it():
    kv = BlockAllocator(num_blocks=4, block_size=2, caching=False)
    first = []
    kv.grow(first, 5)                                  # blocks 0, 1, 2
    fork = first[:2]
    kv.share(fork)                                     # a fork's choices read the full two
    kv.release(first)
    assert (kv.num_used, kv.num_free) == (2, 2)
    other = list(fork)
    kv.share(other)
    kv.release(fork)
    assert kv.num_used == 2
    kv.release(other)
    assert (kv.num_used, kv.num_free) == (0, 4)
    with pytest.raises(ValueError, match="not held"):
        kv.share([3])


def test_an_empty_cache_is_refused():
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=0, block_size=16)


# ---- prefix caching -----------------------------------------------------------------------------

def computed(kv, tokens):
    """A sequence of `tokens` that took its cached prefix, grew, and computed every token."""
    table, keys = kv.match(tokens)
    kv.grow(table, len(tokens))
    kv.register(table, tokens, len(tokens), keys)
    return table


def test_a_prompt_takes_the_full_blocks_of_a_prefix_computed_before():
    kv = BlockAllocator(num_blocks=16, block_size=4)
    first = computed(kv, list(range(10)))              # blocks 0, 1 full, 2 partial
    shared, _ = kv.match(list(range(8)) + [99, 98, 97])
    assert shared == first[:2]                         # the full blocks, read-only
    assert kv.num_used == 3 and (kv.hit_tokens, kv.query_tokens) == (8, 21)
    other, _ = kv.match([0, 1, 2, 3, 5, 5, 5, 5, 5])
    assert other == first[:1]                          # keys name the whole prefix
    assert kv.match([1, 0, 2, 3, 4])[0] == []


def test_never_the_whole_prompt_its_last_token_must_run():
    kv = BlockAllocator(num_blocks=16, block_size=4)
    computed(kv, list(range(8)))
    assert len(kv.match(list(range(8)))[0]) == 1       # 8 tokens: the second block is rerun
    assert len(kv.match(list(range(9)))[0]) == 2


def test_cached_blocks_are_free_to_take_least_recently_used_first():
    kv = BlockAllocator(num_blocks=4, block_size=2)
    a = computed(kv, [1, 2, 3, 4])
    b = computed(kv, [5, 6, 7, 8])
    kv.release(a)
    kv.release(b)
    assert (kv.num_free, kv.num_cached, kv.num_used) == (4, 4, 0)
    kv.match([5, 6, 0])                                # b's first block, held again
    kv.release(kv.match([5, 6, 0])[0])
    fresh = []
    assert kv.grow(fresh, 6) and kv.evictions == 3     # a's two blocks, then b's second
    assert kv.match([1, 2, 0])[0] == [] and len(kv.match([5, 6, 0])[0]) == 1


def test_a_shared_block_is_freed_only_when_its_last_holder_lets_go():
    kv = BlockAllocator(num_blocks=4, block_size=2)
    a = computed(kv, [1, 2, 3])
    b, _ = kv.match([1, 2, 9])
    kv.release(a)
    assert kv.num_used == 1 and kv.num_cached == 0
    kv.release(b)
    assert kv.num_used == 0 and kv.num_cached == 1


def test_without_caching_nothing_is_kept_or_matched():
    kv = BlockAllocator(num_blocks=4, block_size=2, caching=False)
    table = computed(kv, [1, 2, 3, 4])
    kv.release(table)
    assert kv.num_cached == 0 and kv.match([1, 2, 3, 4, 5])[0] == []
