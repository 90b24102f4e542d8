"""Core attention: softmax(QK^T/sqrt(d) + causal mask) V for query groups (GQA), unfused or fused.

Megatron: megatron/core/transformer/dot_product_attention.py (DotProductAttention; here CoreAttention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.packed_seq_params import PackedSeqParams, document_slices
from megalab.core.tensor_parallel.random import get_cuda_rng_tracker
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.kernels import attention as fused_attention


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hn) + causal mask) v, with attention dropout. Megatron: DotProductAttention."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.attention_dropout = config.attention_dropout
        self.sequence_parallel = config.sequence_parallel
        self.backend = config.attention_backend

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, attention_dropout={self.attention_dropout}"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        # query [s, b, np, hn], key/value [s, b, ng, hn] -> context [s, b, np * hn]
        if self.training and self.attention_dropout > 0 and not self.sequence_parallel:
            # the heads are split over TP: each rank its own mask, from the tracker's model-parallel stream
            # (with sequence parallelism the whole block already runs on it: TransformerBlock.forward)
            with get_cuda_rng_tracker().fork():
                return self._forward(query, key, value, packed_seq_params)
        return self._forward(query, key, value, packed_seq_params)

    def _forward(self, query, key, value, packed_seq_params):
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
        # HINT 1: Each query attends to itself and to earlier positions only: the scores q . k / sqrt(hn) for every
        #         (query, key) pair of one head, -inf where the key comes after the query, a softmax over the keys, then
        #         the probability-weighted sum of the values.
        # HINT 2: Reshape q, k, v from [s, b, np, hn] to [b * np, s, hn] and use torch.bmm twice. The causal mask is the
        #         strict upper triangle of an [s, s] boolean matrix (triu with diagonal 1), applied with masked_fill
        #         before torch.softmax over the last dimension; F.dropout on the probabilities; back to [s, b, np * hn].
        # HINT 3: The scale is 1/sqrt(hn), the head dimension; the softmax normalises over the KEYS (the last dim).
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
