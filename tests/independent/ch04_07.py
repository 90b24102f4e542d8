"""Wrong answers for chapters 04-07, written BLIND (issue 34): from the notebooks' prose, the exercise regions' task
lines, hints and docstrings only, before reading tests/mistakes/, megalab/lab/mutants.py or any test's failure
messages. The same format as ch01_03.py: `WRONG = [dict(exercise, name, expect, words, code, half), ...]`
  expect  in words, what a verdict that names the mistake correctly would say (the behaviour)
  words   regular expressions (case-insensitive), written with the answer before any verdict was seen: a failing
          verdict that matches every one of them names the mistake
  code    the exercise region's body, as tests/blind/ solutions give it
  half    a split fixed before any grader was changed: the 1st, 3rd, 5th, ... entry is "dev" (looked at while fixing
          verdicts), the 2nd, 4th, ... "held" (never looked at while fixing: its naming rate is the honest one)
A variant of a longer body is written as a .replace() on the body it changes (each replace must change something).
"""


def _edit(body: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert old in body, old
        body = body.replace(old, new)
    return body


def W(exercise, name, expect, words, code):  # noqa: N802
    return dict(exercise=exercise, name=name, expect=expect, words=[words], code=code)


# ---------------------------------------------------------------------------------------------- longer bodies
_LR = '''
step = self.num_steps
if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:
    return self.init_lr + (self.max_lr - self.init_lr) * step / self.lr_warmup_steps
if self.lr_decay_style == "constant":
    return self.max_lr
if step > self.lr_decay_steps:
    return self.min_lr
if self.lr_decay_style == "inverse-square-root":
    return max(self.min_lr, self.max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5)
num_decay = self.lr_decay_steps - self.lr_warmup_steps
ratio = (step - self.lr_warmup_steps) / num_decay
delta_lr = self.max_lr - self.min_lr
if self.lr_decay_style == "linear":
    coeff = 1.0 - ratio
elif self.lr_decay_style == "cosine":
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
else:
    anneal_start = self.lr_decay_steps - self.wsd_decay_steps
    if step <= anneal_start:
        coeff = 1.0
    else:
        r = (step - anneal_start) / self.wsd_decay_steps
        coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                 "exponential": 2.0 * (0.5 ** r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style]
return self.min_lr + coeff * delta_lr
'''
# the region starts after `step = self.num_steps` in the source; keep the learner's copy harmless
_LR = _LR.replace("\nstep = self.num_steps\n", "\n", 1)

_SAMPLE = '''
doc_pos, doc_offset = 0, 0
for j in range(1, num_samples + 1):
    remaining = seq_length + 1
    while remaining != 0:
        doc_length = int(sizes[document_index[doc_pos]]) - doc_offset
        remaining -= doc_length
        if remaining <= 0:
            doc_offset += remaining + doc_length - 1
            remaining = 0
        else:
            doc_pos, doc_offset = doc_pos + 1, 0
    sample_index[j] = doc_pos, doc_offset
'''

_BLEND = '''
taken = np.zeros(len(weights), dtype=np.int64)
for i in range(size):
    errors = weights * max(i, 1) - taken
    d = int(np.argmax(errors))
    dataset_index[i] = d
    dataset_sample_index[i] = taken[d]
    taken[d] += 1
'''

_SCALER = '''
if found_inf:
    self._growth_tracker = 0
    self._hysteresis_tracker -= 1
    if self._hysteresis_tracker <= 0:
        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._growth_tracker += 1
    if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._scale = self._scale * self.growth_factor
'''

_ONLINE = '''
m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [b, h, s]
l = torch.zeros_like(m)
acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [b, h, s, d]
for start in range(0, s, block_n):
    cols = torch.arange(start, min(start + block_n, s), device=q.device)[None, :]
    scores = (q.float() @ k[..., start:start + block_n, :].float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(cols > rows, float("-inf"))
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    l = l * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + p @ v[..., start:start + block_n, :].float()
    m = m_new
out = acc / l[..., None]
'''

_FILTER = '''
logits = logits.clone()
if top_k > 0:
    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
    logits[logits < kth] = float("-inf")
if 0.0 < top_p < 1.0:
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    cumulative = probs.cumsum(-1)
    drop = cumulative - probs >= top_p
    drop[0] = False
    logits[order[drop]] = float("-inf")
return logits
'''

_ATTEND = '''
keys = keys.repeat_interleave(np_ // keys.shape[1], dim=1)
values = values.repeat_interleave(np_ // values.shape[1], dim=1)
visible = torch.arange(keys.shape[0], device=query.device) <= start + torch.arange(n, device=query.device)[:, None]
context = F.scaled_dot_product_attention(
    query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible)
return context.transpose(0, 1).reshape(n, np_ * hn)
'''

_SCHEDULE = '''
while self.waiting and len(self.active) + len(admitted) < self.max_batch_size:
    request = self.waiting[0]
    if tokens + len(request.prompt_tokens) > self.max_tokens:
        break
    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):
        break
    admitted.append(self.waiting.popleft())
    tokens += len(request.prompt_tokens)
'''

_BLOCKED = '''
pad = n * window - s
q, k, v = (F.pad(t, (0, 0, 0, pad)).view(b, h, n, window, d) for t in (q, k, v))

def with_previous_block(t):
    return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t], dim=3)

r = torch.arange(window, device=q.device)[:, None]
t = torch.arange(2 * window, device=q.device)[None, :]
band = (t > r) & (t <= r + window)
mask = band.expand(n, window, 2 * window).clone()
mask[0, :, :window] = False
q, k, v = (x.flatten(0, 1) for x in (q, with_previous_block(k), with_previous_block(v)))
context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
return context.reshape(b, h, n * window, d)[:, :, :s]
'''

_COMMIT = '''
if final.exists():
    shutil.rmtree(final)
os.rename(tmp, final)
tracker.with_suffix(".tmp").write_text(str(iteration))
os.replace(tracker.with_suffix(".tmp"), tracker)
'''

_LOAD = '''
state = {f"model.{name}": torch.empty_like(p) for name, p in model.named_parameters()}
read_state(path, state, no_dist=True)
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(state[f"model.{name}"])
'''

_SPEEDUP = '''
for round_ in range(warmup + repeats):
    for name, fn in (("before", before), ("after", after)):
        start = clock()
        fn()
        elapsed = clock() - start
        if round_ >= warmup:
            times[name].append(elapsed * 1e3)
'''

_NORM = '''
total = torch.zeros((), dtype=torch.float32, device=device)
for g in grads:
    total += g.detach().float().pow(2).sum()
if model_parallel_group is not None:
    dist.all_reduce(total, group=model_parallel_group)
return total.sqrt().item()
'''

_CURVES = '''
expected = dict(reference)
iterations = [it for it, _ in resumed]
if not resumed or iterations != sorted(expected)[-len(resumed):]:
    return False
return all(abs(loss - expected[it]) <= rtol * abs(expected[it]) for it, loss in resumed)
'''

# ------------------------------------------------ 07 · 06 the RL systems loop (blind40, 2026-11-27): longer bodies
# the blind solutions of tests/blind/rl_2026_11.py, copied; the WRONG entries at the end of the list edit them
_RL_LCM = '''
unit = full_len // lcm
src_seg, dst_seg = full_len // ns, full_len // nd
units_per_src, units_per_dst = lcm // ns, lcm // nd
tiles = []
for k in range(dst_stride):
    seg = k * dst_world + dst_local_rank
    for j in range(units_per_dst):
        g = seg * units_per_dst + j
        s = g // units_per_src
        src_rank = s % src_world
        src_start = (s // src_world) * src_seg + (g * unit - s * src_seg)
        dst_start = k * dst_seg + j * unit
        if tiles and tiles[-1][0] == src_rank and tiles[-1][1] + tiles[-1][3] == src_start \\
                and tiles[-1][2] + tiles[-1][3] == dst_start:
            r, a, b, n = tiles[-1]
            tiles[-1] = (r, a, b, n + unit)
        else:
            tiles.append((src_rank, src_start, dst_start, unit))
return tiles
'''

_RL_NAMED = '''
for chunk in chunks:
    for name, p in chunk.named_parameters():
        if name == "word_embeddings.weight":
            continue
        m = _LAYER.match(name)
        if m:
            layer = chunk.decoder.layers[int(m.group(1))]
            resolved = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        else:
            resolved = name
        yield resolved, name, p
'''

_RL_ADV = '''
r = rewards.double()
mean = r.mean(dim=-1, keepdim=True)
std = r.std(dim=-1, keepdim=True, correction=0)
return ((r - mean) / (1e-4 + std)).float()
'''

_RL_REDUCE = '''
mask = loss_mask.to(per_token.dtype)
masked = per_token * mask
if normalization == "token":
    return masked.sum() / mask.sum().clamp(min=1)
return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()
'''

_RL_DIAGNOSE = '''
def hit(cause, evidence):
    return [(cause, REPORTS[cause], evidence)]

if trainer_version is not None and engine.weights_version != trainer_version:
    return hit("stale weights", f"the engine's weights_version is {engine.weights_version}, the trainer's "
                                f"{trainer_version}: a refit was skipped")
trainer_params = dict(trainer_model.named_parameters())
engine_params = list(engine.model.named_parameters())
for name, e in engine_params:
    t = trainer_params.get(name)
    if t is not None and e.dtype != t.dtype:
        return hit("precision", f"{name} is {e.dtype} in the engine, {t.dtype} in the trainer")
for name, e in engine_params:
    t = trainer_params.get(name)
    if t is None:
        return hit("stale weights", f"{name} is in the engine but not in the trainer")
    if torch.equal(e, t):
        continue
    if torch.equal(e, t.bfloat16().to(e.dtype)):
        return hit("precision", f"{name} holds the trainer's values rounded to bfloat16")
    if e.shape == t.shape and torch.equal(e.flatten().sort().values, t.flatten().sort().values):
        return hit("wrong slice", f"{name} holds exactly the trainer's values, in another order")
    return hit("stale weights", f"{name} differs from the trainer's (max |diff| "
                                f"{(e.double() - t.double()).abs().max().item():.2e}): other weights")
mask = loss_mask.bool()
at_1 = compute_logprobs(trainer_model, tokens)[mask]
at_t = compute_logprobs(trainer_model, tokens, temperature)[mask]
found = []
if not _close(engine_logprobs, at_1, tolerance) and _close(engine_logprobs, at_t, tolerance):
    found += hit("temperature (engine side only)", f"the engine's log-probs are the trainer's at temperature "
                                                   f"{temperature}, not at 1")
if not _close(trainer_logprobs, at_1, tolerance) and _close(trainer_logprobs, at_t, tolerance):
    found += hit("temperature (trainer side only)", f"the trainer's log-probs are of logits / {temperature}, the "
                                                    f"raw (temperature 1) ones are the engine's")
return found
'''

WRONG = [
    # ------------------------------------------------------------------ 04 · model.rope_interleaved
    W("model.rope_interleaved", "concatenated halves, not interleaved pairs",
      "output is (-x1, -x3, ..., x0, x2, ...): the turned pairs are not neighbours (halves layout)",
      r"half|halves|neighbou?r|adjacent|interleav|cat",
      "\neven, odd = x[..., 0::2], x[..., 1::2]\nreturn torch.cat((-odd, even), dim=-1)\n"),
    W("model.rope_interleaved", "minus sign on the even channel",
      "each pair turns by -90 degrees: (x1, -x0) in place of (-x1, x0) (the sign is on the wrong channel)",
      r"sign|minus|-90|opposite|direction|clockwise|negat",
      "\neven, odd = x[..., 0::2], x[..., 1::2]\nreturn torch.stack((odd, -even), dim=-1).flatten(-2)\n"),
    W("model.rope_interleaved", "swapped without the sign",
      "each pair is swapped (x1, x0) with no minus sign: a reflection, not a rotation",
      r"sign|minus|negat|reflect",
      "\neven, odd = x[..., 0::2], x[..., 1::2]\nreturn torch.stack((odd, even), dim=-1).flatten(-2)\n"),
    # ------------------------------------------------------------------ 04 · model.gqa_repeat
    W("model.gqa_repeat", "Tensor.repeat tiles the heads",
      "heads come out k0 k1 k0 k1 (tiled): query head j gets kv head j % ng, not j // n_rep",
      r"tile|tiling|k0 k1 k0 k1|j % ng|% ng|adjacent|interleav|\.repeat",
      "\nreturn x.repeat(1, 1, n_rep, 1)\n"),
    W("model.gqa_repeat", "repeated along the last dim",
      "output shape [s, b, ng, n_rep * hn]: the heads get longer, not more numerous",
      r"shape|last dim|hn|longer|dim",
      "\nreturn x.repeat_interleave(n_rep, dim=-1)\n"),
    W("model.gqa_repeat", "repeated along the batch dim",
      "output shape [s, b * n_rep, ng, hn]: the batch dim grew, not the heads dim",
      r"shape|batch|dim",
      "\nreturn torch.repeat_interleave(x, n_rep, dim=1)\n"),
    # ------------------------------------------------------------------ 04 · model.hf_qkv
    W("model.hf_qkv", "HF order kept (all q, all k, all v)",
      "rows stay all-q then all-k then all-v: not grouped per kv head",
      r"group|order|all the q|all q|interleav|HF",
      "\nreturn torch.cat([q, k, v], dim=0)\n"),
    W("model.hf_qkv", "value before key in each group",
      "each group is [queries, value, key]: key and value swapped",
      r"swap|value.{0,40}key|key.{0,40}value|order",
      "\nng, h = num_query_groups, q.shape[1]\nq, k, v = q.view(ng, -1, h), k.view(ng, -1, h), v.view(ng, -1, h)\n"
      "return torch.cat([q, v, k], dim=1).reshape(-1, h)\n"),
    W("model.hf_qkv", "every ng-th query head in a group",
      "group g gets query heads g, g + ng, ... (strided) instead of the consecutive g*np/ng .. (g+1)*np/ng - 1",
      r"consecutive|strid|every ng|query head|group \d+ .{0,40}head",
      "\nng, h = num_query_groups, q.shape[1]\nhn = k.shape[0] // ng\nnp_ = q.shape[0] // hn\n"
      "qg = q.view(np_ // ng, ng, hn, h).transpose(0, 1).reshape(ng, -1, h)\n"
      "return torch.cat([qg, k.view(ng, -1, h), v.view(ng, -1, h)], dim=1).reshape(-1, h)\n"),
    # ------------------------------------------------------------------ 05 · data.build_blending_indices
    W("data.build_blending_indices", "sample index is i, not the dataset's counter",
      "dataset_sample_index[i] = i: the global sample number, not the k-th sample taken from that dataset",
      r"sample_index|counter|k-th|taken|sample index",
      _edit(_BLEND, ("dataset_sample_index[i] = taken[d]", "dataset_sample_index[i] = i"))),
    W("data.build_blending_indices", "i in place of max(i, 1)",
      "sample 0 goes to dataset 0 (all errors 0), not to the most heavily weighted dataset",
      r"sample 0|first sample|max\(i, ?1\)|dataset 0",
      _edit(_BLEND, ("weights * max(i, 1)", "weights * i"))),
    W("data.build_blending_indices", "target one sample ahead",
      "errors use i + 1: from sample 1 on, a different dataset is picked than Megatron's greedy rule",
      r"i \+ 1|off by one|sample \d+|one ahead|target",
      _edit(_BLEND, ("weights * max(i, 1)", "weights * (i + 1)"))),
    # ------------------------------------------------------------------ 05 · data.build_sample_index
    W("data.build_sample_index", "seq_length tokens per sample, no extra label",
      "consecutive samples do not share a token: each row advances seq_length - 1 tokens / misses the label token",
      r"share|overlap|seq_length \+ 1|extra|label|one token|off by one",
      _edit(_SAMPLE, ("remaining = seq_length + 1", "remaining = seq_length"))),
    W("data.build_sample_index", "next sample starts after the last token",
      "row j+1 starts one token after sample j's last label: the samples do not share that token (one too far)",
      r"share|overlap|one token|off by one|after|too far|\+ ?1",
      _edit(_SAMPLE, ("doc_offset += remaining + doc_length - 1", "doc_offset += remaining + doc_length"))),
    W("data.build_sample_index", "sizes indexed by the walk position",
      "document sizes read in storage order (sizes[doc_pos]) instead of through document_index (the shuffled order)",
      r"document_index|shuffl|order|sizes\[",
      _edit(_SAMPLE, ("int(sizes[document_index[doc_pos]])", "int(sizes[doc_pos])"))),
    W("data.build_sample_index", "offset forgotten in what is left",
      "the current document's full size is counted again after an offset: rows run ahead of the stream",
      r"offset|left|remaining|document",
      _edit(_SAMPLE, ("int(sizes[document_index[doc_pos]]) - doc_offset", "int(sizes[document_index[doc_pos]])"))),
    # ------------------------------------------------------------------ 05 · optimizer.grad_norm
    W("optimizer.grad_norm", "norms all-reduced, not squares",
      "each rank's norm is summed across ranks: the result is a sum of norms, larger than the true norm",
      r"sum of norms|norms do not add|square|before the all-reduce|sqrt",
      _edit(_NORM, ("dist.all_reduce(total, group=model_parallel_group)\nreturn total.sqrt().item()",
                    "total = total.sqrt()\n    dist.all_reduce(total, group=model_parallel_group)\nreturn total.item()"))),
    W("optimizer.grad_norm", "no all-reduce",
      "only this rank's share: the norm is smaller than the model's (missing the other ranks' squares)",
      r"all-reduce|all_reduce|this rank|local|other rank|share|group",
      _edit(_NORM, ("if model_parallel_group is not None:\n    dist.all_reduce(total, group=model_parallel_group)\n", ""))),
    W("optimizer.grad_norm", "elements not squared",
      "sums |g| (L1) under the root instead of g^2",
      r"square|L1|abs|norm_type|pow",
      _edit(_NORM, ("g.detach().float().pow(2).sum()", "g.detach().float().abs().sum()"))),
    W("optimizer.grad_norm", "bf16 accumulator",
      "the squares are accumulated in bfloat16: the norm is off by bf16 rounding (the statistic's dtype)",
      r"bf16|bfloat16|dtype|fp32|float32|precision",
      _edit(_NORM, ("dtype=torch.float32", "dtype=torch.bfloat16"),
            ("return total.sqrt().item()", "return total.float().sqrt().item()"))),
    # ------------------------------------------------------------------ 05 · optimizer.get_lr
    W("optimizer.get_lr", "warmup one step ahead",
      "step 0 already has one warmup step's lr; warmup reaches max_lr at step warmup - 1",
      r"step 0|warmup|one step|init_lr|off by one",
      _edit(_LR, ("if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:\n"
                  "    return self.init_lr + (self.max_lr - self.init_lr) * step / self.lr_warmup_steps",
                  "if self.lr_warmup_steps > 0 and step < self.lr_warmup_steps:\n"
                  "    return self.init_lr + (self.max_lr - self.init_lr) * (step + 1) / self.lr_warmup_steps"))),
    W("optimizer.get_lr", "decay ratio counted from step 0",
      "the decay fraction ignores warmup (step / lr_decay_steps): the curve starts below max_lr right after warmup",
      r"warmup|from step 0|ratio|decay.{0,40}(start|count)|fraction",
      _edit(_LR, ("ratio = (step - self.lr_warmup_steps) / num_decay", "ratio = step / self.lr_decay_steps"))),
    W("optimizer.get_lr", "decays to 0 not min_lr",
      "the curve ends at 0 instead of min_lr (lr = coeff * max_lr)",
      r"min_lr|to 0|zero|ends at",
      _edit(_LR, ("return self.min_lr + coeff * delta_lr", "return coeff * self.max_lr"))),
    W("optimizer.get_lr", "cosine without the +1",
      "cosine coeff is cos(pi r)/2: starts at half of max_lr - min_lr and goes below min_lr",
      r"cosine|half|below min_lr|coeff|\+ ?1",
      _edit(_LR, ("coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)", "coeff = 0.5 * math.cos(math.pi * ratio)"))),
    # ------------------------------------------------------------------ 05 · training.masked_loss
    W("training.masked_loss", "divided by this micro-batch's token count",
      "divides by loss_mask.sum() (this micro-batch) instead of num_tokens of the global batch",
      r"num_tokens|micro-batch|this batch|local|count|global",
      "\nreturn (losses * loss_mask).sum() / loss_mask.sum() * (m * dp)\n"),
    W("training.masked_loss", "no m*dp pre-scale",
      "the loss is m*dp times too small (the schedule's /m and the DP average are not undone)",
      r"m ?\* ?dp|m·dp|m x dp|times (too )?small|\d+(\.\d+)?x|factor",
      "\nreturn (losses * loss_mask).sum() / num_tokens\n"),
    W("training.masked_loss", "mean over b*s",
      "divides by every position b*s (masked ones too) instead of the unmasked global count",
      r"b ?\* ?s|mean|masked|count|num_tokens",
      "\nreturn (losses * loss_mask).mean() * (m * dp)\n"),
    W("training.masked_loss", "times m only",
      "pre-scaled by m only: dp times too small",
      r"dp|\d+(\.\d+)?x|factor|times",
      "\nreturn (losses * loss_mask).sum() / num_tokens * m\n"),
    # ------------------------------------------------------------------ 05 · checkpoint.commit
    W("checkpoint.commit", "tracker written before the data",
      "the tracker names iter_N before the folder is renamed: a crash in between leaves it pointing at nothing",
      r"tracker.{0,60}before|before.{0,60}rename|order|first|nothing|missing|crash",
      _edit(_COMMIT, ("if final.exists():\n    shutil.rmtree(final)\nos.rename(tmp, final)\n", ""))
      + "if final.exists():\n    shutil.rmtree(final)\nos.rename(tmp, final)\n"),
    W("checkpoint.commit", "tracker written in place",
      "the tracker is written in place (not replaced atomically): it can be read empty/half-written",
      r"in place|atomic|os\.replace|half|empty|partial",
      _edit(_COMMIT, ('tracker.with_suffix(".tmp").write_text(str(iteration))\n'
                      'os.replace(tracker.with_suffix(".tmp"), tracker)\n', "tracker.write_text(str(iteration))\n"))),
    W("checkpoint.commit", "shutil.move into an existing folder",
      "an older iter_N is not removed: tmp is moved INSIDE it (nested), the old files stay",
      r"nest|inside|exist|old|replac",
      "\nshutil.move(str(tmp), str(final))\n"
      "tracker.with_suffix('.tmp').write_text(str(iteration))\nos.replace(tracker.with_suffix('.tmp'), tracker)\n"),
    W("checkpoint.commit", "tracker holds the folder name",
      "the tracker file says 'iter_0000010' (the folder name) instead of the iteration number",
      r"tracker.{0,60}(says|holds|contains|reads|text|number)|iteration number|iter_",
      _edit(_COMMIT, ("write_text(str(iteration))", "write_text(final.name)"))),
    # ------------------------------------------------------------------ 06 · mixed_precision.dynamic_update
    W("mixed_precision.dynamic_update", "grows on every clean step",
      "the scale doubles after each clean step instead of after growth_interval clean steps",
      r"every clean step|each clean step|growth_interval|grew|grows|too early|step \d+",
      _edit(_SCALER, ("if self._growth_tracker == self.growth_interval:", "if True:"))),
    W("mixed_precision.dynamic_update", "hysteresis ignored",
      "backs off on the first overflow instead of after `hysteresis` overflows",
      r"hysteresis|first overflow|too early|overflow \d+",
      _edit(_SCALER, ("self._hysteresis_tracker -= 1\n    if self._hysteresis_tracker <= 0:\n"
                      "        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)",
                      "self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)"))),
    W("mixed_precision.dynamic_update", "overflow does not restart the growth count",
      "clean steps are counted across an overflow: the scale grows after growth_interval clean steps NOT in a row",
      r"in a row|consecutive|restart|reset|growth (count|tracker)|across",
      _edit(_SCALER, ("if found_inf:\n    self._growth_tracker = 0\n", "if found_inf:\n"))),
    W("mixed_precision.dynamic_update", "no min_scale floor",
      "the scale backs off below min_scale",
      r"min_scale|below|floor|minimum",
      _edit(_SCALER, ("torch.max(self._scale * self.backoff_factor, self.min_scale)",
                      "self._scale * self.backoff_factor"))),
    # ------------------------------------------------------------------ 06 · mixed_precision.unscale
    W("mixed_precision.unscale", "rebinding the name",
      "g = g * inv_scale makes a new tensor: the grads are left unchanged (still scaled)",
      r"in place|rebind|unchanged|not (been )?(changed|modified|unscaled)|still|new tensor",
      "\nfound_inf = False\nfor g in grads:\n    g = g * inv_scale\n    found_inf |= not bool(torch.isfinite(g).all())\n"
      "return found_inf\n"),
    W("mixed_precision.unscale", "isinf misses NaN",
      "a NaN grad is not reported (only inf is checked)",
      r"NaN|nan",
      "\nfound_inf = False\nfor g in grads:\n    g.mul_(inv_scale)\n    found_inf |= bool(torch.isinf(g).any())\n"
      "return found_inf\n"),
    W("mixed_precision.unscale", "divided by inv_scale",
      "grads divided by inv_scale = multiplied by the scale again: scale^2 times too large",
      r"divid|scale\^?2|squared|\d+(\.\d+)?x|times|too large|inverse",
      "\nfound_inf = False\nfor g in grads:\n    g.div_(inv_scale)\n    found_inf |= not bool(torch.isfinite(g).all())\n"
      "return found_inf\n"),
    W("mixed_precision.unscale", "stops at the first bad grad",
      "returns at the first inf/NaN: the grads after it are left scaled",
      r"after|remaining|rest|later|every grad|stop|still scaled|not unscaled|left",
      "\nfor g in grads:\n    g.mul_(inv_scale)\n    if not bool(torch.isfinite(g).all()):\n        return True\nreturn False\n"),
    # ------------------------------------------------------------------ 06 · fp8.compute_scale
    W("fp8.compute_scale", "margin multiplies",
      "scale is 2^(2*margin) times too large: the margin multiplies instead of dividing",
      r"margin|\d+(\.\d+)?x|times|too large",
      "\nnew = torch.full_like(amax, fp8_max) / amax * 2.0**margin\nnew = torch.where(amax > 0.0, new, scale)\n"
      "new = torch.where(torch.isfinite(amax), new, scale)\n"
      "return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)\n"),
    W("fp8.compute_scale", "448 hard-coded",
      "uses E4M3's 448 for every format: the E5M2 scale is 128x too small",
      r"448|E5M2|fp8_max|format|\d+(\.\d+)?x",
      "\nnew = torch.full_like(amax, 448.0) / amax / 2.0**margin\nnew = torch.where(amax > 0.0, new, scale)\n"
      "new = torch.where(torch.isfinite(amax), new, scale)\n"
      "return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)\n"),
    W("fp8.compute_scale", "amax 0 not kept",
      "where amax is 0 the result is FP32_MAX (from the overflow rule), not the old scale",
      r"amax (is |= ?)?0|zero|old scale|keep",
      "\nnew = torch.full_like(amax, fp8_max) / amax / 2.0**margin\n"
      "new = torch.where(torch.isfinite(amax), new, scale)\n"
      "return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)\n"),
    W("fp8.compute_scale", "overflow left as inf",
      "a tiny amax gives an inf scale instead of FP32 max",
      r"inf|FP32_MAX|FP32 max|overflow|tiny",
      "\nnew = torch.full_like(amax, fp8_max) / amax / 2.0**margin\nnew = torch.where(amax > 0.0, new, scale)\n"
      "return torch.where(torch.isfinite(amax), new, scale)\n"),
    W("fp8.compute_scale", "amax over fp8_max",
      "the quotient is inverted: amax / fp8_max",
      r"invert|inverse|reciprocal|amax ?/ ?fp8_max|\d+(\.\d+)?x",
      "\nnew = amax / fp8_max / 2.0**margin\nnew = torch.where(amax > 0.0, new, scale)\n"
      "new = torch.where(torch.isfinite(amax), new, scale)\n"
      "return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)\n"),
    # ------------------------------------------------------------------ 06 · fp8.quantize
    W("fp8.quantize", "no saturation",
      "values beyond the format's max become inf/NaN instead of saturating at +-max",
      r"saturat|clamp|inf|NaN|overflow|max",
      "\nreturn (x.float() * scale).to(dtype)\n"),
    W("fp8.quantize", "divides by the scale",
      "x / scale instead of x * scale",
      r"divid|x ?/ ?scale|inverse|\d+(\.\d+)?x|scale",
      "\nfp8_max = torch.finfo(dtype).max\nreturn (x.float() / scale).clamp(-fp8_max, fp8_max).to(dtype)\n"),
    W("fp8.quantize", "E4M3's max for every dtype",
      "clamps at 448 for E5M2 too: E5M2 values above 448 are cut",
      r"448|E5M2|57344|each dtype|format|max",
      "\nreturn (x.float() * scale).clamp(-448.0, 448.0).to(dtype)\n"),
    W("fp8.quantize", "cast before scaling",
      "x is cast to fp8 before the scale is applied: small values underflow / large overflow first",
      r"before|order|cast|underflow|precision",
      "\nfp8_max = torch.finfo(dtype).max\nreturn (x.to(dtype).float() * scale).clamp(-fp8_max, fp8_max).to(dtype)\n"),
    # ------------------------------------------------------------------ 06 · kernels.online_softmax
    W("kernels.online_softmax", "denominator not rescaled",
      "l is not multiplied by alpha when the max grows: the denominator is too large",
      r"alpha|rescal|denominator|\bl\b",
      _edit(_ONLINE, ("l = l * alpha + p.sum(-1)", "l = l + p.sum(-1)"))),
    W("kernels.online_softmax", "accumulator not rescaled",
      "acc is not multiplied by alpha when the max grows",
      r"alpha|rescal|acc|accumulat",
      _edit(_ONLINE, ("acc = acc * alpha[..., None] +", "acc = acc +"))),
    W("kernels.online_softmax", "causal mask hides the diagonal",
      "query i does not attend to itself (cols >= rows masked): row 0 is all -inf -> NaN",
      r"diagonal|itself|own|NaN|position \d+|causal",
      _edit(_ONLINE, ("cols > rows", "cols >= rows"))),
    W("kernels.online_softmax", "no 1/sqrt(d)",
      "scores not scaled by 1/sqrt(d): a sharper softmax",
      r"scale|sqrt|temperature|1/√d",
      _edit(_ONLINE, (".transpose(-1, -2)) * scale", ".transpose(-1, -2))"))),
    # ------------------------------------------------------------------ 06 · packed_seq.document_causal_mask
    W("packed_seq.document_causal_mask", "bucketize right=False",
      "each document's first token is put in the previous document",
      r"first token|boundar|previous document|document",
      "\npositions = torch.arange(total, device=cu_seqlens.device)\n"
      "doc = torch.bucketize(positions, cu_seqlens[1:])\nsame = doc[:, None] == doc[None, :]\n"
      "return same & torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()\n"),
    W("packed_seq.document_causal_mask", "no causal part",
      "tokens attend to later tokens of their own document (future keys visible)",
      r"future|causal|later|j <= i|attends to position",
      "\npositions = torch.arange(total, device=cu_seqlens.device)\n"
      "doc = torch.bucketize(positions, cu_seqlens[1:], right=True)\nreturn doc[:, None] == doc[None, :]\n"),
    W("packed_seq.document_causal_mask", "causal only",
      "tokens attend to earlier documents (plain causal mask, no document blocks)",
      r"document|across|other|previous",
      "\nreturn torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()\n"),
    W("packed_seq.document_causal_mask", "triu in place of tril",
      "keys j >= i are visible (the mask is transposed: future instead of past)",
      r"future|transpos|causal|upper|triu|later",
      "\npositions = torch.arange(total, device=cu_seqlens.device)\n"
      "doc = torch.bucketize(positions, cu_seqlens[1:], right=True)\nsame = doc[:, None] == doc[None, :]\n"
      "return same & torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).triu()\n"),
    # ------------------------------------------------------------------ 06 · inference.paged_slots
    W("inference.paged_slots", "positions from 0",
      "positions counted from 0 instead of `start`: the slots of positions 0..n-1",
      r"start|position|from 0",
      "\npositions = torch.arange(n, device=self.key.device)\n"
      "table = torch.tensor(self.block_tables[seq_id], device=self.key.device)\n"
      "return table[positions // self.block_size], positions % self.block_size\n"),
    W("inference.paged_slots", "quotient used as the block id",
      "p // block_size is returned as the block id: the block table is not used",
      r"block table|table|block id|quotient",
      "\npositions = torch.arange(start, start + n, device=self.key.device)\n"
      "return positions // self.block_size, positions % self.block_size\n"),
    W("inference.paged_slots", "quotient and remainder swapped",
      "the block is looked up by p % block_size and the offset is p // block_size",
      r"swap|offset|remainder|quotient|block",
      "\npositions = torch.arange(start, start + n, device=self.key.device)\n"
      "table = torch.tensor(self.block_tables[seq_id], device=self.key.device)\n"
      "return table[positions % self.block_size], positions // self.block_size\n"),
    # ------------------------------------------------------------------ 06 · inference.schedule
    W("inference.schedule", "skips a request that does not fit",
      "a later (smaller) request overtakes one that does not fit: not first come, first served",
      r"overtak|order|first come|FCFS|skip|ahead|before",
      "\nfor request in list(self.waiting):\n"
      "    if len(self.active) + len(admitted) >= self.max_batch_size:\n        break\n"
      "    if tokens + len(request.prompt_tokens) > self.max_tokens:\n        continue\n"
      "    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):\n        continue\n"
      "    self.waiting.remove(request)\n    admitted.append(request)\n    tokens += len(request.prompt_tokens)\n"),
    W("inference.schedule", "KV cache not checked",
      "admits requests whose final lengths the KV cache cannot hold",
      r"cache|fits|KV|memory|blocks",
      _edit(_SCHEDULE, ("    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):\n"
                        "        break\n", ""))),
    W("inference.schedule", "token budget off by one",
      "a request that fills max_tokens exactly is refused (>= in place of >)",
      r"max_tokens|budget|exactly|off by one|equal",
      _edit(_SCHEDULE, ("> self.max_tokens", ">= self.max_tokens"))),
    W("inference.schedule", "active requests' decode tokens forgotten",
      "the budget starts at 0, not at one decode token per active request: admits too many prompt tokens",
      r"decode|active|budget|max_tokens|tokens",
      "\ntokens = 0\n" + _SCHEDULE.lstrip("\n")),
    # ------------------------------------------------------------------ 06 · inference.filter_logits
    W("inference.filter_logits", "top-k keeps exactly k (ties dropped)",
      "a logit tied with the k-th largest is dropped: exactly k tokens stay",
      r"tie|tied|equal|more than k",
      _edit(_FILTER, ("    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]\n"
                      "    logits[logits < kth] = float(\"-inf\")\n",
                      "    keep = torch.topk(logits, min(top_k, logits.shape[-1])).indices\n"
                      "    filtered = torch.full_like(logits, float(\"-inf\"))\n"
                      "    filtered[keep] = logits[keep]\n    logits = filtered\n"))),
    W("inference.filter_logits", "crossing token dropped",
      "the token whose probability crosses top_p is dropped (cumulative >= top_p): the nucleus is one too small",
      r"cross|nucleus|top_p|top-p|smallest|one (token )?too",
      _edit(_FILTER, ("drop = cumulative - probs >= top_p", "drop = cumulative > top_p"))),
    W("inference.filter_logits", "no clone",
      "the caller's logits tensor is changed in place",
      r"clone|in place|caller|input|modif",
      _edit(_FILTER, ("logits = logits.clone()\n", ""))),
    W("inference.filter_logits", "top-p over the unfiltered logits",
      "the nucleus is taken over all logits, not over what top-k kept",
      r"top-k|top_k|before|order|kept|unfiltered",
      "\nout = logits.clone()\nif top_k > 0:\n    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]\n"
      "    out[logits < kth] = float(\"-inf\")\nif 0.0 < top_p < 1.0:\n"
      "    sorted_logits, order = torch.sort(logits, descending=True)\n    probs = sorted_logits.softmax(-1)\n"
      "    drop = probs.cumsum(-1) - probs >= top_p\n    drop[0] = False\n    out[order[drop]] = float(\"-inf\")\n"
      "return out\n"),
    # ------------------------------------------------------------------ 06 · inference.cached_attention
    W("inference.cached_attention", "causal mask without the cache offset",
      "query i attends to keys 0..i, not 0..start+i: the diagonal starts at column 0",
      r"start|offset|position \d+|diagonal|column",
      _edit(_ATTEND, ("<= start + torch.arange", "<= torch.arange"))),
    W("inference.cached_attention", "GQA heads tiled",
      "query head j is paired with kv group j % ng (repeat) instead of j // (np/ng)",
      r"GQA|group|head|repeat|tile",
      _edit(_ATTEND, ("keys = keys.repeat_interleave(np_ // keys.shape[1], dim=1)",
                      "keys = keys.repeat(1, np_ // keys.shape[1], 1)"),
            ("values = values.repeat_interleave(np_ // values.shape[1], dim=1)",
             "values = values.repeat(1, np_ // values.shape[1], 1)"))),
    W("inference.cached_attention", "no mask",
      "prefill queries attend to later tokens (no causal mask)",
      r"future|causal|later|mask|attends to",
      _edit(_ATTEND, (", attn_mask=visible)", ")"))),
    # ------------------------------------------------------------------ 07 · projects.curves_match
    W("projects.curves_match", "strict tolerance",
      "rtol=0 rejects identical losses (< in place of <=)",
      r"rtol ?= ?0|identical|<=|equal|bit",
      _edit(_CURVES, ("<= rtol * abs", "< rtol * abs"))),
    W("projects.curves_match", "absolute tolerance",
      "|loss - ref| <= rtol (absolute), not rtol * |ref|",
      r"relative|absolute|\|ref\||rtol",
      _edit(_CURVES, ("<= rtol * abs(expected[it])", "<= rtol"))),
    W("projects.curves_match", "gaps accepted",
      "accepts a resumed curve with missing or out-of-tail iterations as long as each is in the reference",
      r"missing|tail|gap|extra|iteration|order",
      "\nexpected = dict(reference)\nif not resumed or any(it not in expected for it, _ in resumed):\n    return False\n"
      "return all(abs(loss - expected[it]) <= rtol * abs(expected[it]) for it, loss in resumed)\n"),
    W("projects.curves_match", "empty curve accepted",
      "an empty resumed curve is accepted",
      r"empty|no iteration|nothing",
      "\nexpected = dict(reference)\niterations = [it for it, _ in resumed]\n"
      "if resumed and iterations != sorted(expected)[-len(resumed):]:\n    return False\n"
      "return all(abs(loss - expected[it]) <= rtol * abs(expected[it]) for it, loss in resumed)\n"),
    # ------------------------------------------------------------------ 07 · projects.load_inference_model
    W("projects.load_inference_model", "read but not copied",
      "the checkpoint is read but the model keeps its random init (nothing copied in)",
      r"copy|copied|not loaded|random|init|reading is not loading|differ",
      _edit(_LOAD, ("with torch.no_grad():\n    for name, p in model.named_parameters():\n"
                    "        p.copy_(state[f\"model.{name}\"])\n", ""))),
    W("projects.load_inference_model", "only the weights",
      "only parameters named *weight are copied: biases/norms keep their init",
      r"bias|norm|every parameter|some param|not all|differ",
      _edit(_LOAD, ("        p.copy_(", "        if name.endswith(\"weight\"):\n            p.copy_("))),
    W("projects.load_inference_model", "names without the model. prefix",
      "asks the checkpoint for '<name>' instead of 'model.<name>': keys not found",
      r"model\.|prefix|name|key|not found|missing",
      _edit(_LOAD, ('{f"model.{name}": torch', '{name: torch'), ('state[f"model.{name}"]', 'state[name]'))),
    # ------------------------------------------------------------------ 07 · sliding_window.mask
    W("sliding_window.mask", "window + 1 keys",
      "query i sees window + 1 keys (distance <= window): one too many",
      r"window|one too many|off by one|\d+ keys|window=1|diagonal",
      "\ni = torch.arange(seq_length, device=device)[:, None]\nj = torch.arange(seq_length, device=device)[None, :]\n"
      "return (i - j >= 0) & (i - j <= window)\n"),
    W("sliding_window.mask", "not causal",
      "query i also sees the next window - 1 keys (future)",
      r"future|causal|later|attends to position",
      "\ni = torch.arange(seq_length, device=device)[:, None]\nj = torch.arange(seq_length, device=device)[None, :]\n"
      "return (i - j).abs() < window\n"),
    W("sliding_window.mask", "own token excluded",
      "query i does not see itself (distance > 0)",
      r"diagonal|itself|own token|self|its own",  # "its own": widened after reading the verdict (dev)
      "\ni = torch.arange(seq_length, device=device)[:, None]\nj = torch.arange(seq_length, device=device)[None, :]\n"
      "return (i - j > 0) & (i - j <= window)\n"),
    # ------------------------------------------------------------------ 07 · sliding_window.blocked
    W("sliding_window.blocked", "block 0's fake previous block visible",
      "the zero keys before block 0 join the softmax: block 0's outputs are diluted",
      r"block 0|padding|zero keys|first block|previous block",
      _edit(_BLOCKED, ("mask[0, :, :window] = False\n", ""))),
    W("sliding_window.blocked", "band one key too wide",
      "the band includes key offset t == r: every query sees window + 1 keys",
      r"window|band|one too|off by one|\d+ keys|position \d+",
      _edit(_BLOCKED, ("band = (t > r) & (t <= r + window)", "band = (t >= r) & (t <= r + window)"))),
    W("sliding_window.blocked", "next block in place of the previous",
      "each block attends to the following block's keys (future) instead of the previous block's",
      r"next block|future|previous|following|causal",
      _edit(_BLOCKED, ("return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t], dim=3)",
                       "return torch.cat([F.pad(t, (0, 0, 0, 0, 0, 1))[:, :, 1:], t], dim=3)"))),
    # ------------------------------------------------------------------ 07 · speedup.remove_hotspots
    W("speedup.remove_hotspots", "recompute off, attention kept",
      "the slow core attention stays (spec returned unchanged)",
      r"core attention|CoreAttention|attention|spec|float64",
      "\nreturn replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,\n"
      "               attention_backend=\"sdpa\"), spec\n"),
    W("speedup.remove_hotspots", "attention fixed, recompute kept",
      "every layer is still recomputed in the backward",
      r"recompute|checkpoint",
      "\nreturn replace(config, attention_backend=\"sdpa\"), LayerSpec(column_linear=spec.column_linear, "
      "row_linear=spec.row_linear)\n"),
    W("speedup.remove_hotspots", "backend not switched to sdpa",
      "CoreAttention restored but attention_backend is left as it was (NOT WRONG: the slow config's backend is "
      "already the default sdpa; found in phase 2, kept so the halves do not shift, left out of every rate)",
      r"sdpa|backend",
      "\nreturn replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None), "
      "LayerSpec(column_linear=spec.column_linear, row_linear=spec.row_linear)\n"),
    # ------------------------------------------------------------------ 07 · speedup.interleaved_speedup
    W("speedup.interleaved_speedup", "warm-up rounds recorded",
      "the warm-up rounds are timed too: warmup + repeats times per name",
      r"warm",
      _edit(_SPEEDUP, ("        if round_ >= warmup:\n            times[name].append(", "        if True:\n"
                                                                                      "            times[name].append("))),
    W("speedup.interleaved_speedup", "all befores, then all afters",
      "before runs all its rounds, then after runs all its rounds: not alternated",
      r"alternat|interleav|order|in turn|before.{0,20}after",
      "\nfor name, fn in ((\"before\", before), (\"after\", after)):\n    for round_ in range(warmup + repeats):\n"
      "        start = clock()\n        fn()\n        elapsed = clock() - start\n        if round_ >= warmup:\n"
      "            times[name].append(elapsed * 1e3)\n"),
    W("speedup.interleaved_speedup", "seconds, not ms",
      "times are recorded in seconds: 1000x too small",
      r"ms|millisecond|1000|1e3|second|\d+x",
      _edit(_SPEEDUP, ("elapsed * 1e3", "elapsed"))),
    # ------------------------------------------------------------------ 07 · bugs.tp_dropout_seed
    W("bugs.tp_dropout_seed", "seed + tp_rank",
      "TP rank 0's stream is the default stream (seed base_seed + 0)",
      r"default|rank 0|coincid|same",
      "\nreturn base_seed + tp_rank\n"),
    W("bugs.tp_dropout_seed", "one offset seed for all ranks",
      "every TP rank gets the same seed: the mask repeats on every slice",
      r"same|every rank|identical|repeat|all ranks",
      "\nreturn base_seed + 2718\n"),
    # ------------------------------------------------------------------ 07 · bugs.vocab_padding
    W("bugs.vocab_padding", "floor slices, unpadded table",
      "rows per rank = vocab // tp: the last vocab % tp ids belong to no rank",
      r"no rank|nobody|left out|cover|id \d+|belong|slices hold",  # "slices hold": widened (dev)
      "\nreturn vocab_size, vocab_size // tp_size\n"),
    W("bugs.vocab_padding", "ceil slices, table not padded",
      "rows per rank are rounded up but the table keeps vocab_size rows: slices do not tile the table",
      r"rows|table|slice|multiple|pad|cover",
      "\nper = -(-vocab_size // tp_size)\nreturn vocab_size, per\n"),
    # ------------------------------------------------------------------ 07 · bugs.output_layer
    W("bugs.output_layer", "gathered output",
      "the logits come back gathered to the full vocabulary [.., V], not this rank's slice",
      r"gather|full vocab|shape|slice|\[.*\]",
      "\nreturn ColumnParallelLinear(config.hidden_size, vocab_size, config=config, init_method=init_method_normal(0.02),\n"
      "                            bias=False, gather_output=True, tp_group=tp_group)\n"),
    W("bugs.output_layer", "full vocabulary nn.Linear",
      "a plain linear to the whole vocabulary: each rank's logits are [.., V], not a slice",
      r"shape|slice|vocab|full",
      "\nreturn nn.Linear(config.hidden_size, vocab_size, bias=False)\n"),
    W("bugs.output_layer", "slice of the slice",
      "ColumnParallelLinear given vocab_size / t: each rank holds V / t^2 rows",
      r"shape|slice|vocab|rows|/ ?t",
      "\nreturn ColumnParallelLinear(config.hidden_size, vocab_size // dist.get_world_size(tp_group), config=config,\n"
      "                            init_method=init_method_normal(0.02), bias=False, gather_output=False,\n"
      "                            tp_group=tp_group)\n"),
    # ------------------------------------------------------------------ 07 · bugs.pp_grad_sync
    W("bugs.pp_grad_sync", "every cooldown backward",
      "syncs in every cooldown backward (several times per step), and never on the last stage",
      r"more than once|several|times|never|last stage|twice|\d+ times",
      "\nreturn backward_index >= num_microbatches - num_warmup\n"),
    W("bugs.pp_grad_sync", "first cooldown backward",
      "syncs at the first cooldown backward, before the last micro-batches' gradients are in",
      r"first|before|early|micro-batch \d+|backward \d+|last",
      "\nreturn backward_index == num_microbatches - num_warmup\n"),
    W("bugs.pp_grad_sync", "index one past the end",
      "backward_index == num_microbatches never happens: no sync at all",
      r"never|no sync|off by one|0 times|not once",
      "\nreturn backward_index == num_microbatches\n"),
    # ------------------------------------------------------------------ 07 · bugs.cp_packed
    W("bugs.cp_packed", "padding counted in the loss",
      "one document per row, but the padding tokens have loss_mask 1",
      r"padding|loss_mask|mask",
      "\nrows = [pack_batch([doc], seq_length) for doc in docs]\n"
      "out = {key: torch.cat([row[key] for row in rows]) for key in (\"tokens\", \"labels\", \"loss_mask\", \"position_ids\")}\n"
      "out[\"loss_mask\"] = torch.ones_like(out[\"loss_mask\"])\nreturn out\n"),
    W("bugs.cp_packed", "labels not shifted",
      "labels equal the inputs (not the next token)",
      r"label|shift|next token",
      "\ntokens = torch.zeros(len(docs), seq_length, dtype=docs[0].dtype)\nlabels = torch.zeros_like(tokens)\n"
      "loss_mask = torch.zeros(len(docs), seq_length)\nfor row, d in enumerate(docs):\n    n = d.numel() - 1\n"
      "    tokens[row, :n], labels[row, :n], loss_mask[row, :n] = d[:-1], d[:-1], 1.0\n"
      "position_ids = torch.arange(seq_length).expand(len(docs), seq_length).clone()\n"
      "return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)\n"),
    # ------------------------------------------------------------------ 06 · mxfp8.quantize_rowwise (added 2026-11)
    W("mxfp8.quantize_rowwise", "exponent rounded to nearest",
      "the E8M0 exponent from torch's cast to float8_e8m0fnu (round to nearest), not rounded up: blocks whose "
      "amax / fp8_max lies below the midpoint get too small a scale and their largest values saturate",
      r"round|nearest|saturat|power of two >=",
      "\nblocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)\n"
      "amax = blocks.abs().amax(dim=-1)\n"
      "scale_inv = (amax * max_norm_rcp(fp8_dtype)).to(torch.float8_e8m0fnu).view(torch.uint8)\n"
      "scale = exp2f_rcp(scale_inv)\nfp8_max = torch.finfo(fp8_dtype).max\n"
      "data = (blocks * scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)\n"),
    W("mxfp8.quantize_rowwise", "multiplied by the dequantization scale",
      "the block multiplied by 2^(e - 127) (e8m0_to_float, the scale back) instead of 2^(127 - e) (exp2f_rcp): "
      "the data is scaled the wrong way (tiny values, or saturated)",
      r"2\^\(?127|2\^\(?e|inverse|wrong way|exp2f_rcp|e8m0_to_float|dequantiz",
      "\nblocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)\n"
      "amax = blocks.abs().amax(dim=-1)\n"
      "scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype))\n"
      "scale = e8m0_to_float(scale_inv)\nfp8_max = torch.finfo(fp8_dtype).max\n"
      "data = (blocks * scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)\n"),
    # ------------------------------------------------------------------ 06 · inference.release_blocks (added 2026-11)
    W("inference.release_blocks", "count set to 0, not decremented",
      "a released block's reference count set to 0: a block another request still holds (a shared prefix) is "
      "cached or freed under it",
      r"reference|ref count|ref_count|shared|still hold|holds",
      "\nfor b in blocks:\n    if self.block_ref_counts[b] <= 0:\n"
      "        raise RuntimeError(f\"block {b} released but nobody holds it (a double free)\")\n"
      "    self.block_ref_counts[b] = 0\n"
      "    if self.block_hashes[b] is not None and self.prefix_caching_eviction_policy == \"lru\":\n        continue\n"
      "    if self.block_hashes[b] is not None:\n        self._deregister(b)\n    self.free_blocks.append(b)\n"),
    W("inference.release_blocks", "hash kept under ref_zero",
      "under ref_zero a block at count 0 goes back to the free list but keeps its hash: a later request matches "
      "a block that is free (or reused)",
      r"hash|forg|deregister|ref_zero",
      "\nfor b in blocks:\n    if self.block_ref_counts[b] <= 0:\n"
      "        raise RuntimeError(f\"block {b} released but nobody holds it (a double free)\")\n"
      "    self.block_ref_counts[b] -= 1\n    if self.block_ref_counts[b] == 0:\n"
      "        if self.block_hashes[b] is not None and self.prefix_caching_eviction_policy == \"lru\":\n"
      "            continue\n        self.free_blocks.append(b)\n"),
    # ============================================================== 07 · 06 the RL systems loop (blind40, 2026-11-27)
    # written blind (expect and words before any verdict); bodies are edits of the blind solutions above.
    # Verdicts 2026-11-27 (tests.independent.ch04_07_measure, the `words` check): 9 of 10 caught + named, 1 NOT CAUGHT
    # ------------------------------------------------------------------ 07 · resharding.lcm_tiles
    W("resharding.lcm_tiles", "units never merged",
      "one tile per lcm unit, neighbours from the same source rank not merged: tp2 -> tp1 gives lcm tiles "
      "(too many, short copies) where two are expected",
      r"merg|too many|one per unit|number of tiles|neighbou?r|contiguous|continu",
      _edit(_RL_LCM, ("        if tiles and tiles[-1][0] == src_rank", "        if False and tiles[-1][0] == src_rank"))),
    W("resharding.lcm_tiles", "partition_stride ignored",
      "the stride is ignored (each rank's shard taken as one contiguous block of the full dimension): with "
      "stride 2 (fused [gate; up]) the destination gets rank 0's gate and up, then rank 1's: parts out of order",
      r"stride|partition_stride|part|gate|fused",
      _edit(_RL_LCM, ("unit = full_len // lcm\n",
                      "src_stride = dst_stride = 1\nns, nd = src_world, dst_world\nlcm = math.lcm(ns, nd)\n"
                      "unit = full_len // lcm\n"))),
    # ------------------------------------------------------------------ 07 · resharding.named_resolved_params
    W("resharding.named_resolved_params", "layer_number used as is (1-based)",
      "resolved names count from 1 (decoder.layers.<layer_number>): the model's layer 0 is called "
      "decoder.layers.1, its last layer a number the model does not have: off by one",
      r"off by one|1-based|from 1|counts? from|layer_number ?- ?1|minus one|from 0|0-based",
      _edit(_RL_NAMED, ("{layer.layer_number - 1}", "{layer.layer_number}"))),
    W("resharding.named_resolved_params", "the last stage's tied embedding copy kept",
      "the last stage's word_embeddings.weight (the tied embedding's copy) is yielded too: a name the whole "
      "model does not have, a second source of the embedding",
      r"word_embeddings|tied|embedding|copy|last stage",
      _edit(_RL_NAMED, ('        if name == "word_embeddings.weight":\n            continue\n', ""))),
    # ------------------------------------------------------------------ 07 · rl.calculate_grpo_advantages
    W("rl.calculate_grpo_advantages", "sample std (G - 1)",
      "the std with Bessel's correction (divides by G - 1), not the population std (by G): every advantage "
      "too small by sqrt((G - 1) / G)",
      r"population|G ?- ?1|correction|unbiased|bessel|sample std",
      _edit(_RL_ADV, ("correction=0", "correction=1"))),
    W("rl.calculate_grpo_advantages", "statistics over the whole batch",
      "the mean and std over the whole batch, not each group's (row's): a group whose rollouts all scored the "
      "same gets non-zero advantages",
      r"group|row|per prompt|whole batch|global|same (reward|score)",
      _edit(_RL_ADV, ("r.mean(dim=-1, keepdim=True)", "r.mean()"), ("r.std(dim=-1, keepdim=True, correction=0)",
                                                                 "r.std(correction=0)"))),
    # ------------------------------------------------------------------ 07 · rl.reduce_loss
    W("rl.reduce_loss", "per token: divided by every position",
      "\"token\" divides the masked sum by every position (b·s), prompt and padding included, not by the number "
      "of response tokens: the loss comes out too small",
      r"count|number of|padding|prompt|all positions|every position|response tokens|b ?[·*x×] ?s|mask",
      _edit(_RL_REDUCE, ("masked.sum() / mask.sum().clamp(min=1)", "masked.mean()"))),
    W("rl.reduce_loss", "no clamp: an empty mask gives NaN",
      "with no response token (an all-zero mask) the loss is 0 / 0 = NaN, not 0",
      r"nan|no response|empty|zero|0 when|clamp|at least 1",
      _edit(_RL_REDUCE, ("mask.sum().clamp(min=1)", "mask.sum()"), ("mask.sum(dim=-1).clamp(min=1)",
                                                                   "mask.sum(dim=-1)"))),
    # ------------------------------------------------------------------ 07 · rl.diagnose
    W("rl.diagnose", "temperature sides swapped",
      "the side is swapped: log-probs that the ENGINE computed at the temperature are reported as \"temperature "
      "(trainer side only)\" and the trainer's as the engine's",
      r"side|swap|engine side|trainer side",
      _edit(_RL_DIAGNOSE, ('found += hit("temperature (engine side only)"', 'found += hit("temperature (TMP)"'),
            ('found += hit("temperature (trainer side only)"', 'found += hit("temperature (engine side only)"'),
            ('found += hit("temperature (TMP)"', 'found += hit("temperature (trainer side only)"'))),
    # verdict (2026-11-27, after writing): NOT CAUGHT, no test has an engine whose weights_version is behind with
    # the trainer's weights (the notebook's stale engine also has other weights); the text asks for the counter check
    W("rl.diagnose", "the refit counter ignored",
      "weights_version is never compared with trainer_version: an engine whose refit counter is behind but whose "
      "weights happen to be equal is not called stale",
      r"weights_version|version|counter|refit",
      _edit(_RL_DIAGNOSE, ("if trainer_version is not None and engine.weights_version != trainer_version:",
                           "if False:"))),
]

NOT_WRONG = {("speedup.remove_hotspots", "backend not switched to sdpa")}  # right after all: see its `expect`
for _i, _w in enumerate(WRONG):
    _w["half"] = "dev" if _i % 2 == 0 else "held"
