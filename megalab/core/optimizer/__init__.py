"""Optimizers: param groups, clipping, mixed precision, the distributed optimizer (megatron/core/optimizer/)."""

from torch import nn


# ------------------------------------------------------------------ parameter groups
def get_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: weight matrices decay, biases and norm weights (1-D tensors) do not."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
