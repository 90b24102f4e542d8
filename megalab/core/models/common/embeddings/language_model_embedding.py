"""Token and position embeddings: learned absolute positions (GPT-2/3) or rotary (RoPE).

Megatron: LanguageModelEmbedding (megatron/core/models/common/embeddings/
language_model_embedding.py) and RotaryEmbedding / apply_rotary_pos_emb (rotary_pos_embedding.py).
Activations leave the embedding sequence-first, [s, b, h], the layout Megatron uses throughout
(sequence and context parallelism later split dimension 0).

RoPE rotates each pair (x_i, x_{i+d/2}) of a query/key head by the angle pos * base^(-2i/d), so
q.k depends only on the distance between positions ("rotate half" layout, as Megatron's default).
With rotary_interleaved the pairs are (x_{2i}, x_{2i+1}) instead (Meta's LLaMA code); rope.py
explains both and converts weights between them.

Packed documents (megalab/core/packed_seq_params.py) restart their positions at every document: the learned
embedding reads the per-document position_ids, and RotaryEmbedding(s, packed_seq_params) gives
every token the angle of its position in its own document (Megatron: `_apply_rotary_pos_emb_thd`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.models.common.embeddings.rope_utils import rotate_interleaved
from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        init(self.word_embeddings.weight)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)
            init(self.position_embeddings.weight)
        self.dropout = config.hidden_dropout
        self.max_positions = config.seq_length

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s = input_ids.shape
        longest = s if position_ids is None else int(position_ids.max()) + 1  # packed rows: the longest document
        if longest > self.max_positions:
            raise ValueError(f"sequence of {longest} tokens is longer than config.seq_length={self.max_positions}")
        embeddings = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        return F.dropout(embeddings, self.dropout, self.training)


class RotaryEmbedding(nn.Module):
    """The rotation angles for every position: forward(s) -> [s, 1, 1, rotary_dim]; for a packed
    batch [b, s], forward(s, packed_seq_params) -> [s, b, 1, rotary_dim], positions restarting per document."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000,
                 rotary_interleaved: bool = False):
        super().__init__()
        self.rotary_interleaved = rotary_interleaved
        dim = int(kv_channels * rotary_percent)
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_length: int, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None:
            positions = torch.arange(seq_length, device=self.inv_freq.device)[:, None]  # [s, 1]
        else:  # [s, b]: each token's position in its own document
            positions = packed_seq_params.position_ids((-1, seq_length)).t().to(self.inv_freq.device)
        freqs = positions[..., None].float() * self.inv_freq  # [s, b, dim/2]
        if self.rotary_interleaved:  # angle i for channels 2i and 2i+1
            return freqs.repeat_interleave(2, dim=-1)[:, :, None, :]  # [s, b, 1, dim]
        return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [s, b, 1, dim]: angle i for i and i+dim/2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first rotary_dim channels of t [s, b, heads, head_dim]; the rest pass through."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    rotate = rotate_interleaved if interleaved else _rotate_half
    return torch.cat([t_rot * cos + rotate(t_rot) * sin, t_pass], dim=-1)
