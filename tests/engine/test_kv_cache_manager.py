"""KVCacheManager: block ids per request, prefix hits by chained full-block hashes, ref counts."""

import hashlib
import struct

from flotilla.services.engine.kv_cache_manager import KVCacheManager, hash_block
from flotilla.services.engine.request import Request
from flotilla.services.engine.sampling_params import SamplingParams

BS = 4


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=8)


def prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit req the way the scheduler does; return the prefix-hit token count."""
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit.block_ids)
    req.num_computed_tokens = req.num_tokens
    return hit.num_tokens


def test_allocation_covers_tokens_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make("a", list(range(10)))
    assert prefill(kv, req) == 0
    assert req.block_ids == [0, 1, 2]
    # Decoding tokens 10 and 11 stays in block 2; token 12 needs block 3.
    for tok in (10, 11):
        req.token_ids.append(tok)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert req.block_ids == [0, 1, 2]
    req.token_ids.append(12)
    assert kv.allocate_slots(req, 1)
    assert req.block_ids == [0, 1, 2, 3]
    kv.free(req)
    assert req.block_ids == [] and kv.num_free_blocks == 8


def test_allocation_fails_without_side_effects_when_pool_is_full() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    req = make("a", list(range(9)))
    assert not kv.allocate_slots(req, 9)
    assert req.block_ids == [] and kv.num_free_blocks == 2


def test_shared_prefix_hits_full_blocks_and_counts_references() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", list(range(10)))  # full blocks [0..3], [4..7]; partial [8, 9]
    prefill(kv, a)
    assert a.block_ids == [0, 1, 2]
    b = make("b", list(range(8)) + [100, 101, 102])
    assert prefill(kv, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    kv.free(a)
    assert kv.pool.ref_cnt[:4] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.pool.ref_cnt[:4] == [0, 0, 0, 0]
    # Both full blocks are still cached after everyone left.
    c = make("c", list(range(9)))
    assert prefill(kv, c) == 8
    assert c.block_ids[:2] == [0, 1]


def test_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefill(kv, make("a", list(range(8))))
    # An identical 8-token prompt reuses only the first block: the last one is recomputed.
    b = make("b", list(range(8)))
    assert prefill(kv, b) == 4
    assert b.block_ids == [0, 2]


def test_hash_is_chained_over_the_whole_prefix() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefill(kv, make("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    b = make("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefill(kv, b) == 0
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [0, 2, 3, 4])
    assert hash_block(b"x", [5, 6, 7, 8]) != hash_block(b"y", [5, 6, 7, 8])


def test_block_hashes_are_blake2b_chains_over_int64_ids() -> None:
    """Block i's hash is blake2b-128 seeded with block i-1's digest (a fixed root for block 0)
    over its ids as native int64, whether the blocks are hashed in one call or several."""
    tokens = [5, 2**40, 7, 0, 1, 2, 3, 4, 9, 9, 9, 9, 3]
    parent, expected = b"flotilla-kv-root", []
    for i in range(len(tokens) // BS):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(struct.pack(f"={BS}q", *tokens[i * BS : (i + 1) * BS]))
        parent = h.digest()
        expected.append(parent)
    whole = make("a", tokens)
    prefill(KVCacheManager(num_blocks=8, block_size=BS), whole)
    assert whole.block_hashes == expected
    assert hash_block(None, tokens[:BS]) == expected[0]
    assert hash_block(expected[0], tokens[BS : 2 * BS]) == expected[1]
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parts = make("b", tokens)
    for n in (5, 3, 5):  # chunks: the hashes are extended block by block
        assert kv.allocate_slots(parts, n)
        parts.num_computed_tokens += n
    assert parts.block_hashes == expected


def test_blocks_filled_by_decode_become_cached() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", [1, 2, 3])
    prefill(kv, a)
    a.token_ids.append(4)  # the sampled token completes block 0 when it is computed
    assert kv.allocate_slots(a, 1)
    kv.free(a)
    b = make("b", [1, 2, 3, 4, 5])
    assert prefill(kv, b) == 4


def test_free_releases_tail_first_so_prefix_is_evicted_last() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make("a", list(range(12)))
    prefill(kv, a)  # three full blocks, all cached
    kv.free(a)  # tail first: LRU order 2, 1, 0
    b = make("b", [50] * 6)  # needs 2 new blocks: evicts 2, then 1
    prefill(kv, b)
    assert b.block_ids == [2, 1]
    kv.free(b)
    c = make("c", list(range(12)))
    assert prefill(kv, c) == 4  # the first block of a survived
    assert c.block_ids[0] == 0


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    prefill(kv, make("a", list(range(9))))
    b = make("b", list(range(9)))
    assert prefill(kv, b) == 0
    assert b.block_ids == [3, 4, 5]


def test_touching_an_evictable_hit_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make("a", list(range(8)))
    prefill(kv, a)
    kv.free(a)  # blocks 0, 1 cached and evictable; 2 never used
    b = make("b", list(range(4)) + [9, 9, 9, 9, 9])  # hit block 0, needs 2 more blocks
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0]
    assert kv.allocate_slots(b, 5, hit.block_ids)
    assert b.block_ids == [0, 2, 1]
    assert kv.num_free_blocks == 0
