"""A contiguous key/value cache: one [max_seq, ...] buffer per request slot.

Megatron: megatron/core/inference/contexts/static_context.py (the static engine's cache).
"""

from __future__ import annotations

import torch

from megalab.core.inference.contexts.dynamic_context import local_query_groups
from megalab.core.transformer.transformer_config import TransformerConfig


class ContiguousKVCache:
    """max_batch_size slots of max_seq_len positions each, allocated once."""

    def __init__(self, config: TransformerConfig, max_batch_size: int, max_seq_len: int | None = None,
                 tp_size: int = 1, dtype: torch.dtype = torch.float32, device=None):
        self.max_seq_len = max_seq_len or config.seq_length
        shape = (config.num_layers, max_batch_size, self.max_seq_len, local_query_groups(config, tp_size),
                 config.kv_channels)
        self.key = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, max_seq_len, ng, hn]
        self.value = torch.zeros_like(self.key)
        self.free_slots = list(range(max_batch_size))
        self.slot_of: dict[int, int] = {}  # sequence id -> slot

    def fits(self, lengths: list[int]) -> bool:
        """Would sequences of these final lengths fit at once? One slot each."""
        return len(lengths) <= len(self.slot_of) + len(self.free_slots) and all(n <= self.max_seq_len for n in lengths)

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for positions 0..length-1 of a sequence (a whole slot, the first time)."""
        if length > self.max_seq_len or (seq_id not in self.slot_of and not self.free_slots):
            raise RuntimeError(f"no room for sequence {seq_id} ({length} tokens): free a slot or raise max_batch_size")
        if seq_id not in self.slot_of:
            self.slot_of[seq_id] = self.free_slots.pop(0)

    def write(self, layer: int, seq_id: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value [n, ng, hn] -> positions start .. start+n-1
        slot = self.slot_of[seq_id]
        self.key[layer, slot, start:start + key.shape[0]] = key
        self.value[layer, slot, start:start + key.shape[0]] = value

    def read(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.slot_of[seq_id]
        return self.key[layer, slot, :length], self.value[layer, slot, :length]  # [length, ng, hn] each

    def free(self, seq_id: int) -> None:
        """Give the sequence's slot back (nothing to do for one that never got a slot: a failed step)."""
        if seq_id in self.slot_of:
            self.free_slots.append(self.slot_of.pop(seq_id))

    def bytes_reserved(self) -> int:
        """Bytes held for the sequences now in the cache (a whole slot each)."""
        per_slot = 2 * self.key[:, 0].numel() * self.key.element_size()
        return per_slot * len(self.slot_of)
