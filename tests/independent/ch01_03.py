"""Wrong answers for chapters 01-03, written BLIND (issue 34): from the notebooks' prose, the exercise regions' task
lines, hints and docstrings only, before reading tests/mistakes/, megalab/lab/mutants.py or any test's failure
messages. Each is a realistic learner's slip made on a blind solution (tests/blind/); `expect` says, in words, what a
verdict that names it correctly would say (the behaviour), `words` are alternatives such a verdict would contain.

`half` is a split fixed before any grader was changed: the 1st, 3rd, 5th, ... entry of the list is "dev" (looked at
while fixing verdicts), the 2nd, 4th, ... "held" (never looked at while fixing: its naming rate is the honest one).
`python -m megalab.lab.mutants --solutions tests/independent/ch01_03.py --expect-fail` runs them.
"""

WRONG = [{'exercise': 'dist.shard_bounds',
  'name': 'extra items on the last ranks',
  'expect': 'the LAST ranks get the extra item (10 on 4: 2,2,3,3), not the first',
  'words': ['last', '2, 2, 3, 3|sizes|extra'],
  'code': 'base, extra = divmod(length, world_size)\n'
          'first_big = world_size - extra\n'
          'start = rank * base + max(0, rank - first_big)\n'
          'stop = start + base + (1 if rank >= first_big else 0)\n'
          'return start, stop\n',
  'half': 'dev'},
 {'exercise': 'dist.shard_bounds',
  'name': 'rank == extra gets one too (<=)',
  'expect': 'rank `extra` also gets an extra item: shards overlap / run past length',
  'words': ['overlap', 'past', 'gap', '\\b11\\b', 'length'],
  'code': 'base, extra = divmod(length, world_size)\n'
          'start = rank * base + min(rank, extra)\n'
          'stop = start + base + (1 if rank <= extra else 0)\n'
          'return start, stop\n',
  'half': 'held'},
 {'exercise': 'dist.shard_bounds',
  'name': 'ceil-sized shards',
  'expect': 'shards of ceil(length/n): 10 on 4 gives 3,3,3,1 (sizes differ by more than one)',
  'words': ['3, 3, 3, 1', 'differ', 'more than'],
  'code': 'size = -(-length // world_size)\n'
          'start = min(rank * size, length)\n'
          'stop = min(start + size, length)\n'
          'return start, stop\n',
  'half': 'dev'},
 {'exercise': 'comm.broadcast',
  'name': 'positions not counted from src',
  'expect': 'correct for src=0 only: with src != 0 ranks get the data of the wrong rank / not src',
  'words': ['src'],
  'code': 'me = rank\n'
          'step = 1\n'
          'while step < world:\n'
          '    if me < step:\n'
          '        if me + step < world:\n'
          '            dist.send(tensor, group=group, group_dst=me + step)\n'
          '    elif me < 2 * step:\n'
          '        dist.recv(tensor, group=group, group_src=me - step)\n'
          '    step *= 2\n',
  'half': 'held'},
 {'exercise': 'comm.broadcast',
  'name': 'a loop of sends from src',
  'expect': 'src sends n-1 messages itself (a flat loop, not a tree): rounds/sends count',
  'words': ['round', 'sends', 'tree', 'messages', 'log'],
  'code': 'if rank == src:\n'
          '    for r in range(world):\n'
          '        if r != src:\n'
          '            dist.send(tensor, group=group, group_dst=r)\n'
          'else:\n'
          '    dist.recv(tensor, group=group, group_src=src)\n',
  'half': 'dev'},
 {'exercise': 'comm.broadcast',
  'name': 'receiver listens to the wrong position',
  'expect': 'a receiver waits for a rank that does not send to it (hangs / mismatched send-recv)',
  'words': ['hang', 'deadlock', 'timed out', 'match', 'waits'],
  'code': 'me = (rank - src) % world\n'
          'step = 1\n'
          'while step < world:\n'
          '    if me < step:\n'
          '        if me + step < world:\n'
          '            dist.send(tensor, group=group, group_dst=(me + step + src) % world)\n'
          '    elif me < 2 * step:\n'
          '        dist.recv(tensor, group=group, group_src=(me - step + 1 + src) % world)\n'
          '    step *= 2\n',
  'half': 'held'},
 {'exercise': 'comm.all_gather',
  'name': 'ring the other way',
  'expect': 'sends to rank-1 / receives from rank+1 with the chunk indices of the forward ring: chunks land in the '
            'wrong place',
  'words': ['direction', 'rank - 1', 'other way', 'chunk'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = output[chunks[(rank - s) % world]]\n'
          '    recv_chunk = output[chunks[(rank - s - 1) % world]]\n'
          '    send_recv(send_chunk, (rank - 1) % world, recv_chunk, (rank + 1) % world, group=group)\n',
  'half': 'dev'},
 {'exercise': 'comm.all_gather',
  'name': 'receive into a copy',
  'expect': "received chunks go into a clone and are dropped: the other ranks' chunks stay unfilled",
  'words': ['unfilled', 'copy', 'clone', 'empty', 'not filled', 'zero'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = output[chunks[(rank - s) % world]]\n'
          '    recv_chunk = output[chunks[(rank - s - 1) % world]].clone()\n'
          '    send_recv(send_chunk, (rank + 1) % world, recv_chunk, (rank - 1) % world, group=group)\n',
  'half': 'held'},
 {'exercise': 'comm.all_gather',
  'name': 'chunk indices (r+s)',
  'expect': "wrong chunk schedule: sends chunk (r+s), receives (r+s+1): chunk j holds rank k's shard",
  'words': ['chunk'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = output[chunks[(rank + s) % world]]\n'
          '    recv_chunk = output[chunks[(rank + s + 1) % world]]\n'
          '    send_recv(send_chunk, (rank + 1) % world, recv_chunk, (rank - 1) % world, group=group)\n',
  'half': 'dev'},
 {'exercise': 'comm.reduce_scatter',
  'name': 'copy instead of add',
  'expect': 'the incoming partial sum overwrites instead of adding: the result is not the sum over ranks (a factor / '
            "only some ranks' parts)",
  'words': ['sum', 'add', 'overwr', 'x the', 'factor'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = partial[chunks[(rank - s - 1) % world]]\n'
          '    recv_target = partial[chunks[(rank - s - 2) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    recv_target.copy_(scratch)\n',
  'half': 'held'},
 {'exercise': 'comm.reduce_scatter',
  'name': 'one chunk off',
  'expect': "sends chunk (r-s), adds into (r-s-1): rank r ends with the sum of another rank's chunk",
  'words': ['chunk'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = partial[chunks[(rank - s) % world]]\n'
          '    recv_target = partial[chunks[(rank - s - 1) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    recv_target.add_(scratch)\n',
  'half': 'dev'},
 {'exercise': 'comm.reduce_scatter',
  'name': 'n steps',
  'expect': 'one step too many (n instead of n-1): parts are counted twice, values too large',
  'words': ['step', 'twice', 'x the', 'factor', 'too many'],
  'code': 'for s in range(world):\n'
          '    send_chunk = partial[chunks[(rank - s - 1) % world]]\n'
          '    recv_target = partial[chunks[(rank - s - 2) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    recv_target.add_(scratch)\n',
  'half': 'held'},
 {'exercise': 'comm.ring_all_reduce',
  'name': 'adds in the all-gather phase too',
  'expect': 'the all-gather phase adds instead of copying: chunks counted twice (values too large)',
  'words': ['twice', 'all-gather', 'x the', 'copy', 'factor'],
  'code': 'for s in range(2 * (world - 1)):\n'
          '    send_chunk = flat[chunks[(rank - s - 1) % world]]\n'
          '    recv_target = flat[chunks[(rank - s - 2) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    recv_target.add_(scratch)\n',
  'half': 'dev'},
 {'exercise': 'comm.ring_all_reduce',
  'name': 'reduce-scatter only',
  'expect': 'stops after n-1 steps: rank r holds only chunk r complete, the other chunks are partial',
  'words': ['all-gather', 'only chunk', 'partial', 'chunk'],
  'code': 'for s in range(world - 1):\n'
          '    send_chunk = flat[chunks[(rank - s - 1) % world]]\n'
          '    recv_target = flat[chunks[(rank - s - 2) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    if s < world - 1:\n'
          '        recv_target.add_(scratch)\n'
          '    else:\n'
          '        recv_target.copy_(scratch)\n',
  'half': 'held'},
 {'exercise': 'comm.ring_all_reduce',
  'name': 'average instead of sum',
  'expect': 'divides by n at the end: values are 1/n of the sum',
  'words': ['mean', 'average', '0\\.50', '1/n', 'divid', 'x the'],
  'code': 'for s in range(2 * (world - 1)):\n'
          '    send_chunk = flat[chunks[(rank - s - 1) % world]]\n'
          '    recv_target = flat[chunks[(rank - s - 2) % world]]\n'
          '    scratch = torch.empty_like(recv_target)\n'
          '    send_recv(send_chunk, (rank + 1) % world, scratch, (rank - 1) % world, group=group)\n'
          '    if s < world - 1:\n'
          '        recv_target.add_(scratch)\n'
          '    else:\n'
          '        recv_target.copy_(scratch)\n'
          'flat.div_(world)\n',
  'half': 'dev'},
 {'exercise': 'comm.all_reduce_time',
  'name': 'ring without the factor 2',
  'expect': "ring time is half the model's (reduce-scatter only)",
  'words': ['ring', '0\\.5', 'half', 'factor 2', 'x the'],
  'code': 'if algorithm == "naive":\n'
          '    return 2 * (n - 1) * (alpha + nbytes * beta)\n'
          'if algorithm == "tree":\n'
          '    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)\n'
          'return (n - 1) * alpha + (n - 1) / n * nbytes * beta\n',
  'half': 'held'},
 {'exercise': 'comm.all_reduce_time',
  'name': 'tree with floor(log2 n)',
  'expect': 'tree rounds floor(log2 n): wrong for n not a power of two',
  'words': ['tree', 'log2', 'ceil', 'power of two'],
  'code': 'if algorithm == "naive":\n'
          '    return 2 * (n - 1) * (alpha + nbytes * beta)\n'
          'if algorithm == "tree":\n'
          '    return 2 * int(math.log2(n)) * (alpha + nbytes * beta)\n'
          'return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta\n',
  'half': 'dev'},
 {'exercise': 'comm.all_reduce_time',
  'name': 'naive with n messages',
  'expect': 'naive counts n messages each way instead of n-1',
  'words': ['naive', 'n - 1', 'n-1'],
  'code': 'if algorithm == "naive":\n'
          '    return 2 * n * (alpha + nbytes * beta)\n'
          'if algorithm == "tree":\n'
          '    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)\n'
          'return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta\n',
  'half': 'held'},
 {'exercise': 'comm.busbw',
  'name': 'all_gather with the all_reduce factor',
  'expect': 'all_gather / reduce_scatter get 2(n-1)/n: twice the right busbw',
  'words': ['all_gather', 'reduce_scatter', '2.00', 'twice', 'factor'],
  'code': 'if collective in ("all_reduce", "all_gather", "reduce_scatter"):\n'
          '    factor = 2 * (n - 1) / n\n'
          'elif collective in ("all_gather", "reduce_scatter"):\n'
          '    factor = (n - 1) / n\n'
          'else:\n'
          '    factor = 1.0\n'
          'return algbw(nbytes, seconds) * factor\n',
  'half': 'dev'},
 {'exercise': 'comm.busbw',
  'name': 'divides by the factor',
  'expect': 'algbw / factor instead of times: all_reduce busbw too small',
  'words': ['factor', 'divid', 'x the', 'all_reduce'],
  'code': 'if collective == "all_reduce":\n'
          '    factor = 2 * (n - 1) / n\n'
          'elif collective in ("all_gather", "reduce_scatter"):\n'
          '    factor = (n - 1) / n\n'
          'else:\n'
          '    factor = 1.0\n'
          'return algbw(nbytes, seconds) / factor\n',
  'half': 'held'},
 {'exercise': 'comm.fit_alpha_beta',
  'name': 'absolute error',
  'expect': 'least squares on seconds, not relative: small messages barely count, alpha is off',
  'words': ['relative', 'alpha'],
  'code': 'A = torch.stack([torch.full_like(size, float(latency_steps)), bytes_factor * size], dim=1)\n'
          'b = t.clone()\n'
          'solution = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]\n'
          'return float(solution[0]), float(solution[1])\n',
  'half': 'dev'},
 {'exercise': 'comm.fit_alpha_beta',
  'name': 'alpha and beta swapped',
  'expect': 'returns (beta, alpha)',
  'words': ['swap', 'beta', 'order'],
  'code': 'A = torch.stack([torch.full_like(size, float(latency_steps)), bytes_factor * size], dim=1)\n'
          'A = A / t[:, None]\n'
          'b = torch.ones_like(t)\n'
          'solution = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]\n'
          'return float(solution[1]), float(solution[0])\n',
  'half': 'held'},
 {'exercise': 'comm.fit_alpha_beta',
  'name': 'latency_steps ignored',
  'expect': 'the alpha column is ones, latency_steps ignored: alpha off by the factor latency_steps',
  'words': ['latency_steps', 'alpha', 'x the', 'factor'],
  'code': 'A = torch.stack([torch.ones_like(size), bytes_factor * size], dim=1)\n'
          'A = A / t[:, None]\n'
          'b = torch.ones_like(t)\n'
          'solution = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]\n'
          'return float(solution[0]), float(solution[1])\n',
  'half': 'dev'},
 {'exercise': 'parallel_state.get_ranks',
  'name': 'strides of the masked shape alone',
  'expect': 'strides from the masked sizes, not the full shape: groups hold the wrong ranks',
  'words': ['stride', 'group'],
  'code': 'strides = _prefix_product(parallel_size)\n'
          'masked_shape = [s for s, m in zip(parallel_size, mask) if m]\n'
          'unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]\n'
          'masked_strides = _prefix_product(masked_shape)\n'
          'unmasked_strides = [st for st, m in zip(strides, mask) if not m]\n'
          'group_size = 1\n'
          'for s in masked_shape:\n'
          '    group_size *= s\n'
          'num_groups = world_size // group_size\n'
          'groups = []\n'
          'for g in range(num_groups):\n'
          '    base = sum(c * st for c, st in zip(_decompose(g, unmasked_shape), unmasked_strides))\n'
          '    groups.append([base + sum(c * st for c, st in zip(_decompose(i, masked_shape), masked_strides))\n'
          '                   for i in range(group_size)])\n'
          'return groups\n',
  'half': 'held'},
 {'exercise': 'parallel_state.get_ranks',
  'name': 'unmasked strides of the unmasked shape',
  'expect': 'group bases computed from the unmasked sizes alone: groups overlap / wrong ranks',
  'words': ['stride', 'group', 'overlap'],
  'code': 'strides = _prefix_product(parallel_size)\n'
          'masked_shape = [s for s, m in zip(parallel_size, mask) if m]\n'
          'unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]\n'
          'masked_strides = [st for st, m in zip(strides, mask) if m]\n'
          'unmasked_strides = _prefix_product(unmasked_shape)\n'
          'group_size = 1\n'
          'for s in masked_shape:\n'
          '    group_size *= s\n'
          'num_groups = world_size // group_size\n'
          'groups = []\n'
          'for g in range(num_groups):\n'
          '    base = sum(c * st for c, st in zip(_decompose(g, unmasked_shape), unmasked_strides))\n'
          '    groups.append([base + sum(c * st for c, st in zip(_decompose(i, masked_shape), masked_strides))\n'
          '                   for i in range(group_size)])\n'
          'return groups\n',
  'half': 'dev'},
 {'exercise': 'parallel_state.get_ranks',
  'name': 'last dimension fastest',
  'expect': 'coordinates decomposed with the LAST dimension fastest: groups are the wrong ranks (order)',
  'words': ['fastest', 'order', 'group'],
  'code': 'import itertools\n'
          'masked = [i for i, m in enumerate(mask) if m]\n'
          'unmasked = [i for i, m in enumerate(mask) if not m]\n'
          'strides = _prefix_product(parallel_size)\n'
          'groups = []\n'
          'for u in itertools.product(*[range(parallel_size[i]) for i in unmasked]):\n'
          '    base = sum(c * strides[i] for c, i in zip(u, unmasked))\n'
          '    groups.append([base + sum(c * strides[i] for c, i in zip(v, masked))\n'
          '                   for v in itertools.product(*[range(parallel_size[i]) for i in masked])])\n'
          'return groups\n',
  'half': 'held'},
 {'exercise': 'parallel_state.create_groups',
  'name': 'only my group is created',
  'expect': 'new_group called only for the own group: the ranks disagree on the collective (hang / mismatch)',
  'words': ['every group', 'new_group', 'hang', 'all_ranks', 'same order'],
  'code': 'for ranks in all_ranks:\n'
          '    if rank in ranks:\n'
          '        return dist.new_group(ranks), list(ranks)\n'
          'return None, None\n',
  'half': 'dev'},
 {'exercise': 'parallel_state.create_groups',
  'name': 'breaks after its group',
  'expect': 'stops creating groups once its own is found: later groups missing on some ranks',
  'words': ['every group', 'new_group', 'hang', 'early', 'break', 'same order'],
  'code': 'mine, mine_ranks = None, None\n'
          'for ranks in all_ranks:\n'
          '    group = dist.new_group(ranks)\n'
          '    if rank in ranks:\n'
          '        mine, mine_ranks = group, list(ranks)\n'
          '        break\n'
          'return mine, mine_ranks\n',
  'half': 'held'},
 {'exercise': 'parallel_state.create_groups',
  'name': 'keeps the last group',
  'expect': 'returns the last group created, not the one holding rank',
  'words': ['not in', 'holding', 'contain', 'last', 'rank'],
  'code': 'group, ranks = None, None\n'
          'for ranks in all_ranks:\n'
          '    group = dist.new_group(ranks)\n'
          'return group, list(ranks) if ranks is not None else None\n',
  'half': 'dev'},
 {'exercise': 'model.core_attention',
  'name': 'scale 1/hn',
  'expect': 'scores scaled by 1/hn instead of 1/sqrt(hn) (softmax too flat)',
  'words': ['scale', 'sqrt', 'hn'],
  'code': 'q = query.reshape(s, b * np_, hn).transpose(0, 1)   # [b*np, s, hn]\n'
          'k = key.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'v = value.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'scores = torch.bmm(q, k.transpose(1, 2)) / hn   # [b*np, s, s]\n'
          'mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)\n'
          'scores = scores.masked_fill(mask, float("-inf"))\n'
          'probs = torch.softmax(scores, dim=-1)\n'
          'probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)\n'
          'context = torch.bmm(probs, v)                              # [b*np, s, hn]\n'
          'return context.transpose(0, 1).reshape(s, b, np_ * hn)\n',
  'half': 'held'},
 {'exercise': 'model.core_attention',
  'name': 'diagonal masked too',
  'expect': 'the mask hides the diagonal (triu(0)): a query cannot see itself, first row NaN',
  'words': ['diagonal', 'nan', 'itself', 'triu'],
  'code': 'q = query.reshape(s, b * np_, hn).transpose(0, 1)   # [b*np, s, hn]\n'
          'k = key.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'v = value.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hn)   # [b*np, s, s]\n'
          'mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(0)\n'
          'scores = scores.masked_fill(mask, float("-inf"))\n'
          'probs = torch.softmax(scores, dim=-1)\n'
          'probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)\n'
          'context = torch.bmm(probs, v)                              # [b*np, s, hn]\n'
          'return context.transpose(0, 1).reshape(s, b, np_ * hn)\n',
  'half': 'dev'},
 {'exercise': 'model.core_attention',
  'name': 'softmax over the queries',
  'expect': 'softmax over dim -2 (queries) instead of keys',
  'words': ['softmax', 'dim', 'keys', 'sum to 1'],
  'code': 'q = query.reshape(s, b * np_, hn).transpose(0, 1)   # [b*np, s, hn]\n'
          'k = key.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'v = value.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hn)   # [b*np, s, s]\n'
          'mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)\n'
          'scores = scores.masked_fill(mask, float("-inf"))\n'
          'probs = torch.softmax(scores, dim=-2)\n'
          'probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)\n'
          'context = torch.bmm(probs, v)                              # [b*np, s, hn]\n'
          'return context.transpose(0, 1).reshape(s, b, np_ * hn)\n',
  'half': 'held'},
 {'exercise': 'model.core_attention',
  'name': 'no causal mask',
  'expect': 'no causal mask: positions see the future',
  'words': ['causal', 'future', 'mask', 'later'],
  'code': 'q = query.reshape(s, b * np_, hn).transpose(0, 1)   # [b*np, s, hn]\n'
          'k = key.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'v = value.reshape(s, b * np_, hn).transpose(0, 1)\n'
          'scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hn)   # [b*np, s, s]\n'
          'mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)\n'
          'probs = torch.softmax(scores, dim=-1)\n'
          'probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)\n'
          'context = torch.bmm(probs, v)                              # [b*np, s, hn]\n'
          'return context.transpose(0, 1).reshape(s, b, np_ * hn)\n',
  'half': 'dev'},
 {'exercise': 'model.mlp',
  'name': 'activation on both halves',
  'expect': 'the activation is applied to up as well as gate',
  'words': ['both', 'up', 'gate', 'activation'],
  'code': 'y = self.linear_fc1(hidden_states)\n'
          'if self.gated:\n'
          '    gate, up = torch.chunk(y, 2, dim=-1)\n'
          '    y = self.activation_func(gate) * self.activation_func(up)\n'
          'else:\n'
          '    y = self.activation_func(y)\n'
          'return self.linear_fc2(y)\n',
  'half': 'held'},
 {'exercise': 'model.mlp',
  'name': 'halves swapped',
  'expect': 'activation on the second half: act(up) * gate',
  'words': ['half', 'swap', 'gate', 'up'],
  'code': 'y = self.linear_fc1(hidden_states)\n'
          'if self.gated:\n'
          '    up, gate = torch.chunk(y, 2, dim=-1)\n'
          '    y = self.activation_func(gate) * up\n'
          'else:\n'
          '    y = self.activation_func(y)\n'
          'return self.linear_fc2(y)\n',
  'half': 'dev'},
 {'exercise': 'model.mlp',
  'name': 'no activation without gating',
  'expect': 'the non-gated MLP skips the activation (linear)',
  'words': ['activation', 'gated', 'linear'],
  'code': 'y = self.linear_fc1(hidden_states)\n'
          'if self.gated:\n'
          '    gate, up = torch.chunk(y, 2, dim=-1)\n'
          '    y = self.activation_func(gate) * up\n'
          'else:\n'
          '    pass\n'
          'return self.linear_fc2(y)\n',
  'half': 'held'},
 {'exercise': 'model.norm',
  'name': 'statistics in the input dtype',
  'expect': 'mean of squares computed in bf16/fp16 (no float32 upcast)',
  'words': ['float32', 'float16', 'bfloat16', 'dtype', 'upcast'],
  'code': 'xf = x\n'
          'y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)\n'
          'return (y * self.weight.float()).to(x.dtype)\n',
  'half': 'dev'},
 {'exercise': 'model.norm',
  'name': 'mean over the whole tensor',
  'expect': 'one RMS for the whole tensor, not per token (last dim)',
  'words': ['last dim', 'per token', 'dim', 'whole'],
  'code': 'xf = x.float()\n'
          'y = xf * torch.rsqrt(xf.pow(2).mean() + self.eps)\n'
          'return (y * self.weight.float()).to(x.dtype)\n',
  'half': 'held'},
 {'exercise': 'model.norm',
  'name': 'LayerNorm: subtracts the mean',
  'expect': 'subtracts the mean first (LayerNorm, not RMSNorm)',
  'words': ['mean', 'layernorm', 'centre', 'center'],
  'code': 'xf = x.float()\n'
          'xf = xf - xf.mean(dim=-1, keepdim=True)\n'
          'y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)\n'
          'return (y * self.weight.float()).to(x.dtype)\n',
  'half': 'dev'},
 {'exercise': 'model.norm',
  'name': 'eps outside the root',
  'expect': 'eps added after rsqrt instead of inside: tiny vectors blow up',
  'words': ['eps'],
  'code': 'xf = x.float()\n'
          'y = xf * (torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True)) + self.eps)\n'
          'return (y * self.weight.float()).to(x.dtype)\n',
  'half': 'held'},
 {'exercise': 'model.layer_forward',
  'name': 'residual onto the normalised copy',
  'expect': 'the residual is the normalised input, not the stream',
  'words': ['residual', 'norm'],
  'code': 'residual = self.input_layernorm(hidden_states)\n'
          'attn = self.self_attention(residual, rotary_pos_emb=rotary_pos_emb,\n'
          '                           packed_seq_params=packed_seq_params)\n'
          'hidden_states = residual + F.dropout(attn, p=self.hidden_dropout, training=self.training)\n'
          'residual = hidden_states\n'
          'mlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))\n'
          'return residual + F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)\n',
  'half': 'dev'},
 {'exercise': 'model.layer_forward',
  'name': 'MLP residual from the layer input',
  'expect': 'the MLP block adds the layer INPUT back, not the stream after attention',
  'words': ['residual', 'input', 'attention'],
  'code': 'residual = hidden_states\n'
          'attn = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb=rotary_pos_emb,\n'
          '                           packed_seq_params=packed_seq_params)\n'
          'hidden_states = residual + F.dropout(attn, p=self.hidden_dropout, training=self.training)\n'
          'mlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))\n'
          'return residual + F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)\n',
  'half': 'held'},
 {'exercise': 'model.layer_forward',
  'name': 'dropout always on',
  'expect': 'dropout applied in eval mode too (training=True)',
  'words': ['dropout', 'eval', 'training'],
  'code': 'residual = hidden_states\n'
          'attn = self.self_attention(self.input_layernorm(hidden_states), rotary_pos_emb=rotary_pos_emb,\n'
          '                           packed_seq_params=packed_seq_params)\n'
          'hidden_states = residual + F.dropout(attn, p=self.hidden_dropout, training=True)\n'
          'residual = hidden_states\n'
          'mlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))\n'
          'return residual + F.dropout(mlp_out, p=self.hidden_dropout, training=True)\n',
  'half': 'dev'},
 {'exercise': 'model.gpt_forward',
  'name': 'logits not transposed',
  'expect': 'returns logits [s, b, V], not [b, s, V]',
  'words': ['transpose', '\\[s, b', 'shape'],
  'code': 'if self.pre_process:\n'
          '    hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]\n'
          'else:\n'
          "    hidden_states = input_ids  # the previous chunk's [s, b, h]\n"
          'rotary_pos_emb = None\n'
          'if self.rotary_pos_emb is not None:\n'
          '    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)\n'
          'hidden_states = self.decoder(hidden_states, rotary_pos_emb=rotary_pos_emb, '
          'packed_seq_params=packed_seq_params)\n'
          'if not self.post_process:\n'
          '    return hidden_states\n'
          'logits = self.output(hidden_states)  # [b, s, V]\n'
          'if labels is None:\n'
          '    return logits\n'
          'return self.compute_language_model_loss(labels, logits)\n',
  'half': 'held'},
 {'exercise': 'model.gpt_forward',
  'name': 'rotary angles dropped',
  'expect': 'the decoder gets no rotary angles (RoPE missing)',
  'words': ['rotary', 'rope', 'position'],
  'code': 'if self.pre_process:\n'
          '    hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]\n'
          'else:\n'
          "    hidden_states = input_ids  # the previous chunk's [s, b, h]\n"
          'rotary_pos_emb = None\n'
          'if self.rotary_pos_emb is not None:\n'
          '    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)\n'
          'hidden_states = self.decoder(hidden_states, rotary_pos_emb=None, packed_seq_params=packed_seq_params)\n'
          'if not self.post_process:\n'
          '    return hidden_states\n'
          'logits = self.output(hidden_states).transpose(0, 1).contiguous()  # [b, s, V]\n'
          'if labels is None:\n'
          '    return logits\n'
          'return self.compute_language_model_loss(labels, logits)\n',
  'half': 'dev'},
 {'exercise': 'model.gpt_forward',
  'name': 'logits even with labels',
  'expect': 'with labels returns logits, not the per-token loss',
  'words': ['label', 'loss'],
  'code': 'if self.pre_process:\n'
          '    hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]\n'
          'else:\n'
          "    hidden_states = input_ids  # the previous chunk's [s, b, h]\n"
          'rotary_pos_emb = None\n'
          'if self.rotary_pos_emb is not None:\n'
          '    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)\n'
          'hidden_states = self.decoder(hidden_states, rotary_pos_emb=rotary_pos_emb, '
          'packed_seq_params=packed_seq_params)\n'
          'if not self.post_process:\n'
          '    return hidden_states\n'
          'logits = self.output(hidden_states).transpose(0, 1).contiguous()  # [b, s, V]\n'
          'return logits\n',
  'half': 'held'},
 {'exercise': 'model.gpt_forward',
  'name': 'always embeds',
  'expect': 'a later pipeline chunk embeds its input again (pre_process ignored)',
  'words': ['pre_process', 'pipeline', 'embed'],
  'code': 'hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]\n'
          'rotary_pos_emb = None\n'
          'if self.rotary_pos_emb is not None:\n'
          '    rotary_pos_emb = self.rotary_pos_emb(self.rotary_seq_len(hidden_states), packed_seq_params)\n'
          'hidden_states = self.decoder(hidden_states, rotary_pos_emb=rotary_pos_emb, '
          'packed_seq_params=packed_seq_params)\n'
          'if not self.post_process:\n'
          '    return hidden_states\n'
          'logits = self.output(hidden_states).transpose(0, 1).contiguous()  # [b, s, V]\n'
          'if labels is None:\n'
          '    return logits\n'
          'return self.compute_language_model_loss(labels, logits)\n',
  'half': 'dev'},
 {'exercise': 'model.recompute',
  'name': 'RNG not restored',
  'expect': "the replay draws new dropout masks: gradients differ from the forward's",
  'words': ['rng', 'random', 'dropout', 'mask', 'seed'],
  'code': 'saved = ctx.saved_tensors\n'
          'args = list(ctx.non_tensor_args)\n'
          'for i, t in zip(ctx.tensor_indices, saved):\n'
          '    d = t.detach()\n'
          '    d.requires_grad_(t.requires_grad)\n'
          '    args[i] = d\n'
          'with torch.random.fork_rng(devices=ctx.cuda_devices):\n'
          '    with torch.enable_grad():\n'
          '        outputs = ctx.run_function(*args)\n'
          'if torch.is_tensor(outputs):\n'
          '    outputs = (outputs,)\n'
          'pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]\n'
          'torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])\n'
          'return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in args)\n',
  'half': 'held'},
 {'exercise': 'model.recompute',
  'name': 'no enable_grad',
  'expect': 'the replay runs with grad off (backward mode): no graph to backprop',
  'words': ['enable_grad', 'grad mode', 'graph', 'grad'],
  'code': 'saved = ctx.saved_tensors\n'
          'args = list(ctx.non_tensor_args)\n'
          'for i, t in zip(ctx.tensor_indices, saved):\n'
          '    d = t.detach()\n'
          '    d.requires_grad_(t.requires_grad)\n'
          '    args[i] = d\n'
          'with torch.random.fork_rng(devices=ctx.cuda_devices):\n'
          '    torch.set_rng_state(ctx.cpu_rng_state)\n'
          '    for dev, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):\n'
          '        torch.cuda.set_rng_state(state, dev)\n'
          '    outputs = ctx.run_function(*args)\n'
          'if torch.is_tensor(outputs):\n'
          '    outputs = (outputs,)\n'
          'pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]\n'
          'torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])\n'
          'return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in args)\n',
  'half': 'dev'},
 {'exercise': 'model.recompute',
  'name': 'RNG restored outside fork_rng',
  'expect': "sets the RNG state without fork_rng: the draws after the backward repeat the forward's",
  'words': ['fork_rng', 'rng', 'random', 'after'],
  'code': 'saved = ctx.saved_tensors\n'
          'args = list(ctx.non_tensor_args)\n'
          'for i, t in zip(ctx.tensor_indices, saved):\n'
          '    d = t.detach()\n'
          '    d.requires_grad_(t.requires_grad)\n'
          '    args[i] = d\n'
          'if True:\n'
          '    torch.set_rng_state(ctx.cpu_rng_state)\n'
          '    for dev, state in zip(ctx.cuda_devices, ctx.cuda_rng_states):\n'
          '        torch.cuda.set_rng_state(state, dev)\n'
          '    with torch.enable_grad():\n'
          '        outputs = ctx.run_function(*args)\n'
          'if torch.is_tensor(outputs):\n'
          '    outputs = (outputs,)\n'
          'pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]\n'
          'torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])\n'
          'return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in args)\n',
  'half': 'held'},
 {'exercise': 'data_parallel.grad_hook',
  'name': 'copy instead of add',
  'expect': 'micro-batch gradients overwrite instead of accumulating (no_sync: only the last micro-batch)',
  'words': ['accumul', 'add', 'micro', 'last'],
  'code': 'grad_data = self._bucket_grad_data(bucket)\n'
          'start, end = bucket.ranges[param]\n'
          'grad_data[start:end].copy_(param.grad.reshape(-1))\n'
          'param.grad = None\n'
          'bucket.pending.discard(param)\n'
          'if not bucket.pending:\n'
          '    bucket.pending = set(bucket.params)  # ready for the next backward\n'
          '    if self.zero_stage == 3:\n'
          '        self._free_params(bucket)\n'
          '    if self._sync and self.overlap_grad_reduce:\n'
          '        self.start_grad_sync(bucket)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.grad_hook',
  'name': 'pending never refilled',
  'expect': 'pending not refilled: buckets launch only in the first backward',
  'words': ['pending', 'second', 'launch', 'refill'],
  'code': 'grad_data = self._bucket_grad_data(bucket)\n'
          'start, end = bucket.ranges[param]\n'
          'grad_data[start:end].add_(param.grad.reshape(-1))\n'
          'param.grad = None\n'
          'bucket.pending.discard(param)\n'
          'if not bucket.pending:\n'
          '    if self.zero_stage == 3:\n'
          '        self._free_params(bucket)\n'
          '    if self._sync and self.overlap_grad_reduce:\n'
          '        self.start_grad_sync(bucket)\n',
  'half': 'held'},
 {'exercise': 'data_parallel.grad_hook',
  'name': 'launches inside no_sync',
  'expect': 'launches the bucket even inside no_sync(): reduced every micro-batch',
  'words': ['no_sync', 'launch', 'twice'],
  'code': 'grad_data = self._bucket_grad_data(bucket)\n'
          'start, end = bucket.ranges[param]\n'
          'grad_data[start:end].add_(param.grad.reshape(-1))\n'
          'param.grad = None\n'
          'bucket.pending.discard(param)\n'
          'if not bucket.pending:\n'
          '    bucket.pending = set(bucket.params)  # ready for the next backward\n'
          '    if self.zero_stage == 3:\n'
          '        self._free_params(bucket)\n'
          '    if self.overlap_grad_reduce:\n'
          '        self.start_grad_sync(bucket)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.grad_hook',
  'name': 'param.grad kept',
  'expect': 'param.grad is not dropped: the gradient lives twice',
  'words': ['param.grad', 'drop', 'none', 'memory'],
  'code': 'grad_data = self._bucket_grad_data(bucket)\n'
          'start, end = bucket.ranges[param]\n'
          'grad_data[start:end].add_(param.grad.reshape(-1))\n'
          'bucket.pending.discard(param)\n'
          'if not bucket.pending:\n'
          '    bucket.pending = set(bucket.params)  # ready for the next backward\n'
          '    if self.zero_stage == 3:\n'
          '        self._free_params(bucket)\n'
          '    if self._sync and self.overlap_grad_reduce:\n'
          '        self.start_grad_sync(bucket)\n',
  'half': 'held'},
 {'exercise': 'data_parallel.finish_grad_sync',
  'name': 'unlaunched buckets not launched',
  'expect': 'waits only on launched buckets: with overlap off nothing is reduced (grads are local)',
  'words': ['launch', 'overlap', 'local', 'averag'],
  'code': 'for bucket in self.buckets:\n'
          '    if bucket.handle is None:\n'
          '        continue\n'
          '    bucket.handle.wait()\n'
          '    if not bucket.done_seen:\n'
          '        self.timeline.append((time.perf_counter(), "done", bucket.index))\n'
          '    bucket.handle, bucket.done_seen = None, False\n'
          '    if self.zero_stage >= 2:\n'
          '        bucket.grad_data = None\n'
          '    elif self.zero_stage == 0:\n'
          '        for p, (start, end) in bucket.ranges.items():\n'
          '            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.finish_grad_sync',
  'name': 'stage 0 grads not exposed',
  'expect': 'at stage 0 p.grad is not pointed at the buffer: grads missing / unreduced',
  'words': ['p.grad', 'grad', 'stage 0', 'buffer'],
  'code': 'for bucket in self.buckets:\n'
          '    if bucket.handle is None:\n'
          '        self.start_grad_sync(bucket)\n'
          '        bucket.pending = set(bucket.params)\n'
          'for bucket in self.buckets:\n'
          '    bucket.handle.wait()\n'
          '    if not bucket.done_seen:\n'
          '        self.timeline.append((time.perf_counter(), "done", bucket.index))\n'
          '    bucket.handle, bucket.done_seen = None, False\n'
          '    if self.zero_stage >= 2:\n'
          '        bucket.grad_data = None\n',
  'half': 'held'},
 {'exercise': 'data_parallel.finish_grad_sync',
  'name': 'handles not cleared',
  'expect': "handle never reset: the next step's launch says reduced twice / waits on old handle",
  'words': ['handle', 'twice', 'next step'],
  'code': 'for bucket in self.buckets:\n'
          '    if bucket.handle is None:\n'
          '        self.start_grad_sync(bucket)\n'
          '        bucket.pending = set(bucket.params)\n'
          'for bucket in self.buckets:\n'
          '    bucket.handle.wait()\n'
          '    if not bucket.done_seen:\n'
          '        self.timeline.append((time.perf_counter(), "done", bucket.index))\n'
          '    if self.zero_stage >= 2:\n'
          '        bucket.grad_data = None\n'
          '    elif self.zero_stage == 0:\n'
          '        for p, (start, end) in bucket.ranges.items():\n'
          '            p.grad = bucket.grad_data[start:end].view_as(p).to(p.dtype)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.build_buckets',
  'name': 'forward order',
  'expect': 'parameters bucketed first to last, not reversed',
  'words': ['reverse', 'order', 'last'],
  'code': 'buckets, ids, count, start = [], [], 0, 0\n'
          'for i in range(len(numels)):\n'
          '    ids.append(i)\n'
          '    count += numels[i]\n'
          '    if count >= bucket_size:\n'
          '        end = start + _round_up(count, pad_to)\n'
          '        buckets.append((ids, start, end))\n'
          '        start, ids, count = end, [], 0\n'
          'if ids:\n'
          '    buckets.append((ids, start, start + _round_up(count, pad_to)))\n'
          'return buckets\n',
  'half': 'held'},
 {'exercise': 'data_parallel.build_buckets',
  'name': 'closes at > bucket_size',
  'expect': 'a bucket closes only when it exceeds bucket_size (> instead of >=)',
  'words': ['>=', 'bucket_size', 'close'],
  'code': 'buckets, ids, count, start = [], [], 0, 0\n'
          'for i in reversed(range(len(numels))):\n'
          '    ids.append(i)\n'
          '    count += numels[i]\n'
          '    if count > bucket_size:\n'
          '        end = start + _round_up(count, pad_to)\n'
          '        buckets.append((ids, start, end))\n'
          '        start, ids, count = end, [], 0\n'
          'if ids:\n'
          '    buckets.append((ids, start, start + _round_up(count, pad_to)))\n'
          'return buckets\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.build_buckets',
  'name': 'no padding',
  'expect': 'bucket lengths not padded to pad_to',
  'words': ['pad'],
  'code': 'buckets, ids, count, start = [], [], 0, 0\n'
          'for i in reversed(range(len(numels))):\n'
          '    ids.append(i)\n'
          '    count += numels[i]\n'
          '    if count >= bucket_size:\n'
          '        end = start + count\n'
          '        buckets.append((ids, start, end))\n'
          '        start, ids, count = end, [], 0\n'
          'if ids:\n'
          '    buckets.append((ids, start, start + count))\n'
          'return buckets\n',
  'half': 'held'},
 {'exercise': 'data_parallel.reduce_scatter',
  'name': 'stage 1 into grad_shard',
  'expect': 'stage 1 writes its shard into grad_shard instead of the full buffer',
  'words': ['stage 1', 'grad_shard', 'buffer'],
  'code': 'bucket.handle = reduce_scatter(bucket.grad_shard, grad_data, self.group, async_op=True)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.reduce_scatter',
  'name': 'buffer shard at every stage',
  'expect': "stage 2/3 write into the buffer's shard, grad_shard stays zero",
  'words': ['stage 2', 'grad_shard', 'zero'],
  'code': 'bucket.handle = reduce_scatter(grad_data[bucket.shard], grad_data, self.group, async_op=True)\n',
  'half': 'held'},
 {'exercise': 'data_parallel.reduce_scatter',
  'name': 'synchronous, no handle',
  'expect': 'reduce-scatter run synchronously, bucket.handle left None: finish launches again (grads divided twice / '
            'reduced twice)',
  'words': ['handle', 'twice', 'async'],
  'code': 'output = grad_data[bucket.shard] if self.zero_stage == 1 else bucket.grad_shard\n'
          'reduce_scatter(output, grad_data, self.group)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.zero3_gather',
  'name': 'storage not re-allocated',
  'expect': 'gathers into 0-byte storage (no resize)',
  'words': ['storage', 'resize', '0 bytes', 'size'],
  'code': 'all_gather(bucket.param_data, bucket.param_shard, self.group)\n',
  'half': 'held'},
 {'exercise': 'data_parallel.zero3_gather',
  'name': 'resize in elements, not bytes',
  'expect': 'storage resized to numel bytes (element_size forgotten): too small',
  'words': ['bytes', 'element_size', 'resize', 'storage'],
  'code': 'bucket.param_data.untyped_storage().resize_(bucket.numel)\n'
          'all_gather(bucket.param_data, bucket.param_shard, self.group)\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.zero3_gather',
  'name': 'gathers into a new tensor',
  'expect': 'gathers into a fresh tensor: the parameters (views of param_data) stay empty',
  'words': ['view', 'param_data', 'storage', 'new tensor'],
  'code': 'full = torch.empty(bucket.numel, dtype=bucket.param_shard.dtype, device=bucket.param_shard.device)\n'
          'all_gather(full, bucket.param_shard, self.group)\n'
          'bucket.param_data = full\n',
  'half': 'held'},
 {'exercise': 'data_parallel.zero_step',
  'name': 'main params not copied back',
  'expect': 'the updated fp32 main params are not copied into the model: bf16/fp16 weights do not move',
  'words': ['main param', 'copy', 'fp32', 'not updated', 'unchanged'],
  'code': 'self.optimizer.step()\n'
          'if self.ddp.zero_stage < 3:\n'
          '    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)\n'
          '               for b, shard in zip(self.ddp.buckets, self.shards)]\n'
          '    for handle in handles:\n'
          '        handle.wait()\n',
  'half': 'dev'},
 {'exercise': 'data_parallel.zero_step',
  'name': 'no all-gather',
  'expect': 'each rank keeps the old values of the other shards (no all-gather)',
  'words': ['all-gather', 'all_gather', 'other shard', 'old'],
  'code': 'self.optimizer.step()\nself._copy_main_params_to_model_params()\n',
  'half': 'held'},
 {'exercise': 'data_parallel.zero_step',
  'name': 'all-gather at stage 3 too',
  'expect': 'all-gathers at stage 3 into freed storage',
  'words': ['stage 3'],
  'code': 'self.optimizer.step()\n'
          'self._copy_main_params_to_model_params()\n'
          'if True:\n'
          '    handles = [all_gather(b.param_data, shard, self.ddp.group, async_op=True)\n'
          '               for b, shard in zip(self.ddp.buckets, self.shards)]\n'
          '    for handle in handles:\n'
          '        handle.wait()\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_cross_entropy',
  'name': 'local max only',
  'expect': 'each rank subtracts its own max: the sum of exps mixes scales (loss off)',
  'words': ['max'],
  'code': 'ctx.label_smoothing, ctx.group = label_smoothing, group\n'
          'logits = vocab_parallel_logits\n'
          'local_v = logits.shape[-1]\n'
          'vocab_size = local_v * dist.get_world_size(group)\n'
          "ctx.vocab_size = vocab_size  # the backward's reference reads it (the grader's message)\n"
          'start = dist.get_rank(group) * local_v\n'
          'end = start + local_v\n'
          '# m: the global max of every row\n'
          'logits_max = logits.max(dim=-1).values\n'
          'shifted = logits - logits_max.unsqueeze(-1)\n'
          '# z_y - m: only the rank owning the label has it\n'
          'outside = (target < start) | (target >= end)\n'
          'local_target = (target - start).masked_fill(outside, 0)\n'
          'predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)\n'
          'dist.all_reduce(predicted, group=group)\n'
          '# S (and, for label smoothing, the sum of the logits) in one all-reduce\n'
          'exp = shifted.exp()\n'
          'if label_smoothing > 0:\n'
          '    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n'
          '    dist.all_reduce(sums, group=group)\n'
          '    sum_exp, sum_z = sums[0], sums[1]\n'
          'else:\n'
          '    sum_exp = exp.sum(dim=-1)\n'
          '    dist.all_reduce(sum_exp, group=group)\n'
          'log_s = sum_exp.log()\n'
          'loss = log_s - predicted\n'
          'if label_smoothing > 0:\n'
          '    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\n'
          'softmax = exp / sum_exp.unsqueeze(-1)\n'
          'ctx.save_for_backward(softmax, outside, local_target)\n'
          'return loss\n',
  'half': 'held'},
 {'exercise': 'tp.vocab_cross_entropy',
  'name': 'target logit not masked',
  'expect': 'every rank contributes a target logit (not zeroed outside its range): z_y summed t times',
  'words': ['outside', 'target', 'range', 'mask'],
  'code': 'ctx.label_smoothing, ctx.group = label_smoothing, group\n'
          'logits = vocab_parallel_logits\n'
          'local_v = logits.shape[-1]\n'
          'vocab_size = local_v * dist.get_world_size(group)\n'
          "ctx.vocab_size = vocab_size  # the backward's reference reads it (the grader's message)\n"
          'start = dist.get_rank(group) * local_v\n'
          'end = start + local_v\n'
          '# m: the global max of every row\n'
          'logits_max = logits.max(dim=-1).values\n'
          'dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\n'
          'shifted = logits - logits_max.unsqueeze(-1)\n'
          '# z_y - m: only the rank owning the label has it\n'
          'outside = (target < start) | (target >= end)\n'
          'local_target = (target - start).masked_fill(outside, 0)\n'
          'predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)\n'
          'dist.all_reduce(predicted, group=group)\n'
          '# S (and, for label smoothing, the sum of the logits) in one all-reduce\n'
          'exp = shifted.exp()\n'
          'if label_smoothing > 0:\n'
          '    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n'
          '    dist.all_reduce(sums, group=group)\n'
          '    sum_exp, sum_z = sums[0], sums[1]\n'
          'else:\n'
          '    sum_exp = exp.sum(dim=-1)\n'
          '    dist.all_reduce(sum_exp, group=group)\n'
          'log_s = sum_exp.log()\n'
          'loss = log_s - predicted\n'
          'if label_smoothing > 0:\n'
          '    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\n'
          'softmax = exp / sum_exp.unsqueeze(-1)\n'
          'ctx.save_for_backward(softmax, outside, local_target)\n'
          'return loss\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_cross_entropy',
  'name': 'vocab_size is the local slice',
  'expect': 'ctx.vocab_size (and smoothing) use V/t instead of V',
  'words': ['vocab_size', 'V/t', 'whole', 'smoothing'],
  'code': 'ctx.label_smoothing, ctx.group = label_smoothing, group\n'
          'logits = vocab_parallel_logits\n'
          'local_v = logits.shape[-1]\n'
          'vocab_size = local_v\n'
          "ctx.vocab_size = vocab_size  # the backward's reference reads it (the grader's message)\n"
          'start = dist.get_rank(group) * local_v\n'
          'end = start + local_v\n'
          '# m: the global max of every row\n'
          'logits_max = logits.max(dim=-1).values\n'
          'dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\n'
          'shifted = logits - logits_max.unsqueeze(-1)\n'
          '# z_y - m: only the rank owning the label has it\n'
          'outside = (target < start) | (target >= end)\n'
          'local_target = (target - start).masked_fill(outside, 0)\n'
          'predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)\n'
          'dist.all_reduce(predicted, group=group)\n'
          '# S (and, for label smoothing, the sum of the logits) in one all-reduce\n'
          'exp = shifted.exp()\n'
          'if label_smoothing > 0:\n'
          '    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n'
          '    dist.all_reduce(sums, group=group)\n'
          '    sum_exp, sum_z = sums[0], sums[1]\n'
          'else:\n'
          '    sum_exp = exp.sum(dim=-1)\n'
          '    dist.all_reduce(sum_exp, group=group)\n'
          'log_s = sum_exp.log()\n'
          'loss = log_s - predicted\n'
          'if label_smoothing > 0:\n'
          '    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\n'
          'softmax = exp / sum_exp.unsqueeze(-1)\n'
          'ctx.save_for_backward(softmax, outside, local_target)\n'
          'return loss\n',
  'half': 'held'},
 {'exercise': 'tp.vocab_cross_entropy',
  'name': 'sum of exp not all-reduced',
  'expect': "log S from this rank's slice only",
  'words': ['sum', 'exp', 'log S', 'all-reduce'],
  'code': 'ctx.label_smoothing, ctx.group = label_smoothing, group\n'
          'logits = vocab_parallel_logits\n'
          'local_v = logits.shape[-1]\n'
          'vocab_size = local_v * dist.get_world_size(group)\n'
          "ctx.vocab_size = vocab_size  # the backward's reference reads it (the grader's message)\n"
          'start = dist.get_rank(group) * local_v\n'
          'end = start + local_v\n'
          '# m: the global max of every row\n'
          'logits_max = logits.max(dim=-1).values\n'
          'dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\n'
          'shifted = logits - logits_max.unsqueeze(-1)\n'
          '# z_y - m: only the rank owning the label has it\n'
          'outside = (target < start) | (target >= end)\n'
          'local_target = (target - start).masked_fill(outside, 0)\n'
          'predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)\n'
          'dist.all_reduce(predicted, group=group)\n'
          '# S (and, for label smoothing, the sum of the logits) in one all-reduce\n'
          'exp = shifted.exp()\n'
          'if label_smoothing > 0:\n'
          '    sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])\n'
          '    dist.all_reduce(sums, group=group)\n'
          '    sum_exp, sum_z = sums[0], sums[1]\n'
          'else:\n'
          '    sum_exp = exp.sum(dim=-1)\n'
          'log_s = sum_exp.log()\n'
          'loss = log_s - predicted\n'
          'if label_smoothing > 0:\n'
          '    loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sum_z / vocab_size)\n'
          'softmax = exp / sum_exp.unsqueeze(-1)\n'
          'ctx.save_for_backward(softmax, outside, local_target)\n'
          'return loss\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_cross_entropy_backward',
  'name': 'one-hot not masked',
  'expect': 'the one-hot is subtracted on every rank (also where the target lives elsewhere)',
  'words': ['outside', 'one-hot', 'onehot', 'other rank'],
  'code': "vocab_size = ctx.vocab_size  # set by forward (the grader's message)\n"
          'grad_input = softmax.clone()\n'
          'onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)\n'
          'grad_input -= (1 - a) * onehot\n'
          'if a > 0:\n'
          '    grad_input -= a / vocab_size\n'
          'grad_input *= grad_output.unsqueeze(-1)\n',
  'half': 'held'},
 {'exercise': 'tp.vocab_cross_entropy_backward',
  'name': 'grad_output ignored',
  'expect': 'not scaled by grad_output',
  'words': ['grad_output', 'scale', 'x the'],
  'code': "vocab_size = ctx.vocab_size  # set by forward (the grader's message)\n"
          'grad_input = softmax.clone()\n'
          'onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)\n'
          'onehot.masked_fill_(outside.unsqueeze(-1), 0.0)\n'
          'grad_input -= (1 - a) * onehot\n'
          'if a > 0:\n'
          '    grad_input -= a / vocab_size\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_cross_entropy_backward',
  'name': 'smoothing over the local vocabulary',
  'expect': 'a/(V/t) instead of a/V',
  'words': ['vocab', 'smoothing', 'V/t', 'a/V'],
  'code': "vocab_size = ctx.vocab_size  # set by forward (the grader's message)\n"
          'grad_input = softmax.clone()\n'
          'onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)\n'
          'onehot.masked_fill_(outside.unsqueeze(-1), 0.0)\n'
          'grad_input -= (1 - a) * onehot\n'
          'if a > 0:\n'
          '    grad_input -= a / grad_input.shape[-1]\n'
          'grad_input *= grad_output.unsqueeze(-1)\n',
  'half': 'held'},
 {'exercise': 'tp.column_forward',
  'name': 'always gathers',
  'expect': 'gathers the output even when gather_output is False',
  'words': ['gather_output', 'gather', 'shape'],
  'code': 'output = column_parallel_linear(input_, self.weight, self.bias, self.sequence_parallel, self.tp_group)\n'
          'if True:\n'
          '    output = gather_from_tensor_model_parallel_region(output, self.tp_group)\n'
          'return output\n',
  'half': 'dev'},
 {'exercise': 'tp.column_forward',
  'name': 'plain F.linear',
  'expect': "no f: the input gradient is only this rank's part (not summed over TP)",
  'words': ['input grad', 'dX', 'sum', 'f ', 'copy_to'],
  'code': 'output = F.linear(input_, self.weight, self.bias)\n'
          'if self.gather_output:\n'
          '    output = gather_from_tensor_model_parallel_region(output, self.tp_group)\n'
          'return output\n',
  'half': 'held'},
 {'exercise': 'tp.row_forward',
  'name': 'bias before the reduce',
  'expect': 'the bias is added on every rank before the sum: t times the bias',
  'words': ['bias'],
  'code': 'x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)\n'
          'partial = F.linear(x, self.weight, self.bias)\n'
          'if self.sequence_parallel:\n'
          '    return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)\n'
          'return reduce_from_tensor_model_parallel_region(partial, self.tp_group)\n',
  'half': 'dev'},
 {'exercise': 'tp.row_forward',
  'name': 'all-reduce under SP',
  'expect': 'all-reduces under sequence parallelism: output [s, b, out] instead of [s/t, b, out]',
  'words': ['sequence', 'shape', 'reduce-scatter', 's/t'],
  'code': 'x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)\n'
          'partial = F.linear(x, self.weight)\n'
          'output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)\n'
          'if self.bias is not None:\n'
          '    output = output + self.bias\n'
          'return output\n',
  'half': 'held'},
 {'exercise': 'tp.row_forward',
  'name': 'input always split',
  'expect': 'splits X even when input_is_parallel',
  'words': ['input_is_parallel', 'split', 'shape'],
  'code': 'x = scatter_to_tensor_model_parallel_region(input_, self.tp_group)\n'
          'partial = F.linear(x, self.weight)\n'
          'if self.sequence_parallel:\n'
          '    output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)\n'
          'else:\n'
          '    output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)\n'
          'if self.bias is not None:\n'
          '    output = output + self.bias\n'
          'return output\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_embedding',
  'name': 'outside rows not zeroed',
  'expect': 'ids of other ranks look up row 0 here: their vectors get row 0 added',
  'words': ['outside', 'zero', 'row 0', 'other rank'],
  'code': 'outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)\n'
          'local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)\n'
          'output = F.embedding(local_ids, self.weight)\n'
          'return reduce_from_tensor_model_parallel_region(output, self.tp_group)\n',
  'half': 'held'},
 {'exercise': 'tp.vocab_embedding',
  'name': 'end inclusive',
  'expect': 'id == vocab_end_index counted as local (> instead of >=)',
  'words': ['end', 'boundary', 'range', 'id'],
  'code': 'outside = (input_ids < self.vocab_start_index) | (input_ids > self.vocab_end_index)\n'
          'local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)\n'
          'output = F.embedding(local_ids, self.weight)\n'
          'output = output.masked_fill(outside.unsqueeze(-1), 0.0)\n'
          'return reduce_from_tensor_model_parallel_region(output, self.tp_group)\n',
  'half': 'dev'},
 {'exercise': 'tp.vocab_embedding',
  'name': 'no reduce',
  'expect': "only this rank's rows: no sum over the TP group",
  'words': ['sum', 'reduce', 'only'],
  'code': 'outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)\n'
          'local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)\n'
          'output = F.embedding(local_ids, self.weight)\n'
          'output = output.masked_fill(outside.unsqueeze(-1), 0.0)\n'
          'return output\n',
  'half': 'held'},
 {'exercise': 'tp.gather_last_dim',
  'name': 'concatenated along dim 0',
  'expect': 'the pieces are stacked along the first dimension',
  'words': ['dim', 'last', 'first', 'shape'],
  'code': 'input_ = input_.contiguous()\n'
          'pieces = [torch.empty_like(input_) for _ in range(world)]\n'
          'dist.all_gather(pieces, input_, group=group)\n'
          'return torch.cat(pieces, dim=0).contiguous()\n',
  'half': 'dev'},
 {'exercise': 'tp.gather_last_dim',
  'name': 'one buffer for all',
  'expect': "the receive list holds one tensor t times: every piece is the same rank's",
  'words': ['same', 'piece', 'rank'],
  'code': 'input_ = input_.contiguous()\n'
          'pieces = [torch.empty_like(input_)] * world\n'
          'dist.all_gather(pieces, input_, group=group)\n'
          'return torch.cat(pieces, dim=-1).contiguous()\n',
  'half': 'held'},
 {'exercise': 'tp.copy_to_region',
  'name': 'no reduce in backward',
  'expect': "backward returns the local gradient: dX is one rank's part",
  'words': ['sum', 'reduce', 'backward', 'part'],
  'code': 'return grad_output, None\n',
  'half': 'dev'},
 {'exercise': 'tp.copy_to_region',
  'name': 'mean in backward',
  'expect': 'backward averages: dX is 1/t of the sum',
  'words': ['mean', 'average', '1/t', 'x the', '0\\.50'],
  'code': 'return _reduce(grad_output, ctx.group) / dist.get_world_size(ctx.group), None\n',
  'half': 'held'},
 {'exercise': 'tp.reduce_from_region',
  'name': 'mean instead of sum',
  'expect': 'forward averages: 1/t of the sum',
  'words': ['mean', 'average', '1/t', 'x the', '0\\.50'],
  'code': 'return _reduce(input_, group) / dist.get_world_size(group)\n',
  'half': 'dev'},
 {'exercise': 'tp.reduce_from_region',
  'name': 'identity forward',
  'expect': 'forward returns the local partial sum',
  'words': ['sum', 'reduce', 'partial'],
  'code': 'return input_\n',
  'half': 'held'},
 {'exercise': 'tp.reduce_from_region',
  'name': 'in-place all-reduce of the input',
  'expect': "all-reduces the input in place (no clone): the caller's tensor changes",
  'words': ['in place', 'clone', 'input'],
  'code': 'dist.all_reduce(input_, group=group)\nreturn input_\n',
  'half': 'dev'},
 {'exercise': 'tp.sp_gather',
  'name': 'gathered along the hidden dim',
  'expect': 'shards concatenated along the last dim instead of the sequence',
  'words': ['sequence', 'dim', 'shape', 'hidden'],
  'code': 'input_ = input_.contiguous()\n'
          'pieces = [torch.empty_like(input_) for _ in range(world)]\n'
          'dist.all_gather(pieces, input_, group=group)\n'
          'return torch.cat(pieces, dim=-1)\n',
  'half': 'held'},
 {'exercise': 'tp.sp_gather',
  'name': 'output viewed with the wrong shape',
  'expect': 'allocates [s/t, b, t h] and all_gather_single into it: sequence slices interleaved into hidden',
  'words': ['sequence', 'shape', 'hidden', 'dim'],
  'code': 'input_ = input_.contiguous()\n'
          'output = torch.empty((*input_.shape[:-1], world * input_.shape[-1]), dtype=input_.dtype, '
          'device=input_.device)\n'
          'dist.all_gather_single(output, input_, group=group)\n'
          'return output.view(world * input_.shape[0], *input_.shape[1:])\n',
  'half': 'dev'},
 {'exercise': 'tp.sp_reduce_scatter',
  'name': 'average instead of sum',
  'expect': 'the sequence slice is divided by t (mean, not sum)',
  'words': ['mean', 'average', '1/t', 'x the', '0\\.50'],
  'code': 'input_ = input_.contiguous()\n'
          'chunk = divide(input_.shape[0], world, "sequence length")\n'
          'output = torch.empty((chunk, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)\n'
          'dist.reduce_scatter_single(output, input_, group=group)\n'
          'return output / world\n',
  'half': 'held'},
 {'exercise': 'tp.sp_reduce_scatter',
  'name': 'split along hidden',
  'expect': 'keeps a hidden-dim slice [s, b, h/t] instead of the sequence slice',
  'words': ['sequence', 'hidden', 'dim', 'shape'],
  'code': 'input_ = input_.transpose(0, -1).contiguous()\n'
          'chunk = divide(input_.shape[0], world, "hidden")\n'
          'output = torch.empty((chunk, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)\n'
          'dist.reduce_scatter_single(output, input_, group=group)\n'
          'return output.transpose(0, -1).contiguous()\n',
  'half': 'dev'},
 {'exercise': 'pp.communicate',
  'name': 'receive buffers without requires_grad',
  'expect': 'received activations are not in the graph: the previous stage gets no gradient',
  'words': ['requires_grad', 'graph', 'gradient'],
  'code': '\n'
          'tensor_recv_prev = tensor_recv_next = None\n'
          'if recv_prev:\n'
          '    tensor_recv_prev = torch.empty(tuple(tensor_shape), dtype=dtype, device=device)\n'
          'if recv_next:\n'
          '    tensor_recv_next = torch.empty(tuple(tensor_shape), dtype=dtype, device=device)\n'
          'reqs = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,\n'
          '                        tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,\n'
          '                        group=group, prev_rank=prev_rank, next_rank=next_rank)\n'
          'for req in reqs:\n'
          '    req.wait()\n'
          'return tensor_recv_prev, tensor_recv_next\n',
  'half': 'held'},
 {'exercise': 'pp.communicate',
  'name': 'prev and next swapped in the return',
  'expect': 'returns (from next, from prev)',
  'words': ['swap', 'prev', 'next', 'order'],
  'code': '\n'
          'tensor_recv_prev = tensor_recv_next = None\n'
          'if recv_prev:\n'
          '    tensor_recv_prev = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)\n'
          'if recv_next:\n'
          '    tensor_recv_next = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)\n'
          'reqs = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,\n'
          '                        tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,\n'
          '                        group=group, prev_rank=prev_rank, next_rank=next_rank)\n'
          'for req in reqs:\n'
          '    req.wait()\n'
          'return tensor_recv_next, tensor_recv_prev\n',
  'half': 'dev'},
 {'exercise': 'pp.communicate',
  'name': 'float32 buffers',
  'expect': 'receive buffers always fp32 (dtype ignored)',
  'words': ['dtype', 'float32', 'bfloat16', 'float16'],
  'code': '\n'
          'tensor_recv_prev = tensor_recv_next = None\n'
          'if recv_prev:\n'
          '    tensor_recv_prev = torch.empty(tuple(tensor_shape), dtype=torch.float32, device=device, '
          'requires_grad=True)\n'
          'if recv_next:\n'
          '    tensor_recv_next = torch.empty(tuple(tensor_shape), dtype=torch.float32, device=device, '
          'requires_grad=True)\n'
          'reqs = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,\n'
          '                        tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,\n'
          '                        group=group, prev_rank=prev_rank, next_rank=next_rank)\n'
          'for req in reqs:\n'
          '    req.wait()\n'
          'return tensor_recv_prev, tensor_recv_next\n',
  'half': 'held'},
 {'exercise': 'pp.stage_split',
  'name': 'rank-major virtual stages',
  'expect': "virtual stage pp_rank * v + chunk: a rank's chunks are contiguous",
  'words': ['virtual stage', 'chunk', 'rank'],
  'code': '\n'
          'per_stage = num_layers // num_stages\n'
          'stage = pp_rank * num_model_chunks + chunk\n'
          'return stage * per_stage, (stage + 1) * per_stage\n',
  'half': 'dev'},
 {'exercise': 'pp.stage_split',
  'name': 'stop inclusive',
  'expect': 'stop is the last layer (inclusive): one layer short',
  'words': ['stop', 'inclusive', 'half-open', 'layer'],
  'code': '\n'
          'per_stage = num_layers // num_stages\n'
          'stage = chunk * pp_size + pp_rank\n'
          'return stage * per_stage, (stage + 1) * per_stage - 1\n',
  'half': 'held'},
 {'exercise': 'pp.num_warmup',
  'name': 'no cap',
  'expect': 'warmup larger than the number of forwards when m is small',
  'words': ['cap', 'total', 'forwards', 'num_microbatches'],
  'code': '\n'
          'if pp_size == 1:\n'
          '    return 0\n'
          'total = num_microbatches * num_model_chunks\n'
          'if num_model_chunks == 1:\n'
          '    warmup = pp_size - pp_rank - 1\n'
          'else:\n'
          '    warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size\n'
          'return warmup\n',
  'half': 'dev'},
 {'exercise': 'pp.num_warmup',
  'name': 'one too many',
  'expect': '1F1B warmup pp - rank (the last stage warms up one too)',
  'words': ['last stage', 'one', 'off', 'rank'],
  'code': '\n'
          'if pp_size == 1:\n'
          '    return 0\n'
          'total = num_microbatches * num_model_chunks\n'
          'if num_model_chunks == 1:\n'
          '    warmup = pp_size - pp_rank\n'
          'else:\n'
          '    warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size\n'
          'return min(warmup, total)\n',
  'half': 'held'},
 {'exercise': 'pp.num_warmup',
  'name': 'interleaved without the factor 2',
  'expect': 'interleaved: (p - r - 1) + (v-1) p',
  'words': ['interleaved', '2', 'factor'],
  'code': '\n'
          'if pp_size == 1:\n'
          '    return 0\n'
          'total = num_microbatches * num_model_chunks\n'
          'if num_model_chunks == 1:\n'
          '    warmup = pp_size - pp_rank - 1\n'
          'else:\n'
          '    warmup = (pp_size - pp_rank - 1) + (num_model_chunks - 1) * pp_size\n'
          'return min(warmup, total)\n',
  'half': 'dev'},
 {'exercise': 'pp.schedule_table',
  'name': 'chunks inside micro-batches',
  'expect': 'each micro-batch runs all chunks before the next: (0,0) (0,1) (1,0) ...',
  'words': ['order', 'chunk', 'group'],
  'code': 'table = []\n'
          'for start in range(0, num_microbatches, group_size):\n'
          '    for mb in range(start, min(start + group_size, num_microbatches)):\n'
          '        for chunk in range(num_model_chunks):\n'
          '            table.append((mb, chunk))\n'
          'return table\n',
  'half': 'held'},
 {'exercise': 'pp.schedule_table',
  'name': 'last group not cut',
  'expect': 'the last group runs past m: micro-batch ids >= m',
  'words': ['last group', 'num_microbatches', 'past', '>=', 'range'],
  'code': '\n'
          'table = []\n'
          'for start in range(0, num_microbatches, group_size):\n'
          '    group = range(start, start + group_size)\n'
          '    for chunk in range(num_model_chunks):\n'
          '        for mb in group:\n'
          '            table.append((mb, chunk))\n'
          'return table\n',
  'half': 'dev'},
 {'exercise': 'pp.schedule_table',
  'name': 'one group of everything',
  'expect': 'group_size ignored: every chunk runs all micro-batches',
  'words': ['group_size', 'group'],
  'code': 'return [(mb, chunk) for chunk in range(num_model_chunks) for mb in range(num_microbatches)]\n',
  'half': 'held'},
 {'exercise': 'pp.one_f_one_b',
  'name': 'backward before forward',
  'expect': 'steady state runs backward then forward',
  'words': ['steady', 'backward', 'order', 'before'],
  'code': '\n'
          'num_warmup = min(num_warmup, len(forwards))\n'
          'ops = list(forwards[:num_warmup])\n'
          'next_backward = 0\n'
          'for fwd in forwards[num_warmup:]:\n'
          '    ops.append(backwards[next_backward])\n'
          '    ops.append(fwd)\n'
          '    next_backward += 1\n'
          'ops.extend(backwards[next_backward:])\n'
          'return ops\n',
  'half': 'dev'},
 {'exercise': 'pp.one_f_one_b',
  'name': 'newest backward first',
  'expect': 'the steady state runs the newest backward (a stack), not the oldest',
  'words': ['oldest', 'newest', 'backward', 'order'],
  'code': 'num_warmup = min(num_warmup, len(forwards))\n'
          'ops = list(forwards[:num_warmup])\n'
          'owed = list(backwards[:num_warmup])\n'
          'for i, fwd in enumerate(forwards[num_warmup:]):\n'
          '    ops.append(fwd)\n'
          '    owed.append(backwards[num_warmup + i])\n'
          '    ops.append(owed.pop())\n'
          'ops.extend(reversed(owed))\n'
          'return ops\n',
  'half': 'held'},
 {'exercise': 'pp.one_f_one_b',
  'name': 'no cooldown',
  'expect': 'the backwards still owed after the steady state are never run',
  'words': ['cooldown', 'missing', 'every op', 'backward'],
  'code': '\n'
          'num_warmup = min(num_warmup, len(forwards))\n'
          'ops = list(forwards[:num_warmup])\n'
          'next_backward = 0\n'
          'for fwd in forwards[num_warmup:]:\n'
          '    ops.append(fwd)\n'
          '    ops.append(backwards[next_backward])\n'
          '    next_backward += 1\n'
          'return ops\n',
  'half': 'dev'},
 {'exercise': 'cp.zigzag_split',
  'name': 'mirror off by one',
  'expect': 'the mirror chunk is 2cp - r, not 2cp - 1 - r',
  'words': ['mirror', 'chunk', '2cp'],
  'code': '\nif zigzag:\n    return cp_rank, 2 * cp_size - cp_rank\nreturn 2 * cp_rank, 2 * cp_rank + 1\n',
  'half': 'held'},
 {'exercise': 'cp.zigzag_split',
  'name': 'flag ignored',
  'expect': 'always zigzag: plain split wrong',
  'words': ['plain', 'zigzag'],
  'code': 'return cp_rank, 2 * cp_size - 1 - cp_rank\n',
  'half': 'dev'},
 {'exercise': 'cp.zigzag_split',
  'name': 'plain and zigzag swapped',
  'expect': 'zigzag gives neighbours and plain the mirror pair',
  'words': ['plain', 'zigzag', 'swap'],
  'code': 'if not zigzag:\n    return cp_rank, 2 * cp_size - 1 - cp_rank\nreturn 2 * cp_rank, 2 * cp_rank + 1\n',
  'half': 'held'},
 {'exercise': 'cp.causal_block_mask',
  'name': 'inverted comparison',
  'expect': 'later chunks full, earlier ones skipped',
  'words': ['earlier', 'later', 'full', 'skip'],
  'code': '\n'
          'if kv_chunk > q_chunk:\n'
          '    return "full"\n'
          'if kv_chunk == q_chunk:\n'
          '    return "causal"\n'
          'return "skip"\n',
  'half': 'dev'},
 {'exercise': 'cp.causal_block_mask',
  'name': 'diagonal full',
  'expect': 'the same chunk is "full" (future keys within the chunk visible)',
  'words': ['causal', 'same chunk', 'diagonal'],
  'code': 'if kv_chunk <= q_chunk:\n    return "full"\nreturn "skip"\n',
  'half': 'held'},
 {'exercise': 'cp.lse_merge',
  'name': 'max instead of logaddexp',
  'expect': 'new lse is the max, not the log-sum-exp: outputs not normalised',
  'words': ['lse', 'logaddexp', 'max'],
  'code': '\n'
          'out, lse, block_out, block_lse = out.float(), lse.float(), block_out.float(), block_lse.float()\n'
          'new_lse = torch.maximum(lse, block_lse)\n'
          'safe = torch.where(torch.isinf(new_lse) & (new_lse < 0), torch.zeros_like(new_lse), new_lse)\n'
          'share = torch.exp(lse - safe).unsqueeze(-1)              # exp(-inf) = 0: nothing seen yet\n'
          'block_share = torch.exp(block_lse - safe).unsqueeze(-1)\n'
          'return out * share + block_out * block_share, new_lse\n',
  'half': 'dev'},
 {'exercise': 'cp.lse_merge',
  'name': 'outputs added without shares',
  'expect': 'out + block_out, not weighted by their shares',
  'words': ['share', 'weight', 'rescal'],
  'code': 'return out.float() + block_out.float(), torch.logaddexp(lse.float(), block_lse.float())\n',
  'half': 'held'},
 {'exercise': 'cp.lse_merge',
  'name': 'naive exp',
  'expect': 'log(exp(lse) + exp(block_lse)) overflows for large scores',
  'words': ['overflow', 'inf', 'nan', 'large'],
  'code': '\n'
          'out, lse, block_out, block_lse = out.float(), lse.float(), block_out.float(), block_lse.float()\n'
          'new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))\n'
          'safe = torch.where(torch.isinf(new_lse) & (new_lse < 0), torch.zeros_like(new_lse), new_lse)\n'
          'share = torch.exp(lse - safe).unsqueeze(-1)              # exp(-inf) = 0: nothing seen yet\n'
          'block_share = torch.exp(block_lse - safe).unsqueeze(-1)\n'
          'return out * share + block_out * block_share, new_lse\n',
  'half': 'dev'},
 {'exercise': 'cp.ring_step',
  'name': 'ring reversed',
  'expect': 'sends to me-1 and receives from me+1',
  'words': ['direction', 'previous', 'next', 'reverse'],
  'code': '\n'
          'n = len(ranks)\n'
          'buffer = torch.empty_like(tensor)\n'
          'ops = [dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me - 1) % n], group),\n'
          '       dist.P2POp(dist.irecv, buffer, ranks[(me + 1) % n], group)]\n'
          'requests = dist.batch_isend_irecv(ops)\n'
          'return buffer, requests\n',
  'half': 'held'},
 {'exercise': 'cp.ring_step',
  'name': 'group ranks as global ranks',
  'expect': 'peers are group ranks, not global: wrong peers in a group that is not 0..n-1',
  'words': ['global', 'group rank', 'peer'],
  'code': '\n'
          'n = len(ranks)\n'
          'buffer = torch.empty_like(tensor)\n'
          'ops = [dist.P2POp(dist.isend, tensor.contiguous(), (me + 1) % n, group),\n'
          '       dist.P2POp(dist.irecv, buffer, (me - 1) % n, group)]\n'
          'requests = dist.batch_isend_irecv(ops)\n'
          'return buffer, requests\n',
  'half': 'dev'},
 {'exercise': 'cp.ring_step',
  'name': 'receives into the tensor it sends',
  'expect': 'no fresh buffer: the block received overwrites the one being sent',
  'words': ['buffer', 'overwr', 'same tensor'],
  'code': '\n'
          'n = len(ranks)\n'
          'buffer = tensor\n'
          'ops = [dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me + 1) % n], group),\n'
          '       dist.P2POp(dist.irecv, buffer, ranks[(me - 1) % n], group)]\n'
          'requests = dist.batch_isend_irecv(ops)\n'
          'return buffer, requests\n',
  'half': 'held'},
 {'exercise': 'cp.backward_ring',
  'name': 'no last hop',
  'expect': "dK/dV never travel home: each rank returns the dkv of another rank's block",
  'words': ['home', 'last hop', 'dk', 'owner'],
  'code': '\n'
          'for step in range(cp):\n'
          '    owner = (rank - step) % cp  # whose K/V (and dK/dV) is visiting\n'
          '    if step == 0:\n'
          '        dkv = torch.zeros_like(kv)\n'
          "    else:  # the visiting block's dK/dV arrive with it\n"
          '        dkv, dkv_requests = ring_step(dkv, group)\n'
          '        _wait(dkv_requests)\n'
          '    if step + 1 < cp:\n'
          '        next_block, requests = ring_step(block, group)\n'
          '    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):\n'
          '        dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, '
          'cols],\n'
          '                                                    out[:, :, rows], lse[:, :, rows], dout[:, :, rows],\n'
          '                                                    _mask(kind, c, q.device))\n'
          '        dq[:, :, rows] += dq_b\n'
          '        dkv[0][:, :, cols] += dk_b\n'
          '        dkv[1][:, :, cols] += dv_b\n'
          '    if step + 1 < cp:\n'
          '        _wait(requests)\n'
          '        block = next_block\n',
  'half': 'dev'},
 {'exercise': 'cp.backward_ring',
  'name': 'dkv restarted every step',
  'expect': "dK/dV do not travel: each step starts from zeros, only one rank's share survives",
  'words': ['dk', 'travel', 'share', 'accumul'],
  'code': '\n'
          'for step in range(cp):\n'
          '    owner = (rank - step) % cp  # whose K/V (and dK/dV) is visiting\n'
          '    dkv = torch.zeros_like(kv)\n'
          '    if step + 1 < cp:\n'
          '        next_block, requests = ring_step(block, group)\n'
          '    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):\n'
          '        dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, '
          'cols],\n'
          '                                                    out[:, :, rows], lse[:, :, rows], dout[:, :, rows],\n'
          '                                                    _mask(kind, c, q.device))\n'
          '        dq[:, :, rows] += dq_b\n'
          '        dkv[0][:, :, cols] += dk_b\n'
          '        dkv[1][:, :, cols] += dv_b\n'
          '    if step + 1 < cp:\n'
          '        _wait(requests)\n'
          '        block = next_block\n'
          'if cp > 1:  # one last hop: every dkv goes home to its owner\n'
          '    dkv, dkv_requests = ring_step(dkv, group)\n'
          '    _wait(dkv_requests)\n',
  'half': 'held'},
 {'exercise': 'cp.backward_ring',
  'name': 'dq only from the own block',
  'expect': "dq gets only the own K/V block: the visiting blocks' contributions missing",
  'words': ['dq'],
  'code': '\n'
          'for step in range(cp):\n'
          '    owner = (rank - step) % cp  # whose K/V (and dK/dV) is visiting\n'
          '    if step == 0:\n'
          '        dkv = torch.zeros_like(kv)\n'
          "    else:  # the visiting block's dK/dV arrive with it\n"
          '        dkv, dkv_requests = ring_step(dkv, group)\n'
          '        _wait(dkv_requests)\n'
          '    if step + 1 < cp:\n'
          '        next_block, requests = ring_step(block, group)\n'
          '    for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):\n'
          '        dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], block[0][:, :, cols], block[1][:, :, '
          'cols],\n'
          '                                                    out[:, :, rows], lse[:, :, rows], dout[:, :, rows],\n'
          '                                                    _mask(kind, c, q.device))\n'
          '        if step == 0:\n'
          '            dq[:, :, rows] += dq_b\n'
          '        dkv[0][:, :, cols] += dk_b\n'
          '        dkv[1][:, :, cols] += dv_b\n'
          '    if step + 1 < cp:\n'
          '        _wait(requests)\n'
          '        block = next_block\n'
          'if cp > 1:  # one last hop: every dkv goes home to its owner\n'
          '    dkv, dkv_requests = ring_step(dkv, group)\n'
          '    _wait(dkv_requests)\n',
  'half': 'dev'},
 {'exercise': 'moe.load_balancing_loss',
  'name': 'divides by the local rows',
  'expect': 'divides by probs.shape[0] (local t) not T: wrong under SP/CP',
  'words': ['T', 'total_num_tokens', 'rows', 'local'],
  'code': '\n'
          'f = tokens_per_expert.to(probs.dtype) / (total_num_tokens * topk)   # fraction of the T*k assignments\n'
          'P = probs.sum(dim=0) / probs.shape[0]                              # mean router probability\n'
          'return moe_aux_loss_coeff * num_experts * torch.sum(f * P)\n',
  'half': 'held'},
 {'exercise': 'moe.load_balancing_loss',
  'name': 'detached probs',
  'expect': 'probs detached: no gradient reaches the router',
  'words': ['grad', 'detach', 'router'],
  'code': '\n'
          'f = tokens_per_expert.to(probs.dtype) / (total_num_tokens * topk)   # fraction of the T*k assignments\n'
          'P = probs.detach().sum(dim=0) / total_num_tokens                              # mean router probability\n'
          'return moe_aux_loss_coeff * num_experts * torch.sum(f * P)\n',
  'half': 'dev'},
 {'exercise': 'moe.load_balancing_loss',
  'name': 'k forgotten',
  'expect': 'fraction over T, not T*k: loss k times too large',
  'words': ['topk', 'k', 'x the', 'factor'],
  'code': '\n'
          'f = tokens_per_expert.to(probs.dtype) / total_num_tokens   # fraction of the T*k assignments\n'
          'P = probs.sum(dim=0) / total_num_tokens                              # mean router probability\n'
          'return moe_aux_loss_coeff * num_experts * torch.sum(f * P)\n',
  'half': 'held'},
 {'exercise': 'moe.topk_routing',
  'name': 'softmax over all experts',
  'expect': 'weights are the softmax over all E (top-k not renormalised): they do not sum to 1',
  'words': ['sum to 1', 'sum', 'softmax', 'renormal'],
  'code': '\n'
          'if score_function == "softmax":\n'
          '    top_weights, top_indices = torch.topk(torch.softmax(logits, dim=-1), k=topk, dim=1)\n'
          'elif score_function == "sigmoid":\n'
          '    scores = torch.sigmoid(logits)\n'
          '    choose = scores + expert_bias if expert_bias is not None else scores\n'
          '    _, top_indices = torch.topk(choose, k=topk, dim=1)\n'
          '    top_weights = torch.gather(scores, 1, top_indices)\n'
          '    if topk > 1:\n'
          '        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)\n'
          'else:\n'
          '    raise ValueError(f"unknown score_function {score_function!r}; use \'softmax\' or \'sigmoid\'")\n'
          'probs = torch.zeros_like(logits, dtype=top_weights.dtype).scatter(1, top_indices, top_weights)\n'
          'routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)\n',
  'half': 'dev'},
 {'exercise': 'moe.topk_routing',
  'name': 'sigmoid weights from the biased scores',
  'expect': 'sigmoid weights include the expert bias',
  'words': ['bias'],
  'code': '\n'
          'if score_function == "softmax":\n'
          '    top_values, top_indices = torch.topk(logits, k=topk, dim=1)\n'
          '    top_weights = torch.softmax(top_values, dim=-1)\n'
          'elif score_function == "sigmoid":\n'
          '    scores = torch.sigmoid(logits)\n'
          '    choose = scores + expert_bias if expert_bias is not None else scores\n'
          '    _, top_indices = torch.topk(choose, k=topk, dim=1)\n'
          '    top_weights = torch.gather(choose, 1, top_indices)\n'
          '    if topk > 1:\n'
          '        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)\n'
          'else:\n'
          '    raise ValueError(f"unknown score_function {score_function!r}; use \'softmax\' or \'sigmoid\'")\n'
          'probs = torch.zeros_like(logits, dtype=top_weights.dtype).scatter(1, top_indices, top_weights)\n'
          'routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)\n',
  'half': 'held'},
 {'exercise': 'moe.topk_routing',
  'name': 'sigmoid chooses without the bias',
  'expect': 'the expert bias is not used to choose',
  'words': ['bias', 'choose'],
  'code': '\n'
          'if score_function == "softmax":\n'
          '    top_values, top_indices = torch.topk(logits, k=topk, dim=1)\n'
          '    top_weights = torch.softmax(top_values, dim=-1)\n'
          'elif score_function == "sigmoid":\n'
          '    scores = torch.sigmoid(logits)\n'
          '    choose = scores + expert_bias if expert_bias is not None else scores\n'
          '    _, top_indices = torch.topk(scores, k=topk, dim=1)\n'
          '    top_weights = torch.gather(scores, 1, top_indices)\n'
          '    if topk > 1:\n'
          '        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)\n'
          'else:\n'
          '    raise ValueError(f"unknown score_function {score_function!r}; use \'softmax\' or \'sigmoid\'")\n'
          'probs = torch.zeros_like(logits, dtype=top_weights.dtype).scatter(1, top_indices, top_weights)\n'
          'routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)\n',
  'half': 'dev'},
 {'exercise': 'moe.capacity',
  'name': 'capacity off by one',
  'expect': 'keeps capacity-1 tokens per expert (arrival counted from 1)',
  'words': ['capacity', 'one', 'first'],
  'code': '\n'
          "arrival = routing_map.long().cumsum(dim=0)          # each token's place in its expert's queue\n"
          'kept = routing_map & (arrival < capacity)\n'
          'if pad_to_capacity:\n'
          '    free = capacity - kept.long().sum(dim=0)             # [E] slots still open\n'
          '    unrouted = ~routing_map\n'
          '    filler_arrival = unrouted.long().cumsum(dim=0) - 1\n'
          '    fillers = unrouted & (filler_arrival < free.unsqueeze(0))\n'
          '    routing_map = kept | fillers\n'
          'else:\n'
          '    routing_map = kept\n'
          'probs = probs * kept.to(probs.dtype)\n',
  'half': 'held'},
 {'exercise': 'moe.capacity',
  'name': 'probs not masked',
  'expect': 'dropped tokens keep their weight in probs',
  'words': ['probs', 'weight', 'dropped'],
  'code': '\n'
          "arrival = routing_map.long().cumsum(dim=0) - 1          # each token's place in its expert's queue\n"
          'kept = routing_map & (arrival < capacity)\n'
          'if pad_to_capacity:\n'
          '    free = capacity - kept.long().sum(dim=0)             # [E] slots still open\n'
          '    unrouted = ~routing_map\n'
          '    filler_arrival = unrouted.long().cumsum(dim=0) - 1\n'
          '    fillers = unrouted & (filler_arrival < free.unsqueeze(0))\n'
          '    routing_map = kept | fillers\n'
          'else:\n'
          '    routing_map = kept\n',
  'half': 'dev'},
 {'exercise': 'moe.capacity',
  'name': 'padding ignores free slots',
  'expect': 'padding fills capacity unrouted tokens regardless of the kept ones (over capacity)',
  'words': ['pad', 'capacity', 'free'],
  'code': '\n'
          "arrival = routing_map.long().cumsum(dim=0) - 1          # each token's place in its expert's queue\n"
          'kept = routing_map & (arrival < capacity)\n'
          'if pad_to_capacity:\n'
          '    free = capacity - kept.long().sum(dim=0)             # [E] slots still open\n'
          '    unrouted = ~routing_map\n'
          '    filler_arrival = unrouted.long().cumsum(dim=0) - 1\n'
          '    fillers = unrouted & (filler_arrival < capacity)\n'
          '    routing_map = kept | fillers\n'
          'else:\n'
          '    routing_map = kept\n'
          'probs = probs * kept.to(probs.dtype)\n',
  'half': 'held'},
 {'exercise': 'moe.permute',
  'name': 'token-major order',
  'expect': 'copies grouped by token, not by expert',
  'words': ['order', 'expert', 'token'],
  'code': '\n'
          'num_tokens, num_experts = routing_map.shape\n'
          'map_t = routing_map\n'
          'token_grid = torch.arange(num_tokens, device=routing_map.device).unsqueeze(1).expand(-1, num_experts)\n'
          'sorted_indices = token_grid.masked_select(map_t)                        # [N]\n'
          'permuted = tokens.index_select(0, sorted_indices)\n'
          'permuted_probs = probs.t().contiguous().masked_select(map_t) if probs is not None else None\n'
          'return permuted, permuted_probs, sorted_indices\n',
  'half': 'dev'},
 {'exercise': 'moe.permute',
  'name': 'probs in token-major order',
  'expect': 'permuted probs not transposed: weights belong to other copies',
  'words': ['prob'],
  'code': '\n'
          'num_tokens, num_experts = routing_map.shape\n'
          'map_t = routing_map.t().contiguous()                                   # [E, T]: expert-major\n'
          'token_grid = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)\n'
          'sorted_indices = token_grid.masked_select(map_t)                        # [N]\n'
          'permuted = tokens.index_select(0, sorted_indices)\n'
          'permuted_probs = probs.masked_select(routing_map) if probs is not None else None\n'
          'return permuted, permuted_probs, sorted_indices\n',
  'half': 'held'},
 {'exercise': 'moe.alltoall_dispatch',
  'name': 'splits swapped',
  'expect': 'input and output splits swapped in all_to_all',
  'words': ['split', 'swap'],
  'code': '\n'
          'local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)\n'
          'if ep > 1:\n'
          '    gathered = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]\n'
          '    dist.all_gather(gathered, num_local_tokens_per_expert.contiguous(), group=self.ep_group)\n'
          '    num_global_tokens_per_expert = torch.stack(gathered)                     # [ep, E]\n'
          'else:\n'
          '    num_global_tokens_per_expert = num_local_tokens_per_expert.unsqueeze(0)  # [1, E]\n'
          'self.num_global_tokens_per_local_expert = num_global_tokens_per_expert[:, local]  # [ep, L]: rank j -> my '
          'experts\n'
          'self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()   # rows I send to each '
          'rank\n'
          'self.output_splits = self.num_global_tokens_per_local_expert.sum(dim=1).tolist()  # rows each rank sends '
          'me\n'
          'if ep > 1:\n'
          '    permuted = all_to_all(self.ep_group, permuted, self.input_splits, self.output_splits)\n'
          'if L > 1:  # [rank][expert] -> [expert][rank]\n'
          '    permuted = sort_chunks_by_idxs(permuted, self.num_global_tokens_per_local_expert.reshape(-1),\n'
          '                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())\n',
  'half': 'dev'},
 {'exercise': 'moe.alltoall_dispatch',
  'name': 'chunks not sorted',
  'expect': 'rows left [source rank][expert], not regrouped by local expert',
  'words': ['sort', 'order', 'expert', 'rank'],
  'code': '\n'
          'local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)\n'
          'if ep > 1:\n'
          '    gathered = [torch.empty_like(num_local_tokens_per_expert) for _ in range(ep)]\n'
          '    dist.all_gather(gathered, num_local_tokens_per_expert.contiguous(), group=self.ep_group)\n'
          '    num_global_tokens_per_expert = torch.stack(gathered)                     # [ep, E]\n'
          'else:\n'
          '    num_global_tokens_per_expert = num_local_tokens_per_expert.unsqueeze(0)  # [1, E]\n'
          'self.num_global_tokens_per_local_expert = num_global_tokens_per_expert[:, local]  # [ep, L]: rank j -> my '
          'experts\n'
          'self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()   # rows I send to each '
          'rank\n'
          'self.output_splits = self.num_global_tokens_per_local_expert.sum(dim=1).tolist()  # rows each rank sends '
          'me\n'
          'if ep > 1:\n'
          '    permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)\n'
          'if False:\n'
          '    permuted = sort_chunks_by_idxs(permuted, self.num_global_tokens_per_local_expert.reshape(-1),\n'
          '                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())\n',
  'half': 'held'},
 {'exercise': 'moe.alltoall_dispatch',
  'name': 'counts not exchanged',
  'expect': 'assumes every rank sends me what I send it (no all_gather of counts)',
  'words': ['count', 'split'],
  'code': '\n'
          'local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)\n'
          'if ep > 1:\n'
          '    num_global_tokens_per_expert = num_local_tokens_per_expert.unsqueeze(0).expand(ep, -1)  # [ep, E]\n'
          'else:\n'
          '    num_global_tokens_per_expert = num_local_tokens_per_expert.unsqueeze(0)  # [1, E]\n'
          'self.num_global_tokens_per_local_expert = num_global_tokens_per_expert[:, local]  # [ep, L]: rank j -> my '
          'experts\n'
          'self.input_splits = num_local_tokens_per_expert.view(ep, L).sum(dim=1).tolist()   # rows I send to each '
          'rank\n'
          'self.output_splits = self.num_global_tokens_per_local_expert.sum(dim=1).tolist()  # rows each rank sends '
          'me\n'
          'if ep > 1:\n'
          '    permuted = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)\n'
          'if L > 1:  # [rank][expert] -> [expert][rank]\n'
          '    permuted = sort_chunks_by_idxs(permuted, self.num_global_tokens_per_local_expert.reshape(-1),\n'
          '                                   torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())\n',
  'half': 'dev'},
 {'exercise': 'hybrid.train_step',
  'name': 'loss not divided by m',
  'expect': 'micro-batch losses summed: grads m times the single-process ones',
  'words': ['micro', 'x the', 'factor', 'mean', 'sum'],
  'code': '\n'
          'from contextlib import nullcontext\n'
          'model, stages = build_model(config, state, seed)\n'
          'local = nn.ModuleList(stages)\n'
          "# this rank's slice of the global batch (dp), then its zigzag chunks of each sequence (cp)\n"
          'per_rank = batch_size // dp\n'
          'my_ids = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]\n'
          'my_labels = labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]\n'
          'if cp > 1:\n'
          '    batch = get_batch_on_this_cp_rank(dict(tokens=my_ids, labels=my_labels), cp, cp_rank)\n'
          '    my_ids, my_labels = batch["tokens"], batch["labels"]\n'
          'inputs, targets = my_ids.chunk(num_microbatches), my_labels.chunk(num_microbatches)\n'
          '# data parallelism: DDP over dp-cp (ZeRO via DistributedOptimizer); MoE layers have no DDP wrapper here\n'
          'ddp = None if moe else DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage)\n'
          'if zero_stage:\n'
          '    opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr)\n'
          'else:\n'
          '    opt = optimizer_cls(local.parameters(), lr=lr)\n'
          'if ddp is not None:\n'
          '    ddp.zero_grad_buffer()\n'
          'loss_func = lambda logits, y: _local_loss(logits, y, tp_group)\n'
          'sync = ddp.no_sync() if ddp is not None else nullcontext()\n'
          'with MoEAuxLossAutoScaler.loss_scale(cp / num_microbatches), sync:\n'
          '    if pp > 1:\n'
          '        seq = config.seq_length // cp\n'
          '        if config.sequence_parallel:\n'
          '            seq //= state.get_tensor_model_parallel_world_size()\n'
          '        shape = (seq, per_rank // num_microbatches, config.hidden_size)\n'
          '        result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,\n'
          '                                             group=state.get_pipeline_model_parallel_group())\n'
          '        losses = result.losses\n'
          '    else:\n'
          '        losses = []\n'
          '        stage = stages[0]\n'
          '        for x, y in zip(inputs, targets):\n'
          '            mb_loss = loss_func(stage(x), y)\n'
          '            mb_loss.backward()\n'
          '            losses.append(mb_loss.item())\n'
          'finalize_model_grads([ddp if ddp is not None else local], state)\n'
          'opt.step()\n',
  'half': 'held'},
 {'exercise': 'hybrid.train_step',
  'name': 'grads never finalized',
  'expect': 'finalize_model_grads not called: grads not averaged over dp',
  'words': ['finalize', 'averag', 'dp'],
  'code': '\n'
          'from contextlib import nullcontext\n'
          'model, stages = build_model(config, state, seed)\n'
          'local = nn.ModuleList(stages)\n'
          "# this rank's slice of the global batch (dp), then its zigzag chunks of each sequence (cp)\n"
          'per_rank = batch_size // dp\n'
          'my_ids = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]\n'
          'my_labels = labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]\n'
          'if cp > 1:\n'
          '    batch = get_batch_on_this_cp_rank(dict(tokens=my_ids, labels=my_labels), cp, cp_rank)\n'
          '    my_ids, my_labels = batch["tokens"], batch["labels"]\n'
          'inputs, targets = my_ids.chunk(num_microbatches), my_labels.chunk(num_microbatches)\n'
          '# data parallelism: DDP over dp-cp (ZeRO via DistributedOptimizer); MoE layers have no DDP wrapper here\n'
          'ddp = None if moe else DistributedDataParallel(local, group=dp_group, zero_stage=zero_stage)\n'
          'if zero_stage:\n'
          '    opt = DistributedOptimizer(ddp, optimizer_cls, lr=lr)\n'
          'else:\n'
          '    opt = optimizer_cls(local.parameters(), lr=lr)\n'
          'if ddp is not None:\n'
          '    ddp.zero_grad_buffer()\n'
          'loss_func = lambda logits, y: _local_loss(logits, y, tp_group)\n'
          'sync = ddp.no_sync() if ddp is not None else nullcontext()\n'
          'with MoEAuxLossAutoScaler.loss_scale(cp / num_microbatches), sync:\n'
          '    if pp > 1:\n'
          '        seq = config.seq_length // cp\n'
          '        if config.sequence_parallel:\n'
          '            seq //= state.get_tensor_model_parallel_world_size()\n'
          '        shape = (seq, per_rank // num_microbatches, config.hidden_size)\n'
          '        result = forward_backward_pipelining(stages, inputs, targets, loss_func, shape,\n'
          '                                             group=state.get_pipeline_model_parallel_group())\n'
          '        losses = result.losses\n'
          '    else:\n'
          '        losses = []\n'
          '        stage = stages[0]\n'
          '        for x, y in zip(inputs, targets):\n'
          '            mb_loss = loss_func(stage(x), y)\n'
          '            (mb_loss / num_microbatches).backward()\n'
          '            losses.append(mb_loss.item())\n'
          'opt.step()\n',
  'half': 'dev'},
 {'exercise': 'planner.weight_memory',
  'name': 'experts divided by tp',
  'expect': 'expert params divided by tp instead of ep*etp',
  'words': ['expert', 'ep'],
  'code': '\n'
          't, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp\n'
          'expert_shards = layout.ep * layout.etp\n'
          'layers = model.num_layers / p\n'
          'dense = layers * per_layer["dense"] / t + model.embedding_params() / t  # the first stage holds the '
          'embedding\n'
          'if p == 1:  # a single stage also holds the final norm and an untied output layer\n'
          '    dense += model.final_norm_params()\n'
          '    if model.untie_embeddings_and_output_weights:\n'
          '        dense += model.embedding_params() / t\n'
          'expert = layers * per_layer["expert"] / t\n'
          'held = dense + expert\n'
          'memory = {"params": held * train.param_bytes, "grads": held * train.grad_bytes}\n'
          'if train.use_distributed_optimizer:\n'
          '    expert_dp = t * c * d // expert_shards  # experts are replicated over expert-DP, dense params over '
          'dp·cp\n'
          '    memory["optimizer"] = train.optimizer_bytes * (dense / (d * c) + expert / expert_dp)\n'
          'else:\n'
          '    memory["optimizer"] = train.optimizer_bytes * held\n'
          'return memory\n',
  'half': 'held'},
 {'exercise': 'planner.weight_memory',
  'name': 'optimizer over dp only',
  'expect': 'dense optimizer state sharded over dp, not dp*cp',
  'words': ['cp', 'optimizer', 'shard'],
  'code': '\n'
          't, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp\n'
          'expert_shards = layout.ep * layout.etp\n'
          'layers = model.num_layers / p\n'
          'dense = layers * per_layer["dense"] / t + model.embedding_params() / t  # the first stage holds the '
          'embedding\n'
          'if p == 1:  # a single stage also holds the final norm and an untied output layer\n'
          '    dense += model.final_norm_params()\n'
          '    if model.untie_embeddings_and_output_weights:\n'
          '        dense += model.embedding_params() / t\n'
          'expert = layers * per_layer["expert"] / expert_shards\n'
          'held = dense + expert\n'
          'memory = {"params": held * train.param_bytes, "grads": held * train.grad_bytes}\n'
          'if train.use_distributed_optimizer:\n'
          '    expert_dp = t * c * d // expert_shards  # experts are replicated over expert-DP, dense params over '
          'dp·cp\n'
          '    memory["optimizer"] = train.optimizer_bytes * (dense / d + expert / expert_dp)\n'
          'else:\n'
          '    memory["optimizer"] = train.optimizer_bytes * held\n'
          'return memory\n',
  'half': 'dev'},
 {'exercise': 'planner.weight_memory',
  'name': 'embedding whole',
  'expect': 'the embedding not divided by tp',
  'words': ['embedding', 'tp'],
  'code': '\n'
          't, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp\n'
          'expert_shards = layout.ep * layout.etp\n'
          'layers = model.num_layers / p\n'
          'dense = layers * per_layer["dense"] / t + model.embedding_params()  # the first stage holds the '
          'embedding\n'
          'if p == 1:  # a single stage also holds the final norm and an untied output layer\n'
          '    dense += model.final_norm_params()\n'
          '    if model.untie_embeddings_and_output_weights:\n'
          '        dense += model.embedding_params() / t\n'
          'expert = layers * per_layer["expert"] / expert_shards\n'
          'held = dense + expert\n'
          'memory = {"params": held * train.param_bytes, "grads": held * train.grad_bytes}\n'
          'if train.use_distributed_optimizer:\n'
          '    expert_dp = t * c * d // expert_shards  # experts are replicated over expert-DP, dense params over '
          'dp·cp\n'
          '    memory["optimizer"] = train.optimizer_bytes * (dense / (d * c) + expert / expert_dp)\n'
          'else:\n'
          '    memory["optimizer"] = train.optimizer_bytes * held\n'
          'return memory\n',
  'half': 'held'},
 {'exercise': 'planner.activation_memory',
  'name': 'all micro-batches in flight',
  'expect': 'holds all m micro-batches instead of the 1F1B depth',
  'words': ['flight', 'micro', 'pipeline', 'p micro'],
  'code': '\n'
          'cp = layout.cp\n'
          "tokens = s * b / cp  # this rank's tokens of one micro-batch\n"
          'layer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,\n'
          '                                         ffn_hidden_size=ffn, context_parallel_size=cp)\n'
          'in_flight = num_microbatches\n'
          "embedding = (8 * tokens + tokens * h) / (t if sp else 1)  # int64 token ids + the embedding's dropout "
          'output\n'
          'total = (layer * model.num_layers / layout.pp + embedding) * in_flight\n',
  'half': 'dev'},
 {'exercise': 'planner.activation_memory',
  'name': 'context parallelism ignored',
  'expect': 'layer and embedding bytes for s tokens instead of s/cp',
  'words': ['cp', 'context'],
  'code': '\n'
          'cp = layout.cp\n'
          "tokens = s * b  # this rank's tokens of one micro-batch\n"
          'layer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,\n'
          '                                         ffn_hidden_size=ffn, context_parallel_size=1)\n'
          'in_flight = in_flight_microbatches(layout, num_microbatches)\n'
          "embedding = (8 * tokens + tokens * h) / (t if sp else 1)  # int64 token ids + the embedding's dropout "
          'output\n'
          'total = (layer * model.num_layers / layout.pp + embedding) * in_flight\n',
  'half': 'held'},
 {'exercise': 'planner.llama3_70b_layout',
  'name': 'pure data parallelism',
  'expect': 'dp=64: the model does not fit in 80 GB',
  'words': ['fit', 'memory', 'GB'],
  'code': 'layout = Layout(tp=1, pp=1, cp=1, dp=64)\n',
  'half': 'dev'},
 {'exercise': 'planner.llama3_70b_layout',
  'name': '128 GPUs',
  'expect': 'tp*pp*cp*dp = 128, not 64',
  'words': ['64', 'product'],
  'code': 'layout = Layout(tp=8, pp=4, cp=2, dp=2)\n',
  'half': 'held'},
 {'exercise': 'cp.a2a_communicate',
  'name': 'received chunks left rank-major',
  'expect': "no reorder after the all-to-all: the chunks stay in source-rank order (rank j's two chunks side by "
            'side), not sequence order; right only for the plain split',
  'words': ['order', 'reorder', 'seq_chunk_ids', 'rank-major', 'zigzag'],
  'code': 'hl = h // cp\n'
          'send = x.reshape(b, cp, hl, s_local, hn).movedim(1, 0).contiguous()  # [cp, b, h/cp, s/cp, hn]\n'
          'recv = torch.empty_like(send)\n'
          'dist.all_to_all_single(recv, send, group=group)\n'
          'return recv.movedim(0, 2).reshape(b, hl, cp * s_local, hn)\n',
  'half': 'dev'},
 {'exercise': 'cp.a2a_communicate',
  'name': 'head blocks strided',
  'expect': 'rank j gets heads j, j+cp, j+2cp, ... (the head dim cut as [h/cp, cp]), not the contiguous block '
            'j·h/cp .. (j+1)·h/cp − 1',
  'words': ['head', 'block', '2r, 2r+1', 'strided'],
  'code': 'hl = h // cp\n'
          'send = x.reshape(b, hl, cp, s_local, hn).movedim(2, 0).contiguous()  # [cp, b, h/cp, s/cp, hn]\n'
          'recv = torch.empty_like(send)\n'
          'dist.all_to_all_single(recv, send, group=group)\n'
          'chunks = recv.movedim(0, 2).reshape(b, hl, 2 * cp, s_local // 2, hn)\n'
          'ids = torch.tensor(seq_chunk_ids_for_a2a(cp, True, zigzag), device=x.device)\n'
          'return chunks.index_select(2, ids).reshape(b, hl, cp * s_local, hn)\n',
  'half': 'held'},
 {'exercise': 'moe.ep_overlap',
  'name': 'every all-to-all waited at once',
  'expect': "each pending waited right after it started, before the other micro-batch's compute: right gradients, "
            'nothing hidden',
  'words': ['hidden', 'waited', 'overlap', 'exposed'],
  'code': 'x, g = f_input, b_grad\n'
          'if b_layer is not None:\n'
          '    g = b_layer.moe_combine.backward(g).wait()\n'
          'if f_layer is not None:\n'
          '    x = f_layer.pre_dispatch.forward(x)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.moe_dispatch.forward(x).wait()\n'
          'if b_layer is not None:\n'
          '    g = b_layer.mlp.backward(g)\n'
          'if b_layer is not None:\n'
          '    g = b_layer.moe_dispatch.backward(g).wait()\n'
          'if f_layer is not None:\n'
          '    x = f_layer.mlp.forward(x)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.moe_combine.forward(x).wait()\n'
          'if b_layer is not None:\n'
          '    g = b_layer.pre_dispatch.backward(g)\n'
          'return x, g\n',
  'half': 'dev'},
 {'exercise': 'moe.ep_overlap',
  'name': "forward all-to-alls started after b's compute",
  'expect': "rounds 2 and 4 run b's compute first, then start and wait f's dispatch / combine: the forward "
            'all-to-alls (moe_dispatch F, moe_combine F) are not hidden, the backward ones are',
  'words': ['moe_dispatch', 'moe_combine', 'forward', 'hidden'],
  'code': 'x, g = f_input, b_grad\n'
          'if b_layer is not None:\n'
          '    pending_b = b_layer.moe_combine.backward(g)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.pre_dispatch.forward(x)\n'
          'if b_layer is not None:\n'
          '    g = pending_b.wait()\n'
          'if b_layer is not None:\n'
          '    g = b_layer.mlp.backward(g)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.moe_dispatch.forward(x).wait()\n'
          'if b_layer is not None:\n'
          '    pending_b = b_layer.moe_dispatch.backward(g)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.mlp.forward(x)\n'
          'if b_layer is not None:\n'
          '    g = pending_b.wait()\n'
          'if b_layer is not None:\n'
          '    g = b_layer.pre_dispatch.backward(g)\n'
          'if f_layer is not None:\n'
          '    x = f_layer.moe_combine.forward(x).wait()\n'
          'return x, g\n',
  'half': 'held'},
 {'exercise': 'pp.layout_offset',
  'name': "this stage's own layers counted too",
  'expect': 'pp_rank + 1 ranks of this chunk counted (<= where < belongs): every offset is one stage late, the '
            'first stage does not start at 0',
  'words': ['own', 'one stage', 'off by', 'includ', 'itself'],
  'code': 'pp = self.pipeline_model_parallel_size\n'
          'offset = 0\n'
          'for v in range(vp_stage):\n'
          '    for r in range(pp):\n'
          '        offset += self.layout[r][v].count(layer_type)\n'
          'for r in range(pp_rank + 1):\n'
          '    offset += self.layout[r][vp_stage].count(layer_type)\n'
          'return offset\n',
  'half': 'dev'},
 {'exercise': 'pp.layout_offset',
  'name': 'virtual stage index rank-major',
  'expect': "this stage's place in model order taken as pp_rank * v + vp_stage (rank-major), not vp_stage * pp + "
            'pp_rank: right for v = 1 only',
  'words': ['virtual', 'vp_stage * p', 'model order', 'rank'],
  'code': 'k = pp_rank * self.virtual_pipeline_model_parallel_size + vp_stage  # this stage in model order\n'
          'return sum(self.layers_per_stage(layer_type)[:k])\n',
  'half': 'held'}]
