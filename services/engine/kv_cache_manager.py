"""Per-request KV block bookkeeping over a BlockPool, with automatic prefix caching.

Rules:
- A request's blocks cover its tokens in order: token p lives in block_ids[p // block_size] at
  offset p % block_size.
- Prefix caching works on FULL blocks only. Block i's hash chains the previous block's hash with
  the block's token ids, so equal hashes mean equal whole prefixes.
- A block is registered in the cache when it is allocated for the step that fills it: its K/V is
  written by that step's forward, before any later step (or a later request of the same step,
  whose attention runs after the write) reads it.
- A prefix hit never covers the whole sequence: at least one token is computed, so the step that
  follows has logits to sample from.
- `free` releases a request's blocks last-first, so a shared prefix outlives its private tail in
  the LRU.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple

from flotilla.services.engine.block_pool import BlockPool
from flotilla.services.engine.request import Request

_ROOT_HASH = b"flotilla-kv-root"


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained content hash of one full block (collision-resistant: prefixes are shared)."""
    h = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class PrefixHit(NamedTuple):
    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover the full blocks among its first num_tokens.

        Same digests as hash_block, block by block; the new blocks' ids are packed once and
        hashed from views of that buffer (a long prompt has hundreds of blocks)."""
        bs = self.block_size
        hashes = request.block_hashes
        first, last = len(hashes), num_tokens // bs
        if first >= last:
            return
        ids = array("q", request.token_ids[first * bs : last * bs])
        packed, step = memoryview(ids).cast("B"), bs * ids.itemsize
        parent = hashes[-1] if hashes else _ROOT_HASH
        blake2b = hashlib.blake2b
        for offset in range(0, len(packed), step):
            h = blake2b(parent, digest_size=16)
            h.update(packed[offset : offset + step])
            parent = h.digest()
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request, in full blocks, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        blocks: list[int] = []
        lookup = self.pool.get_cached_block
        for h in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = lookup(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for num_new_tokens beyond the computed ones; False (and no change) if full.

        computed_blocks: a prefix hit from get_computed_blocks for a request that holds no blocks
        yet; they are claimed here together with the new blocks.
        """
        # Called for every scheduled request every step: the common decode case (no prefix hit,
        # no new block, no block filled) does only the arithmetic.
        bs = self.block_size
        pool = self.pool
        num_hit = len(computed_blocks) if computed_blocks else 0
        num_computed = request.num_computed_tokens + num_hit * bs
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = -(-total_tokens // bs) - len(request.block_ids) - num_hit
        if computed_blocks:
            # Claiming a cached block that nobody references takes it off the free list too.
            ref_cnt = pool.ref_cnt
            num_reclaimed = sum(1 for b in computed_blocks if ref_cnt[b] == 0)
            if num_new_blocks + num_reclaimed > pool.num_free_blocks:
                return False
            pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
        elif num_new_blocks > 0 and num_new_blocks > pool.num_free_blocks:
            return False
        if num_new_blocks > 0:
            request.block_ids.extend(pool.get_new_blocks(num_new_blocks))
        if self.enable_prefix_caching and num_computed // bs < total_tokens // bs:
            self._cache_full_blocks(request, num_computed, total_tokens)
        return True

    def _cache_full_blocks(self, request: Request, start_token: int, end_token: int) -> None:
        bs = self.block_size
        first, last = start_token // bs, end_token // bs
        self._update_block_hashes(request, end_token)
        for i in range(first, last):
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
