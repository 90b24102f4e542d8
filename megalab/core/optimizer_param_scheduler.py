"""The learning-rate and weight-decay schedule: warmup, then cosine/linear/constant/WSD/inverse-square-root
decay; optionally weight decay rising from start_wd to end_wd.

Megatron: megatron/core/optimizer_param_scheduler.py (OptimizerParamScheduler).
"""

from __future__ import annotations

import math

import torch


# ------------------------------------------------------------------ learning-rate schedule
class OptimizerParamScheduler:
    """Megatron's LR schedule, stepped once per iteration: `step()` sets every group's lr.

    warmup: init_lr -> max_lr linearly over lr_warmup_steps; then "constant" stays at max_lr for good (as
    Megatron's: it never drops to min_lr); the other styles decay over the next lr_decay_steps - lr_warmup_steps
    steps, "linear", "cosine", "inverse-square-root" (max_lr * sqrt(warmup / step), at least min_lr) or "WSD"
    (stable at max_lr, then the last wsd_decay_steps steps decay to min_lr), and give min_lr after lr_decay_steps.
    lr = min_lr + coeff * (max_lr - min_lr), with r the fraction of the decay done (for WSD: of its
    last wsd_decay_steps steps) and coeff:
        "linear" 1 - r      "cosine" (1 + cos(pi r)) / 2
        WSD's lr_wsd_decay_style: "linear" 1 - r, "cosine" (1 + cos(pi r)) / 2,
        "exponential" 2 * 0.5^r - 1 (the default, as Megatron's --lr-wsd-decay-style), "minus_sqrt" 1 - sqrt(r).
    Weight decay (when start_wd is given): start_wd -> end_wd over wd_incr_steps, wd_incr_style
    "constant", "linear" or "cosine"; each group's weight_decay = that * its "wd_mult" (default 1).
    """

    STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
    WD_STYLES = ("constant", "linear", "cosine")
    WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str = "cosine", init_lr: float = 0.0,
                 wsd_decay_steps: int | None = None, lr_wsd_decay_style: str = "exponential",
                 start_wd: float | None = None, end_wd: float | None = None, wd_incr_steps: int = 0,
                 wd_incr_style: str = "constant"):
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
        if start_wd is not None:
            end_wd = start_wd if end_wd is None else end_wd
            if not 0.0 <= start_wd <= end_wd:
                raise ValueError(f"need 0 <= start_wd <= end_wd, got start_wd={start_wd}, end_wd={end_wd}")
            if wd_incr_style not in self.WD_STYLES:
                raise ValueError(f"wd_incr_style must be one of {self.WD_STYLES}, got {wd_incr_style!r}")
            if wd_incr_style == "constant" and start_wd != end_wd:
                raise ValueError('wd_incr_style "constant" needs start_wd == end_wd')
            if wd_incr_style != "constant" and wd_incr_steps <= 0:
                raise ValueError(f"wd_incr_style {wd_incr_style!r} needs wd_incr_steps > 0")
        self.start_wd, self.end_wd, self.wd_incr_steps, self.wd_incr_style = start_wd, end_wd, wd_incr_steps, wd_incr_style
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
        # HINT 1: The idea. Three phases: warmup (steps 0 .. lr_warmup_steps, a straight line from init_lr to max_lr),
        #         decay (until lr_decay_steps, the style's curve from max_lr down to min_lr), then min_lr for good.
        # HINT 2: The approach. Warmup: step / lr_warmup_steps of the way up. Decay: ratio = the fraction of the DECAY
        #         steps done (counted from the end of warmup); coeff is 1 - ratio (linear) or (cos(pi ratio) + 1) / 2
        #         (cosine); lr = min_lr + coeff * (max_lr - min_lr). See the class docstring for the other styles.
        # HINT 3: A pitfall. Step 0 is the first warmup step (lr = init_lr, not one step up), and the curve ends at
        #         min_lr, not at 0.
        if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if step > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5)
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

    def get_wd(self) -> float | None:
        """The weight decay after `num_steps` steps (Megatron's get_wd); None: left as the optimizer has it."""
        if self.start_wd is None:
            return None
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)
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
