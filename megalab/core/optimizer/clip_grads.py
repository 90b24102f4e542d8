"""The optimizer side of a training step: weight-decay groups, global-norm clipping, LR schedules.

Gradient clipping must see the norm of the WHOLE model's gradient, which no rank holds:

    tp rank 0     tp rank 1                   ||g||^2 = sum over the model-parallel group of
    [W_qkv/2]     [W_qkv/2]   <- split:          the squares of the grads this rank owns,
    [ norm  ]     [ norm  ]   <- duplicated:     duplicated (TP-replicated) tensors counted once
    stage 0 ... stage pp-1    <- PP: disjoint layers, summed over the pipeline too

DP ranks hold the same (averaged) gradient, so the sum runs over the model-parallel (TP x PP)
group only. Every rank then scales its grads by the same factor max_norm / (||g|| + 1e-6), so the
result equals `torch.nn.utils.clip_grad_norm_` on the unsplit model.

The learning rate follows Megatron's `OptimizerParamScheduler`: linear warmup from init_lr to
max_lr, then cosine / linear / WSD decay down to min_lr, constant afterwards.

    lr  max ____                                  WSD:  max ______________
           /    ``--..__  cosine                          /               \\  decay (last
          /             ``--.._____ min                  /                 \\__ phase only)
          warmup        decay                            warmup   stable

Megatron-LM: megatron/core/optimizer/__init__.py (`_get_param_groups`: no weight decay for biases
and norms), megatron/core/optimizer/clip_grads.py (`get_grad_norm_fp32`,
`clip_grad_by_total_norm_fp32`), megatron/core/tensor_parallel/layers.py
(`param_is_not_tensor_parallel_duplicate`), megatron/core/optimizer_param_scheduler.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


# ------------------------------------------------------------------ global-norm clipping
def get_grad_norm_fp32(params: Iterable[nn.Parameter], model_parallel_group=None, tp_rank: int = 0,
                       norm_type: float = 2.0) -> float:
    """The norm of the gradient of the whole model, from this rank's share of it.

    params: the parameters this rank holds (its pipeline stages). A parameter flagged `shared`
    (a tied embedding also held by another stage) and TP duplicates off TP rank 0 are left out.
    model_parallel_group: the ranks that together hold one copy of the model (TP x PP); by default
    the current state's, none (this process alone) when no state is current.
    """
    if norm_type != 2.0:
        raise ValueError(f"only the L2 norm (norm_type=2) is implemented, got {norm_type}")
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None and not getattr(p, "shared", False)
             and param_is_not_tensor_parallel_duplicate(p, tp_rank)]
    device = params[0].device if params else torch.device("cpu")  # the collective runs where the grads live
    model_parallel_group = ps.resolve_group(model_parallel_group, "tp-pp")
    # EXERCISE optimizer.grad_norm: sum the squares of the owned grads in fp32 (on `device`), all-reduce over the model-parallel group, sqrt
    ### BEGIN SOLUTION
    # HINT 1: The idea. The global 2-norm is the square root of the sum of the squares of every gradient element of
    #         the whole model. Each rank owns a disjoint share (`grads` already leaves out TP duplicates and shared).
    # HINT 2: The approach. Add up the squared elements of this rank's grads, in fp32, into one scalar tensor on
    #         `device`; all-reduce (SUM) it over model_parallel_group when there is one; take the square root last.
    # HINT 3: A pitfall. Norms do not add (sqrt(a^2 + b^2) is not a + b): reduce squares, never norms, and take the
    #         root once, after the all-reduce.
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.detach().float().pow(2).sum()
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return total.sqrt().item()
    ### END SOLUTION


def clip_grad_by_total_norm_fp32(params: Iterable[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale every grad by max_norm / (total_norm + 1e-6) if that is below 1 (torch's clip_grad_norm_ rule)."""
    clip_coeff = max_norm / (total_norm + 1e-6)
    if clip_coeff < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coeff)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, model_parallel_group=None,
                   tp_rank: int = 0) -> float:
    """Clip in place by the global norm (see get_grad_norm_fp32); returns the norm before clipping."""
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0 (got {max_norm}); to train without clipping do not call clip_grad_norm")
    params = list(params)
    total_norm = get_grad_norm_fp32(params, model_parallel_group, tp_rank)
    if not math.isfinite(total_norm):
        raise FloatingPointError(f"gradient norm is {total_norm}: the loss diverged (lower the learning rate)")
    clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
    return total_norm


