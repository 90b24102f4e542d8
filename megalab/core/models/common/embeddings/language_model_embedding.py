"""Token and position embeddings: learned absolute positions (GPT-2/3) or rotary (RoPE).

Megatron: LanguageModelEmbedding (megatron/core/models/common/embeddings/
language_model_embedding.py) and RotaryEmbedding / apply_rotary_pos_emb (rotary_pos_embedding.py).
Activations leave the embedding sequence-first, [s, b, h], the layout Megatron uses throughout
(sequence and context parallelism later split dimension 0).

RoPE rotates each pair (x_i, x_{i+d/2}) of a query/key head by the angle pos * base^(-2i/d), so
q.k depends only on the distance between positions ("rotate half" layout, as Megatron's default).
With rotary_interleaved the pairs are (x_{2i}, x_{2i+1}) instead (Meta's LLaMA code); rope_utils.py
explains both and converts weights between them.

Packed documents (megalab/core/packed_seq_params.py) restart their positions at every document: the learned
embedding reads the per-document position_ids, and RotaryEmbedding(s, packed_seq_params) gives
every token the angle of its position in its own document (Megatron: `_apply_rotary_pos_emb_thd`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.tensor_parallel.layers import VocabParallelEmbedding
from megalab.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megalab.core.tensor_parallel.random import get_cuda_rng_tracker
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal


class LanguageModelEmbedding(nn.Module):
    """input_ids [b, s] -> [s, b, h]. With `tp_group` the vocabulary is split (VocabParallelEmbedding,
    drawn whole as on one device, then split) and, under config.sequence_parallel, the output is this
    rank's [s/t, b, h] (Megatron scatters in the embedding too)."""

    def __init__(self, config: TransformerConfig, tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        init(self.word_embeddings.weight)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)
            init(self.position_embeddings.weight)
        self.tp_group = tp_group
        if tp_group is not None:
            full = self.word_embeddings.weight
            self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                          init_method=lambda w: w.copy_(full), tp_group=tp_group)
        self.scatter_to_sequence_parallel = tp_group is not None and config.sequence_parallel
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
        if self.scatter_to_sequence_parallel:  # each TP rank its own tokens, its own mask (Megatron's order)
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)  # [s/t, b, h]
            with get_cuda_rng_tracker().fork():
                return F.dropout(embeddings, self.dropout, self.training)
        return F.dropout(embeddings, self.dropout, self.training)


