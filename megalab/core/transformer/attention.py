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
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.models.common.embeddings.language_model_embedding import apply_rotary_pos_emb
from megalab.core.packed_seq_params import PackedSeqParams, document_slices
from megalab.core.tensor_parallel.random import checkpoint
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal, scaled_init_method_normal
from megalab.kernels import attention as fused_attention


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hn) + causal mask) v, with attention dropout. Megatron: DotProductAttention."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.attention_dropout = config.attention_dropout
        self.backend = config.attention_backend

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, attention_dropout={self.attention_dropout}"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        # query [s, b, np, hn], key/value [s, b, ng, hn] -> context [s, b, np * hn]
        s, b, np_, hn = query.shape
        if key.shape[2] != np_:  # GQA: each key/value head serves np/ng query heads
            key = key.repeat_interleave(np_ // key.shape[2], dim=2)
            value = value.repeat_interleave(np_ // value.shape[2], dim=2)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.backend != "unfused":  # sdpa, triton, flash_attn or auto (megalab/kernels picks)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            context = fused_attention(q, k, v, self.backend, dropout_p=dropout_p, causal=True,
                                      packed_seq_params=packed_seq_params)
            return context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
        if packed_seq_params is not None:  # each document alone: flash-attn's varlen idea, one matmul per document
            stream = [t.transpose(0, 1).reshape(b * s, 1, *t.shape[2:]) for t in (query, key, value)]  # [T, 1, np, hn]
            context = torch.cat([self.unfused_attention(*(t[doc] for t in stream), dropout_p)
                                 for doc in document_slices(packed_seq_params)])  # [T, 1, np * hn]
            return context.view(b, s, np_ * hn).transpose(0, 1)
        return self.unfused_attention(query, key, value, dropout_p)

    @staticmethod
    def unfused_attention(query, key, value, dropout_p: float) -> torch.Tensor:
        """The math, one batched matmul at a time, on [b * np, s, hn] views of q, k, v."""
        s, b, np_, hn = query.shape
        # EXERCISE model.core_attention: scores = q k^T / sqrt(hn), causal mask, softmax, dropout, times v
        ### BEGIN SOLUTION
        q = query.reshape(s, b * np_, hn).transpose(0, 1)  # [b*np, s, hn]
        k = key.reshape(s, b * np_, hn).transpose(0, 1)
        v = value.reshape(s, b * np_, hn).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hn))  # [b*np, s, s]
        future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)  # key after query
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
        context = torch.bmm(probs, v)  # [b*np, s, hn]
        return context.transpose(0, 1).reshape(s, b, np_ * hn)
        ### END SOLUTION


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
