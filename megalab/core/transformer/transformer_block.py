"""A pre-norm transformer layer, and the block that stacks them (with activation recomputation).

    x ─┬─ input_layernorm ─ self_attention ─ dropout ─(+)─┬─ pre_mlp_layernorm ─ mlp ─ dropout ─(+)─> out
       └──────────────────── residual ─────────────────────┘└──────────────── residual ─────────────┘

Megatron: TransformerLayer (megatron/core/transformer/transformer_layer.py) and
TransformerBlock (transformer_block.py), whose final_layernorm ends the stack.

With config.num_moe_experts set, the MLP is a MoELayer (megalab/core/transformer/moe/moe_layer.py), as in Megatron's
MoE layer spec: a mixture-of-experts GPT is the same GPTModel.

Recomputation (config.recompute_granularity), in training only:
    "selective"  the core attention of every layer (SelfAttention checkpoints it): the s^2 part
    "full"       whole layers; recompute_method "uniform" checkpoints every chunk of
                 recompute_num_layers layers, "block" the first recompute_num_layers layers one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.packed_seq_params import PackedSeqParams
from megalab.core.tensor_parallel.random import checkpoint
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
        residual = hidden_states
        attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params)
        hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
        residual = hidden_states
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
        ### END SOLUTION


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig, spec: LayerSpec | None = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config, spec, i + 1) for i in range(config.num_layers))
        self.final_layernorm = build_norm(config)

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states, rotary_pos_emb, packed_seq_params)
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states, rotary_pos_emb, packed_seq_params)
        return self.final_layernorm(hidden_states)

    def _checkpointed_forward(self, hidden_states, rotary_pos_emb, packed_seq_params):
        n, layers = self.config.recompute_num_layers, self.layers
        if self.config.recompute_method == "uniform":  # only every chunk's input is kept
            for start in range(0, len(layers), n):
                hidden_states = checkpoint(_run_layers(layers[start:start + n]), hidden_states, rotary_pos_emb,
                                           packed_seq_params)
        else:  # "block": the first n layers are recomputed, the others keep their activations
            for i, layer in enumerate(layers):
                hidden_states = (checkpoint(layer, hidden_states, rotary_pos_emb, packed_seq_params) if i < n
                                 else layer(hidden_states, rotary_pos_emb, packed_seq_params))
        return hidden_states


def _run_layers(layers):
    def run(hidden_states, rotary_pos_emb, packed_seq_params):
        for layer in layers:
            hidden_states = layer(hidden_states, rotary_pos_emb, packed_seq_params)
        return hidden_states

    return run
