"""Named mistakes of chapter 03's data-parallel, ZeRO, tensor- and sequence-parallel exercises (issue 27).

Each is a typical wrong region body; the first test marked with its exercise (tests/test_data_parallel.py,
tests/test_tensor_parallel.py: the quick 2-rank checks) must fail on it with a verdict that contains `says`.
"""

from tests.mistakes import Mistake

_HOOK_TAIL = """
bucket.pending.discard(param)
if not bucket.pending:
    bucket.pending = set(bucket.params)
    if self.zero_stage == 3:
        self._free_params(bucket)
"""

MISTAKES = [
    # ------------------------------------------------------------------ data_parallel.grad_hook
    Mistake("data_parallel.grad_hook", "copied param.grad into the buffer instead of adding it", says="instead of adding",
            code="""
start, end = bucket.ranges[param]
self._bucket_grad_data(bucket)[start:end].copy_(param.grad.view(-1))
param.grad = None""" + _HOOK_TAIL + """    if self._sync and self.overlap_grad_reduce:
        self.start_grad_sync(bucket)
"""),
    Mistake("data_parallel.grad_hook", "launched full buckets even inside no_sync()", says="inside no_sync",
            code="""
start, end = bucket.ranges[param]
self._bucket_grad_data(bucket)[start:end].add_(param.grad.view(-1))
param.grad = None""" + _HOOK_TAIL + """    if self.overlap_grad_reduce:
        self.start_grad_sync(bucket)
"""),
    Mistake("data_parallel.grad_hook", "never launched a bucket from the hook (no overlap)", says="never launches",
            code="""
start, end = bucket.ranges[param]
self._bucket_grad_data(bucket)[start:end].add_(param.grad.view(-1))
param.grad = None""" + _HOOK_TAIL),
    # ------------------------------------------------------------------ data_parallel.finish_grad_sync
    Mistake("data_parallel.finish_grad_sync", "forgot to wait on the async handles", says="forgot to wait",
            code="""
for bucket in self.buckets:
    if bucket.handle is None:
        self.start_grad_sync(bucket)
    bucket.pending = set(bucket.params)
for bucket in self.buckets:
    if not bucket.done_seen:
        self._record("done", bucket.index)
    bucket.handle, bucket.done_seen = None, False
    if self.zero_stage >= 2:
        bucket.grad_data = None
    if self.zero_stage == 0:
        for p, (start, end) in bucket.ranges.items():
            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)
"""),
    Mistake("data_parallel.finish_grad_sync", "only waited for the buckets the hooks launched", says="did not launch",
            code="""
for bucket in self.buckets:
    bucket.pending = set(bucket.params)
for bucket in self.buckets:
    if bucket.handle is not None:
        bucket.handle.wait()
    if not bucket.done_seen:
        self._record("done", bucket.index)
    bucket.handle, bucket.done_seen = None, False
    if self.zero_stage >= 2:
        bucket.grad_data = None
    if self.zero_stage == 0:
        for p, (start, end) in bucket.ranges.items():
            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)
"""),
    Mistake("data_parallel.finish_grad_sync", "did not reset bucket.handle after waiting", says="not reset",
            code="""
for bucket in self.buckets:
    if bucket.handle is None:
        self.start_grad_sync(bucket)
    bucket.pending = set(bucket.params)
for bucket in self.buckets:
    bucket.handle.wait()
    if not bucket.done_seen:
        self._record("done", bucket.index)
    bucket.done_seen = False
    if self.zero_stage >= 2:
        bucket.grad_data = None
    if self.zero_stage == 0:
        for p, (start, end) in bucket.ranges.items():
            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)
"""),
    Mistake("data_parallel.finish_grad_sync", "left p.grad unset at stage 0", says="p.grad was not set",
            code="""
for bucket in self.buckets:
    if bucket.handle is None:
        self.start_grad_sync(bucket)
    bucket.pending = set(bucket.params)
for bucket in self.buckets:
    bucket.handle.wait()
    if not bucket.done_seen:
        self._record("done", bucket.index)
    bucket.handle, bucket.done_seen = None, False
    if self.zero_stage >= 2:
        bucket.grad_data = None
"""),
    # ------------------------------------------------------------------ data_parallel.build_buckets
    Mistake("data_parallel.build_buckets", "filled the buckets in forward order", says="forward order",
            code="""
buckets, indices, start, filled = [], [], 0, 0
for i in range(len(numels)):
    indices.append(i)
    filled += numels[i]
    if filled >= bucket_size:
        end = start + _round_up(filled, pad_to)
        buckets.append((indices, start, end))
        indices, start, filled = [], end, 0
if indices:
    buckets.append((indices, start, start + _round_up(filled, pad_to)))
return buckets
"""),
    Mistake("data_parallel.build_buckets", "closed a bucket only above bucket_size (> instead of >=)",
            says="only when it exceeds", code="""
buckets, indices, start, filled = [], [], 0, 0
for i in reversed(range(len(numels))):
    indices.append(i)
    filled += numels[i]
    if filled > bucket_size:
        end = start + _round_up(filled, pad_to)
        buckets.append((indices, start, end))
        indices, start, filled = [], end, 0
if indices:
    buckets.append((indices, start, start + _round_up(filled, pad_to)))
return buckets
"""),
    Mistake("data_parallel.build_buckets", "forgot to pad the bucket length to pad_to", says="not padded",
            code="""
buckets, indices, start, filled = [], [], 0, 0
for i in reversed(range(len(numels))):
    indices.append(i)
    filled += numels[i]
    if filled >= bucket_size:
        end = start + filled
        buckets.append((indices, start, end))
        indices, start, filled = [], end, 0
if indices:
    buckets.append((indices, start, start + filled))
return buckets
"""),
    Mistake("data_parallel.build_buckets", "started the next bucket at the unpadded end", says="unpadded end",
            code="""
buckets, indices, start, filled = [], [], 0, 0
for i in reversed(range(len(numels))):
    indices.append(i)
    filled += numels[i]
    if filled >= bucket_size:
        end = start + _round_up(filled, pad_to)
        buckets.append((indices, start, end))
        indices, start, filled = [], start + filled, 0
if indices:
    buckets.append((indices, start, start + _round_up(filled, pad_to)))
return buckets
"""),
    # ------------------------------------------------------------------ data_parallel.reduce_scatter
    Mistake("data_parallel.reduce_scatter", "stage 2 kept its shard in grad_data, not in grad_shard",
            says="not written into bucket.grad_shard", code="""
output = grad_data[bucket.shard]
bucket.handle = reduce_scatter(output, grad_data, self.group, async_op=True)
"""),
    Mistake("data_parallel.reduce_scatter", "called reduce_scatter without async_op=True", says="async_op=True",
            code="""
output = grad_data[bucket.shard] if self.zero_stage == 1 else bucket.grad_shard
bucket.handle = reduce_scatter(output, grad_data, self.group)
"""),
    Mistake("data_parallel.reduce_scatter", "used bucket.grad_shard at stage 1 too", says="stage 1 has no grad_shard",
            code="""
bucket.handle = reduce_scatter(bucket.grad_shard, grad_data, self.group, async_op=True)
"""),
    # ------------------------------------------------------------------ data_parallel.zero3_gather
    Mistake("data_parallel.zero3_gather", "all-gathered without re-allocating the freed storage",
            says="without re-allocating", code="""
all_gather(bucket.param_data, bucket.param_shard, self.group)
"""),
    Mistake("data_parallel.zero3_gather", "copied back only this rank's shard", says="only this rank's shard",
            code="""
data = bucket.param_data
data.untyped_storage().resize_(data.numel() * data.element_size())
data[bucket.shard].copy_(bucket.param_shard)
"""),
    # ------------------------------------------------------------------ data_parallel.zero_step
    Mistake("data_parallel.zero_step", "forgot the all-gather after the step", says="forgot the all-gather",
            code="""
self.optimizer.step()
"""),
    Mistake("data_parallel.zero_step", "launched the all-gathers but never waited", says="forgot to wait",
            code="""
self.optimizer.step()
if self.ddp.zero_stage < 3:
    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)
               for b, shard in zip(self.ddp.buckets, self.shards)]
"""),
]
