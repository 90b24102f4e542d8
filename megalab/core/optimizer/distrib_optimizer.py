"""The distributed optimizer (ZeRO-1/2): each data-parallel rank owns 1/d of the fp32 main
parameters and optimizer state, steps only its shard, then all-gathers the updated parameters.

Megatron: megatron/core/optimizer/distrib_optimizer.py (DistributedOptimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
from megalab.core.distributed.param_and_grad_buffer import Bucket, all_gather


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq; the step counter left out)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")


@dataclass(eq=False)
class ShardRange:
    """The piece of one model parameter that falls into this rank's shard of its bucket.

    Megatron's `param_range_map` entry: `param` elements [start, end) of its flattened tensor
    are bucket elements [bucket_start, bucket_start + end - start) and the optimizer updates them
    through `main_param`, a view into the shard (its .grad a view into the reduced gradients).
    """

    param: nn.Parameter
    bucket: Bucket
    start: int
    end: int
    bucket_start: int
    main_param: torch.Tensor


class DistributedOptimizer:
    """ZeRO stages 1-3: each rank runs `optimizer_cls` on its shard of every bucket only.

    A bucket's shard may cut a parameter between two ranks; the optimizer sees one view per piece
    of a parameter in the shard (`ShardRange`), so element-wise optimizers (SGD, Adam) give the
    unsharded result, and each piece joins its parameter's group (`param_groups`, e.g.
    optimizer.get_param_groups: no weight decay on biases and norms). The views carry the
    parameter's `tensor_model_parallel` / `shared` flags, so optimizer.clip_grad_norm on
    `main_params` sums every gradient element once (Megatron: copy_tensor_model_parallel_attributes).

        bucket   [ w1 ........ | b1 | w0 ......... ]      params in the bucket
        shards   [ rank 0      ][ rank 1     ][ rank 2 ]  rank 1 updates the tail of w1, b1,
                                                          the head of w0: three views, two groups
    step(): update the own shard in place, then (stage 1/2) all-gather every bucket so all ranks
    hold the new parameters; stage 3 gathers on demand.
    Megatron-LM: megatron/core/optimizer/distrib_optimizer.py, `DistributedOptimizer`
    (`_build_model_gbuf_param_range_map`, `_build_model_and_main_param_groups`).
    """

    def __init__(self, ddp: DistributedDataParallel, optimizer_cls: type[torch.optim.Optimizer],
                 param_groups: list[dict] | None = None, **kwargs):
        if ddp.zero_stage == 0:
            raise ValueError("DistributedOptimizer needs DistributedDataParallel(..., zero_stage=1, 2 or 3); "
                             "with stage 0 use a plain torch optimizer on ddp.parameters()")
        if ddp.grad_dtype != ddp.param_dtype:
            raise ValueError("DistributedOptimizer here needs grad_reduce_in_fp32=False (grads in the param dtype)")
        self.ddp = ddp
        param_groups = param_groups or [{"params": list(ddp.parameters())}]
        group_of = {p: k for k, group in enumerate(param_groups) for p in group["params"]}
        if any(p not in group_of for b in ddp.buckets for p in b.params):
            raise ValueError("param_groups must hold every parameter of ddp.module, and one is missing: build them "
                             "from ddp.module (e.g. optimizer.get_param_groups(ddp.module, weight_decay))")
        self.shards, self.ranges = [], []  # the flat shard of every bucket; the parameter pieces in them
        for b in ddp.buckets:
            shard = b.param_shard if ddp.zero_stage == 3 else b.param_data[b.shard]
            grad = b.grad_data[b.shard] if ddp.zero_stage == 1 else b.grad_shard
            self.shards.append(shard)
            for p, (start, end) in b.ranges.items():
                lo, hi = max(start, b.shard.start) - b.shard.start, min(end, b.shard.stop) - b.shard.start
                if lo >= hi:
                    continue
                view = shard[lo:hi]
                view.grad = grad[lo:hi]
                view.tensor_model_parallel = getattr(p, "tensor_model_parallel", False)
                view.shared = getattr(p, "shared", False)
                self.ranges.append(ShardRange(p, b, lo + b.shard.start - start, hi + b.shard.start - start, lo, view))
        groups = [{**group, "params": [r.main_param for r in self.ranges if group_of[r.param] == k]}
                  for k, group in enumerate(param_groups)]
        self.optimizer = optimizer_cls([g for g in groups if g["params"]], **kwargs)

    @property
    def main_params(self) -> list[torch.Tensor]:
        """The views this rank's optimizer updates (each with .grad): what gradient clipping works on."""
        return [r.main_param for r in self.ranges]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (an LR scheduler sets group["lr"] here)."""
        return self.optimizer.param_groups

    def step(self) -> None:
        # EXERCISE data_parallel.zero_step: update the own shards, then (stage 1/2) all-gather every bucket's params
        ### BEGIN SOLUTION
        # HINT 1: Each rank's optimizer updates only its own shard of every bucket (the shards are views into the
        #         parameters); the other ranks still hold the old values of the rest until they receive the new ones.
        # HINT 2: Step self.optimizer; then, below stage 3, launch one asynchronous all_gather per bucket
        #         (bucket.param_data from this rank's shard, over the DDP group) and wait for every handle. Stage 3
        #         gathers on demand, before each forward.
        self.optimizer.step()
        if self.ddp.zero_stage < 3:
            handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)
                       for b, shard in zip(self.ddp.buckets, self.shards)]
            for handle in handles:
                handle.wait()
        ### END SOLUTION

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    def get_parameter_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Collective over DP: each parameter's whole optimizer state, shaped like it, from every rank's shard.

        For checkpoints that any DP size can load. Needs the state to exist (after a step, or
        checkpoint.init_optimizer_state(self.optimizer)). Megatron: get_parameter_state_dp_zero
        (which gathers onto DP rank 0 only).
        """
        template = self.optimizer.state[self.ranges[0].main_param]
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
                        flat[b.shard][r.bucket_start : r.bucket_start + r.end - r.start] = self.optimizer.state[r.main_param][key]
                all_gather(flat, flat[b.shard], self.ddp.group)
                for p, (start, end) in b.ranges.items():
                    out[p][key] = flat[start:end].view_as(p)
        return out

    def load_parameter_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's pieces of each parameter's whole state (the inverse of get_parameter_state)."""
        for r in self.ranges:
            for key, value in self.optimizer.state[r.main_param].items():
                full = state[r.param][key]
                value.copy_(full if value.ndim == 0 else full.reshape(-1)[r.start : r.end])

    def memory_bytes(self) -> dict[str, int]:
        """ddp.memory_bytes() plus this rank's optimizer state."""
        return {**self.ddp.memory_bytes(), "optimizer": optimizer_state_bytes(self.optimizer)}
