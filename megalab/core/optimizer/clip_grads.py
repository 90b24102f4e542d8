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

from megalab.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


# ------------------------------------------------------------------ parameter groups
def get_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: weight matrices decay, biases and norm weights (1-D tensors) do not."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ------------------------------------------------------------------ which tensors are split by TP
def tensor_parallel_dims(model: nn.Module) -> dict[str, int]:
    """name -> the dimension along which TP splits that parameter (absent: replicated on every TP rank)."""
    dims = {}
    for prefix, module in model.named_modules():
        split = {ColumnParallelLinear: {"weight": 0, "bias": 0}, RowParallelLinear: {"weight": 1},
                 VocabParallelEmbedding: {"weight": 0}}.get(type(module), {})
        for pname, dim in split.items():
            if getattr(module, pname, None) is not None:
                dims[f"{prefix}.{pname}" if prefix else pname] = dim
    return dims


def mark_tensor_parallel_params(model: nn.Module) -> None:
    """Set Megatron's `param.tensor_model_parallel` / `partition_dim` attributes on the split parameters."""
    dims = tensor_parallel_dims(model)
    for name, param in model.named_parameters():
        param.tensor_model_parallel = name in dims
        param.partition_dim = dims.get(name, -1)


def param_is_not_tensor_parallel_duplicate(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank owns the tensor for the norm: a TP slice, or a replicated one on TP rank 0."""
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


# ------------------------------------------------------------------ global-norm clipping
def get_grad_norm_fp32(params: Iterable[nn.Parameter], model_parallel_group=None, tp_rank: int = 0,
                       norm_type: float = 2.0) -> float:
    """The norm of the gradient of the whole model, from this rank's share of it.

    params: the parameters this rank holds (its pipeline stages). A parameter flagged `shared`
    (a tied embedding also held by another stage) and TP duplicates off TP rank 0 are left out.
    model_parallel_group: the ranks that together hold one copy of the model (TP x PP).
    """
    if norm_type != 2.0:
        raise ValueError(f"only the L2 norm (norm_type=2) is implemented, got {norm_type}")
    grads = [p.grad for p in params if p.grad is not None and not getattr(p, "shared", False)
             and param_is_not_tensor_parallel_duplicate(p, tp_rank)]
    # EXERCISE optimizer.grad_norm: sum the squares of the owned grads in fp32, all-reduce over the model-parallel group, sqrt
    ### BEGIN SOLUTION
    total = torch.zeros((), dtype=torch.float32)
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


# ------------------------------------------------------------------ learning-rate schedule
class OptimizerParamScheduler:
    """Megatron's LR schedule, stepped once per iteration: `step()` sets every group's lr.

    warmup: init_lr -> max_lr linearly over lr_warmup_steps; decay over the next
    lr_decay_steps - lr_warmup_steps steps with lr_decay_style "constant", "linear", "cosine" or
    "WSD" (stable at max_lr, then the last wsd_decay_steps steps decay "linear", "cosine",
    "exponential" or "minus_sqrt" to min_lr); min_lr after lr_decay_steps.
    """

    STYLES = ("constant", "linear", "cosine", "WSD")
    WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str = "cosine", init_lr: float = 0.0,
                 wsd_decay_steps: int | None = None, lr_wsd_decay_style: str = "linear"):
        if lr_decay_style not in self.STYLES:
            raise ValueError(f"lr_decay_style must be one of {self.STYLES}, got {lr_decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ValueError(f"need 0 <= lr_warmup_steps < lr_decay_steps, got {lr_warmup_steps}, {lr_decay_steps}")
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps - lr_warmup_steps:
                raise ValueError("WSD needs 0 < wsd_decay_steps <= lr_decay_steps - lr_warmup_steps")
            if lr_wsd_decay_style not in self.WSD_STYLES:
                raise ValueError(f"lr_wsd_decay_style must be one of {self.WSD_STYLES}, got {lr_wsd_decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = max_lr, min_lr, init_lr
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = lr_warmup_steps, lr_decay_steps, lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        """The learning rate after `num_steps` steps (Megatron's get_lr)."""
        step = self.num_steps
        # EXERCISE optimizer.get_lr: linear warmup, then the decay style's curve from max_lr to min_lr, then min_lr
        ### BEGIN SOLUTION
        if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if step > self.lr_decay_steps:
            return self.min_lr
        num_decay = self.lr_decay_steps - self.lr_warmup_steps
        ratio = (step - self.lr_warmup_steps) / num_decay
        delta_lr = self.max_lr - self.min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable until the last wsd_decay_steps, then decay
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                coeff = 1.0
            else:
                r = (step - anneal_start) / self.wsd_decay_steps
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * (0.5 ** r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style]
        return self.min_lr + coeff * delta_lr
        ### END SOLUTION

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "lr_warmup_steps": self.lr_warmup_steps, "lr_decay_steps": self.lr_decay_steps,
                "lr_decay_style": self.lr_decay_style}

    def load_state_dict(self, state: dict) -> None:
        for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint's scheduler has {key}={state[key]!r}, this run {getattr(self, key)!r}: "
                                 "resume with the same schedule (or start a new run)")
        self.num_steps = 0
        self.step(state["num_steps"])
