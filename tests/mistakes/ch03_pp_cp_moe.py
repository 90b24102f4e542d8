"""Named mistakes of chapter 03's pipeline, context-parallel, MoE and combining exercises (issue 27).

Each is a typical wrong answer, runnable and different in behaviour from the reference; the exercise's first
failing test must fail on it and its verdict must contain `says` (tests/ch03_checks.py and the focused first
tests in tests/test_{p2p_model,pipeline_parallel,context_parallel,moe,hybrid}.py do the naming).
"""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ pp.communicate
    Mistake("pp.communicate", "each isend/irecv posted on its own (no batch)", says="not as ONE batch_isend_irecv", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = []
if tensor_send_next is not None:
    requests.append(dist.isend(tensor_send_next, next_rank, group=group, tag=ACTIVATION_TAG))
if tensor_recv_prev is not None:
    requests.append(dist.irecv(tensor_recv_prev, prev_rank, group=group, tag=ACTIVATION_TAG))
if tensor_send_prev is not None:
    requests.append(dist.isend(tensor_send_prev, prev_rank, group=group, tag=GRADIENT_TAG))
if tensor_recv_next is not None:
    requests.append(dist.irecv(tensor_recv_next, next_rank, group=group, tag=GRADIENT_TAG))
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "returns the buffers without waiting for the batch", says="forgot to wait()", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
_batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                 tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                 group=group, prev_rank=prev_rank, next_rank=next_rank)
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "receive buffers in the default fp32, not the model's dtype", says="not in the model's dtype",
            code="""
empty = lambda: torch.empty(tensor_shape, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                            group=group, prev_rank=prev_rank, next_rank=next_rank)
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "receive buffers without requires_grad", says="without requires_grad", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                            group=group, prev_rank=prev_rank, next_rank=next_rank)
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    # ------------------------------------------------------------------ pp.stage_split
    Mistake("pp.stage_split", "inclusive stop (start + per_stage - 1)", says="the stop is inclusive", code="""
per_stage = num_layers // num_stages
start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
return start, start + per_stage - 1
"""),
    Mistake("pp.stage_split", "a rank's chunks adjacent: stage pp_rank * v + chunk", says="pp_rank * v + chunk", code="""
per_stage = num_layers // num_stages
start = (pp_rank * num_model_chunks + chunk) * per_stage
return start, start + per_stage
"""),
    Mistake("pp.stage_split", "layers per stage from pp_size only", says="the model chunks (v) left out", code="""
per_stage = num_layers // pp_size
start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
return start, start + per_stage
"""),
    # ------------------------------------------------------------------ pp.num_warmup
    Mistake("pp.num_warmup", "off by one: pp - rank warmup forwards (the last stage warms up too)", says="off by one",
            code="""
total = num_microbatches * num_model_chunks
if pp_size == 1:
    return 0
if num_model_chunks == 1:
    warmup = pp_size - pp_rank
else:
    warmup = (pp_size - pp_rank) * 2 + (num_model_chunks - 1) * pp_size
return min(warmup, total)
"""),
    Mistake("pp.num_warmup", "forgot to cap the warmup at the number of forwards", says="no cap", code="""
if pp_size == 1:
    return 0
if num_model_chunks == 1:
    return pp_size - pp_rank - 1
return (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size
"""),
    Mistake("pp.num_warmup", "interleaved: the (v - 1) * pp term missing", says="other chunks' group", code="""
total = num_microbatches * num_model_chunks
if pp_size == 1:
    return 0
warmup = pp_size - pp_rank - 1
if num_model_chunks > 1:
    warmup *= 2
return min(warmup, total)
"""),
    # ------------------------------------------------------------------ pp.schedule_table
    Mistake("pp.schedule_table", "loops swapped: micro-batch outer, chunk inner", says="loops swapped", code="""
table = []
for first in range(0, num_microbatches, group_size):
    group = range(first, min(first + group_size, num_microbatches))
    table.extend((microbatch, chunk) for microbatch in group for chunk in range(num_model_chunks))
return table
"""),
    Mistake("pp.schedule_table", "group_size ignored", says="group_size ignored", code="""
return [(microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in range(num_microbatches)]
"""),
    Mistake("pp.schedule_table", "the last group not capped at num_microbatches", says="last group runs past", code="""
table = []
for first in range(0, num_microbatches, group_size):
    group = range(first, first + group_size)
    table.extend((microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in group)
return table
"""),
    # ------------------------------------------------------------------ pp.one_f_one_b
    Mistake("pp.one_f_one_b", "steady state: backward before forward", says="backward before the forward", code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [backwards[i], forwards[num_warmup + i]]
return ops + backwards[len(forwards) - num_warmup:]
"""),
    Mistake("pp.one_f_one_b", "no cooldown backwards", says="no cooldown", code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [forwards[num_warmup + i], backwards[i]]
return ops
"""),
    Mistake("pp.one_f_one_b", "steady state runs the backward of the micro-batch just forwarded", says="its OWN backward",
            code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [forwards[num_warmup + i], backwards[num_warmup + i]]
return ops + backwards[:num_warmup]
"""),
    # ------------------------------------------------------------------ cp.zigzag_split
    Mistake("cp.zigzag_split", "rank r gets chunks r and r + 1", says="chunks r and r + 1", code="""
if zigzag:
    return cp_rank, cp_rank + 1
return 2 * cp_rank, 2 * cp_rank + 1
"""),
    Mistake("cp.zigzag_split", "the mirror chunk off by one (2cp - r)", says="mirror chunk off by one", code="""
if zigzag:
    return cp_rank, 2 * cp_size - cp_rank
return 2 * cp_rank, 2 * cp_rank + 1
"""),
    Mistake("cp.zigzag_split", "plain split as neighbouring chunk ids r, r + 1", says="plain split gives rank r", code="""
if zigzag:
    return cp_rank, 2 * cp_size - 1 - cp_rank
return cp_rank, cp_rank + 1
"""),
    # ------------------------------------------------------------------ cp.causal_block_mask
    Mistake("cp.causal_block_mask", "comparison reversed (later chunks full)", says="wrong side of the diagonal", code="""
if kv_chunk > q_chunk:
    return "full"
return "causal" if kv_chunk == q_chunk else "skip"
"""),
    Mistake("cp.causal_block_mask", "diagonal block full", says="treated as full", code="""
return "full" if kv_chunk <= q_chunk else "skip"
"""),
    Mistake("cp.causal_block_mask", "diagonal block skipped", says="diagonal block skipped", code="""
return "full" if kv_chunk < q_chunk else "skip"
"""),
    # ------------------------------------------------------------------ cp.lse_merge
    Mistake("cp.lse_merge", "wrong sign in the rescale", says="sign of the rescale flipped", code="""
new_lse = torch.logaddexp(lse, block_lse)
out = out * torch.exp(new_lse - lse).unsqueeze(-1) + block_out * torch.exp(new_lse - block_lse).unsqueeze(-1)
return out, new_lse
"""),
    Mistake("cp.lse_merge", "log(exp + exp) without subtracting the max", says="without subtracting the max", code="""
new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))
out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
return out, new_lse
"""),
    Mistake("cp.lse_merge", "outputs added without rescaling", says="added without rescaling", code="""
new_lse = torch.logaddexp(lse, block_lse)
return out + block_out, new_lse
"""),
    Mistake("cp.lse_merge", "lse not updated", says="lse not updated", code="""
new_lse = torch.logaddexp(lse, block_lse)
out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
return out, lse
"""),
    # ------------------------------------------------------------------ cp.ring_step
    Mistake("cp.ring_step", "lone isend then irecv", says="not as ONE batch_isend_irecv", code="""
buffer = torch.empty_like(tensor)
requests = [dist.isend(tensor.contiguous(), ranks[(me + 1) % len(ranks)], group=group),
            dist.irecv(buffer, ranks[(me - 1) % len(ranks)], group=group)]
return buffer, requests
"""),
    Mistake("cp.ring_step", "sends to the previous rank, receives from the next", says="the ring runs backwards", code="""
buffer = torch.empty_like(tensor)
requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me - 1) % len(ranks)], group),
                                   dist.P2POp(dist.irecv, buffer, ranks[(me + 1) % len(ranks)], group)])
return buffer, requests
"""),
    Mistake("cp.ring_step", "receives into the tensor it sends", says="receives into the tensor it is sending", code="""
requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, ranks[(me + 1) % len(ranks)], group),
                                   dist.P2POp(dist.irecv, tensor, ranks[(me - 1) % len(ranks)], group)])
return tensor, requests
"""),
    # ------------------------------------------------------------------ cp.backward_ring
    Mistake("cp.backward_ring", "forgot the last hop home of dK/dV", says="forgot the last hop home", code="""
for step in range(cp):
    owner = (rank - step) % cp
    if dkv is None:
        dkv = torch.zeros_like(kv)
    else:
        dkv, dkv_requests = ring_step(dkv, group)
        _wait(dkv_requests)
    if step + 1 < cp:
        next_block, kv_requests = ring_step(block, group)
    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):
        dq_ij, dk, dv = block_attention_backward(
            q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
            dout[:, :, rows], _mask(kind, c, q.device))
        dq[:, :, rows] += dq_ij
        dkv[0][:, :, cols] += dk
        dkv[1][:, :, cols] += dv
    if step + 1 < cp:
        _wait(kv_requests)
        block = next_block
"""),
    Mistake("cp.backward_ring", "dK/dV accumulated locally, never sent with their block", says="never travel", code="""
dkv = torch.zeros_like(kv)
for step in range(cp):
    owner = (rank - step) % cp
    if step + 1 < cp:
        next_block, kv_requests = ring_step(block, group)
    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):
        dq_ij, dk, dv = block_attention_backward(
            q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
            dout[:, :, rows], _mask(kind, c, q.device))
        dq[:, :, rows] += dq_ij
        dkv[0][:, :, cols] += dk
        dkv[1][:, :, cols] += dv
    if step + 1 < cp:
        _wait(kv_requests)
        block = next_block
"""),
    Mistake("cp.backward_ring", "dq overwritten by each block pair", says="dq overwritten", code="""
for step in range(cp):
    owner = (rank - step) % cp
    if dkv is None:
        dkv = torch.zeros_like(kv)
    else:
        dkv, dkv_requests = ring_step(dkv, group)
        _wait(dkv_requests)
    if step + 1 < cp:
        next_block, kv_requests = ring_step(block, group)
    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):
        dq_ij, dk, dv = block_attention_backward(
            q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
            dout[:, :, rows], _mask(kind, c, q.device))
        dq[:, :, rows] = dq_ij
        dkv[0][:, :, cols] += dk
        dkv[1][:, :, cols] += dv
    if step + 1 < cp:
        _wait(kv_requests)
        block = next_block
if cp > 1:
    dkv, dkv_requests = ring_step(dkv, group)
    _wait(dkv_requests)
"""),
    # ------------------------------------------------------------------ moe.load_balancing_loss
    Mistake("moe.load_balancing_loss", "fractions of T, not of T*k", says="forgot the top-k", code="""
aggregated_probs_per_expert = probs.sum(dim=0)
return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
    num_experts * moe_aux_loss_coeff / (total_num_tokens * total_num_tokens))
"""),
    Mistake("moe.load_balancing_loss", "forgot the factor E", says="forgot the factor E", code="""
aggregated_probs_per_expert = probs.sum(dim=0)
return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
    moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))
"""),
    Mistake("moe.load_balancing_loss", "divided by T only once", says="not averaged", code="""
aggregated_probs_per_expert = probs.sum(dim=0)
return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
    num_experts * moe_aux_loss_coeff / (topk * total_num_tokens))
"""),
    Mistake("moe.load_balancing_loss", "probs.mean(0): the probabilities averaged over this rank's rows",
            says="divided by probs' row count", code="""
fractions = tokens_per_expert / (topk * total_num_tokens)
return moe_aux_loss_coeff * num_experts * torch.sum(fractions * probs.mean(dim=0))
"""),
    Mistake("moe.load_balancing_loss", "probs detached: no gradient reaches the router", says="probs detached", code="""
aggregated_probs_per_expert = probs.detach().sum(dim=0)
return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
    num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))
"""),
    # ------------------------------------------------------------------ moe.topk_routing
    Mistake("moe.topk_routing", "softmax over all experts, then top-k (not renormalised)", says="not renormalised to sum 1",
            code="""
if score_function == "softmax":
    top_probs, top_indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k=topk, dim=1)
    top_probs = top_probs.type_as(logits)
else:
    scores = torch.sigmoid(logits)
    chooser = scores if expert_bias is None else scores + expert_bias
    top_indices = torch.topk(chooser, k=topk, dim=1).indices
    top_probs = scores.gather(1, top_indices)
    if topk > 1:
        top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
"""),
    Mistake("moe.topk_routing", "sigmoid weights not renormalised", says="sigmoid scores not renormalised", code="""
if score_function == "softmax":
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    top_probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
else:
    scores = torch.sigmoid(logits)
    chooser = scores if expert_bias is None else scores + expert_bias
    top_indices = torch.topk(chooser, k=topk, dim=1).indices
    top_probs = scores.gather(1, top_indices)
probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
"""),
    Mistake("moe.topk_routing", "the expert bias in the weights too", says="expert bias added to the weights", code="""
if score_function == "softmax":
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    top_probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
else:
    scores = torch.sigmoid(logits)
    if expert_bias is not None:
        scores = scores + expert_bias
    top_probs, top_indices = torch.topk(scores, k=topk, dim=1)
    if topk > 1:
        top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
"""),
    # ------------------------------------------------------------------ moe.capacity
    Mistake("moe.capacity", "keeps capacity + 1 tokens (<= instead of <)", says="off by one", code="""
position = routing_map.long().cumsum(dim=0) - 1
keep = routing_map & (position <= capacity)
if pad_to_capacity:
    free = capacity - keep.sum(dim=0)
    filler = ~routing_map & ((~routing_map).long().cumsum(dim=0) - 1 < free)
    keep = keep | filler
probs = probs * keep
routing_map = keep
"""),
    Mistake("moe.capacity", "arrivals counted over the experts (dim 1)", says="wrong dim", code="""
position = routing_map.long().cumsum(dim=1) - 1
keep = routing_map & (position < capacity)
if pad_to_capacity:
    free = capacity - keep.sum(dim=0)
    filler = ~routing_map & ((~routing_map).long().cumsum(dim=0) - 1 < free)
    keep = keep | filler
probs = probs * keep
routing_map = keep
"""),
    Mistake("moe.capacity", "dropped tokens keep their weight", says="dropped tokens keep their weight", code="""
position = routing_map.long().cumsum(dim=0) - 1
keep = routing_map & (position < capacity)
if pad_to_capacity:
    free = capacity - keep.sum(dim=0)
    filler = ~routing_map & ((~routing_map).long().cumsum(dim=0) - 1 < free)
    keep = keep | filler
routing_map = keep
"""),
    # ------------------------------------------------------------------ moe.permute
    Mistake("moe.permute", "routing_map not transposed: token-major rows", says="token-major order", code="""
mask = routing_map
sorted_indices = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1).expand_as(mask).masked_select(mask)
permuted_probs = probs.masked_select(mask) if probs is not None else None
return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices
"""),
    Mistake("moe.permute", "probs selected without the transpose", says="probs selected token-major", code="""
mask = routing_map.t()
sorted_indices = torch.arange(tokens.shape[0], device=tokens.device).expand_as(mask).masked_select(mask)
permuted_probs = probs.masked_select(routing_map) if probs is not None else None
return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices
"""),
    Mistake("moe.permute", "sorted_indices hold expert ids", says="the expert of each row", code="""
mask = routing_map.t()
sorted_indices = torch.arange(mask.shape[0], device=tokens.device).unsqueeze(1).expand_as(mask).masked_select(mask)
permuted_probs = probs.t().masked_select(mask) if probs is not None else None
return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices
"""),
    # ------------------------------------------------------------------ moe.alltoall_dispatch
    Mistake("moe.alltoall_dispatch", "output and input splits swapped", says="splits swapped", code="""
if ep > 1:
    counts = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]
    dist.all_gather(counts, num_local_tokens_per_expert, group=self.ep_group)
    counts = torch.stack(counts)
else:
    counts = num_local_tokens_per_expert.unsqueeze(0)
per_local = counts[:, self.local_expert_indices]
self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()
self.output_splits = per_local.sum(dim=1).tolist()
self.num_global_tokens_per_local_expert = per_local
if ep > 1:
    permuted = all_to_all(self.ep_group, permuted, self.input_splits, self.output_splits)
if L > 1:
    permuted = sort_chunks_by_idxs(permuted, per_local.reshape(-1),
                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())
"""),
    Mistake("moe.alltoall_dispatch", "received chunks not sorted by local expert", says="forgot to sort", code="""
if ep > 1:
    counts = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]
    dist.all_gather(counts, num_local_tokens_per_expert, group=self.ep_group)
    counts = torch.stack(counts)
else:
    counts = num_local_tokens_per_expert.unsqueeze(0)
per_local = counts[:, self.local_expert_indices]
self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()
self.output_splits = per_local.sum(dim=1).tolist()
self.num_global_tokens_per_local_expert = per_local
if ep > 1:
    permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
"""),
    Mistake("moe.alltoall_dispatch", "counts not all-gathered: assumes every rank routes like this one",
            says="never all_gathered", code="""
counts = num_local_tokens_per_expert.unsqueeze(0).expand(ep, -1)
per_local = counts[:, self.local_expert_indices]
self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()
self.output_splits = per_local.sum(dim=1).tolist()
self.num_global_tokens_per_local_expert = per_local
if ep > 1:
    permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
if L > 1:
    permuted = sort_chunks_by_idxs(permuted, per_local.reshape(-1),
                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())
"""),
    # ------------------------------------------------------------------ hybrid.train_step
    Mistake("hybrid.train_step", "dp grads summed with a plain all_reduce", says="summed, not averaged", code="""
model, stages = build_model(config, state, seed)
local = slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)
mine = get_batch_on_this_cp_rank({"ids": ids[local], "labels": labels[local]}, cp, cp_rank)
inputs, targets = mine["ids"].chunk(num_microbatches), mine["labels"].chunk(num_microbatches)
local = nn.ModuleList(stages)
ddp, opt = None, optimizer_cls(local.parameters(), lr=lr)
loss_func = lambda logits, y: _local_loss(logits, y, tp_group)
losses = []
with MoEAuxLossAutoScaler.loss_scale(1 / num_microbatches):
    for x, y in zip(inputs, targets):
        loss = loss_func(stages[0](x), y)
        (loss / num_microbatches).backward()
        losses.append(loss.item())
for param in local.parameters():
    if param.grad is not None:
        dist.all_reduce(param.grad, group=dp_group)
opt.step()
"""),
    Mistake("hybrid.train_step", "loss not divided by num_microbatches", says="not divided by num_microbatches",
            code="""
model, stages = build_model(config, state, seed)
local = slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)
mine = get_batch_on_this_cp_rank({"ids": ids[local], "labels": labels[local]}, cp, cp_rank)  # zigzag chunks
inputs, targets = mine["ids"].chunk(num_microbatches), mine["labels"].chunk(num_microbatches)
local = nn.ModuleList(stages)  # this rank's parameters
if moe:  # experts reduce over expert-DP, the rest over DP (finalize_model_grads): no DP wrapper
    ddp, opt = None, optimizer_cls(local.parameters(), lr=lr)
else:
    ddp = DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage,
                                  overlap_grad_reduce=False)  # reduce once, after the last micro-batch
    opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr) if zero_stage else optimizer_cls(ddp.parameters(), lr=lr)
loss_func = lambda logits, y: _local_loss(logits, y, tp_group)
with MoEAuxLossAutoScaler.loss_scale(1 / num_microbatches):  # MoE aux losses: their share of the mean
    if pp > 1:
        s, b, h = config.seq_length // cp, inputs[0].shape[0], config.hidden_size
        shape = (s // state.get_tensor_model_parallel_world_size() if config.sequence_parallel else s, b, h)
        result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,
                                             group=state.get_pipeline_model_parallel_group())
        losses = result.losses
    else:
        losses = []
        for x, y in zip(inputs, targets):
            loss = loss_func(stages[0](x), y)
            loss.backward()
            losses.append(loss.item())
finalize_model_grads([ddp] if ddp is not None else stages, state)  # dp(-cp) / edp, SP norms over tp, tied embeddings
opt.step()
"""),
    Mistake("hybrid.train_step", "forgot finalize_model_grads", says="finalize_model_grads not called", code="""
model, stages = build_model(config, state, seed)
local = slice(dp_rank * batch_size // dp, (dp_rank + 1) * batch_size // dp)
mine = get_batch_on_this_cp_rank({"ids": ids[local], "labels": labels[local]}, cp, cp_rank)  # zigzag chunks
inputs, targets = mine["ids"].chunk(num_microbatches), mine["labels"].chunk(num_microbatches)
local = nn.ModuleList(stages)  # this rank's parameters
if moe:  # experts reduce over expert-DP, the rest over DP (finalize_model_grads): no DP wrapper
    ddp, opt = None, optimizer_cls(local.parameters(), lr=lr)
else:
    ddp = DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage,
                                  overlap_grad_reduce=False)  # reduce once, after the last micro-batch
    opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr) if zero_stage else optimizer_cls(ddp.parameters(), lr=lr)
loss_func = lambda logits, y: _local_loss(logits, y, tp_group)
with MoEAuxLossAutoScaler.loss_scale(1 / num_microbatches):  # MoE aux losses: their share of the mean
    if pp > 1:
        s, b, h = config.seq_length // cp, inputs[0].shape[0], config.hidden_size
        shape = (s // state.get_tensor_model_parallel_world_size() if config.sequence_parallel else s, b, h)
        result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,
                                             group=state.get_pipeline_model_parallel_group())
        losses = result.losses
    else:
        losses = []
        for x, y in zip(inputs, targets):
            loss = loss_func(stages[0](x), y)
            (loss / num_microbatches).backward()
            losses.append(loss.item())
opt.step()
"""),
]
