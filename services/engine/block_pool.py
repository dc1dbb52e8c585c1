"""A fixed set of KV-cache blocks: free list, reference counts and the prefix-cache index.

Rules:
- Blocks are numbered 0..num_blocks-1 and never move; a block's K/V lives in the ModelRunner's
  cache tensors at that index.
- A block with ref_cnt > 0 belongs to one or more running requests and is never handed out.
- A freed block (ref_cnt back to 0) that holds a full, hashed block of tokens stays in the prefix
  cache: it can be claimed again by `touch` until it is evicted. Eviction takes the least recently
  freed such block, and only when no never-cached free block is left.
- Allocation order is deterministic: never-cached free blocks first-in first-out (initially
  0, 1, 2, ...), then cached blocks in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks that still hold a cached prefix, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (never-cached plus evictable cached ones)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take n blocks for exclusive use (ref_cnt 1), evicting cached blocks if needed."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        free = self._free_uncached
        if n <= len(free):  # the common case, without the eviction branch
            blocks = [free.popleft() for _ in range(n)]
            for block in blocks:
                self.ref_cnt[block] = 1
            return blocks
        blocks = []
        for _ in range(n):
            if self._free_uncached:
                block = self._free_uncached.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling them out of the LRU."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._evictable[block]
            self.ref_cnt[block] += 1

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Register a full block under its chained hash. A hash already cached keeps its block."""
        if self.block_hash[block] is not None or block_hash in self._cached:
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks freed first are evicted first."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    self._free_uncached.append(block)
                else:
                    self._evictable[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the weights change)."""
        for block in list(self._evictable):
            self._evict(block)
            self._free_uncached.append(block)
        self._evictable.clear()
        for h, block in list(self._cached.items()):
            self.block_hash[block] = None
            del self._cached[h]

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._cached[h]
            self.block_hash[block] = None
            self.num_evictions += 1
