"""The block allocator of a paged key/value cache: fixed-size blocks handed out and returned.

Megatron: megatron/core/inference/contexts/kv_block_allocator.py (dynamic_block_allocator.py in older releases).
"""

from __future__ import annotations


class BlockAllocator:
    """A free list of block ids. Megatron: KVBlockAllocator (core/inference/contexts/kv_block_allocator.py)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"out of KV-cache blocks: asked for {n}, {len(self.free_blocks)} free")
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)
