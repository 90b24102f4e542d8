"""Data parallelism the way Megatron-LM does it: gradient buckets, overlap, and ZeRO stages 1-3.

Every rank holds the model, sees its own micro-batch, and the gradients are averaged. The naive
way (`all_reduce_gradients`) waits for the whole backward pass and then sends one message per
parameter. Megatron's `DistributedDataParallel` instead keeps all gradients in one contiguous
buffer, cut into buckets of about `bucket_size` elements, filled in reverse order of the
parameters (roughly the order backward produces their gradients):

    parameters   w0 b0 | w1 b1 | w2 b2 | w3 b3          (registration order = forward order)
    grad buffer  [ b3 w3 b2 | w2 b1 w1 | b0 w0 ]         (reversed: backward fills it left to right)
                   bucket 0    bucket 1   bucket 2

A hook on every parameter (`register_post_accumulate_grad_hook`) adds the fresh gradient into
the buffer; when the last gradient of a bucket arrives the hook launches an asynchronous
all-reduce of that bucket, while backward keeps computing the earlier layers. `finish_grad_sync()`
waits for all of them before the optimizer step.

ZeRO (Rajbhandari et al. 2020) shards what every rank would otherwise repeat. Each bucket is
padded to a multiple of the data-parallel size n; rank r owns the r-th of its n equal shards:

    stage 0  all-reduce the bucket                      everyone holds params, grads, optimizer state
    stage 1  reduce-scatter the bucket, each rank       optimizer state: 1/n  (DistributedOptimizer)
             updates its shard, all-gather params
    stage 2  + only the shard of the reduced grads      grads: 1/n (the full bucket lives only during
             is kept                                    backward, until finish_grad_sync)
    stage 3  + params sharded per layer ("unit"):       params: 1/n (a unit's full params live only
             all-gather before forward and backward,    while it computes)
             free after, reduce-scatter grads

`reduce_scatter` / `all_gather` call NCCL's collectives on GPUs; on gloo (CPU) they use the
all-reduce and broadcasts that gloo runs faster (same results, see their docstrings).

Megatron-LM: megatron/core/distributed/distributed_data_parallel.py (`DistributedDataParallel`,
`no_sync`, `finish_grad_sync`, `zero_grad_buffer`), param_and_grad_buffer.py (`_ParamAndGradBuffer`,
`_ParamAndGradBucketGroup.start_grad_sync` / `finish_grad_sync`), optimizer/distrib_optimizer.py
(`DistributedOptimizer`), distributed/fsdp/ (stage 3). Names here follow them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

# PyTorch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (Megatron's names) to *_single.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Pending:
    """Async works waited for as one, then a final copy (quacks like the dist.Work that async_op returns)."""

    def __init__(self, works: list, then=None):
        self.works, self.then = works, then

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return True


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """output [numel / n] = this rank's shard of the sum over ranks of input [numel] (may alias input).

    On gloo (CPU) an all-reduce plus a copy of the shard: gloo's own reduce-scatter takes about 1.7x
    as long as its all-reduce of the same tensor (8.4 M floats, 4 ranks). NCCL runs the real one.
    """
    if dist.get_backend(group) != "gloo":
        return _REDUCE_SCATTER(output, input, group=group, async_op=async_op)
    shard = input.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
    copy = None if output.data_ptr() == shard.data_ptr() else (lambda: output.copy_(shard))
    work = _Pending([dist.all_reduce(input, group=group, async_op=True)], copy)
    return work if async_op else work.wait()


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """output [numel] = every rank's input [numel / n], in rank order (input may alias its own chunk).

    On gloo one broadcast per rank: about half the time of gloo's all-gather here (as
    ZeroRedundancyOptimizer does). NCCL runs the real one.
    """
    if dist.get_backend(group) != "gloo":
        return _ALL_GATHER(output, input, group=group, async_op=async_op)
    chunks = output.view(dist.get_world_size(group), -1)
    own = chunks[dist.get_rank(group)]
    if own.data_ptr() != input.data_ptr():
        own.copy_(input)
    work = _Pending([dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True)
                     for r, chunk in enumerate(chunks)])
    return work if async_op else work.wait()


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """The naive version: after backward, average every parameter's .grad with its own all-reduce."""
    world = dist.get_world_size(group)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.div_(world)
            dist.all_reduce(p.grad, group=group)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def build_buckets(numels: Sequence[int], bucket_size: int, pad_to: int = 1) -> list[tuple[list[int], int, int]]:
    """Assign parameters to buckets in reverse order; returns (param indices, start, end) per bucket.

    numels: element count of each parameter, in registration order. Parameters are taken from the
    last to the first and laid out one after another in a flat buffer; a bucket is closed as soon as
    it holds at least `bucket_size` elements (the last one may be smaller). Each bucket's length
    end - start is padded up to a multiple of `pad_to` (the data-parallel size, so ZeRO shards are
    equal); the next bucket starts where the padded one ends. Megatron: `_ParamAndGradBuffer`.

        numels [4, 2, 6, 3], bucket_size 5, pad_to 2  ->  [([3, 2], 0, 10), ([1, 0], 10, 16)]
    """
    if bucket_size < 1 or pad_to < 1:
        raise ValueError(f"bucket_size and pad_to must be >= 1, got {bucket_size} and {pad_to}")
    # EXERCISE data_parallel.build_buckets: reverse order, close a bucket at >= bucket_size elements, pad its length
    ### BEGIN SOLUTION
    buckets, indices, start, filled = [], [], 0, 0
    for i in reversed(range(len(numels))):
        indices.append(i)
        filled += numels[i]
        if filled >= bucket_size:
            end = start + _round_up(filled, pad_to)
            buckets.append((indices, start, end))
            indices, start, filled = [], end, 0
    if indices:
        buckets.append((indices, start, start + _round_up(filled, pad_to)))
    return buckets
    ### END SOLUTION


@dataclass(eq=False)
class Bucket:
    """One bucket: its parameters, where each sits in the bucket, and this rank's shard of it."""

    index: int
    params: list[nn.Parameter]
    ranges: dict[nn.Parameter, tuple[int, int]]  # [start, end) of each parameter inside the bucket
    numel: int  # padded to a multiple of the data-parallel size
    shard: slice  # this rank's 1/n of the bucket
    param_data: torch.Tensor  # [numel] the parameters live here (stage 3: storage freed when not in use)
    param_shard: torch.Tensor | None = None  # [numel / n] stage 3: the persistent parameters
    grad_data: torch.Tensor | None = None  # [numel] gradients (stage 2/3: only during backward)
    grad_shard: torch.Tensor | None = None  # [numel / n] stage 2/3: the reduced gradient shard
    pending: set = field(default_factory=set)  # parameters whose gradient has not arrived yet
    handle: dist.Work | _Pending | None = None  # the in-flight all-reduce / reduce-scatter
    done_seen: bool = False  # its completion is in the timeline
    gathered: bool = True  # stage 3: whether param_data holds the full parameters now


class DistributedDataParallel(nn.Module):
    """Wrap `module` for data parallelism over `group`, with gradient buckets and ZeRO stage 0-3.

    Use it like Megatron's:   ddp.zero_grad_buffer(); loss = f(ddp(x)); loss.backward();
                              ddp.finish_grad_sync(); optimizer.step()
    With zero_stage 0 a plain torch optimizer works on ddp.parameters() (p.grad is the averaged
    gradient after finish_grad_sync); stages 1-3 need `DistributedOptimizer(ddp, ...)`.

    bucket_size: elements per bucket (stage 3 uses one bucket per module that owns parameters).
    overlap_grad_reduce: launch each bucket's reduction from the backward hooks (else all in finish).
    grad_reduce_in_fp32: keep the gradient buffer ("main grads") and reduce in float32.
    Parameters are broadcast from group rank 0 at construction, as torch DDP does.
    self.timeline: (time.perf_counter(), event, bucket) with events "grad_ready" (a hook fired),
    "launch" (a bucket's reduction started), "done" (first seen finished), "finish" (all waited for).
    """

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None, bucket_size: int = 10**6,
                 zero_stage: int = 0, overlap_grad_reduce: bool = True, grad_reduce_in_fp32: bool = False):
        super().__init__()
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        self.module = module
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.zero_stage, self.overlap_grad_reduce = zero_stage, overlap_grad_reduce
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no parameters that require grad")
        if len({p.dtype for p in params}) > 1:
            raise ValueError("all parameters must have one dtype (cast the module first, e.g. module.float())")
        self.param_dtype = params[0].dtype
        self.grad_dtype = torch.float32 if grad_reduce_in_fp32 else self.param_dtype
        self._sync = True
        self.timeline: list[tuple[float, str, int]] = []

        if zero_stage == 3:  # one bucket per module owning parameters, last module first
            units = [m for m in module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
            index = {p: i for i, p in enumerate(params)}
            layout, start = [], 0
            for unit in reversed(units):
                ids = [index[p] for p in reversed(list(unit.parameters(recurse=False))) if p.requires_grad]
                end = start + _round_up(sum(params[i].numel() for i in ids), self.world)
                layout.append((ids, start, end))
                start = end
        else:
            layout = build_buckets([p.numel() for p in params], bucket_size, pad_to=self.world)
        self.buckets = [self._make_bucket(k, [params[i] for i in ids], end - start)
                        for k, (ids, start, end) in enumerate(layout)]
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._grad_hook(bucket, p))
        if zero_stage == 3:
            for unit, bucket in zip(reversed(units), self.buckets):
                unit.register_forward_pre_hook(lambda m, args, bucket=bucket: self._gather_params(bucket))
                unit.register_forward_hook(lambda m, args, out, bucket=bucket: self._after_forward(bucket, out))

    def _make_bucket(self, index: int, params: list[nn.Parameter], numel: int) -> Bucket:
        """Move the parameters into one flat, padded buffer (same values, rank 0's) and set up the shards."""
        param_data = torch.zeros(numel, dtype=self.param_dtype, device=params[0].device)
        ranges, offset = {}, 0
        for p in params:
            ranges[p] = (offset, offset + p.numel())
            param_data[offset : offset + p.numel()] = p.detach().view(-1)
            p.data = param_data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        dist.broadcast(param_data, src=dist.get_global_rank(self.group, 0), group=self.group)
        size = numel // self.world
        bucket = Bucket(index, params, ranges, numel, slice(self.rank * size, (self.rank + 1) * size), param_data,
                        pending=set(params))
        if self.zero_stage <= 1:
            bucket.grad_data = torch.zeros(numel, dtype=self.grad_dtype, device=param_data.device)
            for p, (start, end) in ranges.items():  # Megatron's param.main_grad: where the gradient accumulates
                p.main_grad = bucket.grad_data[start:end].view_as(p)
        else:
            bucket.grad_shard = torch.zeros(size, dtype=self.grad_dtype, device=param_data.device)
        if self.zero_stage == 3:
            bucket.param_shard = param_data[bucket.shard].clone()
            self._free_params(bucket)
        return bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ gradients

    def _record(self, event: str, bucket: int) -> None:
        now = time.perf_counter()
        for b in self.buckets:  # gloo has no completion callbacks: note finished reductions when we look
            if b.handle is not None and not b.done_seen and b.handle.is_completed():
                b.done_seen = True
                self.timeline.append((now, "done", b.index))
        self.timeline.append((now, event, bucket))

    def _bucket_grad_data(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's full gradient buffer (stage 2/3 allocate it when backward first needs it)."""
        if bucket.grad_data is None:
            bucket.grad_data = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=bucket.param_data.device)
        return bucket.grad_data

    def _grad_hook(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Runs when param.grad has been accumulated in backward (register_post_accumulate_grad_hook)."""
        self._record("grad_ready", bucket.index)
        # EXERCISE data_parallel.grad_hook: add param.grad into the bucket's buffer, drop it, launch the full bucket
        ### BEGIN SOLUTION
        start, end = bucket.ranges[param]
        self._bucket_grad_data(bucket)[start:end].add_(param.grad.view(-1))
        param.grad = None  # the buffer is the gradient now (Megatron: param.main_grad)
        bucket.pending.discard(param)
        if not bucket.pending:  # the last gradient of this bucket: ready for the next backward, and send
            bucket.pending = set(bucket.params)
            if self.zero_stage == 3:
                self._free_params(bucket)
            if self._sync and self.overlap_grad_reduce:
                self.start_grad_sync(bucket)
        ### END SOLUTION

    def start_grad_sync(self, bucket: Bucket) -> None:
        """Launch the bucket's averaging: all-reduce (stage 0) or reduce-scatter (ZeRO), asynchronously."""
        if bucket.handle is not None:
            raise RuntimeError(f"bucket {bucket.index} was reduced twice before finish_grad_sync(): accumulate "
                               "micro-batches inside `with ddp.no_sync():` and call finish_grad_sync() after the last")
        self._record("launch", bucket.index)
        grad_data = self._bucket_grad_data(bucket)
        grad_data.div_(self.world)  # average = sum of (grad / n); Megatron's gradient_scaling_factor
        if self.zero_stage == 0:
            bucket.handle = dist.all_reduce(grad_data, group=self.group, async_op=True)
            return
        # EXERCISE data_parallel.reduce_scatter: stage 1 keeps its shard in the full buffer, stage 2/3 in grad_shard
        ### BEGIN SOLUTION
        output = grad_data[bucket.shard] if self.zero_stage == 1 else bucket.grad_shard
        bucket.handle = reduce_scatter(output, grad_data, self.group, async_op=True)
        ### END SOLUTION

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (launching those not yet launched); then grads are averaged.

        Stage 0: p.grad is set to the parameter's slice of the buffer. Stage 2/3: the full bucket
        buffers are freed, only the reduced shards stay.
        """
        # EXERCISE data_parallel.finish_grad_sync: launch what is not launched, wait for all, expose/free grads
        ### BEGIN SOLUTION
        for bucket in self.buckets:
            if bucket.handle is None:  # overlap off, or a parameter got no gradient in this backward
                self.start_grad_sync(bucket)
            bucket.pending = set(bucket.params)
        for bucket in self.buckets:
            bucket.handle.wait()
            if not bucket.done_seen:
                self._record("done", bucket.index)
            bucket.handle, bucket.done_seen = None, False
            if self.zero_stage >= 2:
                bucket.grad_data = None
            if self.zero_stage == 0:
                for p, (start, end) in bucket.ranges.items():
                    p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)
        ### END SOLUTION
        self._record("finish", -1)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: inside, backward only adds into the buffers; reduce after the last micro-batch."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero_grad_buffer(self) -> None:
        """Zero the gradients before a new step (and clear the timeline)."""
        for bucket in self.buckets:
            if bucket.grad_data is not None:
                bucket.grad_data.zero_()
            for p in bucket.params:
                p.grad = None
        self.timeline = []

    # ------------------------------------------------------------------ stage 3: parameters on demand

    def _gather_params(self, bucket: Bucket) -> None:
        """Stage 3: rebuild the unit's full parameters from every rank's shard (before forward / backward)."""
        if bucket.gathered:
            return
        # EXERCISE data_parallel.zero3_gather: re-allocate param_data's storage and all-gather the shards into it
        ### BEGIN SOLUTION
        data = bucket.param_data
        data.untyped_storage().resize_(data.numel() * data.element_size())
        all_gather(data, bucket.param_shard, self.group)
        ### END SOLUTION
        bucket.gathered = True

    def _after_forward(self, bucket: Bucket, output) -> None:
        """Stage 3: free the unit's parameters, and gather them again when backward reaches its output."""
        self._free_params(bucket)
        for out in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad, bucket=bucket: self._gather_params(bucket))

    def _free_params(self, bucket: Bucket) -> None:
        """Stage 3: release the full parameters; the views (and tensors autograd saved) keep their shape."""
        if self.zero_stage == 3 and bucket.gathered:
            bucket.param_data.untyped_storage().resize_(0)
            bucket.gathered = False

    # ------------------------------------------------------------------ inspection

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter, by name, in full (stage 3 gathers them)."""
        for bucket in self.buckets:
            self._gather_params(bucket)
        out = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for bucket in self.buckets:
            self._free_params(bucket)
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps for parameters and gradients (buffers, padding included)."""
        params = sum((b.param_shard if self.zero_stage == 3 else b.param_data).numel() for b in self.buckets)
        grads = sum((b.grad_data if self.zero_stage <= 1 else b.grad_shard).numel() for b in self.buckets)
        return {"params": params * self.buckets[0].param_data.element_size(),
                "grads": grads * torch.finfo(self.grad_dtype).bits // 8}


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
