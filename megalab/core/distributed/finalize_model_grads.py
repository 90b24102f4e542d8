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


def _modules(model: list[nn.Module]) -> list[nn.Module]:
    """The model chunks inside `model`: DDP wrappers and ModuleLists of chunks are opened."""
    chunks = []
    for chunk in model:
        inner = chunk.module if hasattr(chunk, "finish_grad_sync") else chunk
        chunks.extend(inner if isinstance(inner, nn.ModuleList) else [inner])
    return chunks


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    """Under DDP the gradient is in its buffer, `param.main_grad`; else `param.grad`."""
    return getattr(param, "main_grad", param.grad)


def allreduce_data_parallel_grads(module: nn.Module, state: ps.ParallelState) -> None:
    """Without a DDP wrapper: every gradient averaged over its data-parallel replicas, the expert
    parameters (`allreduce = False`) over expert-DP, the others over DP x CP (Megatron's DDP does the
    same with two buffers; its gradient_scaling_factor is 1 / (dp x cp))."""
    dp_size = state.get_data_parallel_world_size(with_context_parallel=True)
    for p in module.parameters():
        if p.grad is None:
            continue
        expert = not getattr(p, "allreduce", True)
        group = state.get_expert_data_parallel_group() if expert else state.get_data_parallel_group(True)
        p.grad.div_(dp_size)
        dist.all_reduce(p.grad, group=group)


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum, across TP, the gradients of parameters marked `sequence_parallel` (norms, row biases):
    under SP each rank saw only its 1/t of the tokens. Megatron: _allreduce_non_tensor_model_parallel_grads
    (formerly _allreduce_layernorm_grads). `group`: the current state's TP group unless given."""
    grads = [_grad(p) for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_group(group))
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def allreduce_word_embedding_grads(model: nn.Module, group=None) -> None:
    """Sum the tied word-embedding gradient of the first and last stage over the embedding group
    (`group`: the current state's unless given). Megatron: _allreduce_word_embedding_grads."""
    if not model.config.share_embeddings_and_output_weights:
        return
    group = ps.resolve_group(group, "embd", alone=False)
    weight = model.shared_embedding_or_output_weight()
    if getattr(weight, "main_grad", None) is None and weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(_grad(weight), group=group)


def finalize_model_grads(model: list[nn.Module], state: ps.ParallelState | None = None) -> None:
    """After the last micro-batch's backward, before the optimizer step: complete every gradient.

    `model`: this rank's model chunks (GPTModel chunks, a MoE layer...), or the DDP wrapper(s) around
    them. In Megatron's order (megatron/core/distributed/finalize_model_grads.py):
      1. data parallel: DDP's finish_grad_sync (all-reduce or reduce-scatter of the buckets), or without a
         wrapper an average over DP x CP (expert parameters over expert-DP);
      2. sequence parallel: the norms' and row biases' gradients summed over TP;
      3. tied embeddings: the first and last pipeline stage's word-embedding gradients summed;
      4. MoE expert bias (aux-loss-free balancing): every router's bias moved by its token counts summed
         over TP x DP x CP, before the optimizer step (Megatron's _update_router_expert_bias);
      5. the global aux loss's window of token counts reset: one window per global batch (Megatron's
         reset_model_temporary_tensors).
    The first three are sums (and one scale), so their order does not change the result; under the
    distributed optimizer only this rank's shard of each buffer is used afterwards.
    `state`: the current ParallelState unless given.
    """
    state = state or ps.get_parallel_state()
    chunks = _modules(model)
    for chunk in model:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
        else:
            allreduce_data_parallel_grads(chunk, state)
    if state.get_tensor_model_parallel_world_size() > 1:
        for chunk in chunks:
            if chunk.config.sequence_parallel:
                allreduce_sequence_parallel_grads(chunk, state.get_tensor_model_parallel_group())
    if state.get_pipeline_model_parallel_world_size() > 1 and state.is_rank_in_embedding_group():
        done = set()  # each tied weight once (the first stage's embedding, the last stage's share of it)
        for chunk in chunks:
            if getattr(chunk, "pre_process", False) or hasattr(chunk, "word_embeddings"):
                if id(weight := chunk.shared_embedding_or_output_weight()) not in done:
                    done.add(id(weight))
                    allreduce_word_embedding_grads(chunk, state.get_embedding_group())
    if any(getattr(chunk.config, "moe_router_enable_expert_bias", False) for chunk in chunks if hasattr(chunk, "config")):
        update_expert_bias(chunks, state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    for module in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(module, TopKRouter):
            module.reset_global_aux_loss_tracker()


def update_expert_bias(model: nn.Module | list[nn.Module], group=None) -> None:
    """Once per step (finalize_model_grads calls it, before the optimizer step): move every router's expert
    bias by the token counts since the last update (summed over `group`: the current state's tp-dp-cp group,
    none when no state is current), then zero the counts. Megatron: _update_router_expert_bias."""
    group = ps.resolve_group(group, "tp-dp-cp")
    modules = [m for chunk in (model if isinstance(model, list) else [model]) for m in chunk.modules()]
    for router in (m for m in modules if isinstance(m, TopKRouter) and m.expert_bias is not None):
        counts = router.local_tokens_per_expert.clone()
        if group is not None:
            dist.all_reduce(counts, group=group)
        router.expert_bias.copy_(get_updated_expert_bias(counts, router.expert_bias,
                                                         router.config.moe_router_bias_update_rate))
        router.local_tokens_per_expert.zero_()
