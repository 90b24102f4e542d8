"""MoE helpers: load-balancing and z losses, their tracker and autoscaler, capacity, top-k with
capacity, the expert-bias update, permute/unpermute of tokens by expert.

Megatron: megatron/core/transformer/moe/moe_utils.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch


# ------------------------------------------------------------------ auxiliary losses
class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; in backward it also starts the gradient of `aux_loss`, so an auxiliary
    loss needs no plumbing to the training loop: loss.backward() reaches it through the activations.

    The aux loss's gradient is the factor the main loss is scaled by (1 by default). Megatron's schedule
    (forward_step_calc_loss) calls set_loss_scale(loss_scale * cp_size / num_microbatches) on every
    micro-batch (loss_scale: the fp16 grad scaler's, else 1; just loss_scale with
    --calculate-per-token-loss), and so does megalab's forward_backward_pipelining for MoE models: with
    DDP's average over DP x CP, each micro-batch's aux loss then weighs 1 / (num_microbatches x dp), as
    its main loss does. Here the factor is read when the forward runs: set it for a step with
    `with MoEAuxLossAutoScaler.loss_scale(cp_size / num_microbatches): ...` (the setting ends with the
    block), or set_loss_scale(scale) as Megatron does (it stays until changed).
    """

    main_loss_backward_scale = 1.0

    @staticmethod
    @contextmanager
    def loss_scale(scale: float) -> Iterator[None]:
        saved, MoEAuxLossAutoScaler.main_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale, float(scale)
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = saved

    @staticmethod
    def set_loss_scale(scale: float | torch.Tensor) -> None:
        """Megatron's setter: the aux-loss gradient factor from now on."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = float(scale)

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale)


def get_aux_losses_tracker(model: torch.nn.Module) -> dict[str, dict[int, torch.Tensor]]:
    """{"load_balancing_loss": {layer_number: value}, "z_loss": {...}}: the values of the last forward
    of `model`'s routers (each router keeps its own in `router.aux_losses`; nothing global)."""
    tracker = {}
    for module in model.modules():
        for name, value in getattr(module, "aux_losses", {}).items():
            tracker.setdefault(name, {})[module.layer_number] = value
    return tracker


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i (Switch Transformer eq. 4, GShard): f_i the fraction of the T*k
    assignments that went to expert i, P_i the mean router probability of expert i. Equals
    coeff when the load is uniform, coeff * E when every token picks the same experts.
    probs [t, E] (full scores, not just the top-k) of this rank's t tokens; tokens_per_expert [E] and
    T = total_num_tokens count the whole sequence (under sequence or context parallelism t < T): divide by T,
    never by probs' own row count. The result must stay a function of probs: its gradient trains the router."""
    # EXERCISE moe.load_balancing_loss: coeff * E * sum_i (tokens_i / (T k)) * (sum_t probs_ti / T)
    ### BEGIN SOLUTION
    # HINT 1: The loss is the dot product of two distributions over experts: the fraction of the T*k
    #         assignments each expert got (f_i) and its mean router probability (P_i), scaled so that a perfectly
    #         uniform router gives exactly coeff.
    # HINT 2: Sum probs over tokens per expert (T * P_i), multiply by tokens_per_expert (T*k * f_i) and
    #         sum; then scale by coeff * E / (k * T * T) to turn the counts into fractions and means.
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
    tokens_per_expert [E] (assignments before any dropping).

    softmax: the top-k logits, softmax over those k (Megatron's default, Mixtral's way).
    sigmoid: sigmoid scores; the top-k of score + expert_bias (the bias only chooses, DeepSeek-V3),
             weights = the chosen scores normalized to sum 1.
    capacity: each expert keeps its first `capacity` tokens (by position: Megatron's
              --moe-token-drop-policy position; its default "probs" keeps the highest weights), the rest
              are dropped; with pad_to_capacity, unrouted tokens with weight 0 fill every expert up to capacity.
    Megatron splits this into topk_routing_with_score_function and apply_router_token_dropping.
    """
    num_tokens, num_experts = logits.shape
    # EXERCISE moe.topk_routing: choose k experts per token and their weights (softmax or sigmoid scores)
    ### BEGIN SOLUTION
    # HINT 1: Each token picks the k experts with the highest scores (per token: along the expert dim); the
    #         weights of its k experts must sum to 1.
    # HINT 2: softmax: torch.topk of the logits along dim 1, then softmax over those k values. sigmoid:
    #         sigmoid scores, choose the top-k of score + expert_bias (when given), weigh by the chosen scores (not
    #         the biased ones) renormalised to sum 1 when k > 1. Scatter weights and True into [T, E].
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
    # HINT 1: An expert serves at most `capacity` tokens, first come first served in token order; the ones
    #         after that are dropped (weight 0). Padding fills the free slots with unrouted tokens of weight 0.
    # HINT 2: A cumulative sum of routing_map down the tokens gives each token's arrival number at each
    #         expert; keep those below capacity. For padding, the same trick on the unrouted pairs, limited to the
    #         free slots (capacity minus kept). Then mask probs and return the kept map.
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


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """What the load-balancing loss sees: the top-k of the normalized scores WITHOUT the expert bias
    (the bias only steers which experts serve a token, not the balance the loss measures) and the
    scores. logits [T, E] -> routing_map [T, E] (bool), scores [T, E] (softmax, or sigmoid / row sum)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_indices = torch.topk(scores, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            update_rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
    return expert_bias + update_rate * torch.sign(tokens_per_expert.float().mean() - tokens_per_expert.float())


# ------------------------------------------------------------------ permutation
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """Copy each token once per chosen expert, grouped by expert (expert 0's tokens first, in token
    order). tokens [T, h], routing_map [T, E] -> permuted [N, h], permuted probs [N], sorted_indices [N]
    (N = routing_map.sum(), sorted_indices[j] = the token row j came from)."""
    # EXERCISE moe.permute: token indices per expert from routing_map.T, then gather the rows (and the probs)
    ### BEGIN SOLUTION
    # HINT 1: Group the token copies expert by expert: all of expert 0's tokens (in token order), then
    #         expert 1's, ..., one copy per chosen expert.
    # HINT 2: Transpose routing_map to [E, T] so that expert-major order is the memory order;
    #         masked_select a [E, T] grid of token indices (arange expanded) to get sorted_indices; index_select the
    #         token rows with them; the probs the same way through probs.t().
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
