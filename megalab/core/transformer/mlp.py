"""The feed-forward block: h -> ffn -> h, with an optional gated linear unit.

    plain:  linear_fc2( act( linear_fc1(x) ) )                 linear_fc1: h -> ffn
    gated:  linear_fc2( act(x W_gate) * (x W_up) )             linear_fc1: h -> 2 ffn  (SwiGLU with silu)

Megatron: MLP (megatron/core/transformer/mlp.py); linear_fc1 is column-parallel and
linear_fc2 row-parallel, so under TP the activation runs on each rank's slice of ffn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal, scaled_init_method_normal

ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "squared_relu": lambda x: F.relu(x).pow(2),
}


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, spec):
        super().__init__()
        self.gated = config.gated_linear_unit
        self.activation_func = ACTIVATIONS[config.activation_func]
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        self.linear_fc1 = spec.column_linear(
            config.hidden_size, fc1_size, config=config,
            init_method=init_method_normal(config.init_method_std), bias=config.add_bias_linear,
            stride=2 if self.gated else 1,  # [gate; up]: under TP each rank takes a slice of both
        )
        self.linear_fc2 = spec.row_linear(
            config.ffn_hidden_size, config.hidden_size, config=config,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            bias=config.add_bias_linear,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        # EXERCISE model.mlp: fc1, activation (gated: act(first half) * second half), fc2
        ### BEGIN SOLUTION
        # HINT 1: The MLP maps h -> ffn -> h: linear_fc1, the activation, linear_fc2. With a gated linear unit, fc1
        #         produces two halves [gate; up] of ffn each, and only the gate goes through the activation.
        # HINT 2: Gated: torch.chunk the fc1 output into two along the last dimension and multiply
        #         activation_func(gate) by up. Otherwise apply activation_func to the whole of it. Then linear_fc2.
        intermediate = self.linear_fc1(hidden_states)  # [s, b, ffn] or [s, b, 2 ffn]
        if self.gated:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            intermediate = self.activation_func(gate) * up
        else:
            intermediate = self.activation_func(intermediate)
        return self.linear_fc2(intermediate)
        ### END SOLUTION
