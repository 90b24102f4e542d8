"""The experts of an MoE layer: a loop of MLPs (SequentialMLP) or one batched matmul (GroupedMLP).

Megatron: megatron/core/transformer/moe/experts.py.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megalab.core.transformer.mlp import ACTIVATIONS, MLP
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal, scaled_init_method_normal


# ------------------------------------------------------------------ experts
def _expert_config(config: TransformerConfig, ffn_hidden_size: int) -> TransformerConfig:
    return dataclasses.replace(config, ffn_hidden_size=ffn_hidden_size)


class SequentialMLP(nn.Module):
    """The local experts as a loop of MLPs, one per chunk of tokens.

    Every expert is drawn as on one device and only the local ones are kept, so with the same
    seed EP = n builds the same model as EP = 1 (as tensor_parallel splits one master weight).
    """

    def __init__(self, config: TransformerConfig, local_expert_indices: list[int]):
        super().__init__()
        expert_config = _expert_config(config, config.moe_ffn_hidden_size)
        experts = [MLP(expert_config, LayerSpec()) for _ in range(config.num_moe_experts)]
        self.local_experts = nn.ModuleList(experts[e] for e in local_expert_indices)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:  # [N, h] -> [N, h]
        chunks = torch.split(tokens, tokens_per_expert.tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local_experts, chunks)])


class GroupedMLP(nn.Module):
    """All local experts in one batched matmul: tokens are laid out [L, max tokens, h] (zero rows
    pad the shorter experts) and multiplied by stacked weights. weight1 [L, h, ffn (x2 gated)],
    weight2 [L, ffn, h]; expert l's weight1[l] is SequentialMLP's linear_fc1.weight.T. The weights
    of all E experts are drawn, the local ones kept (the same model for any EP, given the seed)."""

    def __init__(self, config: TransformerConfig, local_expert_indices: list[int]):
        super().__init__()
        E, L, h, ffn = config.num_moe_experts, len(local_expert_indices), config.hidden_size, config.moe_ffn_hidden_size
        self.gated, self.activation_func = config.gated_linear_unit, ACTIVATIONS[config.activation_func]
        fc1 = ffn * (2 if self.gated else 1)
        weight1 = init_method_normal(config.init_method_std)(torch.empty(E, h, fc1))  # the MLP's init, per expert
        weight2 = scaled_init_method_normal(config.init_method_std, config.num_layers)(torch.empty(E, ffn, h))
        self.weight1 = nn.Parameter(weight1[local_expert_indices].clone())
        self.weight2 = nn.Parameter(weight2[local_expert_indices].clone())
        self.bias1 = nn.Parameter(torch.zeros(L, fc1)) if config.add_bias_linear else None
        self.bias2 = nn.Parameter(torch.zeros(L, h)) if config.add_bias_linear else None

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:  # [N, h] -> [N, h]
        L = tokens_per_expert.numel()
        counts = tokens_per_expert.to(tokens.device)
        expert = torch.repeat_interleave(torch.arange(L, device=tokens.device), counts)  # [N] expert of each row
        slot = torch.arange(tokens.shape[0], device=tokens.device) - (counts.cumsum(0) - counts)[expert]
        padded = tokens.new_zeros(L, int(counts.max()) if tokens.shape[0] else 0, tokens.shape[-1])
        padded = padded.index_put((expert, slot), tokens)  # [L, max_n, h]
        x = torch.bmm(padded, self.weight1)  # [L, max_n, fc1]
        if self.bias1 is not None:
            x = x + self.bias1.unsqueeze(1)
        if self.gated:
            gate, up = torch.chunk(x, 2, dim=-1)
            x = self.activation_func(gate) * up
        else:
            x = self.activation_func(x)
        y = torch.bmm(x, self.weight2)  # [L, max_n, h]
        if self.bias2 is not None:
            y = y + self.bias2.unsqueeze(1)
        return y[expert, slot]
