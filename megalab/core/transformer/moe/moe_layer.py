"""Mixture of experts: a router sends each token to k of E expert MLPs; expert parallelism puts
the experts on different ranks and moves the tokens to them with an all-to-all.

    hidden [s, b, h] ─> tokens [T, h]                                     T = s * b
        │ TopKRouter: logits = x W_r^T [T, E] ─> probs [T, E], routing_map [T, E] (k True per row)
        │             (+ load-balancing loss, z-loss, capacity: drop or pad)
        │ dispatcher.token_permutation ─> [N, h] grouped by local expert     N = tokens for my experts
        │ experts (a loop of MLPs, or one batched matmul) ─> [N, h]
        │ dispatcher.token_unpermutation: back to the owning rank, sum_k prob * expert(x) ─> [T, h]
        (+ shared experts, which see every token)                         ─> [s, b, h]

Expert parallelism (EP ranks share the experts, E/EP each; each rank holds different tokens):

    all-to-all dispatcher (Megatron's MoEAlltoAllTokenDispatcher)
        permute by expert ─> a2a, uneven splits ─> sort chunks by local expert ─> experts
        ─> sort back ─> a2a back ─> unpermute (weighted by the probs)
    all-gather dispatcher (MoEAllGatherTokenDispatcher)
        all-gather every rank's tokens ─> keep those for my experts ─> experts ─> unpermute
        ─> reduce-scatter (each rank gets its own tokens, summed over every rank's experts)

Expert weights are split over the EP group and replicated over the expert-data-parallel (EDP)
group; they carry `allreduce = False` (Megatron's mark) so their gradients are reduced over
EDP, the dense weights over DP (`finalize_model_grads`). The auxiliary losses reach the gradients
through `loss.backward()` by MoEAuxLossAutoScaler, and their values are kept for logging in a
tracker (`get_aux_losses_tracker`).

Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), moe_utils.py
(switch_load_balancing_loss_func, z_loss_func, topk_routing_with_score_function,
apply_router_token_dropping, compute_routing_scores_for_aux_loss, permute, unpermute,
sort_chunks_by_idxs, MoEAuxLossAutoScaler, get_updated_expert_bias), token_dispatcher.py,
experts.py (SequentialMLP, TEGroupedMLP), shared_experts.py, moe_layer.py (MoELayer).
Not here: expert tensor parallelism (expert_tensor_parallel_size > 1), Megatron's default "probs" drop
policy (tokens are dropped by position), sinkhorn routing, group-limited top-k, and fused kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.transformer.mlp import MLP
from megalab.core.transformer.moe.experts import GroupedMLP, SequentialMLP, _expert_config
from megalab.core.transformer.moe.router import TopKRouter
from megalab.core.transformer.moe.token_dispatcher import DISPATCHERS
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig


# ------------------------------------------------------------------ the layer
class MoELayer(nn.Module):
    """hidden [s, b, h] -> [s, b, h]: router, dispatcher, experts (+ shared experts).

    ep_group: the expert-parallel group; by default the current ParallelState's (or none: one
    process holds every expert). This rank holds experts [ep_rank * E/EP, (ep_rank + 1) * E/EP).
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, ep_group=None):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts (None builds the dense MLP instead)")
        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else None
        tp_cp_group = None  # each TP x CP rank routes its own tokens (SP slice, CP chunks): the counts are summed there
        if state is not None and state.get_tensor_model_parallel_world_size() * state.get_context_parallel_world_size() > 1:
            tp_cp_group = state.get_tensor_and_context_parallel_group()
        if ep_group is None and state is not None:
            ep_group = state.get_expert_model_parallel_group()
            if state.sizes.expert_tensor_parallel_size > 1:
                raise ValueError("expert_tensor_parallel_size > 1 is not implemented in megalab.core.transformer.moe.moe_layer; "
                                 "initialize_model_parallel(..., expert_tensor_parallel_size=1)")
            if state.get_tensor_model_parallel_world_size() > 1 and not config.sequence_parallel:
                raise ValueError("MoE with tensor parallelism needs config.sequence_parallel=True "
                                 "(each TP rank routes its own slice of the tokens; Megatron's rule)")
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        E = config.num_moe_experts
        if E % ep_size:
            raise ValueError(f"num_moe_experts {E} is not divisible by the expert-parallel size {ep_size}; "
                             "each EP rank holds E / EP experts: change one of them")
        self.config, self.layer_number = config, layer_number
        self.num_local_experts = E // ep_size
        self.local_expert_indices = list(range(ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts))
        tp_dp_cp_group = state.get_tensor_and_data_parallel_group(with_context_parallel=True) if state else None
        self.router = TopKRouter(config, layer_number, tp_cp_group, tp_dp_cp_group)
        self.experts = (GroupedMLP if config.moe_grouped_gemm else SequentialMLP)(config, self.local_expert_indices)
        for p in self.experts.parameters():
            p.allreduce = False  # Megatron's mark: reduced over the expert-data-parallel group, not DP
        self.token_dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, ep_group)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = MLP(_expert_config(config, config.moe_shared_expert_intermediate_size), LayerSpec())
            for p in self.shared_experts.parameters():
                p.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        s, b, h = hidden_states.shape
        hidden = hidden_states.reshape(s * b, h)  # [T, h]
        probs, routing_map = self.router(hidden_states)  # [T, E], [T, E] (the router sees [s, b, h]: per-sequence losses)
        dispatched, tokens_per_expert = self.token_dispatcher.token_permutation(hidden, probs, routing_map)
        expert_output = self.experts(dispatched, tokens_per_expert)  # [N, h]
        output = self.token_dispatcher.token_unpermutation(expert_output)  # [T, h]
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        return output.view(s, b, h)


