"""GPTModel: embeddings, a TransformerBlock, and logits over the vocabulary.

    input_ids [b, s] ─ embedding (word + learned positions) ─> [s, b, h]
                     ─ decoder (TransformerBlock: L layers, final_layernorm) ─> [s, b, h]
                     ─ output_layer (tied: the word-embedding matrix) ─> logits [b, s, V]
                       or, with labels, the per-token cross-entropy loss [b, s]

With RoPE the positions enter inside attention (rotary_pos_emb) instead of the embedding.
Megatron: GPTModel (megatron/core/models/gpt/gpt_model.py); `decoder`, `embedding`,
`rotary_pos_emb`, `output_layer` and `shared_embedding_or_output_weight` are its names.

packed_seq_params (PackedSeqParams, megalab/core/packed_seq_params.py): the rows hold packed documents; the
positions restart in each one (position_ids default to that) and attention stays inside each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding, RotaryEmbedding
from megalab.core.packed_seq_params import PackedSeqParams, packed_position_ids
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_block import TransformerBlock
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None):
        super().__init__()
        spec = spec or LayerSpec()
        self.config = config
        self.embedding = LanguageModelEmbedding(config)
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.rotary_base, config.rotary_interleaved
            )
        self.decoder = TransformerBlock(config, spec)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = spec.column_linear(
                config.hidden_size, config.vocab_size, config=config,
                init_method=init_method_normal(config.init_method_std), bias=False,
            )

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is not None:  # checks the boundaries; positions restart in every document
            position_ids = packed_position_ids(input_ids, position_ids, packed_seq_params)
        # EXERCISE model.gpt_forward: embed, (rotary angles), decoder, output layer (tied or not), logits or loss
        ### BEGIN SOLUTION
        hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]
        rotary = self.rotary_pos_emb
        rotary_pos_emb = rotary(input_ids.shape[1], packed_seq_params) if rotary is not None else None
        hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
        if self.output_layer is None:
            logits = F.linear(hidden_states, self.shared_embedding_or_output_weight())  # [s, b, V]
        else:
            logits = self.output_layer(hidden_states)
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view_as(labels)  # [b, s]
        ### END SOLUTION
