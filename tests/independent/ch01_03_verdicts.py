"""Which verdicts name their blind wrong answer (tests/independent/ch01_03.py), judged by reading each verdict
against the answer's `expect` (issue 34): (exercise, name) -> a phrase the verdict holds when it names the
mistake correctly, None when it is caught but not named. No verdict was judged to name a mistake wrongly.
tests/test_independent_ch01_03.py requires the phrases (on demand: MEGALAB_INDEPENDENT=1)."""

SAYS = {('dist.shard_bounds', 'extra items on the last ranks'): 'gave the extra items to the last ranks, not the first',
 ('dist.shard_bounds', 'rank == extra gets one too (<=)'): 'rank length % world_size got an extra item too (<= where '
                                                           '< b',
 ('dist.shard_bounds', 'ceil-sized shards'): 'ceil-sized shards, as torch.chunk cuts them (the last ranks ',
 ('comm.broadcast', 'positions not counted from src'): 'counted tree positions from rank 0, not from src (position =',
 ('comm.broadcast', 'a loop of sends from src'): 'not a tree: src sends to every rank itself; in a binomial tr',
 ('comm.broadcast', 'receiver listens to the wrong position'): 'a rank sends to or receives from itself: its peer is '
                                                               'compute',
 ('comm.all_gather', 'ring the other way'): 'the ring turns the other way: every rank sent to rank - 1 an',
 ('comm.all_gather', 'receive into a copy'): 'the received chunks never reach output: receive straight int',
 ('comm.all_gather', 'chunk indices (r+s)'): 'the wrong chunk lands in a slot: send chunk (rank - s) mod n',
 ('comm.reduce_scatter', 'copy instead of add'): 'your own part is missing: the received partial sum overwrote',
 ('comm.reduce_scatter', 'one chunk off'): "used all_gather's chunk indices (send r - s, receive r - s -",
 ('comm.reduce_scatter', 'n steps'): 'more steps than the ring needs (n-1 = 2): the result is righ',
 ('comm.ring_all_reduce', 'adds in the all-gather phase too'): 'the all-gather phase adds the finished chunks again: '
                                                               'in the ',
 ('comm.ring_all_reduce', 'reduce-scatter only'): 'the all-gather phase is missing: after n-1 steps only chunk ',
 ('comm.ring_all_reduce', 'average instead of sum'): 'averaged (divided by n): the all-reduce sums',
 ('comm.all_reduce_time', 'ring without the factor 2'): 'counted one phase only (reduce, then broadcast: the factor '
                                                        '2',
 ('comm.all_reduce_time', 'tree with floor(log2 n)'): 'rounded log2(n) down (int or floor): a partial round is a wh',
 ('comm.all_reduce_time', 'naive with n messages'): 'n messages each way: the root already holds its own part, it',
 ('comm.busbw', 'all_gather with the all_reduce factor'): "gave all_gather the all-reduce's factor 2(n-1)/n; it "
                                                          'moves e',
 ('comm.busbw', 'divides by the factor'): 'divided algbw by the factor instead of multiplying',
 ('comm.fit_alpha_beta', 'absolute error'): 'fitted absolute errors (divide each row by its time: the fit',
 ('comm.fit_alpha_beta', 'alpha and beta swapped'): 'returned (beta, alpha): swapped',
 ('comm.fit_alpha_beta', 'latency_steps ignored'): "ignored latency_steps (alpha's column must be latency_steps,",
 ('parallel_state.get_ranks', 'strides of the masked shape alone'): 'the masked strides come from the masked sizes '
                                                                    'alone (take th',
 ('parallel_state.get_ranks', 'unmasked strides of the unmasked shape'): 'the unmasked strides come from the '
                                                                         'unmasked sizes alone (tak',
 ('parallel_state.get_ranks', 'last dimension fastest'): 'the right groups in the wrong order (groups in the order '
                                                         'of ',
 ('parallel_state.create_groups', 'only my group is created'): 'called new_group only for its own group (every rank '
                                                               'must cal',
 ('parallel_state.create_groups', 'breaks after its group'): "stopped early: the groups after this rank's own were "
                                                             'never c',
 ('parallel_state.create_groups', 'keeps the last group'): 'returned the last group created, not the one holding '
                                                           'this ra',
 ('model.core_attention', 'scale 1/hn'): 'scaled the scores by 1/hn, not 1/sqrt(hn)',
 ('model.core_attention', 'diagonal masked too'): 'the mask hides the diagonal too (triu(1), not triu(0): a tok',
 ('model.core_attention', 'softmax over the queries'): 'softmax over the wrong dim (it normalises over the keys, the',
 ('model.core_attention', 'no causal mask'): 'forgot the causal mask (a query must not see later keys)',
 ('model.mlp', 'activation on both halves'): 'gated: the activation on both halves (only the gate goes thr',
 ('model.mlp', 'halves swapped'): "gated: the halves swapped (fc1's output is [gate; up]: act(g",
 ('model.mlp', 'no activation without gating'): 'no activation between the two linears (fc2(fc1(x)) is one li',
 ('model.norm', 'statistics in the input dtype'): "statistics in the input's dtype: 6 of 6 rows came out all ze",
 ('model.norm', 'mean over the whole tensor'): 'one RMS for the whole tensor (the mean of the squares is per',
 ('model.norm', 'LayerNorm: subtracts the mean'): 'subtracted the mean: that is LayerNorm; RMSNorm does not cen',
 ('model.norm', 'eps outside the root'): 'eps added after the root (rsqrt(mean(x^2)) + eps): it goes i',
 ('model.layer_forward', 'residual onto the normalised copy'): "the attention block's residual is the normalised "
                                                               'input (add ',
 ('model.layer_forward', 'MLP residual from the layer input'): "the MLP's residual is the layer's input (it is the "
                                                               'stream af',
 ('model.layer_forward', 'dropout always on'): 'dropout applied in eval mode: pass training=self.training to',
 ('model.gpt_forward', 'logits not transposed'): 'returned the logits as [s, b, V]: transpose them to [b, s, V',
 ('model.gpt_forward', 'rotary angles dropped'): 'never passed the rotary angles (rotary_pos_emb) to the decod',
 ('model.gpt_forward', 'logits even with labels'): 'returned the logits even with labels: with labels, return th',
 ('model.gpt_forward', 'always embeds'): 'a chunk without pre_process called the embedding (it has non',
 ('model.recompute', 'RNG not restored'): "the replay drew a new dropout mask: restore the forward's RN",
 ('model.recompute', 'no enable_grad'): 'replayed the region without torch.enable_grad (backward runs',
 ('model.recompute', 'RNG restored outside fork_rng'): 'restored the RNG state without torch.random.fork_rng: after ',
 ('data_parallel.grad_hook', 'copy instead of add'): 'copied param.grad into the buffer instead of adding it (accu',
 ('data_parallel.grad_hook', 'pending never refilled'): 'a bucket launched twice in one step, none inside '
                                                        'no_sync(): ',
 ('data_parallel.grad_hook', 'launches inside no_sync'): 'launched the bucket inside no_sync() (the hook must not '
                                                         'star',
 ('data_parallel.grad_hook', 'param.grad kept'): 'param.grad kept after adding it to the buffer: autograd adds',
 ('data_parallel.finish_grad_sync', 'unlaunched buckets not launched'): 'skipped the buckets the hooks did not '
                                                                        'launch (overlap off): ',
 ('data_parallel.finish_grad_sync', 'stage 0 grads not exposed'): 'p.grad was not set from the bucket buffer after '
                                                                  'the wait (st',
 ('data_parallel.finish_grad_sync', 'handles not cleared'): 'bucket.handle not reset to None after the wait (the '
                                                            'next ste',
 ('data_parallel.build_buckets', 'forward order'): 'filled the buckets in forward order (backward produces the l',
 ('data_parallel.build_buckets', 'closes at > bucket_size'): 'closed a bucket only when it exceeds bucket_size (> '
                                                             'instead ',
 ('data_parallel.build_buckets', 'no padding'): 'bucket length not padded to a multiple of pad_to (_round_up)',
 ('data_parallel.reduce_scatter', 'stage 1 into grad_shard'): 'stage 1 has no grad_shard: its shard is the view '
                                                              'grad_data[b',
 ('data_parallel.reduce_scatter', 'buffer shard at every stage'): "stage 2's reduced shard not written into "
                                                                  'bucket.grad_shard (',
 ('data_parallel.reduce_scatter', 'synchronous, no handle'): 'bucket.handle left None: keep the work that '
                                                             'reduce_scatter(.',
 ('data_parallel.zero3_gather', 'storage not re-allocated'): 'all-gathered into param_data without re-allocating its '
                                                             'stora',
 ('data_parallel.zero3_gather', 'resize in elements, not bytes'): "param_data's storage re-allocated too small: "
                                                                  'resize_ takes B',
 ('data_parallel.zero3_gather', 'gathers into a new tensor'): None,
 ('data_parallel.zero_step', 'main params not copied back'): 'forgot to copy the updated fp32 main params back into '
                                                             'the mo',
 ('data_parallel.zero_step', 'no all-gather'): "forgot the all-gather after the step (only this rank's shard",
 ('data_parallel.zero_step', 'all-gather at stage 3 too'): None,
 ('tp.vocab_cross_entropy', 'local max only'): "subtracted each rank's own max, not the max over the TP grou",
 ('tp.vocab_cross_entropy', 'target logit not masked'): 'target logit not masked to 0 on the ranks that do not own '
                                                        'th',
 ('tp.vocab_cross_entropy', 'vocab_size is the local slice'): "the smoothing term divides by this rank's V/t, not "
                                                              'the whole',
 ('tp.vocab_cross_entropy', 'sum of exp not all-reduced'): "the sum of exp not all-reduced: log S of this rank's "
                                                           'vocabul',
 ('tp.vocab_cross_entropy_backward', 'one-hot not masked'): 'one-hot not masked where the target lives on another '
                                                            'rank (s',
 ('tp.vocab_cross_entropy_backward', 'grad_output ignored'): 'forgot to multiply by grad_output',
 ('tp.vocab_cross_entropy_backward', 'smoothing over the local vocabulary'): 'a / (V/t): the smoothing spreads over '
                                                                             'the whole vocabulary V',
 ('tp.column_forward', 'always gathers'): 'all-gathered the output although gather_output=False (gather',
 ('tp.column_forward', 'plain F.linear'): 'skipped copy_to_tensor_model_parallel_region (f) before the ',
 ('tp.row_forward', 'bias before the reduce'): 'bias added on every rank before the all-reduce (counted t ti',
 ('tp.row_forward', 'all-reduce under SP'): 'all-reduced under sequence_parallel instead of reduce-scatte',
 ('tp.row_forward', 'input always split'): 'split X although input_is_parallel=True (scatter only when i',
 ('tp.vocab_embedding', 'outside rows not zeroed'): "did not zero the rows of ids outside this rank's vocabulary ",
 ('tp.vocab_embedding', 'end inclusive'): "looked up ids of other ranks' rows (shift by vocab_start_ind",
 ('tp.vocab_embedding', 'no reduce'): 'forgot the all-reduce (each rank has only the rows it owns)',
 ('tp.gather_last_dim', 'concatenated along dim 0'): 'concatenated along dim 0 instead of the last dim',
 ('tp.gather_last_dim', 'one buffer for all'): 'every receive buffer is the same tensor ([t] * world repeats',
 ('tp.copy_to_region', 'no reduce in backward'): "f's backward returned the gradient unchanged (it must all-re",
 ('tp.copy_to_region', 'mean in backward'): 'averaged the gradient over the TP group instead of summing i',
 ('tp.reduce_from_region', 'mean instead of sum'): 'averaged over the TP group instead of summing',
 ('tp.reduce_from_region', 'identity forward'): "g's forward returned the input unchanged (it must all-reduce",
 ('tp.reduce_from_region', 'in-place all-reduce of the input'): "all-reduced g's input in place: the caller's tensor "
                                                                'now hold',
 ('tp.sp_gather', 'gathered along the hidden dim'): 'gathered along the hidden (last) dim instead of the sequence',
 ('tp.sp_gather', 'output viewed with the wrong shape'): 'the output buffer is not [t * s/t, b, h] as one tensor: '
                                                         'all_',
 ('tp.sp_reduce_scatter', 'average instead of sum'): 'averaged over the ranks instead of summing (a row-parallel o',
 ('tp.sp_reduce_scatter', 'split along hidden'): 'reduce-scattered along the hidden (last) dim instead of the ',
 ('pp.communicate', 'receive buffers without requires_grad'): 'receive buffers without requires_grad=True: backward '
                                                              'gives t',
 ('pp.communicate', 'prev and next swapped in the return'): 'returned (from next, from prev) instead of (from prev, '
                                                            'from ',
 ('pp.communicate', 'float32 buffers'): "receive buffers not in the model's dtype (torch.empty withou",
 ('pp.stage_split', 'rank-major virtual stages'): "virtual stage pp_rank * v + chunk (a rank's chunks adjacent)",
 ('pp.stage_split', 'stop inclusive'): 'off by one: the stop is inclusive (start + per_stage - 1), t',
 ('pp.num_warmup', 'no cap'): 'no cap: the warmup count is not limited to the number of for',
 ('pp.num_warmup', 'one too many'): 'off by one: pp - rank instead of pp - rank - 1 (the last sta',
 ('pp.num_warmup', 'interleaved without the factor 2'): 'interleaved warmup without the doubling: (pp - rank - 1) + '
                                                        '(',
 ('pp.schedule_table', 'chunks inside micro-batches'): 'loops swapped: each micro-batch through every chunk, instead',
 ('pp.schedule_table', 'last group not cut'): 'the last group runs past the last micro-batch (group end not',
 ('pp.schedule_table', 'one group of everything'): 'group_size ignored: all micro-batches on chunk 0, then all o',
 ('pp.one_f_one_b', 'backward before forward'): 'steady state runs the backward before the forward (B F inste',
 ('pp.one_f_one_b', 'newest backward first'): 'the owed backwards run newest first (a stack): the steady st',
 ('pp.one_f_one_b', 'no cooldown'): 'no cooldown: the backwards still owed after the steady state',
 ('cp.zigzag_split', 'mirror off by one'): 'the mirror chunk off by one: 2*cp - r instead of 2*cp - 1 - ',
 ('cp.zigzag_split', 'flag ignored'): 'the zigzag flag is ignored: zigzag=False gives the same pair',
 ('cp.zigzag_split', 'plain and zigzag swapped'): 'zigzag and plain swapped',
 ('cp.causal_block_mask', 'inverted comparison'): 'the wrong side of the diagonal: LATER key chunks full, earli',
 ('cp.causal_block_mask', 'diagonal full'): 'the diagonal block (same chunk) treated as full: no causal m',
 ('cp.lse_merge', 'max instead of logaddexp'): 'the new lse is the max of the two, not their log-sum-exp: th',
 ('cp.lse_merge', 'outputs added without shares'): 'the outputs added without rescaling each by its share exp(ls',
 ('cp.lse_merge', 'naive exp'): 'log(exp(lse) + exp(block_lse)) without subtracting the max: ',
 ('cp.ring_step', 'ring reversed'): 'the ring runs backwards: sends to the previous rank (me - 1)',
 ('cp.ring_step', 'group ranks as global ranks'): 'peers given as group ranks: the P2POp peers are GLOBAL ranks',
 ('cp.ring_step', 'receives into the tensor it sends'): 'receives into the tensor it is sending (no fresh buffer): '
                                                        'th',
 ('cp.backward_ring', 'no last hop'): 'forgot the last hop home: each rank ends up with the dK/dV o',
 ('cp.backward_ring', 'dkv restarted every step'): 'dK/dV restarted at zero every step (they must travel with th',
 ('cp.backward_ring', 'dq only from the own block'): None,
 ('moe.load_balancing_loss', 'divides by the local rows'): "divided by probs' row count (16, e.g. probs.mean(0)), "
                                                           'not by',
 ('moe.load_balancing_loss', 'detached probs'): 'probs detached (or the loss rebuilt from plain numbers)',
 ('moe.load_balancing_loss', 'k forgotten'): 'forgot the top-k in the denominator: fractions of T, not of ',
 ('moe.topk_routing', 'softmax over all experts'): 'softmax over all experts, then the top-k: the k weights not ',
 ('moe.topk_routing', 'sigmoid weights from the biased scores'): 'the expert bias added to the weights: it only '
                                                                 'chooses the ex',
 ('moe.topk_routing', 'sigmoid chooses without the bias'): 'chose the experts by the sigmoid scores alone: the '
                                                           'expert bi',
 ('moe.capacity', 'capacity off by one'): 'off by one: arrivals counted from 1 (cumsum without - 1) kee',
 ('moe.capacity', 'probs not masked'): 'dropped tokens keep their weight: probs not masked with the ',
 ('moe.capacity', 'padding ignores free slots'): 'padding added up to `capacity` fillers on top of the kept to',
 ('moe.permute', 'token-major order'): 'token-major order: routing_map not transposed, so the rows a',
 ('moe.permute', 'probs in token-major order'): 'the probs selected token-major (probs not transposed like ro',
 ('moe.alltoall_dispatch', 'splits swapped'): 'output and input splits swapped: all_to_all(group, input, OU',
 ('moe.alltoall_dispatch', 'chunks not sorted'): 'forgot to sort the received chunks by local expert (sort_chu',
 ('moe.alltoall_dispatch', 'counts not exchanged'): 'the counts were never all_gathered: the output splits must c',
 ('hybrid.train_step', 'loss not divided by m'): 'the loss not divided by num_microbatches: the gradients are ',
 ('hybrid.train_step', 'grads never finalized'): 'the weights never moved: the optimizer saw no gradient (fina',
 ('planner.weight_memory', 'experts divided by tp'): 'experts divided by tp, not by ep·etp (expert parallelism spl',
 ('planner.weight_memory', 'optimizer over dp only'): 'the dense optimizer state sharded over dp only: the distribu',
 ('planner.weight_memory', 'embedding whole'): 'the embedding not divided by tp (VocabParallelEmbedding spli',
 ('planner.activation_memory', 'all micro-batches in flight'): 'all m micro-batches in flight (1F1B holds at most p)',
 ('planner.activation_memory', 'context parallelism ignored'): 'context parallelism ignored (each rank holds s/cp '
                                                               'tokens)',
 ('planner.llama3_70b_layout', 'pure data parallelism'): 'the layout does not fit in 80 GB (with 10% kept free)',
 ('planner.llama3_70b_layout', '128 GPUs'): 'the sizes multiply to 128 GPUs, not 64',
 # added 2026-11 (blind wrong answers of cp.a2a_communicate, moe.ep_overlap, pp.layout_offset)
 ('cp.a2a_communicate', 'received chunks left rank-major'): 'chunks left in arrival order (rank by rank): not '
                                                            'reordered',
 ('cp.a2a_communicate', 'head blocks strided'): 'rank j got the strided heads j, j + cp, ... instead of the c',
 ('moe.ep_overlap', 'every all-to-all waited at once'): 'none of the four all-to-alls is hidden: each was waited for',
 ('moe.ep_overlap', "forward all-to-alls started after b's compute"): "exposed: [('moe_combine', 'F'), "
                                                                       "('moe_dispatch', 'F')]",
 ('pp.layout_offset', "this stage's own layers counted too"): "included the stage's own layers",
 ('pp.layout_offset', 'virtual stage index rank-major'): 'rank-major'}
