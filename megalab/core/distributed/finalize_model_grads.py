"""After backward, before the optimizer step: the reductions that complete every gradient.

Megatron: megatron/core/distributed/finalize_model_grads.py. Sequence-parallel parameters (norms, row
biases) summed over TP, the tied word embedding summed between the first and last pipeline stage, the
data-parallel reduction (DDP's finish_grad_sync, or a plain all-reduce without a DDP wrapper), and the
MoE expert-bias update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.tensor_parallel.mappings import _group
from megalab.core.transformer.moe.moe_utils import get_updated_expert_bias
from megalab.core.transformer.moe.router import TopKRouter


# ------------------------------------------------------------------ sequence-parallel gradients
def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum, across TP, the gradients of parameters marked `sequence_parallel` (norms, row biases):
    under SP each rank saw only its 1/t of the tokens. Megatron: _allreduce_layernorm_grads
    in finalize_model_grads (megatron/core/distributed/finalize_model_grads.py). Under DDP the
    gradient is in its buffer, `param.main_grad` (reduced here before DDP's own reduction)."""
    grads = [getattr(p, "main_grad", p.grad) for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_group(group))
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(new.view_as(g))


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


def allreduce_word_embedding_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the tied word-embedding gradient of the first and last stage (Megatron: _allreduce_word_embedding_grads).

    Under DDP the gradient is in its buffer, `weight.main_grad` (reduced here before DDP's own reduction).
    """
    if group is None or not model.config.share_embeddings_and_output_weights:
        return
    weight = model.shared_embedding_or_output_weight()
    if getattr(weight, "main_grad", None) is not None:
        dist.all_reduce(weight.main_grad, group=group)
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


def finalize_context_parallel_grads(model: nn.Module, state: ps.ParallelState | None = None) -> None:
    """Sum gradients over the CP ranks (each saw other tokens of the same sequences) and average
    over DP: one all-reduce over the dp-cp group, divided by the DP size. Megatron reduces over
    the same group (get_data_parallel_group(with_context_parallel=True)) in finalize_model_grads,
    averaging, with the loss multiplied by cp to turn the CP average into this sum."""
    state = state or ps.get_parallel_state()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=state.get_data_parallel_group(with_context_parallel=True))
    flat /= state.get_data_parallel_world_size()
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def finalize_model_grads(ddp: nn.Module, model: nn.Module, state: ps.ParallelState | None = None) -> None:
    """After the last micro-batch's backward: the reductions that complete every gradient.

    Sequence parallelism: norms and row biases saw 1/t of the tokens, summed over TP. Tied
    embeddings: the first and last stage each hold a copy, summed over the embedding group. Then
    DDP averages over DP x CP. (Megatron's finalize_model_grads does DDP's first: all are sums,
    so the order does not matter; here the first two work on the full buffers, param.main_grad.)
    `ddp` wraps this rank's stages; `model` is the model they come from.
    """
    state = state or ps.get_parallel_state()
    if model.config.sequence_parallel:
        allreduce_sequence_parallel_grads(ddp.module, state.get_tensor_model_parallel_group())
    if state.get_pipeline_model_parallel_world_size() > 1 and state.is_rank_in_embedding_group():
        allreduce_word_embedding_grads(model, state.get_embedding_group())
    ddp.finish_grad_sync()


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
