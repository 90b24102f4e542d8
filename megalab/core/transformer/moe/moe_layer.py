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
EDP, the dense weights over DP (`finalize_moe_grads`). The auxiliary losses reach the gradients
through `loss.backward()` by MoEAuxLossAutoScaler, and their values are kept for logging in a
tracker (`get_aux_losses_tracker`).

Megatron: megatron/core/transformer/moe/ — router.py (TopKRouter), moe_utils.py
(switch_load_balancing_loss_func, z_loss_func, topk_softmax_with_capacity, permute, unpermute,
sort_chunks_by_idxs, MoEAuxLossAutoScaler, get_updated_expert_bias), token_dispatcher.py,
experts.py (SequentialMLP, GroupedMLP), shared_experts.py, moe_layer.py (MoELayer).
Not here: expert tensor parallelism (expert_tensor_parallel_size > 1), Megatron's "probs" drop
policy (tokens are dropped by position), and fused kernels.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.tensor_parallel.layers import (
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megalab.core.transformer.mlp import ACTIVATIONS, MLP
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal, scaled_init_method_normal


# ------------------------------------------------------------------ auxiliary losses
class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; in backward it also starts the gradient of `aux_loss` (with
    main_loss_backward_scale, 1 unless a schedule scales the main loss), so an auxiliary loss
    needs no plumbing to the training loop: loss.backward() reaches it through the activations."""

    main_loss_backward_scale = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The factor the main loss is scaled by (e.g. 1 / number of micro-batches)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale.to(aux_loss.device)
        return grad_output, torch.ones_like(aux_loss) * scale


_AUX_LOSSES: dict[str, dict[int, torch.Tensor]] = {}  # name -> layer_number -> last value (detached)


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: int) -> None:
    _AUX_LOSSES.setdefault(name, {})[layer_number] = loss.detach()


def get_aux_losses_tracker() -> dict[str, dict[int, torch.Tensor]]:
    """{"load_balancing_loss": {layer_number: value}, "z_loss": {...}}: the last forward's values."""
    return _AUX_LOSSES


def clear_aux_losses_tracker() -> None:
    _AUX_LOSSES.clear()


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i (Switch Transformer eq. 4, GShard): f_i the fraction of the T*k
    assignments that went to expert i, P_i the mean router probability of expert i. Equals
    coeff when the load is uniform, coeff * E when every token picks the same experts.
    probs [T, E] (full scores, not just the top-k), tokens_per_expert [E]."""
    # EXERCISE moe.load_balancing_loss: coeff * E * sum_i (tokens_i / (T k)) * (sum_t probs_ti / T)
    ### BEGIN SOLUTION
    aggregated_probs_per_expert = probs.sum(dim=0)  # [E]
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))
    ### END SOLUTION


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """coeff * mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022): keeps router logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


# ------------------------------------------------------------------ routing
def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(num_tokens / E * capacity_factor), num_tokens counting T * k assignments."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def topk_softmax_with_capacity(logits: torch.Tensor, topk: int, capacity_factor: float | None = None,
                               pad_to_capacity: bool = False, score_function: str = "softmax",
                               expert_bias: torch.Tensor | None = None):
    """Route T tokens to k experts each. logits [T, E] ->
    probs [T, E] (the weight of each chosen expert, 0 elsewhere), routing_map [T, E] (bool),
    tokens_per_expert [E] (assignments before any dropping, for the load-balancing loss).

    softmax: the top-k logits, softmax over those k (Megatron's default, Mixtral's way).
    sigmoid: sigmoid scores; the top-k of score + expert_bias (the bias only chooses, DeepSeek-V3),
             weights = the chosen scores normalized to sum 1.
    capacity: each expert keeps its first `capacity` tokens (by position), the rest are dropped;
              with pad_to_capacity, unrouted tokens with weight 0 fill every expert up to capacity.
    """
    num_tokens, num_experts = logits.shape
    # EXERCISE moe.topk_routing: choose k experts per token and their weights (softmax or sigmoid scores)
    ### BEGIN SOLUTION
    if score_function == "softmax":
        scores, top_indices = torch.topk(logits, k=topk, dim=1)
        top_probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits)
        chooser = scores if expert_bias is None else scores + expert_bias
        top_indices = torch.topk(chooser, k=topk, dim=1).indices
        top_probs = scores.gather(1, top_indices)
        if topk > 1:
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    ### END SOLUTION
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return probs, routing_map, tokens_per_expert
    capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    # EXERCISE moe.capacity: keep each expert's first `capacity` tokens; with padding, fill up to capacity with unrouted tokens
    ### BEGIN SOLUTION
    position = routing_map.long().cumsum(dim=0) - 1  # [T, E]: arrival order of each token at each expert
    keep = routing_map & (position < capacity)
    if pad_to_capacity:
        free = capacity - keep.sum(dim=0)  # [E] empty slots
        filler = ~routing_map & ((~routing_map).long().cumsum(dim=0) - 1 < free)
        keep = keep | filler  # filler tokens have probs 0: computed, then weighted by 0
    probs = probs * keep
    routing_map = keep
    ### END SOLUTION
    return probs, routing_map, tokens_per_expert


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            update_rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
    return expert_bias + update_rate * torch.sign(tokens_per_expert.float().mean() - tokens_per_expert.float())


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
            save_to_aux_losses_tracker("z_loss", self._sum_over_tp(z_loss), self.layer_number)
            if training:
                logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        probs, routing_map, tokens_per_expert = topk_softmax_with_capacity(
            logits, self.topk, c.moe_expert_capacity_factor, c.moe_pad_expert_input_to_capacity,
            c.moe_router_score_function, self.expert_bias)
        self.tokens_per_expert = tokens_per_expert.detach()
        if self.expert_bias is not None and training:
            self.local_tokens_per_expert += tokens_per_expert
        if c.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        # the balance term E * sum f_i P_i is tracked always (1 when balanced), added to the loss when coeff > 0
        balance = switch_load_balancing_loss_func(scores, self._sum_over_tp(tokens_per_expert),
                                                  hidden.shape[0] * self.tp_size, self.topk, self.num_experts, 1.0)
        save_to_aux_losses_tracker("load_balancing_loss", self._sum_over_tp(balance), self.layer_number)
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


def update_expert_bias(model: nn.Module, group=None) -> None:
    """After an optimizer step: move every router's expert bias by the token counts since the last
    update (summed over `group`, e.g. the data-parallel group). Megatron: _update_router_expert_bias."""
    for router in (m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None):
        counts = router.local_tokens_per_expert.clone()
        if group is not None:
            dist.all_reduce(counts, group=group)
        router.expert_bias.copy_(get_updated_expert_bias(counts, router.expert_bias,
                                                         router.config.moe_router_bias_update_rate))
        router.local_tokens_per_expert.zero_()


# ------------------------------------------------------------------ permutation
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """Copy each token once per chosen expert, grouped by expert (expert 0's tokens first, in token
    order). tokens [T, h], routing_map [T, E] -> permuted [N, h], permuted probs [N], sorted_indices [N]
    (N = routing_map.sum(), sorted_indices[j] = the token row j came from)."""
    # EXERCISE moe.permute: token indices per expert from routing_map.T, then gather the rows (and the probs)
    ### BEGIN SOLUTION
    mask = routing_map.t()  # [E, T]
    sorted_indices = torch.arange(tokens.shape[0], device=tokens.device).expand_as(mask).masked_select(mask)
    permuted_probs = probs.t().masked_select(mask) if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices
    ### END SOLUTION


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int,
              probs: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of permute: [N, h] -> [T, h], each token the prob-weighted sum of its copies."""
    if probs is not None:
        permuted = permuted * probs.unsqueeze(-1).to(permuted.dtype)
    out = permuted.new_zeros(num_tokens, permuted.shape[-1])
    return out.index_add(0, sorted_indices, permuted)


def sort_chunks_by_idxs(input_: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: list[int]) -> torch.Tensor:
    """Split input_ along dim 0 into chunks of split_sizes and concatenate them in sorted_idxs order."""
    chunks = torch.split(input_, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        dist.all_to_all_single(output, input_.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        output_split_sizes, input_split_sizes = ctx.splits
        return None, _AllToAll.apply(ctx.group, grad_output, input_split_sizes, output_split_sizes), None, None


def all_to_all(group, input_, output_split_sizes: list[int], input_split_sizes: list[int]) -> torch.Tensor:
    """Megatron's tensor_parallel.all_to_all: rank r sends input_split_sizes[j] rows to rank j and
    receives output_split_sizes[j] rows from rank j, differentiably."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)


# ------------------------------------------------------------------ token dispatchers
class MoEAllGatherTokenDispatcher:
    """Every rank gets every token of the EP group, keeps those routed to its experts, and the
    outputs are reduce-scattered back (summing the contributions of all ranks' experts)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], ep_group=None):
        self.num_local_experts, self.local_expert_indices, self.ep_group = (
            num_local_experts, local_expert_indices, ep_group)
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1

    def token_permutation(self, hidden, probs, routing_map):  # [T, h], [T, E], [T, E]
        if self.ep_size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.ep_group)  # [ep T, h]
            probs = gather_from_sequence_parallel_region(probs, group=self.ep_group)  # [ep T, E]
            with torch.no_grad():
                routing_map = gather_from_sequence_parallel_region(routing_map.float(), group=self.ep_group).bool()
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.num_tokens = hidden.shape[0]
        permuted, self.permuted_probs, self.sorted_indices = permute(hidden, routing_map[:, local], probs[:, local])
        return permuted, routing_map[:, local].sum(dim=0)  # [N, h], tokens per local expert [L]

    def token_unpermutation(self, expert_output):  # [N, h] -> [T, h]
        output = unpermute(expert_output, self.sorted_indices, self.num_tokens, self.permuted_probs)
        if self.ep_size > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.ep_group)
        return output


class MoEAlltoAllTokenDispatcher:
    """permute -> all-to-all (uneven splits) -> sort by local expert; and back. Only the tokens
    routed to another rank's experts travel, once each way (a2a_bytes counts them)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], ep_group=None):
        self.num_local_experts, self.local_expert_indices, self.ep_group = (
            num_local_experts, local_expert_indices, ep_group)
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.a2a_bytes = 0  # bytes this rank sent to other ranks, dispatch + combine, last forward

    def token_permutation(self, hidden, probs, routing_map):  # [T, h], [T, E], [T, E]
        ep, L = self.ep_size, self.num_local_experts
        self.num_tokens = hidden.shape[0]
        num_local_tokens_per_expert = routing_map.sum(dim=0)  # [E]
        permuted, self.permuted_probs, self.sorted_indices = permute(hidden, routing_map, probs)
        # EXERCISE moe.alltoall_dispatch: exchange counts, a2a the permuted tokens, sort the chunks by local expert
        ### BEGIN SOLUTION
        if ep > 1:
            counts = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]
            dist.all_gather(counts, num_local_tokens_per_expert, group=self.ep_group)
            counts = torch.stack(counts)  # [ep, E]: what each rank sends to each expert
        else:
            counts = num_local_tokens_per_expert.unsqueeze(0)
        per_local = counts[:, self.local_expert_indices]  # [ep, L]: rows from rank r for my expert l
        self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()
        self.output_splits = per_local.sum(dim=1).tolist()
        self.num_global_tokens_per_local_expert = per_local
        if ep > 1:
            permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
        if L > 1:  # received [rank][expert] -> [expert][rank]
            permuted = sort_chunks_by_idxs(permuted, per_local.reshape(-1),
                                           torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())
        ### END SOLUTION
        sent = sum(n for r, n in enumerate(self.input_splits) if r != self.ep_rank)
        self.a2a_bytes = 2 * sent * hidden.shape[-1] * hidden.element_size()
        return permuted, self.num_global_tokens_per_local_expert.sum(dim=0)  # [N, h], [L]

    def token_unpermutation(self, expert_output):  # [N, h] -> [T, h]
        ep, L = self.ep_size, self.num_local_experts
        if L > 1:  # [expert][rank] -> [rank][expert]
            expert_output = sort_chunks_by_idxs(expert_output, self.num_global_tokens_per_local_expert.t().reshape(-1),
                                                torch.arange(L * ep).view(L, ep).t().reshape(-1).tolist())
        if ep > 1:
            expert_output = all_to_all(self.ep_group, expert_output, self.input_splits, self.output_splits)
        return unpermute(expert_output, self.sorted_indices, self.num_tokens, self.permuted_probs)


DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


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
        tp_group = None
        if state is not None and config.sequence_parallel and state.get_tensor_model_parallel_world_size() > 1:
            tp_group = state.get_tensor_model_parallel_group()
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
        self.router = TopKRouter(config, layer_number, tp_group)
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
        probs, routing_map = self.router(hidden)  # [T, E], [T, E]
        dispatched, tokens_per_expert = self.token_dispatcher.token_permutation(hidden, probs, routing_map)
        expert_output = self.experts(dispatched, tokens_per_expert)  # [N, h]
        output = self.token_dispatcher.token_unpermutation(expert_output)  # [T, h]
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        return output.view(s, b, h)


def finalize_moe_grads(model: nn.Module, state: ps.ParallelState | None = None) -> None:
    """After backward, Megatron's finalize_model_grads for an MoE model without a DP wrapper:
    sequence-parallel grads summed over TP; then every grad summed over its data-parallel group
    (expert params, `allreduce = False`: EDP; the rest: DP) and divided by the DP size, so both
    end up as the mean over the data-parallel replicas (Megatron's DDP gradient_scaling_factor)."""
    state = state or ps.get_parallel_state()
    if state.get_tensor_model_parallel_world_size() > 1:
        allreduce_sequence_parallel_grads(model, state.get_tensor_model_parallel_group())
    dp_size = state.get_data_parallel_world_size(with_context_parallel=True)
    for p in model.parameters():
        if p.grad is None:
            continue
        expert = not getattr(p, "allreduce", True)
        group = state.get_expert_data_parallel_group() if expert else state.get_data_parallel_group(True)
        p.grad.div_(dp_size)
        dist.all_reduce(p.grad, group=group)
