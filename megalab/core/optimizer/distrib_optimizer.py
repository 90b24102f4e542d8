"""The distributed optimizer (ZeRO-1/2): each data-parallel rank owns 1/d of the main parameters
and optimizer state, steps only its shard, then all-gathers the updated parameters.

For a bf16/fp16 model the main parameters of the shard are an fp32 copy (Megatron's
`shard_fp32_from_float16_groups`): the reduced gradients are copied into fp32 main grads (none
copied when DDP already reduced in fp32, `grad_reduce_in_fp32`), Adam steps the fp32 shard, and
the shard is copied back into the 16-bit parameters before the all-gather. For an fp32 model the
main parameters are views into the model's own shard.

Megatron: megatron/core/optimizer/distrib_optimizer.py (DistributedOptimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
from megalab.core.distributed.param_and_grad_buffer import Bucket, all_gather
from megalab.core.optimizer.grad_scaler import MegatronGradScaler
from megalab.core.optimizer.optimizer import HALF_DTYPES, unscale_and_check_for_nan


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq; the step counter left out)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")


@dataclass(eq=False)
class ShardRange:
    """The piece of one model parameter that falls into this rank's shard of its bucket.

    Megatron's `param_range_map` entry: `param` elements [start, end) of its flattened tensor
    are bucket elements [bucket_start, bucket_start + end - start) of the shard. `model_param` is
    that piece of the parameter (a view into the shard, the model's dtype) and `model_grad` the
    same piece of the reduced gradients (the grad buffer's dtype). The optimizer updates
    `main_param`: `model_param` itself for fp32 models, an fp32 copy for bf16/fp16 ones; its .grad
    is `model_grad` when the dtypes agree, else an fp32 copy of it (`prepare_grads`).
    """

    param: nn.Parameter
    bucket: Bucket
    start: int
    end: int
    bucket_start: int
    main_param: torch.Tensor
    model_param: torch.Tensor
    model_grad: torch.Tensor

    @property
    def main_is_copy(self) -> bool:
        return self.main_param is not self.model_param

    @property
    def grad_is_copy(self) -> bool:
        return self.main_param.grad is not self.model_grad


class DistributedOptimizer:
    """ZeRO stages 1-3: each rank runs `optimizer_cls` on its shard of every bucket only.

    A bucket's shard may cut a parameter between two ranks; the optimizer sees one main param per
    piece of a parameter in the shard (`ShardRange`), so element-wise optimizers (SGD, Adam) give
    the unsharded result, and each piece joins its parameter's group (`param_groups`, e.g.
    optimizer.get_param_groups: no weight decay on biases and norms). The main params carry the
    parameter's `tensor_model_parallel` / `shared` flags, so optimizer.clip_grad_norm on
    `main_params` sums every gradient element once (Megatron: copy_tensor_model_parallel_attributes).

        bucket   [ w1 ........ | b1 | w0 ......... ]      params in the bucket
        shards   [ rank 0      ][ rank 1     ][ rank 2 ]  rank 1 updates the tail of w1, b1,
                                                          the head of w0: three pieces, two groups

    Mixed precision, as Megatron's (bf16 model, DDP with grad_reduce_in_fp32=True):

        reduced grads, fp32 [shard] ──────────────────► main grads (the same tensors)
        main params, fp32 [shard] ◄── optimizer.step ──┘
        model shard, bf16 ◄── copy ── main params;  all-gather ──► every rank's full bf16 params

    With bf16/fp16 grad buffers the reduced grads are copied into fp32 main grads first. An fp16
    model needs a loss scale: pass a `grad_scaler` (the main grads are unscaled, and a step whose
    grads hold an inf/NaN on any rank of `found_inf_group` is skipped on all, the scale lowered).
    step(): prepare_grads, update the own shard, copy it back, then (stage 1/2) all-gather every
    bucket so all ranks hold the new parameters; stage 3 gathers on demand.
    Megatron-LM: megatron/core/optimizer/distrib_optimizer.py, `DistributedOptimizer`
    (`_build_model_gbuf_param_range_map`, `_build_model_and_main_param_groups`,
    `_copy_model_grads_to_main_grads`, `_copy_main_params_to_model_params`).
    """

    def __init__(self, ddp: DistributedDataParallel, optimizer_cls: type[torch.optim.Optimizer],
                 param_groups: list[dict] | None = None, grad_scaler: MegatronGradScaler | None = None,
                 found_inf_group=None, **kwargs):
        if ddp.zero_stage == 0:
            raise ValueError("DistributedOptimizer needs DistributedDataParallel(..., zero_stage=1, 2 or 3); "
                             "with stage 0 use a plain torch optimizer on ddp.parameters()")
        if ddp.param_dtype == torch.float16 and grad_scaler is None:
            raise ValueError("an fp16 model needs a grad_scaler (DynamicGradScaler or ConstantGradScaler), "
                             "or small grads underflow to zero")
        self.ddp, self.grad_scaler = ddp, grad_scaler
        self.found_inf_group = found_inf_group  # None: every rank (each DP rank holds other grads)
        param_groups = param_groups or [{"params": list(ddp.parameters())}]
        group_of = {p: k for k, group in enumerate(param_groups) for p in group["params"]}
        if any(p not in group_of for b in ddp.buckets for p in b.params):
            raise ValueError("param_groups must hold every parameter of ddp.module, and one is missing: build them "
                             "from ddp.module (e.g. optimizer.get_param_groups(ddp.module, weight_decay))")
        half = ddp.param_dtype in HALF_DTYPES
        self.shards, self.ranges = [], []  # the flat model-dtype shard of every bucket; the parameter pieces in them
        for b in ddp.buckets:
            shard = b.param_shard if ddp.zero_stage == 3 else b.param_data[b.shard]  # [numel / n] model dtype
            grad = b.grad_data[b.shard] if ddp.zero_stage == 1 else b.grad_shard  # [numel / n] grad dtype
            self.shards.append(shard)
            for p, (start, end) in b.ranges.items():
                lo, hi = max(start, b.shard.start) - b.shard.start, min(end, b.shard.stop) - b.shard.start
                if lo >= hi:
                    continue
                model_param, model_grad = shard[lo:hi], grad[lo:hi]
                # Megatron: shard_fp32_from_float16_groups (a copy) or shard_fp32_groups (a view)
                main = model_param.detach().clone().float() if half else model_param
                main.grad = model_grad if model_grad.dtype == main.dtype else torch.zeros_like(main)
                main.tensor_model_parallel = getattr(p, "tensor_model_parallel", False)
                main.shared = getattr(p, "shared", False)
                self.ranges.append(ShardRange(p, b, lo + b.shard.start - start, hi + b.shard.start - start, lo, main,
                                              model_param, model_grad))
        groups = [{**group, "params": [r.main_param for r in self.ranges if group_of[r.param] == k]}
                  for k, group in enumerate(param_groups)]
        self.optimizer = optimizer_cls([g for g in groups if g["params"]], **kwargs)
        self._prepared = None  # the ddp.grad_syncs whose grads prepare_grads copied; its found_inf
        self._found_inf = False

    @property
    def main_params(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer updates, each with .grad: what gradient clipping works on
        (the reduced grads are copied into the fp32 main grads first, once per finish_grad_sync)."""
        self.prepare_grads()
        return [r.main_param for r in self.ranges]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (an LR scheduler sets group["lr"] here)."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy the reduced grads into the main grads, unscale them (fp16); True if any rank found an inf/NaN.

        Runs once per gradient sync (ddp.grad_syncs): clipping main_params, then step(), keeps the
        clipped grads. Megatron: MixedPrecisionOptimizer.prepare_grads (_copy_model_grads_to_main_grads,
        _unscale_main_grads_and_check_for_nan).
        """
        if self._prepared == self.ddp.grad_syncs:
            return self._found_inf
        for r in self.ranges:
            if r.grad_is_copy:
                r.main_param.grad.copy_(r.model_grad)
        self._found_inf = False
        if self.grad_scaler is not None:
            found = unscale_and_check_for_nan([r.main_param.grad for r in self.ranges],
                                              self.grad_scaler.inv_scale.to(self.shards[0].device))
            flag = torch.tensor([float(found)], device=self.shards[0].device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                         group=self.found_inf_group)  # every rank skips the same steps
            self._found_inf = bool(flag.item())
        self._prepared = self.ddp.grad_syncs
        return self._found_inf

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated fp32 main params into the model's shard, rounded to its dtype (fp32: the same tensor)."""
        for r in self.ranges:
            if r.main_is_copy:
                r.model_param.copy_(r.main_param)

    @torch.no_grad()
    def _copy_model_params_to_main_params(self) -> None:
        """Refresh the fp32 main params from the model's shard (after the model params were loaded)."""
        for r in self.ranges:
            if r.main_is_copy:
                r.main_param.copy_(r.model_param)

    def step(self) -> bool:
        """One update of every parameter; False when the step was skipped (fp16: an inf/NaN grad)."""
        found_inf = self.prepare_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._prepared = None
                return False
        # EXERCISE data_parallel.zero_step: update the own shards, copy them back, then (stage 1/2) all-gather
        ### BEGIN SOLUTION
        # HINT 1: Each rank's optimizer updates only its own shard of every bucket: its main params (for a 16-bit
        #         model an fp32 copy of the shard); the other ranks still hold the old values of the rest until they
        #         receive the new ones.
        # HINT 2: Step self.optimizer, copy the main params into the model's shard
        #         (self._copy_main_params_to_model_params); then, below stage 3, launch one asynchronous all_gather per
        #         bucket (bucket.param_data from this rank's shard, over the DDP group) and wait for every handle.
        #         Stage 3 gathers on demand, before each forward.
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        if self.ddp.zero_stage < 3:
            handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)
                       for b, shard in zip(self.ddp.buckets, self.shards)]
            for handle in handles:
                handle.wait()
        ### END SOLUTION
        self._prepared = None
        return True

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    def _state_of(self, r: ShardRange) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps for one piece: the fp32 main param as "param" (16-bit models;
        Megatron's _get_main_param_and_optimizer_states), then the optimizer's state."""
        state = {"param": r.main_param} if r.main_is_copy else {}
        return {**state, **self.optimizer.state[r.main_param]}

    def get_parameter_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Collective over DP: each parameter's whole optimizer state, shaped like it, from every rank's shard.

        For checkpoints that any DP size can load; a 16-bit model's fp32 main params come as "param"
        (the bf16/fp16 model params alone would lose the bits the updates accumulate in). Needs the
        state to exist (after a step, or checkpoint.init_optimizer_state(self.optimizer)).
        Megatron: get_parameter_state_dp_zero (which gathers onto DP rank 0 only).
        """
        template = self._state_of(self.ranges[0])
        out = {p: {} for b in self.ddp.buckets for p in b.params}
        for key, value in template.items():
            if value.ndim == 0:  # a per-step scalar (Adam's step): the same in every piece
                for state in out.values():
                    state[key] = value.clone()
                continue
            for b in self.ddp.buckets:
                flat = torch.zeros(b.numel, dtype=value.dtype, device=value.device)  # [numel] the bucket's state
                for r in self.ranges:
                    if r.bucket is b:
                        flat[b.shard][r.bucket_start : r.bucket_start + r.end - r.start] = self._state_of(r)[key]
                all_gather(flat, flat[b.shard], self.ddp.group)
                for p, (start, end) in b.ranges.items():
                    out[p][key] = flat[start:end].view_as(p)
        return out

    @torch.no_grad()
    def load_parameter_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's pieces of each parameter's whole state (the inverse of get_parameter_state).

        A 16-bit model's main params come from "param" when the state has it, else from the model's
        params (load those first; Megatron: _copy_model_params_to_main_params).
        """
        for r in self.ranges:
            saved = state[r.param]
            if r.main_is_copy and "param" not in saved:
                r.main_param.copy_(r.model_param)
            for key, value in self._state_of(r).items():
                if key == "param" and key not in saved:
                    continue
                value.copy_(saved[key] if value.ndim == 0 else saved[key].reshape(-1)[r.start : r.end])

    def memory_bytes(self) -> dict[str, int]:
        """ddp.memory_bytes() plus this rank's optimizer state, in which the fp32 main params and main
        grads of a 16-bit model count (the ZeRO paper's K = 12 bytes: main param, momentum, variance)."""
        copies = sum(t.numel() * t.element_size() for r in self.ranges
                     for t, copied in ((r.main_param, r.main_is_copy), (r.main_param.grad, r.grad_is_copy)) if copied)
        return {**self.ddp.memory_bytes(), "optimizer": optimizer_state_bytes(self.optimizer) + copies}
