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
self._copy_main_params_to_model_params()
"""),
    Mistake("data_parallel.zero_step", "launched the all-gathers but never waited", says="forgot to wait",
            code="""
self.optimizer.step()
self._copy_main_params_to_model_params()
if self.ddp.zero_stage < 3:
    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)
               for b, shard in zip(self.ddp.buckets, self.shards)]
"""),
    Mistake("data_parallel.zero_step", "stepped the fp32 main params but never copied them back",
            says="forgot to copy the updated fp32 main params back", code="""
self.optimizer.step()
if self.ddp.zero_stage < 3:
    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)
               for b, shard in zip(self.ddp.buckets, self.shards)]
    for handle in handles:
        handle.wait()
"""),
]

_CE_TAIL = """
exp_logits = logits.exp()
sums = torch.stack([exp_logits.sum(dim=-1), logits.sum(dim=-1)])
dist.all_reduce(sums, group=group)
sum_exp_logits, sum_logits = sums
loss = sum_exp_logits.log() - predicted_logits
vocab_size = logits.shape[-1] * dist.get_world_size(group)
if label_smoothing > 0:
    loss = (1 - label_smoothing) * loss + label_smoothing * (sum_exp_logits.log() - sum_logits / vocab_size)

softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
ctx.save_for_backward(softmax, outside, local_target)
ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
return loss
"""
_CE_TARGET = """
first, last = vocab_range(logits.shape[-1] * dist.get_world_size(group), group)
outside = (target < first) | (target >= last)
local_target = (target - first).masked_fill(outside, 0)
predicted_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
dist.all_reduce(predicted_logits, group=group)
"""

MISTAKES += [
    # ------------------------------------------------------------------ tp.vocab_cross_entropy
    Mistake("tp.vocab_cross_entropy", "skipped the max subtraction", says="skipped the max subtraction",
            code="""
logits = vocab_parallel_logits.float()
""" + _CE_TARGET + _CE_TAIL),
    Mistake("tp.vocab_cross_entropy", "subtracted the local max (no all-reduce MAX)", says="own max",
            code="""
logits = vocab_parallel_logits.float()
logits_max = logits.max(dim=-1).values
logits = logits - logits_max.unsqueeze(-1)
""" + _CE_TARGET + _CE_TAIL),
    Mistake("tp.vocab_cross_entropy", "did not mask the target logit on the other ranks", says="not masked",
            code="""
logits = vocab_parallel_logits.float()
logits_max = logits.max(dim=-1).values
dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
logits = logits - logits_max.unsqueeze(-1)
first, last = vocab_range(logits.shape[-1] * dist.get_world_size(group), group)
outside = (target < first) | (target >= last)
local_target = (target - first).masked_fill(outside, 0)
predicted_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
dist.all_reduce(predicted_logits, group=group)
""" + _CE_TAIL),
    # ------------------------------------------------------------------ tp.vocab_cross_entropy_backward
    Mistake("tp.vocab_cross_entropy_backward", "did not mask the one-hot of targets on other ranks",
            says="one-hot not masked", code="""
grad_input = softmax.clone()
onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)
grad_input -= (1.0 - a) * onehot + a / ctx.vocab_size
grad_input *= grad_output.unsqueeze(-1)
"""),
    Mistake("tp.vocab_cross_entropy_backward", "forgot to multiply by grad_output", says="grad_output",
            code="""
grad_input = softmax.clone()
onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)
onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
grad_input -= (1.0 - a) * onehot + a / ctx.vocab_size
"""),
    Mistake("tp.vocab_cross_entropy_backward", "onehot - softmax (sign flipped)", says="sign flipped",
            code="""
onehot = torch.zeros_like(softmax).scatter_(-1, local_target.unsqueeze(-1), 1.0)
onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
grad_input = (1.0 - a) * onehot + a / ctx.vocab_size - softmax
grad_input *= grad_output.unsqueeze(-1)
"""),
    # ------------------------------------------------------------------ tp.column_forward
    Mistake("tp.column_forward", "forgot the all-gather when gather_output", says="not all-gathered",
            code="""
return column_parallel_linear(input_, self.weight, self.bias, self.sequence_parallel, self.tp_group)
"""),
    Mistake("tp.column_forward", "a plain F.linear, without f (copy_to_tensor_model_parallel_region)",
            says="copy_to_tensor_model_parallel_region", code="""
output_parallel = F.linear(input_, self.weight, self.bias)
if self.gather_output:
    return gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
return output_parallel
"""),
    Mistake("tp.column_forward", "always f, ignoring sequence_parallel", says="sequence_parallel ignored",
            code="""
output_parallel = F.linear(copy_to_tensor_model_parallel_region(input_, self.tp_group), self.weight, self.bias)
if self.gather_output:
    return gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
return output_parallel
"""),
    # ------------------------------------------------------------------ tp.row_forward
    Mistake("tp.row_forward", "added the bias before the all-reduce", says="bias added on every rank",
            code="""
if not self.input_is_parallel:
    input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
output_parallel = F.linear(input_, self.weight, self.bias)
if self.sequence_parallel:
    return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
"""),
    Mistake("tp.row_forward", "forgot the all-reduce", says="forgot the all-reduce",
            code="""
if not self.input_is_parallel:
    input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
output = F.linear(input_, self.weight)
if self.sequence_parallel:
    output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
return output + self.bias if self.bias is not None else output
"""),
    Mistake("tp.row_forward", "all-reduced under sequence parallelism", says="instead of reduce-scattering",
            code="""
if not self.input_is_parallel:
    input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
output_parallel = F.linear(input_, self.weight)
output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
return output + self.bias if self.bias is not None else output
"""),
    # ------------------------------------------------------------------ tp.vocab_embedding
    Mistake("tp.vocab_embedding", "did not zero the rows of ids outside the range", says="did not zero",
            code="""
outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
output_parallel = F.embedding(local_ids, self.weight)
return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
"""),
    Mistake("tp.vocab_embedding", "looked up every id without masking the outside ones", says="other ranks' rows",
            code="""
outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
output_parallel = F.embedding(input_ids - self.vocab_start_index, self.weight)
output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
"""),
    Mistake("tp.vocab_embedding", "forgot the all-reduce", says="forgot the all-reduce",
            code="""
outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
return F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
"""),
    # ------------------------------------------------------------------ tp.gather_last_dim
    Mistake("tp.gather_last_dim", "concatenated along dim 0", says="along dim 0",
            code="""
pieces = [torch.empty_like(input_) for _ in range(world)]
dist.all_gather(pieces, input_.contiguous(), group=group)
return torch.cat(pieces)
"""),
    Mistake("tp.gather_last_dim", "one receive buffer repeated ([t] * world)", says="same tensor",
            code="""
pieces = [torch.empty_like(input_)] * world
dist.all_gather(pieces, input_.contiguous(), group=group)
return torch.cat(pieces, dim=-1)
"""),
    Mistake("tp.gather_last_dim", "stacked instead of concatenated", says="stacked",
            code="""
pieces = [torch.empty_like(input_) for _ in range(world)]
dist.all_gather(pieces, input_.contiguous(), group=group)
return torch.stack(pieces, dim=-1)
"""),
    # ------------------------------------------------------------------ tp.copy_to_region
    Mistake("tp.copy_to_region", "identity backward (f and g swapped)", says="unchanged",
            code="""
return grad_output, None
"""),
    Mistake("tp.copy_to_region", "averaged instead of summed", says="averaged",
            code="""
return _reduce(grad_output, ctx.group) / dist.get_world_size(ctx.group), None
"""),
    Mistake("tp.copy_to_region", "all-reduced over the world, not ctx.group", says="every rank",
            code="""
grad = grad_output.clone()
dist.all_reduce(grad)
return grad, None
"""),
    # ------------------------------------------------------------------ tp.reduce_from_region
    Mistake("tp.reduce_from_region", "identity forward (f and g swapped)", says="unchanged",
            code="""
return input_
"""),
    Mistake("tp.reduce_from_region", "averaged instead of summed", says="averaged",
            code="""
return _reduce(input_, group) / dist.get_world_size(group)
"""),
    Mistake("tp.reduce_from_region", "all-reduced over the world, not the TP group", says="every rank",
            code="""
output = input_.clone()
dist.all_reduce(output)
return output
"""),
    # ------------------------------------------------------------------ tp.sp_gather
    Mistake("tp.sp_gather", "gathered along the hidden dim", says="hidden",
            code="""
pieces = [torch.empty_like(input_) for _ in range(world)]
dist.all_gather(pieces, input_.contiguous(), group=group)
return torch.cat(pieces, dim=-1)
"""),
    Mistake("tp.sp_gather", "gathered along the batch dim", says="batch",
            code="""
pieces = [torch.empty_like(input_) for _ in range(world)]
dist.all_gather(pieces, input_.contiguous(), group=group)
return torch.cat(pieces, dim=1)
"""),
    # ------------------------------------------------------------------ tp.sp_reduce_scatter
    Mistake("tp.sp_reduce_scatter", "reduce-scattered along the hidden dim", says="hidden",
            code="""
chunk = divide(input_.shape[-1], world, "hidden size")
output = input_.clone()
dist.all_reduce(output, group=group)
rank = dist.get_rank(group)
return output[..., rank * chunk:(rank + 1) * chunk].contiguous()
"""),
    Mistake("tp.sp_reduce_scatter", "split without summing", says="without summing",
            code="""
chunk = divide(input_.shape[0], world, "sequence length")
rank = dist.get_rank(group)
return input_[rank * chunk:(rank + 1) * chunk].contiguous()
"""),
    Mistake("tp.sp_reduce_scatter", "all-reduced, kept the whole sequence", says="without scattering",
            code="""
output = input_.clone()
dist.all_reduce(output, group=group)
return output
"""),
]
