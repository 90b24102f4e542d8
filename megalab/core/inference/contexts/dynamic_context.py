"""KV caches: keep every past token's keys and values so a decode step computes one new token only.

Without a cache, token t+1 costs a forward over all t+1 tokens (O(t) work per token, O(t^2) per
sequence). With one, a step runs the model on the newest token and its attention reads the cached
K/V of the earlier ones. Two layouts, one interface (reserve / write / read / free):

    contiguous   one [max_seq_len] row per sequence slot, reserved up front
                 key[layer, slot, 0 : max_seq_len, ng, hn]           (Megatron's static
                 key_value_memory_dict: [s, b, ng, hn] per layer)   most of it never used

    paged        fixed-size blocks from one shared pool; a sequence owns a block table
                 block table of seq 7:  [5, 2, 9]   block_size = 4
                 token position p  ->  block table[p // 4], offset p % 4
                 pool  key[layer, num_blocks, block_size, ng, hn]    blocks come and go with
                                                                      the sequences (vLLM's
                 PagedAttention; Megatron's dynamic_context.py + kv_block_allocator.py)

ng = key/value groups on this device (num_query_groups, divided by the TP size), hn = kv_channels.

The paged cache is the memory of Megatron's dynamic engine (DynamicInferenceContext): blocks are taken one at
a time as a request grows (reserve / try_reserve), shared between requests with the same prompt prefix
(prefix caching: each full prompt block is named by a hash chained over the blocks before it,
compute_block_hashes), and counted by the allocator (kv_block_allocator.py) so a shared block stays
until its last holder lets go.
"""

from __future__ import annotations

import hashlib

import torch

from megalab.core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megalab.core.transformer.transformer_config import TransformerConfig


def local_query_groups(config: TransformerConfig, tp_size: int = 1) -> int:
    """Key/value groups each rank caches: column-parallel linear_qkv gives it ng / tp whole groups."""
    if config.num_query_groups % tp_size:
        raise ValueError(f"num_query_groups {config.num_query_groups} is not divisible by the TP size {tp_size}")
    return config.num_query_groups // tp_size


def compute_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """One hash per FULL block of tokens, each chained over the blocks before it: equal hashes mean equal
    prefixes (so equal K/V), not just equal blocks. SHA-256(parent digest || block's token bytes) mapped to
    [1, 2**63 - 1], as Megatron's compute_block_hashes_batched (core/inference/inference_request.py)."""
    hashes, parent = [], b"\x00" * 32
    for i in range(len(tokens) // block_size):
        block = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(int.from_bytes(parent[:8], "little") % (2**63 - 1) + 1)
    return hashes


class PagedKVCache:
    """A pool of num_blocks blocks of block_size positions, handed out as sequences grow.

    Megatron: DynamicInferenceContext (core/inference/contexts/dynamic_context.py) holds this pool and its
    KVBlockAllocator; paused_limit, enable_prefix_caching and prefix_caching_eviction_policy ("lru" or
    "ref_zero") are its settings (see kv_block_allocator.py).
    """

    def __init__(self, config: TransformerConfig, num_blocks: int, block_size: int = 16, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device=None, paused_limit: int | None = None,
                 enable_prefix_caching: bool = False, prefix_caching_eviction_policy: str = "lru"):
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, block_size, local_query_groups(config, tp_size), config.kv_channels)
        self.key = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_blocks, block_size, ng, hn]
        self.value = torch.zeros_like(self.key)
        self.allocator = KVBlockAllocator(num_blocks, paused_limit, enable_prefix_caching, prefix_caching_eviction_policy)
        self.block_tables: dict[int, list[int]] = {}  # sequence id -> its blocks, in position order

    def blocks_needed(self, seq_id: int, length: int) -> int:
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-length // self.block_size) - have)  # ceil(length / block_size) - have

    def fits(self, lengths: list[int]) -> bool:
        """Would sequences of these final lengths fit at once? ceil(length / block_size) blocks each."""
        return sum(-(-n // self.block_size) for n in lengths) <= self.allocator.num_blocks

    def reserve(self, seq_id: int, length: int) -> None:
        """Grow the sequence's block table until it covers positions 0..length-1."""
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self.allocator.allocate(self.blocks_needed(seq_id, length)))

    def try_reserve(self, seq_id: int, length: int) -> bool:
        """reserve, or False (and nothing taken) when the pool cannot give the blocks now."""
        blocks = self.allocator.allocate_memory_blocks(self.blocks_needed(seq_id, length))
        if blocks is None:
            return False
        self.block_tables.setdefault(seq_id, []).extend(blocks)
        return True

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Start a sequence's block table with cached blocks of its prompt prefix (one more reference each)."""
        self.allocator.retain_memory_blocks(blocks)
        self.block_tables.setdefault(seq_id, []).extend(blocks)

    def slots(self, seq_id: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of positions start .. start+n-1 through the block table."""
        # EXERCISE inference.paged_slots: map each position to (its block from the block table, its offset)
        ### BEGIN SOLUTION
        # HINT 1: A sequence's positions live in fixed-size blocks scattered over the pool: position p is in
        #         the (p // block_size)-th block OF ITS BLOCK TABLE, at offset p % block_size inside that block.
        # HINT 2: Make the positions start .. start+n-1 with torch.arange, look the block ids up in the
        #         sequence's block table (as a tensor on the cache's device), and take the remainders for the offsets.
        # HINT 3: The quotient p // block_size indexes the block table (it is not a block id), and the positions start
        #         at `start`, not 0.
        positions = torch.arange(start, start + n, device=self.key.device)
        table = torch.tensor(self.block_tables[seq_id], device=self.key.device)
        return table[positions // self.block_size], positions % self.block_size
        ### END SOLUTION

    def write(self, layer: int, seq_id: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value [n, ng, hn] -> positions start .. start+n-1
        blocks, offsets = self.slots(seq_id, start, key.shape[0])
        self.key[layer, blocks, offsets] = key
        self.value[layer, blocks, offsets] = value

    def read(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self.slots(seq_id, 0, length)
        return self.key[layer, blocks, offsets], self.value[layer, blocks, offsets]  # [length, ng, hn] each

    def free(self, seq_id: int) -> None:
        """Give the sequence's blocks back (nothing to do for one that never got any: a failed step)."""
        if seq_id in self.block_tables:
            self.allocator.release_memory_blocks(self.block_tables.pop(seq_id))

    def bytes_reserved(self) -> int:
        """Bytes held for the sequences now in the cache (their blocks only)."""
        per_block = 2 * self.key[:, 0].numel() * self.key.element_size()
        return per_block * sum(len(t) for t in self.block_tables.values())


DynamicInferenceContext = PagedKVCache  # Megatron's name for the paged cache and its bookkeeping
