"""BlockPool: exact allocation order, reference counts and LRU eviction of cached blocks."""

import pytest

from flotilla.services.engine.block_pool import BlockPool


def test_fresh_blocks_come_out_in_order_and_are_counted() -> None:
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.ref_cnt == [1, 1, 1, 0]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)


def test_freed_uncached_blocks_are_reused_first_in_first_out() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(4)
    pool.free_blocks([2, 0])
    assert pool.get_new_blocks(2) == [2, 0]


def test_cached_block_survives_free_and_can_be_touched_again() -> None:
    pool = BlockPool(3)
    [b] = pool.get_new_blocks(1)
    pool.cache_block(b, b"h0")
    pool.free_blocks([b])
    assert pool.ref_cnt[b] == 0 and pool.num_free_blocks == 3
    assert pool.get_cached_block(b"h0") == b
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 2
    pool.touch([b])  # a second request sharing the block
    assert pool.ref_cnt[b] == 2
    pool.free_blocks([b])
    assert pool.ref_cnt[b] == 1 and pool.get_cached_block(b"h0") == b


def test_never_cached_blocks_are_used_before_evicting_cached_ones() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"ha")
    pool.free_blocks([a, c])  # a cached, c not
    assert pool.get_new_blocks(1) == [c]
    assert pool.get_cached_block(b"ha") == a


def test_eviction_takes_least_recently_freed_cached_block() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for blk, h in zip(blocks, [b"h0", b"h1", b"h2"], strict=True):
        pool.cache_block(blk, h)
    pool.free_blocks([1, 2, 0])  # LRU order: 1, 2, 0
    pool.touch([2])  # claimed again: no longer evictable
    pool.free_blocks([2])  # freed again: now the most recent
    assert pool.get_new_blocks(1) == [1]
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_new_blocks(1) == [0]
    assert pool.get_new_blocks(1) == [2]
    assert pool.num_cached_blocks == 0 and pool.num_evictions == 3


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.get_cached_block(b"h") == a
    pool.free_blocks([b])  # b holds no cache entry: plain free block
    assert pool.get_new_blocks(1) == [b]


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_reset_prefix_cache_forgets_all_hashes() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"ha") is None and pool.get_cached_block(b"hb") is None
    assert pool.num_free_blocks == 1
    pool.free_blocks([b])
    assert pool.get_new_blocks(2) == [a, b]
