"""Causal self-attention: one fused QKV projection, core attention, an output projection.

    hidden [s, b, h] ─ linear_qkv ─> [s, b, ng, (np/ng + 2) * hn]     per key/value group: its
                                       │ split                          np/ng query heads, 1 key, 1 value
                         q [s, b, np, hn]   k, v [s, b, ng, hn]
                                       │ core attention (softmax(q k^T / sqrt(hn)) v, causal)
                              context [s, b, np * hn] ─ linear_proj ─> [s, b, h]

np query heads, ng key/value groups (num_query_groups; ng = np is MHA, ng < np is GQA, ng = 1
MQA), hn = kv_channels. Megatron: Attention/SelfAttention (megatron/core/transformer/attention.py)
and DotProductAttention (dot_product_attention.py), whose "unfused" math is written out below;
the fused paths (PyTorch's F.scaled_dot_product_attention, our Triton FlashAttention, flash-attn,
or "auto") are in megalab/kernels.

With `packed_seq_params` (megalab/core/packed_seq_params.py) the rows hold packed documents: attention stays
inside each document (the fused backends take the boundaries; "unfused" runs document by document).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from megalab.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.tensor_parallel.random import checkpoint
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal, scaled_init_method_normal


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, spec, layer_number: int = 1):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.heads_per_group, self.kv_channels = np_ // ng, hn
        self.linear_qkv = spec.column_linear(
            config.hidden_size, (np_ + 2 * ng) * hn, config=config,
            init_method=init_method_normal(config.init_method_std),
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        self.core_attention = spec.core_attention(config)
        self.linear_proj = spec.row_linear(
            np_ * hn, config.hidden_size, config=config,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            bias=config.add_bias_linear,
        )
        self.checkpoint_core_attention = config.recompute_granularity == "selective"

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        mixed = self.linear_qkv(hidden_states)  # [s, b, ng * (np/ng + 2) * hn]
        s, b, _ = mixed.shape
        group_width = (self.heads_per_group + 2) * self.kv_channels
        # groups on this device: all of them here, a 1/tp share once linear_qkv is column-parallel
        ng = mixed.shape[-1] // group_width
        mixed = mixed.view(s, b, ng, group_width)
        query, key, value = torch.split(
            mixed, [self.heads_per_group * self.kv_channels, self.kv_channels, self.kv_channels], dim=3
        )
        query = query.reshape(s, b, ng * self.heads_per_group, self.kv_channels)  # [s, b, np, hn]
        if rotary_pos_emb is not None:
            interleaved = self.config.rotary_interleaved
            query = apply_rotary_pos_emb(query, rotary_pos_emb, interleaved)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, interleaved)
        # a spec's core attention takes (query, key, value); packed_seq_params only when the batch is packed,
        # so a custom core attention without packing support keeps the plain three-tensor signature
        packed = () if packed_seq_params is None else (packed_seq_params,)
        if packed and len(inspect.signature(self.core_attention.forward).parameters) < 4:
            raise ValueError(f"{type(self.core_attention).__name__} (this layer spec's core attention) takes no "
                             "packed_seq_params: run unpacked batches, or give its forward a packed_seq_params "
                             "argument as CoreAttention has")
        if self.checkpoint_core_attention and self.training:  # selective recomputation
            context = checkpoint(self.core_attention, query, key, value, *packed)
        else:
            context = self.core_attention(query, key, value, *packed)  # [s, b, np * hn]
        return self.linear_proj(context)
