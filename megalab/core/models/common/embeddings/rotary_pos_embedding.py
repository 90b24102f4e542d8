"""Rotary position embeddings: the angles for positions 0..s-1 (or each packed document's, or this
context-parallel rank's chunks).

Megatron: megatron/core/models/common/embeddings/rotary_pos_embedding.py (RotaryEmbedding; under CP
it calls get_pos_emb_on_this_cp_rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.utils import cp_rank_positions
from megalab.transformer_engine.context_parallel import check_not_packed


class RotaryEmbedding(nn.Module):
    """The rotation angles for every position: forward(s) -> [s, 1, 1, rotary_dim]; for a packed
    batch [b, s], forward(s, packed_seq_params) -> [s, b, 1, rotary_dim], positions restarting per document.

    With `cp_group`, s is this context-parallel rank's share s/cp and the angles are those of its
    chunks' positions in the full sequence (zigzag or contiguous); packed batches are refused there.
    Megatron: RotaryEmbedding.forward, which calls get_pos_emb_on_this_cp_rank under CP."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000,
                 rotary_interleaved: bool = False, cp_group: dist.ProcessGroup | None = None, cp_zigzag: bool = True):
        super().__init__()
        self.rotary_interleaved = rotary_interleaved
        self.cp_group, self.cp_zigzag = cp_group, cp_zigzag
        dim = int(kv_channels * rotary_percent)
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_length: int, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if self.cp_group is not None:  # [s/cp, 1, 1, dim]: the angles of this rank's chunks
            check_not_packed(packed_seq_params)
            cp = dist.get_world_size(self.cp_group)
            positions = cp_rank_positions(seq_length * cp, cp, dist.get_rank(self.cp_group), self.cp_zigzag)
            return self._angles(torch.arange(seq_length * cp, device=self.inv_freq.device)[:, None])[
                positions.to(self.inv_freq.device)]
        if packed_seq_params is None:
            positions = torch.arange(seq_length, device=self.inv_freq.device)[:, None]  # [s, 1]
        else:  # [s, b]: each token's position in its own document
            positions = packed_seq_params.position_ids((-1, seq_length)).t().to(self.inv_freq.device)
        return self._angles(positions)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:  # [s, b] -> [s, b, 1, dim]
        freqs = positions[..., None].float() * self.inv_freq  # [s, b, dim/2]
        if self.rotary_interleaved:  # angle i for channels 2i and 2i+1
            return freqs.repeat_interleave(2, dim=-1)[:, :, None, :]  # [s, b, 1, dim]
        return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [s, b, 1, dim]: angle i for i and i+dim/2
