"""Typical wrong answers to the exercises of chapters 01 (foundations) and 02 (core architecture).

Each Mistake is a whole wrong region body; `python -m megalab.lab.mutants --file tests/mistakes/ch01_ch02.py`
swaps it in and checks that the exercise's first failing test names it (its verdict contains `says`).
"""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ dist.shard_bounds
    Mistake("dist.shard_bounds", "gave the extra items to the last ranks instead of the first", says="last ranks",
            code="""
base, extra = divmod(length, world_size)
first_big = world_size - extra
start = rank * base + max(0, rank - first_big)
stop = start + base + (1 if rank >= first_big else 0)
return start, stop
"""),
    Mistake("dist.shard_bounds", "put the whole remainder on the last rank", says="remainder on the last rank",
            code="""
base = length // world_size
start = rank * base
stop = length if rank == world_size - 1 else start + base
return start, stop
"""),
    Mistake("dist.shard_bounds", "ceil-sized shards, as torch.chunk cuts them", says="ceil",
            code="""
size = -(-length // world_size)
start = min(rank * size, length)
stop = min(start + size, length)
return start, stop
"""),
    # ------------------------------------------------------------------ comm.broadcast
    Mistake("comm.broadcast", "counted tree positions from rank 0, not from src", says="from rank 0",
            code="""
me = rank
step = 1
while step < world:
    if me < step and me + step < world:
        dist.send(tensor, group_dst=me + step, group=group)
    elif step <= me < 2 * step:
        dist.recv(tensor, group_src=me - step, group=group)
    step *= 2
"""),
    Mistake("comm.broadcast", "always received from src (the sender is the position `step` below)",
            says="wrong peer", code="""
me = (rank - src) % world
step = 1
while step < world:
    if me < step and me + step < world:
        dist.send(tensor, group_dst=(src + me + step) % world, group=group)
    elif step <= me < 2 * step:
        dist.recv(tensor, group_src=src, group=group)
    step *= 2
"""),
    Mistake("comm.broadcast", "off-by-one receive condition: a send without its matching recv",
            says="never received", code="""
me = (rank - src) % world
step = 1
while step < world:
    if me < step and me + step < world:
        dist.send(tensor, group_dst=(src + me + step) % world, group=group)
    elif step < me < 2 * step:
        dist.recv(tensor, group_src=(src + me - step) % world, group=group)
    step *= 2
"""),
    Mistake("comm.broadcast", "src sends to every rank in turn (n-1 sends), not a binomial tree", says="not a tree",
            code="""
if rank == src:
    for peer in range(world):
        if peer != src:
            dist.send(tensor, group_dst=peer, group=group)
else:
    dist.recv(tensor, group_src=src, group=group)
"""),
    Mistake("comm.broadcast", "dst=/src= (global ranks) given group ranks", says="group ranks and global ranks mixed up",
            code="""
me = (rank - src) % world
step = 1
while step < world:
    if me < step and me + step < world:
        dist.send(tensor, dst=(src + me + step) % world, group=group)
    elif step <= me < 2 * step:
        dist.recv(tensor, src=(src + me - step) % world, group=group)
    step *= 2
"""),
    # ------------------------------------------------------------------ comm.all_gather
    Mistake("comm.all_gather", "received into a copy and forgot to copy it into output", says="never reach",
            code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
for step in range(world - 1):
    outgoing = output[chunks[(rank - step) % world]]
    incoming = output[chunks[(rank - step - 1) % world]].clone()
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
"""),
    Mistake("comm.all_gather", "always sent its own shard instead of the chunk received in the step before",
            says="own shard", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
for step in range(world - 1):
    outgoing = output[chunks[rank]]
    incoming = output[chunks[(rank - step - 1) % world]]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
"""),
    Mistake("comm.all_gather", "reversed the ring (sent to rank - 1, received from rank + 1) with the same chunks",
            says="the ring turns the other way", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
for step in range(world - 1):
    outgoing = output[chunks[(rank - step) % world]]
    incoming = output[chunks[(rank - step - 1) % world]]
    send_recv(outgoing, prev_rank, incoming, next_rank, group)
"""),
    Mistake("comm.all_gather", "the global rank (dist.get_rank()) where the group rank is needed",
            says="group ranks and global ranks mixed up", code="""
me = dist.get_rank()
next_rank, prev_rank = (me + 1) % world, (me - 1) % world
for step in range(world - 1):
    outgoing = output[chunks[(me - step) % world]]
    incoming = output[chunks[(me - step - 1) % world]]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
"""),
    # ------------------------------------------------------------------ comm.reduce_scatter
    Mistake("comm.reduce_scatter", "received straight into the partial sum (overwrote it instead of adding)",
            says="overwrote", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
for step in range(world - 1):
    outgoing = partial[chunks[(rank - step - 1) % world]]
    target = partial[chunks[(rank - step - 2) % world]]
    send_recv(outgoing, next_rank, target, prev_rank, group)
"""),
    Mistake("comm.reduce_scatter", "copied all_gather's chunk indices (send chunk r - s, receive r - s - 1)",
            says="all_gather's chunk indices", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(partial[: chunks[0].stop])
for step in range(world - 1):
    outgoing = partial[chunks[(rank - step) % world]]
    target = partial[chunks[(rank - step - 1) % world]]
    incoming = received[: target.numel()]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
    target += incoming
"""),
    Mistake("comm.reduce_scatter", "sent and received one after the other (send, then recv) instead of send_recv",
            says="send_recv", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(partial[: chunks[0].stop])
for step in range(world - 1):
    outgoing = partial[chunks[(rank - step - 1) % world]]
    target = partial[chunks[(rank - step - 2) % world]]
    incoming = received[: target.numel()]
    dist.send(outgoing, group_dst=next_rank, group=group)
    dist.recv(incoming, group_src=prev_rank, group=group)
    target += incoming
"""),
    # ------------------------------------------------------------------ comm.ring_all_reduce
    Mistake("comm.ring_all_reduce", "added in the all-gather phase too (the finished chunks counted again)",
            says="adds the finished chunks", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(flat[: chunks[0].stop])
for step in range(2 * (world - 1)):
    outgoing = flat[chunks[(rank - step - 1) % world]]
    target = flat[chunks[(rank - step - 2) % world]]
    incoming = received[: target.numel()]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
    target += incoming
"""),
    Mistake("comm.ring_all_reduce", "stopped after the reduce-scatter (n-1 steps, no all-gather phase)",
            says="all-gather phase is missing", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(flat[: chunks[0].stop])
for step in range(world - 1):
    outgoing = flat[chunks[(rank - step - 1) % world]]
    target = flat[chunks[(rank - step - 2) % world]]
    incoming = received[: target.numel()]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
    target += incoming
"""),
    Mistake("comm.ring_all_reduce", "received into the chunk it sends (same chunk index in and out)",
            says="wrong chunk", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(flat[: chunks[0].stop])
for step in range(2 * (world - 1)):
    outgoing = flat[chunks[(rank - step - 1) % world]]
    target = flat[chunks[(rank - step - 1) % world]]
    incoming = received[: target.numel()]
    send_recv(outgoing, next_rank, incoming, prev_rank, group)
    if step < world - 1:
        target += incoming
    else:
        target.copy_(incoming)
"""),
    # ------------------------------------------------------------------ comm.all_reduce_time
    Mistake("comm.all_reduce_time", "ring: each step sends the whole message, not nbytes / n", says="nbytes / n",
            code="""
if algorithm == "naive":
    return 2 * (n - 1) * (alpha + nbytes * beta)
if algorithm == "tree":
    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)
return 2 * (n - 1) * (alpha + nbytes * beta)
"""),
    Mistake("comm.all_reduce_time", "tree: log2(n) without rounding up", says="ceil", code="""
if algorithm == "naive":
    return 2 * (n - 1) * (alpha + nbytes * beta)
if algorithm == "tree":
    return 2 * math.log2(n) * (alpha + nbytes * beta)
return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
"""),
    Mistake("comm.all_reduce_time", "counted one phase only (forgot the factor 2)", says="one phase", code="""
if algorithm == "naive":
    return (n - 1) * (alpha + nbytes * beta)
if algorithm == "tree":
    return math.ceil(math.log2(n)) * (alpha + nbytes * beta)
return (n - 1) * alpha + (n - 1) / n * nbytes * beta
"""),
    # ------------------------------------------------------------------ comm.busbw
    Mistake("comm.busbw", "used (n-1)/n for all-reduce too (forgot its factor 2)", says="2(n-1)/n", code="""
factor = {
    "all_reduce": (n - 1) / n,
    "all_gather": (n - 1) / n,
    "reduce_scatter": (n - 1) / n,
    "broadcast": 1.0,
    "reduce": 1.0,
}[collective]
return algbw(nbytes, seconds) * factor
"""),
    Mistake("comm.busbw", "divided algbw by the factor instead of multiplying", says="divided", code="""
factor = {
    "all_reduce": 2 * (n - 1) / n,
    "all_gather": (n - 1) / n,
    "reduce_scatter": (n - 1) / n,
    "broadcast": 1.0,
    "reduce": 1.0,
}[collective]
return algbw(nbytes, seconds) / factor
"""),
    Mistake("comm.ring_all_reduce", "the ring turned the other way (send to rank - 1, receive from rank + 1)",
            says="the ring turns the other way", code="""
next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
received = torch.empty_like(flat[: chunks[0].stop])
for step in range(2 * (world - 1)):
    outgoing = flat[chunks[(rank - step - 1) % world]]
    target = flat[chunks[(rank - step - 2) % world]]
    incoming = received[: target.numel()]
    send_recv(outgoing, prev_rank, incoming, next_rank, group)
    if step < world - 1:
        target += incoming
    else:
        target.copy_(incoming)
"""),
    # ------------------------------------------------------------------ comm.fit_alpha_beta
    Mistake("comm.fit_alpha_beta", "fitted absolute errors (forgot to divide each row by its time)",
            says="relative", code="""
design = torch.stack([torch.full_like(size, latency_steps), bytes_factor * size], dim=1)
solution = torch.linalg.lstsq(design, t[:, None]).solution
alpha, beta = solution.flatten().tolist()
return alpha, beta
"""),
    Mistake("comm.fit_alpha_beta", "ignored latency_steps and bytes_factor (fitted one message)",
            says="latency_steps", code="""
design = torch.stack([torch.ones_like(size), size], dim=1) / t[:, None]
solution = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution
alpha, beta = solution.flatten().tolist()
return alpha, beta
"""),
    Mistake("comm.fit_alpha_beta", "returned (beta, alpha)", says="swapped", code="""
design = torch.stack([torch.full_like(size, latency_steps), bytes_factor * size], dim=1) / t[:, None]
solution = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution
alpha, beta = solution.flatten().tolist()
return beta, alpha
"""),
    # ------------------------------------------------------------------ parallel_state.get_ranks
    Mistake("parallel_state.get_ranks", "groups of consecutive ranks (right only for the fastest dimensions)",
            says="consecutive ranks", code="""
masked_shape = [s for s, m in zip(parallel_size, mask) if m]
group_size = _prefix_product(masked_shape)[-1]
return [list(range(g * group_size, (g + 1) * group_size)) for g in range(world_size // group_size)]
"""),
    Mistake("parallel_state.get_ranks", "the LAST dimension varies fastest (pp innermost instead of tp)",
            says="last dimension varies fastest", code="""
stride = [_prefix_product(parallel_size[i + 1:])[-1] for i in range(len(parallel_size))]
masked_shape = [s for s, m in zip(parallel_size, mask) if m]
masked_stride = [d for d, m in zip(stride, mask) if m]
unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
unmasked_stride = [d for d, m in zip(stride, mask) if not m]
group_size = _prefix_product(masked_shape)[-1]
groups = []
for group_index in range(world_size // group_size):
    base = sum(c * d for c, d in zip(_decompose(group_index, unmasked_shape), unmasked_stride))
    groups.append(
        [base + sum(c * d for c, d in zip(_decompose(i, masked_shape), masked_stride)) for i in range(group_size)]
    )
return groups
"""),
    Mistake("parallel_state.get_ranks", "masked and unmasked dimensions swapped", says="swapped", code="""
stride = _prefix_product(parallel_size)
masked_shape = [s for s, m in zip(parallel_size, mask) if not m]
masked_stride = [d for d, m in zip(stride, mask) if not m]
unmasked_shape = [s for s, m in zip(parallel_size, mask) if m]
unmasked_stride = [d for d, m in zip(stride, mask) if m]
group_size = _prefix_product(masked_shape)[-1]
groups = []
for group_index in range(world_size // group_size):
    base = sum(c * d for c, d in zip(_decompose(group_index, unmasked_shape), unmasked_stride))
    groups.append(
        [base + sum(c * d for c, d in zip(_decompose(i, masked_shape), masked_stride)) for i in range(group_size)]
    )
return groups
"""),
    # ------------------------------------------------------------------ parallel_state.create_groups
    Mistake("parallel_state.create_groups", "returned the last group created, not the one holding this rank",
            says="last group", code="""
mine = (None, None)
for ranks in all_ranks:
    group = dist.new_group(ranks)
    mine = (group, ranks)
return mine
"""),
    Mistake("parallel_state.create_groups", "called new_group only for the groups this rank is in",
            says="only for its own group", code="""
mine = (None, None)
for ranks in all_ranks:
    if rank in ranks:
        mine = (dist.new_group(ranks), ranks)
return mine
"""),
    Mistake("parallel_state.create_groups", "returned as soon as it found its group (later groups never created)",
            says="stopped early", code="""
for ranks in all_ranks:
    group = dist.new_group(ranks)
    if rank in ranks:
        return group, ranks
return None, None
"""),
    # ------------------------------------------------------------------ model.core_attention
    Mistake("model.core_attention", "forgot the causal mask", says="causal mask", code="""
q = query.reshape(s, b * np_, hn).transpose(0, 1)
k = key.reshape(s, b * np_, hn).transpose(0, 1)
v = value.reshape(s, b * np_, hn).transpose(0, 1)
scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hn))
probs = torch.softmax(scores, dim=-1)
probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
context = torch.bmm(probs, v)
return context.transpose(0, 1).reshape(s, b, np_ * hn)
"""),
    Mistake("model.core_attention", "softmax over the queries (dim 1), not the keys", says="softmax over the wrong dim",
            code="""
q = query.reshape(s, b * np_, hn).transpose(0, 1)
k = key.reshape(s, b * np_, hn).transpose(0, 1)
v = value.reshape(s, b * np_, hn).transpose(0, 1)
scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hn))
future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=1)
probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
context = torch.bmm(probs, v)
return context.transpose(0, 1).reshape(s, b, np_ * hn)
"""),
    Mistake("model.core_attention", "forgot the 1/sqrt(hn) scale", says="1/sqrt(hn)", code="""
q = query.reshape(s, b * np_, hn).transpose(0, 1)
k = key.reshape(s, b * np_, hn).transpose(0, 1)
v = value.reshape(s, b * np_, hn).transpose(0, 1)
scores = torch.bmm(q, k.transpose(1, 2))
future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
context = torch.bmm(probs, v)
return context.transpose(0, 1).reshape(s, b, np_ * hn)
"""),
    Mistake("model.core_attention", "masked the diagonal too (triu(0): a token cannot see itself)", says="diagonal",
            code="""
q = query.reshape(s, b * np_, hn).transpose(0, 1)
k = key.reshape(s, b * np_, hn).transpose(0, 1)
v = value.reshape(s, b * np_, hn).transpose(0, 1)
scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hn))
future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(0)
probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
context = torch.bmm(probs, v)
return context.transpose(0, 1).reshape(s, b, np_ * hn)
"""),
    # ------------------------------------------------------------------ model.mlp
    Mistake("model.mlp", "gated: swapped the halves (act(up) * gate)", says="halves swapped", code="""
intermediate = self.linear_fc1(hidden_states)
if self.gated:
    up, gate = torch.chunk(intermediate, 2, dim=-1)
    intermediate = self.activation_func(gate) * up
else:
    intermediate = self.activation_func(intermediate)
return self.linear_fc2(intermediate)
"""),
    Mistake("model.mlp", "applied the activation after linear_fc2 instead of between the linears",
            says="after linear_fc2", code="""
intermediate = self.linear_fc1(hidden_states)
if self.gated:
    gate, up = torch.chunk(intermediate, 2, dim=-1)
    return self.activation_func(self.linear_fc2(gate * up))
return self.activation_func(self.linear_fc2(intermediate))
"""),
    Mistake("model.mlp", "gated: the activation on both halves", says="both halves", code="""
intermediate = self.activation_func(self.linear_fc1(hidden_states))
if self.gated:
    gate, up = torch.chunk(intermediate, 2, dim=-1)
    intermediate = gate * up
return self.linear_fc2(intermediate)
"""),
    # ------------------------------------------------------------------ model.norm
    Mistake("model.norm", "forgot eps", says="eps", code="""
x32 = x.float()
normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True))
return normed.type_as(x) * self.weight
"""),
    Mistake("model.norm", "mean of the squares over the wrong dim (the first, not the hidden one)",
            says="wrong dim", code="""
x32 = x.float()
normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=0, keepdim=True) + self.eps)
return normed.type_as(x) * self.weight
"""),
    Mistake("model.norm", "statistics in the input's dtype (no upcast: fp16 x^2 overflows)",
            says="statistics in the input's dtype", code="""
normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
return normed * self.weight
"""),
    Mistake("model.norm", "eps outside the square root", says="eps outside the square root", code="""
x32 = x.float()
normed = x32 / (x32.pow(2).mean(dim=-1, keepdim=True).sqrt() + self.eps)
return normed.type_as(x) * self.weight
"""),
    Mistake("model.norm", "subtracted the mean (that is LayerNorm, not RMSNorm)", says="subtracted the mean", code="""
x32 = x.float()
x32 = x32 - x32.mean(dim=-1, keepdim=True)
normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
return normed.type_as(x) * self.weight
"""),
    # ------------------------------------------------------------------ model.layer_forward
    Mistake("model.layer_forward", "added the normalised input as the residual", says="normalised", code="""
residual = self.input_layernorm(hidden_states)
attention_output = self.self_attention(residual, rotary_pos_emb, packed_seq_params)
hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
residual = self.pre_mlp_layernorm(hidden_states)
mlp_output = self.mlp(residual)
return residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
"""),
    Mistake("model.layer_forward", "the MLP's residual is the layer's input, not the attention block's output",
            says="layer's input", code="""
residual = hidden_states
attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params)
hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
return residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
"""),
    Mistake("model.layer_forward", "added the residual twice", says="twice", code="""
residual = hidden_states
attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params)
hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
residual = hidden_states
mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
return hidden_states + residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
"""),
    Mistake("model.layer_forward", "normalised the MLP's input with input_layernorm (pre_mlp_layernorm unused)",
            says="pre_mlp_layernorm", code="""
residual = hidden_states
attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params)
hidden_states = residual + F.dropout(attention_output, self.hidden_dropout, self.training)
residual = hidden_states
mlp_output = self.mlp(self.input_layernorm(hidden_states))
return residual + F.dropout(mlp_output, self.hidden_dropout, self.training)
"""),
    # ------------------------------------------------------------------ model.gpt_forward
    Mistake("model.gpt_forward", "returned the logits as [s, b, V] (forgot the transpose)", says="transpose",
            code="""
hidden_states = self.embedding(input_ids, position_ids) if self.pre_process else input_ids
rotary_pos_emb = None
if self.rotary_pos_emb is not None:
    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)
hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
if not self.post_process:
    return hidden_states
logits = self.output(hidden_states)
if labels is None:
    return logits
return self.compute_language_model_loss(labels, logits.transpose(0, 1))
"""),
    Mistake("model.gpt_forward", "never passed the rotary angles to the decoder", says="rotary", code="""
hidden_states = self.embedding(input_ids, position_ids) if self.pre_process else input_ids
hidden_states = self.decoder(hidden_states, None, packed_seq_params)
if not self.post_process:
    return hidden_states
logits = self.output(hidden_states).transpose(0, 1).contiguous()
if labels is None:
    return logits
return self.compute_language_model_loss(labels, logits)
"""),
    Mistake("model.gpt_forward", "returned the logits even when labels were given (no loss)", says="labels",
            code="""
hidden_states = self.embedding(input_ids, position_ids) if self.pre_process else input_ids
rotary_pos_emb = None
if self.rotary_pos_emb is not None:
    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)
hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
if not self.post_process:
    return hidden_states
return self.output(hidden_states).transpose(0, 1).contiguous()
"""),
    Mistake("model.gpt_forward", "always multiplied by the word embeddings, even in an untied model",
            says="untied", code="""
hidden_states = self.embedding(input_ids, position_ids) if self.pre_process else input_ids
rotary_pos_emb = None
if self.rotary_pos_emb is not None:
    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)
hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
if not self.post_process:
    return hidden_states
logits = F.linear(hidden_states, self.shared_embedding_or_output_weight()).transpose(0, 1).contiguous()
if labels is None:
    return logits
return self.compute_language_model_loss(labels, logits)
"""),
    # ------------------------------------------------------------------ model.recompute
    Mistake("model.recompute", "replayed without restoring the forward's RNG state (a new dropout mask)",
            says="RNG state", code="""
args = list(ctx.non_tensor_args)
for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
    args[i] = saved.detach().requires_grad_(saved.requires_grad)
with torch.enable_grad():
    outputs = ctx.run_function(*args)
outputs = outputs if isinstance(outputs, tuple) else (outputs,)
pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
grads = [args[i].grad if i in ctx.tensor_indices else None for i in range(len(args))]
return (None, *grads)
"""),
    Mistake("model.recompute", "restored the RNG state without fork_rng (the draws after backward repeat)",
            says="fork_rng", code="""
args = list(ctx.non_tensor_args)
for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
    args[i] = saved.detach().requires_grad_(saved.requires_grad)
torch.set_rng_state(ctx.cpu_rng_state)
for device, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):
    torch.cuda.set_rng_state(state, device)
with torch.enable_grad():
    outputs = ctx.run_function(*args)
outputs = outputs if isinstance(outputs, tuple) else (outputs,)
pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
grads = [args[i].grad if i in ctx.tensor_indices else None for i in range(len(args))]
return (None, *grads)
"""),
    Mistake("model.recompute", "replayed the region without torch.enable_grad (backward runs with grad off)",
            says="enable_grad", code="""
args = list(ctx.non_tensor_args)
for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
    args[i] = saved.detach().requires_grad_(saved.requires_grad)
with torch.random.fork_rng(devices=ctx.cuda_devices):
    torch.set_rng_state(ctx.cpu_rng_state)
    for device, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):
        torch.cuda.set_rng_state(state, device)
    outputs = ctx.run_function(*args)
outputs = outputs if isinstance(outputs, tuple) else (outputs,)
pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
if pairs:
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
grads = [args[i].grad if i in ctx.tensor_indices else None for i in range(len(args))]
return (None, *grads)
"""),
]
