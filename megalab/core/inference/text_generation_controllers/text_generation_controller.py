"""One inference step of a GPTModel over a ragged batch, with its attention reading a KV cache.

Training runs [s, b] rectangles; serving runs many requests at different points. A step here
takes every new token of every scheduled request, flattened into one "sequence" of T tokens
(Megatron's dynamic engine and vLLM do the same), with each token's request and position:

    request A prefill (4 tokens)   request B decode   request C decode
    [a0 a1 a2 a3                   b7                 c12 ]             T = 6 tokens, b = 1
    positions 0 1 2 3              7                  12

Every matmul (QKV, projection, MLP, logits) runs once over all T tokens; only the core attention
works per request: it writes the request's new K/V to the cache and attends over its cached
past. The model's own modules run unchanged: for the step, each layer's `core_attention` is
swapped for a `CachedAttention` (the role of Megatron's `inference_context` argument), so the
training forward is untouched. Works for any GPTModel, tensor-parallel too (each rank caches
its own key/value groups).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


@dataclass
class Segment:
    """`length` consecutive tokens of sequence `seq_id` in the flat batch, at positions start.."""
    seq_id: int
    start: int
    length: int


class CachedAttention(nn.Module):
    """Core attention of one layer over a ragged batch: write the new K/V, attend over the cache."""

    def __init__(self, layer: int, cache, segments: list[Segment]):
        super().__init__()
        self.layer, self.cache, self.segments = layer, cache, segments

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                packed_seq_params=None) -> torch.Tensor:
        # query [T, 1, np, hn], key/value [T, 1, ng, hn] -> context [T, 1, np * hn]
        if packed_seq_params is not None:
            raise ValueError("KV-cache inference takes its requests as Segments, not PackedSeqParams")
        outputs, offset = [], 0
        for seg in self.segments:
            new = slice(offset, offset + seg.length)
            self.cache.write(self.layer, seg.seq_id, seg.start, key[new, 0], value[new, 0])
            keys, values = self.cache.read(self.layer, seg.seq_id, seg.start + seg.length)  # [len, ng, hn]
            outputs.append(attend(query[new, 0], keys, values, seg.start))
            offset += seg.length
        return torch.cat(outputs)[:, None]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of n new queries at positions start.. over `len` cached keys (GQA aware)."""
    # query [n, np, hn], keys/values [len, ng, hn] -> [n, np * hn]
    n, np_, hn = query.shape
    # EXERCISE inference.cached_attention: query i (position start+i) attends to cached keys 0..start+i
    ### BEGIN SOLUTION
    # HINT 1: The n new queries sit at positions start .. start+n-1 of their sequence; query i sees the
    #         cached keys 0 .. start+i, including earlier tokens of the same prefill but no later ones.
    # HINT 2: Repeat each key/value group np/ng times along the head dim (repeat_interleave, as
    #         CoreAttention does for GQA), build a [n, len] boolean mask key_position <= start + i, run
    #         F.scaled_dot_product_attention with heads first ([np, n, hn]) and reshape back to [n, np * hn].
    # HINT 3: The causal offset: with a cache the diagonal starts at column `start`, not 0.
    keys = keys.repeat_interleave(np_ // keys.shape[1], dim=1)  # GQA: each key/value group serves np/ng heads
    values = values.repeat_interleave(np_ // values.shape[1], dim=1)
    visible = torch.arange(keys.shape[0], device=query.device) <= start + torch.arange(n, device=query.device)[:, None]
    context = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible)  # [np, n, hn]
    return context.transpose(0, 1).reshape(n, np_ * hn)
    ### END SOLUTION


@contextmanager
def cached_attention(model, cache, segments: list[Segment]):
    """Swap every layer's core attention for a CachedAttention for the duration of one step."""
    layers = model.decoder.layers
    originals = [layer.self_attention.core_attention for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.self_attention.core_attention = CachedAttention(i, cache, segments)
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer.self_attention.core_attention = original


@torch.inference_mode()
def forward_step(model, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: list[Segment],
                 cache) -> torch.Tensor:
    """Logits [T, V] for the flat batch input_ids/position_ids [T]; fills the cache for these tokens."""
    if int(position_ids.max()) >= model.config.seq_length:
        raise ValueError(f"position {int(position_ids.max())} is past config.seq_length={model.config.seq_length}")
    embedding = model.embedding
    hidden = embedding.word_embeddings(input_ids[None])  # [1, T, h]
    if embedding.position_embeddings is not None:
        hidden = hidden + embedding.position_embeddings(position_ids[None])
    hidden = hidden.transpose(0, 1)  # [T, 1, h]: the T tokens play the sequence dimension, b = 1
    rotary = None
    if model.rotary_pos_emb is not None:
        rotary = model.rotary_pos_emb(int(position_ids.max()) + 1)[position_ids]  # [T, 1, 1, d]: each token's angle
    with cached_attention(model, cache, segments):
        hidden = model.decoder(hidden, rotary)  # [T, 1, h]
    return output_logits(model, hidden)[:, 0]  # [T, V]


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output layer (tied or not; vocab-parallel under TP, then gathered): [T, 1, h] -> [T, 1, V]."""
    logits = model.output(hidden)
    return logits if model.tp_group is None else gather_from_tensor_model_parallel_region(logits, model.tp_group)
