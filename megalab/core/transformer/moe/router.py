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

    The load-balancing losses (config.moe_router_load_balancing_type, one coefficient each):
      "aux_loss"         E * sum_i f_i P_i over the micro-batch's tokens;
      "seq_aux_loss"     the same per sequence, averaged over the batch (DeepSeek-V2/V3);
      "global_aux_loss"  f_i from the token counts of every micro-batch since the last
                         reset_global_aux_loss_tracker() (finalize_model_grads calls it once per
                         global batch, as Megatron's), summed over TP x DP x CP (Qwen's global balance).
    f_i always counts each token's top-k of the scores without the expert bias (Megatron's
    compute_routing_scores_for_aux_loss). The aux_loss value is tracked even when its coefficient is 0.

    Under sequence parallelism and context parallelism (tp_cp_group given: Megatron's tp_cp) each
    TP x CP rank routes its slice of the sequence, and the losses are those of the whole sequence,
    as in Megatron: the token counts are summed over TP x CP (so the rank's share of E sum f_i P_i
    uses the global f), the z-loss coefficient is divided by the TP x CP size; the ranks' shares add
    up to the sequence's loss. The schedule scales their gradients by cp / num_microbatches
    (MoEAuxLossAutoScaler), and DDP's average over DP x CP leaves 1 / (num_microbatches x dp).
    tp_dp_cp_group: where the global aux loss sums its counts (None: this process alone).
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, tp_cp_group=None, tp_dp_cp_group=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.aux_losses: dict[str, torch.Tensor] = {}  # the last forward's values, for logging
        self.tp_cp_group, self.tp_dp_cp_group = tp_cp_group, tp_dp_cp_group
        self.tp_cp_size = dist.get_world_size(tp_cp_group) if tp_cp_group is not None else 1
        self.topk, self.num_experts = config.moe_router_topk, config.num_moe_experts
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        init_method_normal(config.init_method_std)(self.weight.data)
        self.weight.sequence_parallel = config.sequence_parallel  # each TP rank routes its own tokens
        bias = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts) if bias else None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts) if bias else None)
        self.tokens_per_expert = None  # of the last forward, before dropping (for histograms)
        glob = self.get_aux_loss_coeff("global_aux_loss") > 0
        self.register_buffer("global_tokens_per_expert", torch.zeros(config.num_moe_experts) if glob else None,
                             persistent=False)
        self.register_buffer("ga_steps", torch.zeros(()) if glob else None, persistent=False)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """The coefficient of one load-balancing loss type (0 when it is not configured)."""
        types, coeffs = self.config.moe_router_load_balancing_type, self.config.moe_aux_loss_coeff
        if isinstance(types, str):
            return coeffs if types == aux_loss_type else 0.0
        return coeffs[types.index(aux_loss_type)] if aux_loss_type in types else 0.0

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new window of token counts for the global aux loss (Megatron: every global batch, in
        finalize_model_grads' reset_model_temporary_tensors)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def forward(self, hidden: torch.Tensor):  # [s, b, h] or [T, h] -> probs [T, E], routing_map [T, E]
        c = self.config
        seq_length, bsz = hidden.shape[:2] if hidden.dim() == 3 else (hidden.shape[0], 1)
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
        logits = F.linear(hidden, self.weight)  # [T, E]
        training = self.training and torch.is_grad_enabled()
        if c.moe_z_loss_coeff:
            z_loss = z_loss_func(logits, c.moe_z_loss_coeff / self.tp_cp_size)
            self.aux_losses["z_loss"] = self._sum_over(z_loss, self.tp_cp_group).detach()
            if training:
                logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        probs, routing_map, tokens_per_expert = topk_softmax_with_capacity(
            logits, self.topk, c.moe_expert_capacity_factor, c.moe_pad_expert_input_to_capacity,
            c.moe_router_score_function, self.expert_bias)
        self.tokens_per_expert = tokens_per_expert.detach()
        if self.expert_bias is not None and torch.is_grad_enabled():
            # the assignments kept after dropping/padding, as Megatron's _apply_expert_bias counts them
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        # f_i counts the top-k of the scores without the bias (Megatron's compute_routing_scores_for_aux_loss)
        aux_map, scores = compute_routing_scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)
        # the balance term E * sum f_i P_i is tracked always (1 when balanced), added to the loss when coeff > 0
        balance = switch_load_balancing_loss_func(scores, self._sum_over(aux_map.sum(dim=0), self.tp_cp_group),
                                                  hidden.shape[0] * self.tp_cp_size, self.topk, self.num_experts, 1.0)
        self.aux_losses["load_balancing_loss"] = self._sum_over(balance, self.tp_cp_group).detach()
        if self.get_aux_loss_coeff("aux_loss") > 0 and training:
            probs = MoEAuxLossAutoScaler.apply(probs, balance * self.get_aux_loss_coeff("aux_loss"))
        if (coeff := self.get_aux_loss_coeff("seq_aux_loss")) > 0 and training:
            # each sequence's own f and P: the batch dimension joins the experts ([s, b*E]), averaged over b
            seq_map, seq_scores = aux_map.reshape(seq_length, -1), scores.reshape(seq_length, -1)
            seq = switch_load_balancing_loss_func(seq_scores, self._sum_over(seq_map.sum(dim=0), self.tp_cp_group),
                                                  seq_length * self.tp_cp_size, self.topk, self.num_experts, coeff) / bsz
            self.aux_losses["seq_load_balancing_loss"] = self._sum_over(seq, self.tp_cp_group).detach() / coeff
            probs = MoEAuxLossAutoScaler.apply(probs, seq)
        if (coeff := self.get_aux_loss_coeff("global_aux_loss")) > 0 and training:
            group = self.tp_dp_cp_group
            size = dist.get_world_size(group) if group is not None else 1
            self.global_tokens_per_expert += self._sum_over(aux_map.sum(dim=0).float(), group)
            self.ga_steps += 1
            glob = switch_load_balancing_loss_func(scores, self.global_tokens_per_expert / self.ga_steps,
                                                   hidden.shape[0] * size, self.topk, self.num_experts, coeff)
            self.aux_losses["global_load_balancing_loss"] = self._sum_over(glob, group).detach() / coeff
            probs = MoEAuxLossAutoScaler.apply(probs, glob)
        return probs, routing_map

    @staticmethod
    def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
        """value summed over `group` (a copy, outside autograd), or value itself without one."""
        if group is None or dist.get_world_size(group) == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=group)
        return value
