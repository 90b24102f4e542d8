"""The top-k router: scores (softmax or sigmoid), optional expert bias, capacity, and auxiliary losses.

Megatron: megatron/core/transformer/moe/router.py (TopKRouter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal


class TopKRouter(nn.Module):
    """logits = x W^T, then top-k routing; attaches the aux/z-losses to the activations.
    The weight is dense (replicated on every EP rank): its gradient is reduced over DP.

    Under sequence parallelism (tp_group given) each TP rank routes its slice of the sequence, and
    the losses are those of the whole sequence, as in Megatron: the token counts are summed over
    TP (so the rank's share of E sum f_i P_i uses the global f), the z-loss coefficient is divided
    by the TP size; the rank's shares add up to the sequence's loss when the gradients are summed.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, tp_group=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.aux_losses: dict[str, torch.Tensor] = {}  # the last forward's values, for logging
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.topk, self.num_experts = config.moe_router_topk, config.num_moe_experts
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        init_method_normal(config.init_method_std)(self.weight.data)
        self.weight.sequence_parallel = config.sequence_parallel  # each TP rank routes its own tokens
        bias = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts) if bias else None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts) if bias else None)
        self.tokens_per_expert = None  # of the last forward, before dropping (for histograms)

    def forward(self, hidden: torch.Tensor):  # [T, h] -> probs [T, E], routing_map [T, E]
        c = self.config
        logits = F.linear(hidden, self.weight)  # [T, E]
        training = self.training and torch.is_grad_enabled()
        if c.moe_z_loss_coeff:
            z_loss = z_loss_func(logits, c.moe_z_loss_coeff / self.tp_size)
            self.aux_losses["z_loss"] = self._sum_over_tp(z_loss).detach()
            if training:
                logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        probs, routing_map, tokens_per_expert = topk_softmax_with_capacity(
            logits, self.topk, c.moe_expert_capacity_factor, c.moe_pad_expert_input_to_capacity,
            c.moe_router_score_function, self.expert_bias)
        self.tokens_per_expert = tokens_per_expert.detach()
        if self.expert_bias is not None and torch.is_grad_enabled():
            # the assignments kept after dropping/padding, as Megatron's _apply_expert_bias counts them
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        # the balance term E * sum f_i P_i is tracked always (1 when balanced), added to the loss when coeff > 0;
        # f_i counts the top-k of the scores without the bias (Megatron's compute_routing_scores_for_aux_loss)
        aux_map, scores = compute_routing_scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)
        balance = switch_load_balancing_loss_func(scores, self._sum_over_tp(aux_map.sum(dim=0)),
                                                  hidden.shape[0] * self.tp_size, self.topk, self.num_experts, 1.0)
        self.aux_losses["load_balancing_loss"] = self._sum_over_tp(balance).detach()
        if c.moe_aux_loss_coeff > 0 and training:
            probs = MoEAuxLossAutoScaler.apply(probs, balance * c.moe_aux_loss_coeff)
        return probs, routing_map

    def _sum_over_tp(self, value: torch.Tensor) -> torch.Tensor:
        """value summed over the TP group (a copy, outside autograd), or value itself without SP."""
        if self.tp_size == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.tp_group)
        return value
