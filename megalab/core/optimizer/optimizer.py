"""Mixed-precision training: 16-bit model, fp32 main params, and (for fp16) dynamic loss scaling.

The model computes in fp16 or bf16; the optimizer updates an fp32 copy of every weight (the
"main params", Megatron's name), so small updates are not rounded away.

    loss ── x scale ──► backward (16-bit grads) ──► main grads (fp32) ── x 1/scale ──┐
                                                                                     ▼
       model params (16-bit) ◄── copy ── main params (fp32) ◄── optimizer.step ◄── any inf/NaN?
                                                                          yes: skip the step,
                                                                          back off the scale

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a
large scale first, and a too-large scale overflows to inf. `DynamicGradScaler` keeps the scale as
large as possible: it backs off when a step overflows (after `hysteresis` overflows) and grows it
after `growth_interval` clean steps. bf16 has fp32's 8 exponent bits and needs no scaling.

Bytes per parameter with Adam (Megatron's docs/user-guide/features/dist_optimizer.md):
    fp16 params + fp16 grads, fp32 main params + grads + Adam m, v:  2 + 2 + 4 + 4 + 8 = 20
    bf16 params + fp32 grads (main_grad), fp32 main params + m, v:   2 + 4 + 4 + 8     = 18
    fp32 params + fp32 grads + m, v:                                 4 + 4 + 8         = 16

Megatron-LM: megatron/core/optimizer/grad_scaler.py (ConstantGradScaler, DynamicGradScaler) and
megatron/core/optimizer/optimizer.py (MixedPrecisionOptimizer, Float16OptimizerWithFloat16Params).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.optimizer.grad_scaler import MegatronGradScaler

HALF_DTYPES = (torch.float16, torch.bfloat16)


def unscale_and_check_for_nan(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> bool:
    """Multiply every grad by `inv_scale` in place; True if any grad holds an inf or a NaN.

    Megatron calls PyTorch's fused torch._amp_foreach_non_finite_check_and_unscale_ here
    (Float16OptimizerWithFloat16Params._unscale_main_grads_and_check_for_nan) and all-reduces
    the flag over the model-parallel group so every rank skips the same steps.
    """
    # EXERCISE mixed_precision.unscale: unscale the grads in place and report whether any is inf/NaN
    ### BEGIN SOLUTION
    # HINT 1: The grads came from loss x scale, so each one must be multiplied by inv_scale = 1/scale,
    #         in place (the optimizer reads these very tensors); and one inf or NaN anywhere means the step is skipped.
    # HINT 2: Loop over the grads: an in-place multiply (Tensor.mul_) by inv_scale, then ask
    #         torch.isfinite whether every element is finite; return True if any grad had an inf or a NaN.
    # HINT 3: A NaN is not an inf (torch.isinf misses it), and `g = g * inv_scale` rebinds a name
    #         without touching the grad.
    found_inf = False
    for g in grads:
        g.mul_(inv_scale)
        found_inf |= not bool(torch.isfinite(g).all())
    return found_inf
    ### END SOLUTION


class Float16OptimizerWithFloat16Params:
    """Wraps a torch optimizer built on a 16-bit model so it steps fp32 main params instead.

    fp16: grad_scaler is required (Dynamic or Constant); the fp16 .grad is copied to a fp32
    main grad, unscaled and checked; an overflowing step is skipped.
    bf16: grad_scaler=None; with accumulate_grads_in_fp32 (Megatron's
    --accumulate-allreduce-grads-in-fp32, always on for bf16) each backward adds the grad into
    an fp32 `param.main_grad` buffer (the job of Megatron's DDP) and the main params use it as
    their grad without a copy.
    found_inf_group: the ranks that hold different parts of the model (Megatron: the
    model-parallel group; by default the current state's, none when no state is current); an
    overflow on any of them skips the step on all of them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grad_scaler: MegatronGradScaler | None = None,
                 accumulate_grads_in_fp32: bool = False, clip_grad: float = 0.0,
                 found_inf_group: dist.ProcessGroup | None = None):
        self.optimizer, self.grad_scaler, self.clip_grad = optimizer, grad_scaler, clip_grad
        self.found_inf_group = ps.resolve_group(found_inf_group, "tp-pp")
        self.float16_groups, self.fp32_from_float16_groups = [], []
        for group in optimizer.param_groups:
            model_params = list(group["params"])
            dtypes = {p.dtype for p in model_params}
            if not dtypes <= set(HALF_DTYPES):
                raise TypeError(f"expected fp16/bf16 model params, got {sorted(map(str, dtypes))}: "
                                "call model.half() or model.bfloat16() before building the optimizer")
            if torch.float16 in dtypes and grad_scaler is None:
                raise ValueError("fp16 params need a grad_scaler (DynamicGradScaler or ConstantGradScaler), "
                                 "or small grads underflow to zero")
            main_params = [p.detach().clone().float() for p in model_params]
            for p, main in zip(model_params, main_params):
                if accumulate_grads_in_fp32:
                    p.main_grad = torch.zeros_like(main)
                    p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            group["params"] = main_params
            self.float16_groups.append(model_params)
            self.fp32_from_float16_groups.append(main_params)
        self.accumulate_grads_in_fp32 = accumulate_grads_in_fp32

    def _pairs(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.tensor(1.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale().to(loss.device)

    def zero_grad(self) -> None:
        for model_param, main_param in self._pairs():
            model_param.grad = main_param.grad = None
            if self.accumulate_grads_in_fp32:
                model_param.main_grad.zero_()

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Returns (update_successful, grad_norm); a skipped step returns (False, None)."""
        # Megatron: _copy_model_grads_to_main_grads.
        for model_param, main_param in self._pairs():
            if self.accumulate_grads_in_fp32:
                main_param.grad = model_param.main_grad  # the fp32 buffer itself, no copy
            elif model_param.grad is not None:
                main_param.grad = model_param.grad.float()
        main_grads = [main.grad for _, main in self._pairs() if main.grad is not None]
        if self.grad_scaler is not None:
            found_inf = unscale_and_check_for_nan(main_grads, self.grad_scaler.inv_scale)
            if self.found_inf_group is not None:
                flag = torch.tensor([float(found_inf)], device=self.fp32_from_float16_groups[0][0].device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.found_inf_group)
                found_inf = bool(flag.item())
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None
        main_params = [main for _, main in self._pairs()]
        norm = float(nn.utils.clip_grad_norm_(main_params, self.clip_grad if self.clip_grad > 0 else float("inf")))
        self.optimizer.step()
        # Megatron: _copy_main_params_to_model_params.
        for model_param, main_param in self._pairs():
            model_param.copy_(main_param)
        return True, norm


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def bytes_per_parameter(model: nn.Module, optimizer: torch.optim.Optimizer | Float16OptimizerWithFloat16Params) -> dict:
    """Measured bytes per model parameter, by what holds them: {"params", "grads", "main_params",
    "main_grads", "optimizer_state", "total"}. Call after a step (so grads and Adam state exist);
    a tensor shared between two roles (bf16's main_grad) is counted once."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    inner = optimizer.optimizer if isinstance(optimizer, Float16OptimizerWithFloat16Params) else optimizer
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    main_params = opt_params if isinstance(optimizer, Float16OptimizerWithFloat16Params) else []
    out = {
        "params": nbytes(params),
        "grads": nbytes([getattr(p, "main_grad", p.grad) for p in params]),
        "main_params": nbytes(main_params),
        "main_grads": nbytes([p.grad for p in main_params]),
        "optimizer_state": nbytes([v for p in opt_params for v in inner.state[p].values() if v.dim() > 0]),
    }
    n = sum(p.numel() for p in params)
    out = {k: v / n for k, v in out.items()}
    out["total"] = sum(out.values())
    return out
