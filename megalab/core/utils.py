"""Linear layers and their initialization, the single-device stand-ins for Megatron's parallel ones.

Megatron builds every weight matrix of a transformer layer through one of two classes
(megatron/core/tensor_parallel/layers.py):

    ColumnParallelLinear  splits the OUTPUT features across TP ranks   linear_qkv, linear_fc1, output_layer
    RowParallelLinear     splits the INPUT features across TP ranks    linear_proj, linear_fc2

Here both roles are a plain `Linear`; a `LayerSpec` (spec.py) says which class plays which
role, so chapter 03 swaps in the parallel classes without touching attention or MLP code.
Every linear factory takes (input_size, output_size, *, config, init_method, bias, stride).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megalab.core.transformer.transformer_config import TransformerConfig


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, std^2): Megatron's init_method for embeddings, linear_qkv and linear_fc1."""
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (std / sqrt(2 L))^2) for the layers that write into the residual stream
    (linear_proj, linear_fc2): 2 L of them add up, so each one starts smaller (GPT-2's rule)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


class Linear(nn.Linear):
    """y = x W^T + b on one device, initialized the Megatron way (weights by init_method, bias 0).

    `stride` says the output is made of that many concatenated parts (2 for a gated linear_fc1:
    [gate; up]); one device ignores it, ColumnParallelLinear splits each part across ranks.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], torch.Tensor], bias: bool = True, stride: int = 1):
        super().__init__(input_size, output_size, bias=bias)
        with torch.no_grad():
            init_method(self.weight)
            if bias:
                self.bias.zero_()
