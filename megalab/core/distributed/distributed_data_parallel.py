"""Data parallelism the way Megatron-LM does it: gradient buckets, overlap, and ZeRO stages 1-3.

Every rank holds the model, sees its own micro-batch, and the gradients are averaged. The naive
way (`all_reduce_gradients`) waits for the whole backward pass and then sends one message per
parameter. Megatron's `DistributedDataParallel` instead keeps all gradients in one contiguous
buffer, cut into buckets of about `bucket_size` elements, filled in reverse order of the
parameters (roughly the order backward produces their gradients):

    parameters   w0 b0 | w1 b1 | w2 b2 | w3 b3          (registration order = forward order)
    grad buffer  [ b3 w3 b2 | w2 b1 w1 | b0 w0 ]         (reversed: backward fills it left to right)
                   bucket 0    bucket 1   bucket 2

A hook on every parameter (`register_post_accumulate_grad_hook` here; Megatron hooks each parameter's
`AccumulateGrad` node) adds the fresh gradient into the buffer; when the last gradient of a bucket
arrives the hook launches an asynchronous all-reduce of that bucket, while backward keeps computing
the earlier layers. `finish_grad_sync()` waits for all of them before the optimizer step.

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
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.distributed.param_and_grad_buffer import Bucket, _round_up, all_gather, build_buckets, reduce_scatter


def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """The naive version: after backward, average every parameter's .grad with its own all-reduce
    (`group`: the current state's dp-cp group, or every rank when no state is current)."""
    group = ps.resolve_group(group, "dp-cp")
    world = dist.get_world_size(group)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.div_(world)
            dist.all_reduce(p.grad, group=group)


class DistributedDataParallel(nn.Module):
    """Wrap `module` for data parallelism over `group`, with gradient buckets and ZeRO stage 0-3.

    Use it like Megatron's:   ddp.zero_grad_buffer(); loss = f(ddp(x)); loss.backward();
                              ddp.finish_grad_sync(); optimizer.step()
    With zero_stage 0 a plain torch optimizer works on ddp.parameters() (p.grad is the averaged
    gradient after finish_grad_sync); stages 1-3 need `DistributedOptimizer(ddp, ...)`.

    bucket_size: elements per bucket (stage 3 uses one bucket per module that owns parameters).
    overlap_grad_reduce: launch each bucket's reduction from the backward hooks (else all in finish).
    grad_reduce_in_fp32: keep the gradient buffer ("main grads") and reduce in float32 (Megatron's
    DistributedDataParallelConfig.grad_reduce_in_fp32; for bf16/fp16 models, whose 16-bit grads are
    added into it; the DistributedOptimizer then steps on them without a copy).
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
        self.group = ps.resolve_group(group, "dp-cp")  # the current state's dp-cp group (no state: every rank)
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
        self.grad_syncs = 0  # finish_grad_sync calls so far (the optimizer copies each sync's grads once)
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
        # HINT 1: The bucket's flat buffer (param.main_grad) is where this parameter's gradient lives from now on; a
        #         bucket may be reduced only once every one of its parameters has delivered its gradient.
        # HINT 2: Add (not copy: micro-batches accumulate) param.grad into the parameter's range of the buffer
        #         (bucket.ranges), drop param.grad, tick the parameter off bucket.pending; when nothing is pending,
        #         refill pending for the next backward and call start_grad_sync, unless inside no_sync() or with
        #         overlap off.
        # HINT 3: Stage 3 frees the unit's full parameters once its last gradient is in (self._free_params).
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
        # HINT 1: After a reduce-scatter each rank holds only ITS 1/n of the summed bucket: where that shard is kept
        #         depends on the stage (stage 1 still has the whole grad buffer, stage 2/3 only the small grad_shard).
        # HINT 2: Pick the output tensor (a view of the buffer at bucket.shard for stage 1, bucket.grad_shard
        #         otherwise), then call param_and_grad_buffer.reduce_scatter on self.group asynchronously and keep its
        #         handle in bucket.handle so finish_grad_sync can wait for it.
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
        # HINT 1: Some buckets were launched by the hooks, some not (overlap off, no_sync, a parameter without a
        #         gradient); an async collective's result exists only after its handle has been waited for.
        # HINT 2: First launch every bucket without a handle (start_grad_sync) and reset its pending set; then, bucket
        #         by bucket, wait, note 'done' if not seen, clear handle and done_seen, free the full grad buffer at
        #         stage >= 2, and at stage 0 point each p.grad at its range of the buffer (in the parameter's dtype).
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
        self.grad_syncs += 1
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
        # HINT 1: At stage 3 param_data keeps its shape but its storage was shrunk to 0 bytes; the parameters are
        #         views into it, so refilling that same storage brings them all back.
        # HINT 2: Resize param_data's untyped storage back to numel * element_size bytes, then all_gather
        #         (param_and_grad_buffer) every rank's param_shard into it, over self.group.
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


