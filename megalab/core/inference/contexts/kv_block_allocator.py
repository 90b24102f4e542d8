"""The block allocator of a paged key/value cache: fixed-size blocks handed out, shared and returned.

    free list  [7, 8, 9]           blocks nobody holds
    ref counts {0: 2, 1: 1, ...}   how many requests hold each block (a shared prompt prefix: > 1)
    hashes     {h(p0): 0, ...}     prefix caching: a full prompt block's hash -> the block holding its K/V

With prefix caching a released block whose count falls to 0 keeps its K/V and its hash: the next
request with the same prefix takes it back (retain) instead of recomputing it. Under the LRU policy it
stays "cached" (evictable) until an allocation needs room: then the least recently used cached blocks
are evicted (their hash forgotten) and reused. Under REF_ZERO it is forgotten at once.

Megatron: KVBlockAllocator (core/inference/contexts/kv_block_allocator.py; dynamic_block_allocator.py in older
releases), with PrefixCachingEvictionPolicy (core/inference/config.py): REF_ZERO (Megatron's default) or LRU.
Megatron keeps one extra "dummy" block for CUDA graphs; we have none.
"""

from __future__ import annotations

import itertools

POLICIES = ("lru", "ref_zero")  # Megatron's PrefixCachingEvictionPolicy values


class KVBlockAllocator:
    """Free list + reference counts + (prefix caching) block hashes. Megatron: KVBlockAllocator
    (core/inference/contexts/kv_block_allocator.py).

    paused_limit: how many blocks paused requests may keep (the rest of the paused requests are evicted
    and recomputed later; default half the pool); Megatron derives it from paused_buffer_size_gb.
    The prefix_caching_eviction_policy default here is "lru" (Megatron's is "ref_zero"), so a cached prefix
    outlives its requests.
    """

    def __init__(self, num_blocks: int, paused_limit: int | None = None, enable_prefix_caching: bool = False,
                 prefix_caching_eviction_policy: str = "lru"):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got num_blocks={num_blocks}")
        paused_limit = num_blocks // 2 if paused_limit is None else paused_limit
        if not 0 <= paused_limit <= num_blocks - 1:
            raise ValueError(f"paused_limit must leave at least one block for running requests: "
                             f"0 <= paused_limit <= {num_blocks - 1}, got {paused_limit}")
        if prefix_caching_eviction_policy not in POLICIES:
            raise ValueError(f"prefix_caching_eviction_policy must be one of {POLICIES}, "
                             f"got {prefix_caching_eviction_policy!r}")
        self.num_blocks, self.paused_limit = num_blocks, paused_limit
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caching_eviction_policy = prefix_caching_eviction_policy
        self.free_blocks = list(range(num_blocks))
        self.block_ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks  # None: not registered
        self.kv_hash_to_block_id: dict[int, int] = {}
        self.block_timestamps = [0] * num_blocks  # LRU: higher = used more recently
        self.clock = itertools.count(1)
        self.evicted_block_count = 0  # cached blocks evicted so far (their hash forgotten, reused)

    # ------------------------------------------------------------------ counts
    def get_total_used(self) -> int:
        """Blocks outside the free list: held by requests, or cached for reuse (prefix caching)."""
        return self.num_blocks - len(self.free_blocks)

    def get_evictable_block_count(self) -> int:
        """Cached blocks nobody holds (ref count 0, hash registered): reusable, or evictable for room."""
        return sum(1 for b, h in enumerate(self.block_hashes) if h is not None and self.block_ref_counts[b] == 0)

    def get_allocatable_count(self) -> int:
        """Blocks an allocation can get now: the free list, plus the evictable cached blocks under LRU."""
        return len(self.free_blocks) + self.get_evictable_block_count()

    def get_referenced_count(self) -> int:
        """Blocks some request holds (a leak check: 0 once every request is over)."""
        return sum(1 for count in self.block_ref_counts if count > 0)

    def is_memory_available(self, num_blocks: int) -> bool:
        return self.get_allocatable_count() >= num_blocks

    # ------------------------------------------------------------------ allocate / release
    def allocate_memory_blocks(self, num_blocks: int) -> list[int] | None:
        """num_blocks blocks at ref count 1, evicting LRU cached blocks if the free list is short; None if
        even that is not enough (nothing changes then)."""
        if len(self.free_blocks) < num_blocks and not self.evict_lru_blocks(num_blocks - len(self.free_blocks)):
            return None
        blocks, self.free_blocks = self.free_blocks[:num_blocks], self.free_blocks[num_blocks:]
        now = next(self.clock)
        for b in blocks:
            self.block_ref_counts[b], self.block_timestamps[b] = 1, now
        return blocks

    def allocate(self, n: int) -> list[int]:
        """allocate_memory_blocks, raising when the cache cannot give n blocks."""
        blocks = self.allocate_memory_blocks(n)
        if blocks is None:
            raise RuntimeError(f"out of KV-cache blocks: asked for {n}, {self.get_allocatable_count()} allocatable")
        return blocks

    def release_memory_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds any more is cached or freed."""
        # EXERCISE inference.release_blocks: drop one reference per block; at 0 keep a registered block cached (LRU) or free it
        ### BEGIN SOLUTION
        # HINT 1: A block may be held by several requests (a shared prompt prefix): releasing drops ONE
        #         reference. Only when nobody holds it does it leave its owners; then, with prefix caching under
        #         the LRU policy, a block that carries a hash stays cached (its K/V is reusable); any other
        #         block goes back to the free list (under REF_ZERO its hash is forgotten first).
        # HINT 2: For each block: refuse a block whose count is already 0 (a double free); decrement
        #         block_ref_counts; if the count is now 0: a registered block (block_hashes[b] is not None) under
        #         "lru" stays where it is (evictable); otherwise forget its hash (the _deregister helper) if
        #         it has one, and append it to free_blocks.
        # HINT 3: A block released twice in the same call (two references of one request list) drops two
        #         references; the unregistered blocks (a prompt's partial last block, generated tokens) are never
        #         kept cached, whatever the policy.
        for b in blocks:
            if self.block_ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released more often than it was allocated or retained")
            self.block_ref_counts[b] -= 1
            if self.block_ref_counts[b] > 0:
                continue
            if self.block_hashes[b] is not None and self.prefix_caching_eviction_policy == "lru":
                continue  # cached: its K/V stays for the next request with this prefix
            if self.block_hashes[b] is not None:
                self._deregister(b)
            self.free_blocks.append(b)
        ### END SOLUTION

    def release(self, blocks: list[int]) -> None:
        self.release_memory_blocks(blocks)

    def retain_memory_blocks(self, blocks: list[int]) -> None:
        """One more reference to each (cached, matched) block: it cannot be evicted while held."""
        now = next(self.clock)
        for b in blocks:
            self.block_ref_counts[b] += 1
            self.block_timestamps[b] = now

    # ------------------------------------------------------------------ prefix caching
    def register_kv_block_hashes(self, blocks: list[int], hashes: list[int]) -> None:
        """Make filled prompt blocks findable by their hash (a hash already registered keeps its block)."""
        for b, h in zip(blocks, hashes):
            if self.block_hashes[b] is None and h not in self.kv_hash_to_block_id:
                self.block_hashes[b], self.kv_hash_to_block_id[h] = h, b

    def match(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest registered prefix of these (parent-chained) block hashes."""
        blocks = []
        for h in hashes:
            if h not in self.kv_hash_to_block_id:
                break
            blocks.append(self.kv_hash_to_block_id[h])
        return blocks

    def evict_lru_blocks(self, num_blocks_needed: int) -> bool:
        """Free the num_blocks_needed least recently used cached blocks (False, and nothing evicted, if fewer).

        Megatron also keeps a cached parent until its cached children are gone; here a child whose parent was
        evicted can no longer be matched (lookups walk the chain from the start) and is simply evicted later.
        """
        if self.prefix_caching_eviction_policy != "lru":
            return False
        cached = [b for b, h in enumerate(self.block_hashes) if h is not None and self.block_ref_counts[b] == 0]
        if len(cached) < num_blocks_needed:
            return False
        for b in sorted(cached, key=lambda b: self.block_timestamps[b])[:num_blocks_needed]:
            self._deregister(b)
            self.free_blocks.append(b)
            self.evicted_block_count += 1
        return True

    def _deregister(self, block: int) -> None:
        del self.kv_hash_to_block_id[self.block_hashes[block]]
        self.block_hashes[block] = None


BlockAllocator = KVBlockAllocator  # the course's earlier name
