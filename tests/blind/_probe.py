SOLUTIONS = [
 {
  "exercise": "dist.shard_bounds",
  "name": "first try (A)",
  "code": "base, extra = divmod(length, world_size)\nstart = rank * base + min(rank, extra)\nstop = start + base + (1 if rank < extra else 0)\nreturn start, stop\n"
 },
 {
  "exercise": "comm.broadcast",
  "name": "first try (A)",
  "code": "me = (rank - src) % world\nstep = 1\nwhile step < world:\n    if me < step:\n        if me + step < world:\n            dist.send(tensor, group=group, group_dst=(me + step + src) % world)\n    elif me < 2 * step:\n        dist.recv(tensor, group=group, group_src=(me - step + src) % world)\n    step *= 2\n"
 },
 {
  "exercise": "comm.all_gather",
  "name": "first try (A)",
  "code": "for s in range(world - 1):\n    send_chunk = output[chunks[(rank - s) % world]]\n    recv_chunk = output[chunks[(rank - s - 1) % world]]\n    send_recv(send_chunk, (rank + 1) % world, recv_chunk, (rank - 1) % world, group=group)\n"
 },
 {
  "exercise": "comm.reduce_scatter",
  "name": "first try (A)",
  "code": "for s in range(world - 1):\n    send_chunk = partial[chunks[(rank - s - 1) % world]]\n    recv_target = partial[chunks[(rank - s - 2) % world]]\n    scratch = torch.empty_like(recv_target)\n    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n    recv_target.add_(scratch)\n"
 },
 {
  "exercise": "comm.ring_all_reduce",
  "name": "first try (A)",
  "code": "for s in range(2 * (world - 1)):\n    send_chunk = flat[chunks[(rank - s - 1) % world]]\n    recv_target = flat[chunks[(rank - s - 2) % world]]\n    scratch = torch.empty_like(recv_target)\n    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n    if s < world - 1:\n        recv_target.add_(scratch)\n    else:\n        recv_target.copy_(scratch)\n"
 },
 {
  "exercise": "comm.all_reduce_time",
  "name": "first try (A)",
  "code": "if algorithm == \"naive\":\n    return 2 * (n - 1) * (alpha + nbytes * beta)\nif algorithm == \"tree\":\n    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)\nreturn 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta\n"
 },
 {
  "exercise": "comm.busbw",
  "name": "first try (A)",
  "code": "if collective == \"all_reduce\":\n    factor = 2 * (n - 1) / n\nelif collective in (\"all_gather\", \"reduce_scatter\"):\n    factor = (n - 1) / n\nelse:\n    factor = 1.0\nreturn algbw(nbytes, seconds) * factor\n"
 },
 {
  "exercise": "comm.fit_alpha_beta",
  "name": "first try (A)",
  "code": "A = torch.stack([torch.full_like(size, float(latency_steps)), bytes_factor * size], dim=1)\nA = A / t[:, None]\nb = torch.ones_like(t)\nsolution = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]\nreturn float(solution[0]), float(solution[1])\n"
 },
 {
  "exercise": "parallel_state.get_ranks",
  "name": "first try (A)",
  "code": "strides = _prefix_product(parallel_size)\nmasked_shape = [s for s, m in zip(parallel_size, mask) if m]\nunmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]\nmasked_strides = [st for st, m in zip(strides, mask) if m]\nunmasked_strides = [st for st, m in zip(strides, mask) if not m]\ngroup_size = 1\nfor s in masked_shape:\n    group_size *= s\nnum_groups = world_size // group_size\ngroups = []\nfor g in range(num_groups):\n    base = sum(c * st for c, st in zip(_decompose(g, unmasked_shape), unmasked_strides))\n    groups.append([base + sum(c * st for c, st in zip(_decompose(i, masked_shape), masked_strides))\n                   for i in range(group_size)])\nreturn groups\n"
 },
 {
  "exercise": "parallel_state.create_groups",
  "name": "first try (A)",
  "code": "mine, mine_ranks = None, None\nfor ranks in all_ranks:\n    group = dist.new_group(ranks)\n    if rank in ranks:\n        mine, mine_ranks = group, list(ranks)\nreturn mine, mine_ranks\n"
 },
 {
  "exercise": "model.core_attention",
  "name": "first try (A)",
  "code": "q = query.reshape(s, b * np_, hn).transpose(0, 1)   # [b*np, s, hn]\nk = key.reshape(s, b * np_, hn).transpose(0, 1)\nv = value.reshape(s, b * np_, hn).transpose(0, 1)\nscores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hn)   # [b*np, s, s]\nmask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)\nscores = scores.masked_fill(mask, float(\"-inf\"))\nprobs = torch.softmax(scores, dim=-1)\nprobs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)\ncontext = torch.bmm(probs, v)                              # [b*np, s, hn]\nreturn context.transpose(0, 1).reshape(s, b, np_ * hn)\n"
 },
 {
  "exercise": "model.mlp",
  "name": "first try (A)",
  "code": "y = self.linear_fc1(hidden_states)\nif self.gated:\n    gate, up = torch.chunk(y, 2, dim=-1)\n    y = self.activation_func(gate) * up\nelse:\n    y = self.activation_func(y)\nreturn self.linear_fc2(y)\n"
 },
 {
  "exercise": "model.norm",
  "name": "first try (A)",
  "code": "xf = x.float()\ny = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)\nreturn (y * self.weight.float()).to(x.dtype)\n"
 },
 {
  "exercise": "model.layer_forward",
  "name": "first try (A)",
  "code": "residual = hidden_states\nattn = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb=rotary_pos_emb,\n                           packed_seq_params=packed_seq_params)\nhidden_states = residual + F.dropout(attn, p=self.hidden_dropout, training=self.training)\nresidual = hidden_states\nmlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))\nreturn residual + F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)\n"
 },
 {
  "exercise": "model.gpt_forward",
  "name": "first try (A)",
  "code": "if self.pre_process:\n    hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]\nelse:\n    hidden_states = input_ids  # the previous chunk's [s, b, h]\nrotary_pos_emb = None\nif self.rotary_pos_emb is not None:\n    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)\nhidden_states = self.decoder(hidden_states, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)\nif not self.post_process:\n    return hidden_states\nlogits = self.output(hidden_states).transpose(0, 1).contiguous()  # [b, s, V]\nif labels is None:\n    return logits\nreturn self.compute_language_model_loss(labels, logits)\n"
 },
 {
  "exercise": "model.recompute",
  "name": "first try (A)",
  "code": "saved = ctx.saved_tensors\nargs = list(ctx.non_tensor_args)\nfor i, t in zip(ctx.tensor_indices, saved):\n    d = t.detach()\n    d.requires_grad_(t.requires_grad)\n    args[i] = d\nwith torch.random.fork_rng(devices=ctx.cuda_devices):\n    torch.set_rng_state(ctx.cpu_rng_state)\n    for dev, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):\n        torch.cuda.set_rng_state(state, dev)\n    with torch.enable_grad():\n        outputs = ctx.run_function(*args)\nif torch.is_tensor(outputs):\n    outputs = (outputs,)\npairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]\ntorch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])\nreturn (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in args)\n"
 },
 {
  "exercise": "data_parallel.grad_hook",
  "name": "first try (A)",
  "code": "grad_data = self._bucket_grad_data(bucket)\nstart, end = bucket.ranges[param]\ngrad_data[start:end].add_(param.grad.reshape(-1))\nparam.grad = None\nbucket.pending.discard(param)\nif not bucket.pending:\n    bucket.pending = set(bucket.params)  # ready for the next backward\n    if self.zero_stage == 3:\n        self._free_params(bucket)\n    if self._sync and self.overlap_grad_reduce:\n        self.start_grad_sync(bucket)\n"
 },
 {
  "exercise": "data_parallel.finish_grad_sync",
  "name": "first try (A)",
  "code": "for bucket in self.buckets:\n    if bucket.handle is None:\n        self.start_grad_sync(bucket)\n        bucket.pending = set(bucket.params)\nfor bucket in self.buckets:\n    bucket.handle.wait()\n    if not bucket.done_seen:\n        self.timeline.append((time.perf_counter(), \"done\", bucket.index))\n    bucket.handle, bucket.done_seen = None, False\n    if self.zero_stage >= 2:\n        bucket.grad_data = None\n    elif self.zero_stage == 0:\n        for p, (start, end) in bucket.ranges.items():\n            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)\n"
 },
 {
  "exercise": "data_parallel.build_buckets",
  "name": "first try (A)",
  "code": "buckets, ids, count, start = [], [], 0, 0\nfor i in reversed(range(len(numels))):\n    ids.append(i)\n    count += numels[i]\n    if count >= bucket_size:\n        end = start + _round_up(count, pad_to)\n        buckets.append((ids, start, end))\n        start, ids, count = end, [], 0\nif ids:\n    buckets.append((ids, start, start + _round_up(count, pad_to)))\nreturn buckets\n"
 },
 {
  "exercise": "data_parallel.reduce_scatter",
  "name": "first try (A)",
  "code": "output = grad_data[bucket.shard] if self.zero_stage == 1 else bucket.grad_shard\nbucket.handle = reduce_scatter(output, grad_data, self.group, async_op=True)\n"
 },
 {
  "exercise": "data_parallel.zero3_gather",
  "name": "first try (A)",
  "code": "bucket.param_data.untyped_storage().resize_(bucket.numel * bucket.param_data.element_size())\nall_gather(bucket.param_data, bucket.param_shard, self.group)\n"
 },
 {
  "exercise": "data_parallel.zero_step",
  "name": "first try (A)",
  "code": "self.optimizer.step()\nif self.ddp.zero_stage < 3:\n    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)\n               for b, shard in zip(self.ddp.buckets, self.shards)]\n    for handle in handles:\n        handle.wait()\n"
 },
 {
  "exercise": "tp.vocab_cross_entropy",
  "name": "first try (A)",
  "code": "ctx.label_smoothing, ctx.group = label_smoothing, group\nlogits = vocab_parallel_logits\nlocal_v = logits.shape[-1]\nvocab_size = local_v * dist.get_world_size(group)\nstart = dist.get_rank(group) * local_v\nend = start + local_v\n# m: the global max of every row\nlogits_max = logits.max(dim=-1).values\ndist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\nshifted = logits - logits_max.unsqueeze(-1)\n# z_y - m: only the rank owning the label has it\noutside = (target < start) | (target >= end)\nlocal_target = (target - start).masked_fill(outside, 0)\npredicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)\ndist.all_reduce(predicted, group=group)\n# S (and, for label smoothing, the sum of the logits) in one all-reduce\nexp = shifted.exp()\nif label_smoothing > 0:\n    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n    dist.all_reduce(sums, group=group)\n    sum_exp, sum_z = sums[0], sums[1]\nelse:\n    sum_exp = exp.sum(dim=-1)\n    dist.all_reduce(sum_exp, group=group)\nlog_s = sum_exp.log()\nloss = log_s - predicted\nif label_smoothing > 0:\n    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\nsoftmax = exp / sum_exp.unsqueeze(-1)\nctx.save_for_backward(softmax, outside, local_target)\nreturn loss\n"
 },
 {
  "exercise": "tp.vocab_cross_entropy",
  "name": "final (A)",
  "code": "ctx.label_smoothing, ctx.group = label_smoothing, group\nlogits = vocab_parallel_logits\nlocal_v = logits.shape[-1]\nvocab_size = local_v * dist.get_world_size(group)\nctx.vocab_size = vocab_size  # the backward's reference reads it (the grader's message)\nstart = dist.get_rank(group) * local_v\nend = start + local_v\n# m: the global max of every row\nlogits_max = logits.max(dim=-1).values\ndist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\nshifted = logits - logits_max.unsqueeze(-1)\n# z_y - m: only the rank owning the label has it\noutside = (target < start) | (target >= end)\nlocal_target = (target - start).masked_fill(outside, 0)\npredicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)\ndist.all_reduce(predicted, group=group)\n# S (and, for label smoothing, the sum of the logits) in one all-reduce\nexp = shifted.exp()\nif label_smoothing > 0:\n    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n    dist.all_reduce(sums, group=group)\n    sum_exp, sum_z = sums[0], sums[1]\nelse:\n    sum_exp = exp.sum(dim=-1)\n    dist.all_reduce(sum_exp, group=group)\nlog_s = sum_exp.log()\nloss = log_s - predicted\nif label_smoothing > 0:\n    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\nsoftmax = exp / sum_exp.unsqueeze(-1)\nctx.save_for_backward(softmax, outside, local_target)\nreturn loss\n"
 },
 {
  "exercise": "tp.vocab_cross_entropy_backward",
  "name": "first try (A)",
  "code": "vocab_size = softmax.shape[-1] * dist.get_world_size(ctx.group)\ngrad_input = softmax.clone()\nonehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)\nonehot.masked_fill_(outside.unsqueeze(-1), 0.0)\ngrad_input -= (1 - a) * onehot\nif a > 0:\n    grad_input -= a / vocab_size\ngrad_input *= grad_output.unsqueeze(-1)\n"
 },
 {
  "exercise": "tp.vocab_cross_entropy_backward",
  "name": "final (A)",
  "code": "vocab_size = ctx.vocab_size  # set by forward (the grader's message)\ngrad_input = softmax.clone()\nonehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)\nonehot.masked_fill_(outside.unsqueeze(-1), 0.0)\ngrad_input -= (1 - a) * onehot\nif a > 0:\n    grad_input -= a / vocab_size\ngrad_input *= grad_output.unsqueeze(-1)\n"
 },
 {
  "exercise": "tp.column_forward",
  "name": "first try (A)",
  "code": "output = column_parallel_linear(input_, self.weight, self.bias, self.sequence_parallel, self.tp_group)\nif self.gather_output:\n    output = gather_from_tensor_model_parallel_region(output, self.tp_group)\nreturn output\n"
 },
 {
  "exercise": "tp.row_forward",
  "name": "first try (A)",
  "code": "x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)\npartial = F.linear(x, self.weight)\nif self.sequence_parallel:\n    output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)\nelse:\n    output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)\nif self.bias is not None:\n    output = output + self.bias\nreturn output\n"
 },
 {
  "exercise": "tp.vocab_embedding",
  "name": "first try (A)",
  "code": "outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)\nlocal_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)\noutput = F.embedding(local_ids, self.weight)\noutput = output.masked_fill(outside.unsqueeze(-1), 0.0)\nreturn reduce_from_tensor_model_parallel_region(output, self.tp_group)\n"
 },
 {
  "exercise": "tp.gather_last_dim",
  "name": "first try (A)",
  "code": "input_ = input_.contiguous()\npieces = [torch.empty_like(input_) for _ in range(world)]\ndist.all_gather(pieces, input_, group=group)\nreturn torch.cat(pieces, dim=-1).contiguous()\n"
 },
 {
  "exercise": "tp.copy_to_region",
  "name": "first try (A)",
  "code": "return _reduce(grad_output, ctx.group), None\n"
 },
 {
  "exercise": "tp.reduce_from_region",
  "name": "first try (A)",
  "code": "return _reduce(input_, group)\n"
 },
 {
  "exercise": "tp.sp_gather",
  "name": "first try (A)",
  "code": "input_ = input_.contiguous()\noutput = torch.empty((world * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype, device=input_.device)\ndist.all_gather_single(output, input_, group=group)\nreturn output\n"
 },
 {
  "exercise": "tp.sp_reduce_scatter",
  "name": "first try (A)",
  "code": "input_ = input_.contiguous()\nchunk = divide(input_.shape[0], world, \"sequence length\")\noutput = torch.empty((chunk, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)\ndist.reduce_scatter_single(output, input_, group=group)\nreturn output\n"
 },
 {
  "exercise": "pp.communicate",
  "name": "first try (B)",
  "code": "\ntensor_recv_prev = tensor_recv_next = None\nif recv_prev:\n    tensor_recv_prev = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)\nif recv_next:\n    tensor_recv_next = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)\nreqs = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,\n                        tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,\n                        group=group, prev_rank=prev_rank, next_rank=next_rank)\nfor req in reqs:\n    req.wait()\nreturn tensor_recv_prev, tensor_recv_next\n"
 },
 {
  "exercise": "pp.stage_split",
  "name": "first try (B)",
  "code": "\nper_stage = num_layers // num_stages\nstage = chunk * pp_size + pp_rank\nreturn stage * per_stage, (stage + 1) * per_stage\n"
 },
 {
  "exercise": "pp.num_warmup",
  "name": "first try (B)",
  "code": "\nif pp_size == 1:\n    return 0\ntotal = num_microbatches * num_model_chunks\nif num_model_chunks == 1:\n    warmup = pp_size - pp_rank - 1\nelse:\n    warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size\nreturn min(warmup, total)\n"
 },
 {
  "exercise": "pp.schedule_table",
  "name": "first try (B)",
  "code": "\ntable = []\nfor start in range(0, num_microbatches, group_size):\n    group = range(start, min(start + group_size, num_microbatches))\n    for chunk in range(num_model_chunks):\n        for mb in group:\n            table.append((mb, chunk))\nreturn table\n"
 },
 {
  "exercise": "pp.one_f_one_b",
  "name": "first try (B)",
  "code": "\nnum_warmup = min(num_warmup, len(forwards))\nops = list(forwards[:num_warmup])\nnext_backward = 0\nfor fwd in forwards[num_warmup:]:\n    ops.append(fwd)\n    ops.append(backwards[next_backward])\n    next_backward += 1\nops.extend(backwards[next_backward:])\nreturn ops\n"
 },
 {
  "exercise": "cp.zigzag_split",
  "name": "first try (B)",
  "code": "\nif zigzag:\n    return cp_rank, 2 * cp_size - 1 - cp_rank\nreturn 2 * cp_rank, 2 * cp_rank + 1\n"
 },
 {
  "exercise": "cp.causal_block_mask",
  "name": "first try (B)",
  "code": "\nif kv_chunk < q_chunk:\n    return \"full\"\nif kv_chunk == q_chunk:\n    return \"causal\"\nreturn \"skip\"\n"
 },
 {
  "exercise": "cp.lse_merge",
  "name": "first try (B)",
  "code": "\nout, lse, block_out, block_lse = out.float(), lse.float(), block_out.float(), block_lse.float()\nnew_lse = torch.logaddexp(lse, block_lse)\nsafe = torch.where(torch.isinf(new_lse) & (new_lse < 0), torch.zeros_like(new_lse), new_lse)\nshare = torch.exp(lse - safe).unsqueeze(-1)              # exp(-inf) = 0: nothing seen yet\nblock_share = torch.exp(block_lse - safe).unsqueeze(-1)\nreturn out * share + block_out * block_share, new_lse\n"
 },
 {
  "exercise": "cp.lse_merge",
  "name": "final (B)",
  "code": "\nnew_lse = torch.logaddexp(lse, block_lse)\nsafe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)  # nothing seen on either side\nshare = torch.exp(lse - safe).unsqueeze(-1)              # exp(-inf) = 0: nothing seen yet\nblock_share = torch.exp(block_lse - safe).unsqueeze(-1)\nreturn out * share + block_out * block_share, new_lse\n"
 },
 {
  "exercise": "cp.ring_step",
  "name": "first try (B)",
  "code": "\nn = len(ranks)\nbuffer = torch.empty_like(tensor)\nops = [dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me + 1) % n], group),\n       dist.P2POp(dist.irecv, buffer, ranks[(me - 1) % n], group)]\nrequests = dist.batch_isend_irecv(ops)\nreturn buffer, requests\n"
 },
 {
  "exercise": "cp.backward_ring",
  "name": "first try (B)",
  "code": "\nfor step in range(cp):\n    owner = (rank - step) % cp  # whose K/V (and dK/dV) is visiting\n    if step == 0:\n        dkv = torch.zeros_like(kv)\n    else:  # the visiting block's dK/dV arrive with it\n        dkv, dkv_requests = ring_step(dkv, group)\n        _wait(dkv_requests)\n    if step + 1 < cp:\n        next_block, requests = ring_step(block, group)\n    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):\n        dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols],\n                                                    out[:, :, rows], lse[:, :, rows], dout[:, :, rows],\n                                                    _mask(kind, c, q.device))\n        dq[:, :, rows] += dq_b\n        dkv[0][:, :, cols] += dk_b\n        dkv[1][:, :, cols] += dv_b\n    if step + 1 < cp:\n        _wait(requests)\n        block = next_block\nif cp > 1:  # one last hop: every dkv goes home to its owner\n    dkv, dkv_requests = ring_step(dkv, group)\n    _wait(dkv_requests)\n"
 },
 {
  "exercise": "moe.load_balancing_loss",
  "name": "first try (B)",
  "code": "\nf = tokens_per_expert.to(probs.dtype) / (total_num_tokens * topk)   # fraction of the T*k assignments\nP = probs.sum(dim=0) / total_num_tokens                              # mean router probability\nreturn moe_aux_loss_coeff * num_experts * torch.sum(f * P)\n"
 },
 {
  "exercise": "moe.topk_routing",
  "name": "first try (B)",
  "code": "\nif score_function == \"softmax\":\n    top_values, top_indices = torch.topk(logits, k=topk, dim=1)\n    top_weights = torch.softmax(top_values, dim=-1)\nelif score_function == \"sigmoid\":\n    scores = torch.sigmoid(logits)\n    choose = scores + expert_bias if expert_bias is not None else scores\n    _, top_indices = torch.topk(choose, k=topk, dim=1)\n    top_weights = torch.gather(scores, 1, top_indices)\n    if topk > 1:\n        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)\nelse:\n    raise ValueError(f\"unknown score_function {score_function!r}; use 'softmax' or 'sigmoid'\")\nprobs = torch.zeros_like(logits, dtype=top_weights.dtype).scatter(1, top_indices, top_weights)\nrouting_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)\n"
 },
 {
  "exercise": "moe.capacity",
  "name": "first try (B)",
  "code": "\narrival = routing_map.long().cumsum(dim=0) - 1          # each token's place in its expert's queue\nkept = routing_map & (arrival < capacity)\nif pad_to_capacity:\n    free = capacity - kept.long().sum(dim=0)             # [E] slots still open\n    unrouted = ~routing_map\n    filler_arrival = unrouted.long().cumsum(dim=0) - 1\n    fillers = unrouted & (filler_arrival < free.unsqueeze(0))\n    routing_map = kept | fillers\nelse:\n    routing_map = kept\nprobs = probs * kept.to(probs.dtype)\n"
 },
 {
  "exercise": "moe.permute",
  "name": "first try (B)",
  "code": "\nnum_tokens, num_experts = routing_map.shape\nmap_t = routing_map.t().contiguous()                                   # [E, T]: expert-major\ntoken_grid = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)\nsorted_indices = token_grid.masked_select(map_t)                        # [N]\npermuted = tokens.index_select(0, sorted_indices)\npermuted_probs = probs.t().contiguous().masked_select(map_t) if probs is not None else None\nreturn permuted, permuted_probs, sorted_indices\n"
 },
 {
  "exercise": "moe.alltoall_dispatch",
  "name": "first try (B)",
  "code": "\nlocal = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)\nif ep > 1:\n    gathered = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]\n    dist.all_gather(gathered, num_local_tokens_per_expert.contiguous(), group=self.ep_group)\n    num_global_tokens_per_expert = torch.stack(gathered)                     # [ep, E]\nelse:\n    num_global_tokens_per_expert = num_local_tokens_per_expert.unsqueeze(0)  # [1, E]\nself.num_global_tokens_per_local_expert = num_global_tokens_per_expert[:, local]  # [ep, L]: rank j -> my experts\nself.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()   # rows I send to each rank\nself.output_splits = self.num_global_tokens_per_local_expert.sum(dim=1).tolist()  # rows each rank sends me\nif ep > 1:\n    permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)\nif L > 1:  # [rank][expert] -> [expert][rank]\n    permuted = sort_chunks_by_idxs(permuted, self.num_global_tokens_per_local_expert.reshape(-1),\n                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())\n"
 },
 {
  "exercise": "hybrid.train_step",
  "name": "first try (B)",
  "code": "\nfrom contextlib import nullcontext\nmodel, stages = build_model(config, state, seed)\nlocal = nn.ModuleList(stages)\n# this rank's slice of the global batch (dp), then its zigzag chunks of each sequence (cp)\nper_rank = batch_size // dp\nmy_ids = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]\nmy_labels = labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]\nif cp > 1:\n    batch = get_batch_on_this_cp_rank(dict(tokens=my_ids, labels=my_labels), cp, cp_rank)\n    my_ids, my_labels = batch[\"tokens\"], batch[\"labels\"]\ninputs, targets = my_ids.chunk(num_microbatches), my_labels.chunk(num_microbatches)\n# data parallelism: DDP over dp-cp (ZeRO via DistributedOptimizer); MoE layers have no DDP wrapper here\nddp = None if moe else DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage)\nif zero_stage:\n    opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr)\nelse:\n    opt = optimizer_cls(local.parameters(), lr=lr)\nif ddp is not None:\n    ddp.zero_grad_buffer()\nloss_func = lambda logits, y: _local_loss(logits, y, tp_group)\nsync = ddp.no_sync() if ddp is not None else nullcontext()\nwith MoEAuxLossAutoScaler.loss_scale(cp / num_microbatches), sync:\n    if pp > 1:\n        seq = config.seq_length // cp\n        if config.sequence_parallel:\n            seq //= state.get_tensor_model_parallel_world_size()\n        shape = (seq, per_rank // num_microbatches, config.hidden_size)\n        result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,\n                                             group=state.get_pipeline_model_parallel_group())\n        losses = result.losses\n    else:\n        losses = []\n        stage = stages[0]\n        for x, y in zip(inputs, targets):\n            mb_loss = loss_func(stage(x), y)\n            (mb_loss / num_microbatches).backward()\n            losses.append(mb_loss.item())\nfinalize_model_grads([ddp if ddp is not None else local], state)\nopt.step()\n"
 },
 {
  "exercise": "planner.weight_memory",
  "name": "first try (B)",
  "code": "\nt, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp\nexpert_shards = layout.ep * layout.etp\nlayers = model.num_layers / p\ndense = layers * per_layer[\"dense\"] / t + model.embedding_params() / t  # the first stage holds the embedding\nif p == 1:  # a single stage also holds the final norm and an untied output layer\n    dense += model.final_norm_params()\n    if model.untie_embeddings_and_output_weights:\n        dense += model.embedding_params() / t\nexpert = layers * per_layer[\"expert\"] / expert_shards\nheld = dense + expert\nmemory = {\"params\": held * train.param_bytes, \"grads\": held * train.grad_bytes}\nif train.use_distributed_optimizer:\n    expert_dp = t * c * d // expert_shards  # experts are replicated over expert-DP, dense params over dp\u00b7cp\n    memory[\"optimizer\"] = train.optimizer_bytes * (dense / (d * c) + expert / expert_dp)\nelse:\n    memory[\"optimizer\"] = train.optimizer_bytes * held\nreturn memory\n"
 },
 {
  "exercise": "planner.activation_memory",
  "name": "first try (B)",
  "code": "\ncp = layout.cp\ntokens = s * b / cp  # this rank's tokens of one micro-batch\nlayer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,\n                                         ffn_hidden_size=ffn, context_parallel_size=cp)\nin_flight = in_flight_microbatches(layout, num_microbatches)\nembedding = (8 * tokens + tokens * h) / (t if sp else 1)  # int64 token ids + the embedding's dropout output\ntotal = (layer * model.num_layers / layout.pp + embedding) * in_flight\n"
 },
 {
  "exercise": "planner.llama3_70b_layout",
  "name": "first try (B)",
  "code": "\n# tp4\u00b7pp4\u00b7cp2\u00b7dp2 (= 64): tp\u00b7cp = 8 stays inside one 8-GPU NVLink node, so the chatty TP collectives and\n# the CP ring (hidden behind attention) never cross the network; tp = 4 instead of 8 halves the exposed\n# sequence-parallel traffic per layer, and cp = 2 halves the 8k-token activations again, so\n# W+G+O ~41 GB + activations ~22 GB fit under 72 GB (80 GB minus 10% headroom). pp = 4 crosses nodes,\n# where only one activation per micro-batch travels; with m = 512 / (1 \u00b7 dp2) = 256 micro-batches the\n# bubble is (4 \u2212 1)/256 \u2248 1.2%. dp = 2 with the distributed optimizer shards Adam's state.\n# (Also NeMo's LLaMA-3 70B recipe: TP 4, PP 4, CP 2.)\nlayout = Layout(tp=4, pp=4, cp=2, dp=2)\n"
 },
 {
  "exercise": "model.rope_interleaved",
  "name": "first try (B)",
  "code": "\neven, odd = x[..., 0::2], x[..., 1::2]\nreturn torch.stack((-odd, even), dim=-1).flatten(-2)\n"
 },
 {
  "exercise": "model.gqa_repeat",
  "name": "first try (B)",
  "code": "\ns, b, ng, hn = x.shape\nreturn x.unsqueeze(3).expand(s, b, ng, n_rep, hn).reshape(s, b, ng * n_rep, hn)\n"
 },
 {
  "exercise": "model.hf_qkv",
  "name": "first try (B)",
  "code": "\nng, h = num_query_groups, q.shape[1]\nhn = k.shape[0] // ng\ngrouped = torch.cat([q.reshape(ng, -1, h), k.reshape(ng, hn, h), v.reshape(ng, hn, h)], dim=1)\nreturn grouped.reshape(-1, h)\n"
 },
 {
  "exercise": "data.build_blending_indices",
  "name": "first try (B)",
  "code": "\nweights = np.asarray(weights, dtype=np.float64)\ntaken = np.zeros(len(weights), dtype=np.int64)\nfor i in range(size):\n    errors = weights * max(i, 1) - taken\n    d = int(np.argmax(errors))  # ties go to the first\n    dataset_index[i] = d\n    dataset_sample_index[i] = taken[d]\n    taken[d] += 1\n"
 },
 {
  "exercise": "data.build_sample_index",
  "name": "first try (B)",
  "code": "\npos, offset = 0, 0  # row 0: the first document, token 0\nfor j in range(1, num_samples + 1):\n    remaining = seq_length + 1  # the tokens sample j - 1 reads, starting at (pos, offset)\n    while remaining > 0:\n        left = int(sizes[document_index[pos]]) - offset\n        if left >= remaining:  # this document holds the last token: the next sample starts at it\n            offset += remaining - 1\n            remaining = 0\n        else:\n            remaining -= left\n            pos += 1\n            offset = 0\n    sample_index[j] = (pos, offset)\n"
 },
 {
  "exercise": "optimizer.grad_norm",
  "name": "first try (B)",
  "code": "\ntotal = torch.zeros((), dtype=torch.float32, device=device)\nfor g in grads:\n    total += g.detach().float().pow(2).sum().to(device)\nif model_parallel_group is not None:\n    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=model_parallel_group)\nreturn total.sqrt().item()\n"
 },
 {
  "exercise": "optimizer.get_lr",
  "name": "first try (B)",
  "code": "\nmax_lr, min_lr = self.max_lr, self.min_lr\nif self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:  # linear warmup from init_lr\n    return self.init_lr + (max_lr - self.init_lr) * step / self.lr_warmup_steps\nif step > self.lr_decay_steps:  # after the decay: min_lr for good\n    return min_lr\nstyle = self.lr_decay_style\nif style == \"constant\":\n    return max_lr\nif style == \"inverse-square-root\":\n    return max(min_lr, max_lr * math.sqrt(self.lr_warmup_steps / max(step, 1)))\nratio = (step - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)  # fraction of the decay done\nif style == \"linear\":\n    coeff = 1.0 - ratio\nelif style == \"cosine\":\n    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)\nelse:  # WSD: stable at max_lr, then the last wsd_decay_steps steps decay\n    start = self.lr_decay_steps - self.wsd_decay_steps\n    if step <= start:\n        coeff = 1.0\n    else:\n        r = (step - start) / self.wsd_decay_steps\n        if self.lr_wsd_decay_style == \"linear\":\n            coeff = 1.0 - r\n        elif self.lr_wsd_decay_style == \"cosine\":\n            coeff = 0.5 * (math.cos(math.pi * r) + 1.0)\n        elif self.lr_wsd_decay_style == \"exponential\":  # geometric from max_lr to min_lr\n            if min_lr > 0:\n                return max_lr * (min_lr / max_lr) ** r\n            coeff = 0.0 if r >= 1 else 0.5 ** (10 * r)\n        else:  # \"minus_sqrt\"\n            coeff = 1.0 - math.sqrt(r)\nreturn min_lr + coeff * (max_lr - min_lr)\n"
 },
 {
  "exercise": "optimizer.get_lr",
  "name": "final (B)",
  "code": "\nmax_lr, min_lr = self.max_lr, self.min_lr\nif self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:  # linear warmup from init_lr\n    return self.init_lr + (max_lr - self.init_lr) * step / self.lr_warmup_steps\nstyle = self.lr_decay_style\nif style == \"constant\":  # no decay at all: max_lr for good (the grader: not min_lr after lr_decay_steps)\n    return max_lr\nif step > self.lr_decay_steps:  # after the decay: min_lr for good\n    return min_lr\nif style == \"inverse-square-root\":\n    return max(min_lr, max_lr * math.sqrt(self.lr_warmup_steps / max(step, 1)))\nratio = (step - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)  # fraction of the decay done\nif style == \"linear\":\n    coeff = 1.0 - ratio\nelif style == \"cosine\":\n    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)\nelse:  # WSD: stable at max_lr, then the last wsd_decay_steps steps decay\n    start = self.lr_decay_steps - self.wsd_decay_steps\n    if step <= start:\n        coeff = 1.0\n    else:\n        r = (step - start) / self.wsd_decay_steps\n        if self.lr_wsd_decay_style == \"linear\":\n            coeff = 1.0 - r\n        elif self.lr_wsd_decay_style == \"cosine\":\n            coeff = 0.5 * (math.cos(math.pi * r) + 1.0)\n        elif self.lr_wsd_decay_style == \"exponential\":  # from the grader's value: 2 * 0.5^r - 1 (1 at r=0, 0 at r=1)\n            coeff = 2.0 * 0.5 ** r - 1.0\n        else:  # \"minus_sqrt\"\n            coeff = 1.0 - math.sqrt(r)\nreturn min_lr + coeff * (max_lr - min_lr)\n"
 },
 {
  "exercise": "training.masked_loss",
  "name": "first try (B)",
  "code": "\nreturn (losses * loss_mask).sum() / num_tokens * m * dp\n"
 },
 {
  "exercise": "checkpoint.commit",
  "name": "first try (B)",
  "code": "\ntmp = Path(tmp)\nif final.exists():  # an older save of the same iteration\n    shutil.rmtree(final)\nos.rename(tmp, final)  # atomic: the data is published first\ntracker_tmp = tracker.with_name(tracker.name + \".tmp\")\nwith open(tracker_tmp, \"w\") as f:\n    f.write(str(iteration))\n    f.flush()\n    os.fsync(f.fileno())\nos.replace(tracker_tmp, tracker)  # atomic: then the tracker names it\n"
 },
 {
  "exercise": "mixed_precision.dynamic_update",
  "name": "first try (C)",
  "code": "\nif found_inf:\n    self._growth_tracker = 0\n    self._hysteresis_tracker -= 1\n    if self._hysteresis_tracker <= 0:\n        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)\nelse:\n    self._growth_tracker += 1\n    if self._growth_tracker == self.growth_interval:\n        self._growth_tracker = 0\n        self._hysteresis_tracker = self.hysteresis\n        self._scale = self._scale * self.growth_factor\n"
 },
 {
  "exercise": "mixed_precision.unscale",
  "name": "first try (C)",
  "code": "\nfound_inf = False\nfor g in grads:\n    g.mul_(inv_scale.to(g.device))\n    if not bool(torch.isfinite(g).all()):\n        found_inf = True\nreturn found_inf\n"
 },
 {
  "exercise": "fp8.compute_scale",
  "name": "first try (C)",
  "code": "\namax = amax.float()\nsf = (fp8_max / amax) / (2.0 ** margin)\nold = scale.float().expand_as(sf) if sf.dim() else scale.float().reshape(())\nsf = torch.where((amax > 0.0) & torch.isfinite(amax), sf, old)\nsf = torch.where(torch.isinf(sf), torch.full_like(sf, FP32_MAX), sf)\nreturn sf\n"
 },
 {
  "exercise": "fp8.quantize",
  "name": "first try (C)",
  "code": "\nfp8_max = torch.finfo(dtype).max\ny = x.float() * scale.float().to(x.device)\nreturn y.clamp(-fp8_max, fp8_max).to(dtype)\n"
 },
 {
  "exercise": "kernels.online_softmax",
  "name": "first try (C)",
  "code": "\nqf, kf, vf = q.float(), k.float(), v.float()\nm = torch.full((*q.shape[:-1], 1), float(\"-inf\"), device=q.device, dtype=torch.float32)  # [b, h, s, 1]\nl = torch.zeros_like(m)\nacc = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device, dtype=torch.float32)\nfor start in range(0, k.shape[-2], block_n):\n    end = min(start + block_n, k.shape[-2])\n    scores = qf @ kf[..., start:end, :].transpose(-1, -2) * scale  # [b, h, s, n]\n    if causal:\n        cols = torch.arange(start, end, device=q.device)[None, :]  # [1, n] key positions\n        scores = scores.masked_fill(cols > rows, float(\"-inf\"))\n    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))\n    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)\n    alpha = torch.exp(m - m_safe)\n    p = torch.exp(scores - m_safe)\n    acc = acc * alpha + p @ vf[..., start:end, :]\n    l = l * alpha + p.sum(dim=-1, keepdim=True)\n    m = m_new\nout = acc / l\n"
 },
 {
  "exercise": "packed_seq.document_causal_mask",
  "name": "first try (C)",
  "code": "\nlengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()\ndoc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)  # [T]\npos = torch.arange(total, device=cu_seqlens.device)\nreturn (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])\n"
 },
 {
  "exercise": "inference.paged_slots",
  "name": "first try (C)",
  "code": "\npositions = torch.arange(start, start + n, device=self.key.device)\ntable = torch.tensor(self.block_tables.get(seq_id, []), dtype=torch.long, device=self.key.device)\nindex = positions // self.block_size\nif n and int(index.max()) >= table.numel():\n    raise IndexError(f\"sequence {seq_id} has {table.numel()} blocks; position {start + n - 1} is not reserved\")\nreturn table[index], positions % self.block_size\n"
 },
 {
  "exercise": "inference.schedule",
  "name": "first try (C)",
  "code": "\nwhile self.waiting:\n    request = self.waiting[0]\n    batch = [*self.active, *admitted, request]\n    if len(batch) > self.max_batch_size:\n        break\n    if tokens + len(request.prompt_tokens) > self.max_tokens:\n        break\n    if not self.cache.fits([r.final_length for r in batch]):\n        break\n    self.waiting.popleft()\n    admitted.append(request)\n    tokens += len(request.prompt_tokens)\n"
 },
 {
  "exercise": "inference.filter_logits",
  "name": "first try (C)",
  "code": "\nlogits = logits.clone()\nif top_k:\n    k = min(top_k, logits.shape[-1])\n    keep = torch.zeros_like(logits, dtype=torch.bool)\n    keep.scatter_(-1, logits.topk(k, dim=-1).indices, True)\n    logits = logits.masked_fill(~keep, float(\"-inf\"))\nif top_p:\n    sorted_logits, order = logits.sort(dim=-1, descending=True)\n    probs = sorted_logits.softmax(dim=-1)\n    before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens\n    drop_sorted = before >= top_p\n    drop_sorted[..., 0] = False  # the most likely token always stays\n    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)\n    logits = logits.masked_fill(drop, float(\"-inf\"))\nreturn logits\n"
 },
 {
  "exercise": "inference.filter_logits",
  "name": "final (C)",
  "code": "\nlogits = logits.clone()\nif top_k:\n    k = min(top_k, logits.shape[-1])\n    kth = logits.topk(k, dim=-1).values[..., -1:]  # ties with the k-th largest stay too\n    logits = logits.masked_fill(logits < kth, float(\"-inf\"))\nif top_p:\n    sorted_logits, order = logits.sort(dim=-1, descending=True)\n    probs = sorted_logits.softmax(dim=-1)\n    before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens\n    drop_sorted = before >= top_p\n    drop_sorted[..., 0] = False  # the most likely token always stays\n    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)\n    logits = logits.masked_fill(drop, float(\"-inf\"))\nreturn logits\n"
 },
 {
  "exercise": "inference.cached_attention",
  "name": "first try (C)",
  "code": "\nng = keys.shape[1]\nif np_ != ng:  # GQA: each key/value group serves np/ng query heads\n    keys = keys.repeat_interleave(np_ // ng, dim=1)\n    values = values.repeat_interleave(np_ // ng, dim=1)\nq, k, v = query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [np, n, hn], [np, len, hn]\nscores = (q.float() @ k.float().transpose(-1, -2)) / (hn ** 0.5)  # [np, n, len]\nrows = torch.arange(n, device=query.device)[:, None] + start  # query positions\ncols = torch.arange(keys.shape[0], device=query.device)[None, :]\nscores = scores.masked_fill(cols > rows, float(\"-inf\"))\nprobs = scores.softmax(dim=-1)\ncontext = probs @ v.float()  # [np, n, hn]\nreturn context.transpose(0, 1).reshape(n, np_ * hn).to(query.dtype)\n"
 },
 {
  "exercise": "projects.curves_match",
  "name": "first try (C)",
  "code": "\nif not resumed or len(resumed) > len(reference):\n    return False\ntail = reference[len(reference) - len(resumed):]\nif [int(it) for it, _ in resumed] != [int(it) for it, _ in tail]:\n    return False\nfor (_, loss), (_, ref) in zip(resumed, tail):\n    loss, ref = float(loss), float(ref)\n    if rtol == 0:\n        if loss != ref:\n            return False\n    elif not abs(loss - ref) <= rtol * abs(ref):\n        return False\nreturn True\n"
 },
 {
  "exercise": "sliding_window.mask",
  "name": "first try (C)",
  "code": "\ni = torch.arange(seq_length, device=device)[:, None]\nj = torch.arange(seq_length, device=device)[None, :]\ndiff = i - j\nreturn (diff >= 0) & (diff < window)\n"
 },
 {
  "exercise": "sliding_window.blocked",
  "name": "first try (C)",
  "code": "\npad = n * window - s\nqp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [b, h, n*W, d]\nqb = qp.view(b, h, n, window, d)\nkb, vb = kp.view(b, h, n, window, d), vp.view(b, h, n, window, d)\n# every block gets the previous block's keys/values (block 0: a zero block, masked out) and its own\nkk = torch.cat([F.pad(kb, (0, 0, 0, 0, 1, 0))[:, :, :n], kb], dim=3)  # [b, h, n, 2W, d]\nvv = torch.cat([F.pad(vb, (0, 0, 0, 0, 1, 0))[:, :, :n], vb], dim=3)\nr = torch.arange(window, device=q.device)[:, None]  # query within its block\nt = torch.arange(2 * window, device=q.device)[None, :]  # key from block c-1's start\nband = (r < t) & (t <= r + window)  # [W, 2W]\nmask = band.expand(n, window, 2 * window).clone()\nmask[0, :, :window] = False  # block 0 has no block -1\nout = F.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask)  # [b, h, n, W, d]\nreturn out.reshape(b, h, n * window, d)[:, :, :s]\n"
 },
 {
  "exercise": "speedup.remove_hotspots",
  "name": "first try (C)",
  "code": "\nfrom megalab.core.transformer.dot_product_attention import CoreAttention\n\nfast_config = replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,\n                      attention_backend=\"sdpa\")\nreturn fast_config, replace(spec, core_attention=CoreAttention)\n"
 },
 {
  "exercise": "speedup.interleaved_speedup",
  "name": "first try (C)",
  "code": "\nfor round_ in range(warmup + repeats):\n    for name, fn in ((\"before\", before), (\"after\", after)):\n        start = clock()\n        fn()\n        elapsed_ms = (clock() - start) * 1e3\n        if round_ >= warmup:\n            times[name].append(elapsed_ms)\n"
 },
 {
  "exercise": "projects.load_inference_model",
  "name": "first try (C)",
  "code": "\nparams = dict(model.named_parameters())\nstate = {f\"model.{name}\": torch.empty(p.shape, dtype=p.dtype) for name, p in params.items()}\nread_state(path, state, no_dist=True)\nwith torch.no_grad():\n    for name, p in params.items():\n        p.copy_(state[f\"model.{name}\"])\n"
 },
 {
  "exercise": "bugs.tp_dropout_seed",
  "name": "first try (C)",
  "code": "\nreturn base_seed + 2718 + tp_rank  # Megatron's tensor_model_parallel_seed: its own stream per TP rank\n"
 },
 {
  "exercise": "bugs.vocab_padding",
  "name": "first try (C)",
  "code": "\npadded = vocab_size_with_padding(vocab_size, 1, tp_size)  # round UP to a multiple of tp_size: no id left out\nreturn padded, padded // tp_size\n"
 },
 {
  "exercise": "bugs.output_layer",
  "name": "first try (C)",
  "code": "\n# Megatron's output layer: a ColumnParallelLinear (f = copy_to_tensor_model_parallel_region in front, this\n# rank's vocabulary rows, the logits kept split for vocab_parallel_cross_entropy)\nreturn ColumnParallelLinear(config.hidden_size, vocab_size, config=config, init_method=init_method_normal(0.02),\n                            bias=False, gather_output=False, tp_group=tp_group)\n"
 },
 {
  "exercise": "bugs.pp_grad_sync",
  "name": "first try (C)",
  "code": "\n# the last backward of the step, whether it falls in the steady 1F1B phase (last stage: no cooldown) or in the cooldown\nreturn backward_index == num_microbatches - 1\n"
 },
 {
  "exercise": "bugs.cp_packed",
  "name": "first try (C)",
  "code": "\n# one document per row: inputs then padding (token 0, outside the loss); each row is one causal sequence\nif any(d.dim() != 1 or not 2 <= d.numel() <= seq_length + 1 for d in docs):\n    raise ValueError(f\"every document needs 2 .. seq_length + 1 = {seq_length + 1} tokens\")\ndevice = docs[0].device\ntokens = torch.zeros(len(docs), seq_length, dtype=docs[0].dtype, device=device)\nlabels = torch.zeros_like(tokens)\nloss_mask = torch.zeros(len(docs), seq_length, device=device)\nfor row, d in enumerate(docs):\n    n = d.numel() - 1\n    tokens[row, :n], labels[row, :n], loss_mask[row, :n] = d[:-1], d[1:], 1.0\nposition_ids = torch.arange(seq_length, device=device).expand(len(docs), seq_length).clone()\nreturn dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)\n"
 }
]
