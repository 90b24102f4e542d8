"""LayerNorm and RMSNorm over the hidden dimension, chosen by `config.normalization`.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      (GPT)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * weight                      (LLaMA: no centring, no bias)

Megatron gets both from Transformer Engine or Apex fused kernels (megatron/core/fusions/
fused_layer_norm.py); a fused kernel saves only its input and the per-token statistics for
backward, as F.layer_norm does here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalab.core.transformer.transformer_config import TransformerConfig


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        # EXERCISE model.norm: x / sqrt(mean(x^2) + eps) * weight, statistics in float32
        ### BEGIN SOLUTION
        # HINT 1: RMSNorm divides each token's hidden vector by its root mean square (no mean subtracted, no bias), then
        #         scales it by weight; eps keeps the division finite for tiny vectors.
        # HINT 2: Upcast to float32, take the mean of the squares over the LAST dimension (keepdim=True), add eps and
        #         multiply by torch.rsqrt of it; cast back to the input's dtype (type_as), then multiply by self.weight.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight
        ### END SOLUTION

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(config: TransformerConfig, hidden_size: int | None = None) -> nn.Module:
    norm = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    norm = norm(hidden_size or config.hidden_size, config.layernorm_epsilon)
    for p in norm.parameters():  # under sequence parallelism each TP rank sees 1/t of the tokens:
        p.sequence_parallel = config.sequence_parallel  # its gradient is summed across TP after backward
    return norm
