"""One transformer layer: x + attention(norm(x)), then + mlp(norm(.)), pre-norm, with the modules
its spec names.

Megatron: megatron/core/transformer/transformer_layer.py (TransformerLayer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.transformer.attention import SelfAttention
from megalab.core.transformer.mlp import MLP
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.torch_norm import build_norm
from megalab.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None, layer_number: int = 1):
        super().__init__()
        spec = spec or LayerSpec()
        self.layer_number = layer_number  # 1-based, as in Megatron
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, spec, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        if config.num_moe_experts is None:
            self.mlp = MLP(config, spec)
        else:  # a mixture of experts in place of the MLP (megalab/core/transformer/moe/moe_layer.py builds on model/: import it here)
            from megalab.core.transformer.moe.moe_layer import MoELayer

            self.mlp = MoELayer(config, layer_number)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        # [s, b, h] -> [s, b, h]
        # EXERCISE model.layer_forward: norm, attention, dropout, residual add; norm, MLP, dropout, residual add
        ### BEGIN SOLUTION
        # HINT 1: Pre-norm: each sub-layer reads a normalised copy of the residual stream and adds its output back onto
        #         the stream itself (not onto the normalised copy).
        # HINT 2: input_layernorm -> self_attention(..., rotary_pos_emb, packed_seq_params) -> F.dropout(hidden_dropout,
        #         self.training) -> add the residual; then pre_mlp_layernorm -> mlp -> dropout -> add the new residual.
        # HINT 3: The MLP's residual is the stream after the attention block, not the layer's input; add each
        #         residual once.
        residual = hidden_states
        attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params)
        hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
        residual = hidden_states
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
        ### END SOLUTION
