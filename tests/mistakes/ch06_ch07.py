"""Typical wrong answers to the exercises of chapters 06 (advanced) and 07 (projects), as mutants.

`python -m megalab.lab.mutants --file tests/mistakes/ch06_ch07.py` swaps each `code` in for its exercise's
region and checks that the exercise's first failing test names the mistake (its verdict contains `says`).
"""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ 06·01 mixed precision
    Mistake("mixed_precision.dynamic_update", "grew the scale on every clean step", says="on every clean step", code="""
if found_inf:
    self._growth_tracker = 0
    self._hysteresis_tracker -= 1
    if self._hysteresis_tracker <= 0:
        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.dynamic_update", "kept the growth count through an overflow",
            says="did not restart the growth count", code="""
if found_inf:
    self._hysteresis_tracker -= 1
    if self._hysteresis_tracker <= 0:
        self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._growth_tracker += 1
    if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.dynamic_update", "backed off on every overflow (no hysteresis)", says="hysteresis",
            code="""
if found_inf:
    self._growth_tracker = 0
    self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
else:
    self._growth_tracker += 1
    if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._scale = self._scale * self.growth_factor
"""),
    Mistake("mixed_precision.unscale", "multiplied by the loss scale instead of 1/scale", says="divided by inv_scale",
            code="""
found_inf = False
for g in grads:
    g.div_(inv_scale)
    found_inf |= not bool(torch.isfinite(g).all())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "unscaled a copy, not the grads in place", says="not the gradients in place",
            code="""
found_inf = False
for g in grads:
    g = g * inv_scale
    found_inf |= not bool(torch.isfinite(g).all())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "checked for inf only, not NaN", says="inf only", code="""
found_inf = False
for g in grads:
    g.mul_(inv_scale)
    found_inf |= bool(torch.isinf(g).any())
return found_inf
"""),
    Mistake("mixed_precision.unscale", "only the last grad's inf/NaN counts", says="only the last gradient counts",
            code="""
found_inf = False
for g in grads:
    g.mul_(inv_scale)
    found_inf = not bool(torch.isfinite(g).all())
return found_inf
"""),
]
MISTAKES += [
    # ------------------------------------------------------------------ 06·02 FP8
    Mistake("fp8.compute_scale", "forgot the margin", says="forgot the margin", code="""
new = torch.full_like(amax, fp8_max) / amax
new = torch.where(amax > 0.0, new, scale)
new = torch.where(torch.isfinite(amax), new, scale)
return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
"""),
    Mistake("fp8.compute_scale", "hard-coded E4M3's max 448", says="448", code="""
new = torch.full_like(amax, 448.0) / amax / 2.0**margin
new = torch.where(amax > 0.0, new, scale)
new = torch.where(torch.isfinite(amax), new, scale)
return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
"""),
    Mistake("fp8.compute_scale", "amax 0 not kept at the old scale", says="where amax is 0", code="""
new = torch.full_like(amax, fp8_max) / amax / 2.0**margin
new = torch.where(torch.isfinite(amax), new, scale)
return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
"""),
    Mistake("fp8.compute_scale", "no FP32-max clamp on overflow", says="FP32 max", code="""
new = torch.full_like(amax, fp8_max) / amax / 2.0**margin
new = torch.where(amax > 0.0, new, scale)
return torch.where(torch.isfinite(amax), new, scale)
"""),
    Mistake("fp8.quantize", "cast without clamping", says="without clamping", code="""
return (x.float() * scale).to(dtype)
"""),
    Mistake("fp8.quantize", "divided by the scale", says="divided by the scale", code="""
fp8_max = torch.finfo(dtype).max
return (x.float() / scale).clamp(-fp8_max, fp8_max).to(dtype)
"""),
    Mistake("fp8.quantize", "clamped to E4M3's max for E5M2 too", says="448", code="""
return (x.float() * scale).clamp(-448.0, 448.0).to(dtype)
"""),
    # ------------------------------------------------------------------ 06·03 FlashAttention (the PyTorch model of the kernel)
    Mistake("kernels.online_softmax", "running sum not rescaled", says="running sum", code="""
m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
l = torch.zeros_like(m)  # noqa: E741
acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
for start in range(0, s, block_n):
    cols = torch.arange(start, min(start + block_n, s), device=q.device)[None, :]
    scores = (q.float() @ k[..., start:start + block_n, :].float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(cols > rows, float("-inf"))
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    l = l + p.sum(-1)  # noqa: E741
    acc = acc * alpha[..., None] + p @ v[..., start:start + block_n, :].float()
    m = m_new
out = acc / l[..., None]
"""),
    Mistake("kernels.online_softmax", "accumulator not rescaled", says="accumulator", code="""
m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
l = torch.zeros_like(m)  # noqa: E741
acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
for start in range(0, s, block_n):
    cols = torch.arange(start, min(start + block_n, s), device=q.device)[None, :]
    scores = (q.float() @ k[..., start:start + block_n, :].float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(cols > rows, float("-inf"))
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    l = l * alpha + p.sum(-1)  # noqa: E741
    acc = acc + p @ v[..., start:start + block_n, :].float()
    m = m_new
out = acc / l[..., None]
"""),
    Mistake("kernels.online_softmax", "causal mask hides the diagonal", says="hides the diagonal", code="""
m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
l = torch.zeros_like(m)  # noqa: E741
acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
for start in range(0, s, block_n):
    cols = torch.arange(start, min(start + block_n, s), device=q.device)[None, :]
    scores = (q.float() @ k[..., start:start + block_n, :].float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(cols >= rows, float("-inf"))
    m_new = torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    l = l * alpha + p.sum(-1)  # noqa: E741
    acc = acc * alpha[..., None] + p @ v[..., start:start + block_n, :].float()
    m = m_new
out = acc / l[..., None]
"""),
    # ------------------------------------------------------------------ 06·04 packed sequences
    Mistake("packed_seq.document_causal_mask", "plain causal mask", says="across documents", code="""
return torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
"""),
    Mistake("packed_seq.document_causal_mask", "same document, not causal", says="no causal part", code="""
positions = torch.arange(total, device=cu_seqlens.device)
doc = torch.bucketize(positions, cu_seqlens[1:], right=True)
return doc[:, None] == doc[None, :]
"""),
    Mistake("packed_seq.document_causal_mask", "document ids off by one at the boundaries", says="right=True", code="""
positions = torch.arange(total, device=cu_seqlens.device)
doc = torch.bucketize(positions, cu_seqlens[1:])
same = doc[:, None] == doc[None, :]
causal = torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
return same & causal
"""),
    Mistake("packed_seq.document_causal_mask", "upper triangle", says="upper triangle", code="""
positions = torch.arange(total, device=cu_seqlens.device)
doc = torch.bucketize(positions, cu_seqlens[1:], right=True)
same = doc[:, None] == doc[None, :]
causal = torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).triu()
return same & causal
"""),
]
MISTAKES += [
    # ------------------------------------------------------------------ 06·05 inference
    Mistake("inference.paged_slots", "skipped the block table", says="not as an index into the block table", code="""
positions = torch.arange(start, start + n, device=self.key.device)
return positions // self.block_size, positions % self.block_size
"""),
    Mistake("inference.paged_slots", "block index rounded up: off by one page", says="off by one page", code="""
positions = torch.arange(start, start + n, device=self.key.device)
table = torch.tensor(self.block_tables[seq_id], device=self.key.device)
return table[(positions + self.block_size - 1) // self.block_size], positions % self.block_size
"""),
    Mistake("inference.paged_slots", "positions from 0, not start", says="not from start", code="""
positions = torch.arange(n, device=self.key.device)
table = torch.tensor(self.block_tables[seq_id], device=self.key.device)
return table[positions // self.block_size], positions % self.block_size
"""),
    Mistake("inference.schedule", "admitted past the token budget", says="past the token budget", code="""
while self.waiting and len(self.active) + len(admitted) < self.max_batch_size:
    request = self.waiting[0]
    if tokens > self.max_tokens:
        break
    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):
        break
    admitted.append(self.waiting.popleft())
    tokens += len(request.prompt_tokens)
"""),
    Mistake("inference.schedule", "skipped a request that does not fit", says="first come, first served", code="""
for request in list(self.waiting):
    if len(self.active) + len(admitted) >= self.max_batch_size:
        break
    if tokens + len(request.prompt_tokens) > self.max_tokens:
        continue
    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):
        continue
    self.waiting.remove(request)
    admitted.append(request)
    tokens += len(request.prompt_tokens)
"""),
    Mistake("inference.schedule", "forgot the running requests' decode tokens", says="decode tokens", code="""
tokens = 0
while self.waiting and len(self.active) + len(admitted) < self.max_batch_size:
    request = self.waiting[0]
    if tokens + len(request.prompt_tokens) > self.max_tokens:
        break
    if not self.cache.fits([r.final_length for r in (*self.active, *admitted, request)]):
        break
    admitted.append(self.waiting.popleft())
    tokens += len(request.prompt_tokens)
"""),
    Mistake("inference.schedule", "ignored the KV cache", says="KV cache", code="""
while self.waiting and len(self.active) + len(admitted) < self.max_batch_size:
    request = self.waiting[0]
    if tokens + len(request.prompt_tokens) > self.max_tokens:
        break
    admitted.append(self.waiting.popleft())
    tokens += len(request.prompt_tokens)
"""),
    Mistake("inference.filter_logits", "top-k kept exactly k, dropping ties", says="ties", code="""
logits = logits.clone()
if top_k > 0:
    keep = torch.topk(logits, min(top_k, logits.shape[-1])).indices
    outside = torch.ones_like(logits, dtype=torch.bool)
    outside[keep] = False
    logits[outside] = float("-inf")
if 0.0 < top_p < 1.0:
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= top_p
    drop[0] = False
    logits[order[drop]] = float("-inf")
return logits
"""),
    Mistake("inference.filter_logits", "top-k kept k + 1 (off by one in the k-th largest)", says="kept k + 1", code="""
logits = logits.clone()
if top_k > 0:
    kth = torch.topk(logits, min(top_k + 1, logits.shape[-1])).values[-1]
    logits[logits < kth] = float("-inf")
if 0.0 < top_p < 1.0:
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    drop = before >= top_p
    drop[0] = False
    logits[order[drop]] = float("-inf")
return logits
"""),
    Mistake("inference.filter_logits", "top-p dropped the token that crosses p", says="crosses top_p", code="""
logits = logits.clone()
if top_k > 0:
    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
    logits[logits < kth] = float("-inf")
if 0.0 < top_p < 1.0:
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative >= top_p
    drop[0] = False
    logits[order[drop]] = float("-inf")
return logits
"""),
    Mistake("inference.filter_logits", "top-p cumulated in vocabulary order", says="vocabulary order", code="""
logits = logits.clone()
if top_k > 0:
    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
    logits[logits < kth] = float("-inf")
if 0.0 < top_p < 1.0:
    probs = logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[logits.argmax()] = False
    logits[drop] = float("-inf")
return logits
"""),
    Mistake("inference.filter_logits", "top-p on the logits before top-k", says="before top-k", code="""
original, logits = logits, logits.clone()
if top_k > 0:
    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
    logits[logits < kth] = float("-inf")
if 0.0 < top_p < 1.0:
    sorted_logits, order = torch.sort(original, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= top_p
    drop[0] = False
    logits[order[drop]] = float("-inf")
return logits
"""),
    Mistake("inference.cached_attention", "causal mask without the cache offset", says="without the cache offset",
            code="""
keys = keys.repeat_interleave(np_ // keys.shape[1], dim=1)
values = values.repeat_interleave(np_ // values.shape[1], dim=1)
visible = torch.arange(keys.shape[0], device=query.device) <= torch.arange(n, device=query.device)[:, None]
context = F.scaled_dot_product_attention(
    query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible)
return context.transpose(0, 1).reshape(n, np_ * hn)
"""),
    Mistake("inference.cached_attention", "no causal mask", says="no causal mask", code="""
keys = keys.repeat_interleave(np_ // keys.shape[1], dim=1)
values = values.repeat_interleave(np_ // values.shape[1], dim=1)
context = F.scaled_dot_product_attention(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1))
return context.transpose(0, 1).reshape(n, np_ * hn)
"""),
    Mistake("inference.cached_attention", "GQA groups repeated, not interleaved", says="repeat_interleave", code="""
keys = keys.repeat(1, np_ // keys.shape[1], 1)
values = values.repeat(1, np_ // values.shape[1], 1)
visible = torch.arange(keys.shape[0], device=query.device) <= start + torch.arange(n, device=query.device)[:, None]
context = F.scaled_dot_product_attention(
    query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible)
return context.transpose(0, 1).reshape(n, np_ * hn)
"""),
]
MISTAKES += [
    # ------------------------------------------------------------------ 07·01 train in 3D parallel: the resume check
    Mistake("projects.curves_match", "never checked the iterations", says="never checked the iterations", code="""
if not resumed or len(resumed) > len(reference):
    return False
tail = reference[-len(resumed):]
return all(abs(loss - ref) <= rtol * abs(ref) for (_, loss), (_, ref) in zip(resumed, tail))
"""),
    Mistake("projects.curves_match", "any iterations of the reference accepted", says="in order, none missing", code="""
expected = dict(reference)
if not resumed or any(it not in expected for it, _ in resumed):
    return False
return all(abs(loss - expected[it]) <= rtol * abs(expected[it]) for it, loss in resumed)
"""),
    Mistake("projects.curves_match", "rtol used as an absolute tolerance", says="absolute tolerance", code="""
expected = dict(reference)
iterations = [it for it, _ in resumed]
if not resumed or iterations != sorted(expected)[-len(resumed):]:
    return False
return all(abs(loss - expected[it]) <= rtol for it, loss in resumed)
"""),
    Mistake("projects.curves_match", "strict < rejects the exact continuation", says="instead of <=", code="""
expected = dict(reference)
iterations = [it for it, _ in resumed]
if not resumed or iterations != sorted(expected)[-len(resumed):]:
    return False
return all(abs(loss - expected[it]) < rtol * abs(expected[it]) for it, loss in resumed)
"""),
    # ------------------------------------------------------------------ 07·02 a custom layer: sliding-window attention
    Mistake("sliding_window.mask", "window off by one (W + 1 keys)", says="W + 1 keys", code="""
i = torch.arange(seq_length, device=device)[:, None]
j = torch.arange(seq_length, device=device)[None, :]
distance = i - j
return (distance >= 0) & (distance <= window)
"""),
    Mistake("sliding_window.mask", "window off by one (W - 1 keys)", says="W - 1 keys", code="""
i = torch.arange(seq_length, device=device)[:, None]
j = torch.arange(seq_length, device=device)[None, :]
return (i - j >= 0) & (i - j < window - 1)
"""),
    Mistake("sliding_window.mask", "no causal part", says="no causal part", code="""
i = torch.arange(seq_length, device=device)[:, None]
j = torch.arange(seq_length, device=device)[None, :]
return (i - j).abs() < window
"""),
    Mistake("sliding_window.mask", "band the wrong way (j - i)", says="wrong way", code="""
i = torch.arange(seq_length, device=device)[:, None]
j = torch.arange(seq_length, device=device)[None, :]
distance = j - i
return (distance >= 0) & (distance < window)
"""),
    Mistake("sliding_window.blocked", "block 0's padding block visible", says="zero padding", code="""
pad = n * window - s
q, k, v = (F.pad(t, (0, 0, 0, pad)).view(b, h, n, window, d) for t in (q, k, v))

def with_previous_block(t):
    return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t], dim=3)

r = torch.arange(window, device=q.device)[:, None]
t = torch.arange(2 * window, device=q.device)[None, :]
band = (t > r) & (t <= r + window)
mask = band.expand(n, window, 2 * window)
q, k, v = (x.flatten(0, 1) for x in (q, with_previous_block(k), with_previous_block(v)))
context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
return context.reshape(b, h, n * window, d)[:, :, :s]
"""),
    Mistake("sliding_window.blocked", "band off by one (W + 1 keys)", says="W + 1 keys", code="""
pad = n * window - s
q, k, v = (F.pad(t, (0, 0, 0, pad)).view(b, h, n, window, d) for t in (q, k, v))

def with_previous_block(t):
    return torch.cat([F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t], dim=3)

r = torch.arange(window, device=q.device)[:, None]
t = torch.arange(2 * window, device=q.device)[None, :]
band = (t >= r) & (t <= r + window)
mask = band.expand(n, window, 2 * window).clone()
mask[0, :, :window] = False
q, k, v = (x.flatten(0, 1) for x in (q, with_previous_block(k), with_previous_block(v)))
context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
return context.reshape(b, h, n * window, d)[:, :, :s]
"""),
    Mistake("sliding_window.blocked", "only the query's own block", says="own block", code="""
pad = n * window - s
q, k, v = (F.pad(t, (0, 0, 0, pad)).view(b, h, n, window, d) for t in (q, k, v))
mask = torch.ones(window, window, dtype=torch.bool, device=q.device).tril()
q, k, v = (x.flatten(0, 1) for x in (q, k, v))
context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
return context.reshape(b, h, n * window, d)[:, :, :s]
"""),
    # ------------------------------------------------------------------ 07·03 profile and speed up
    Mistake("speedup.remove_hotspots", "kept full recompute", says="kept full activation recompute", code="""
config = replace(config, attention_backend="sdpa")
return config, LayerSpec(column_linear=spec.column_linear, row_linear=spec.row_linear)
"""),
    Mistake("speedup.remove_hotspots", "kept the looped attention", says="LoopedAttention", code="""
config = replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                 attention_backend="sdpa")
return config, spec
"""),
    Mistake("speedup.remove_hotspots", "selective recompute instead of none", says="selective recompute", code="""
config = replace(config, recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                 attention_backend="sdpa")
return config, LayerSpec(column_linear=spec.column_linear, row_linear=spec.row_linear)
"""),
    Mistake("speedup.interleaved_speedup", "not interleaved", says="not interleaved", code="""
for name, fn in (("before", before), ("after", after)):
    for round_ in range(warmup + repeats):
        start = clock()
        fn()
        elapsed = clock() - start
        if round_ >= warmup:
            times[name].append(elapsed * 1e3)
"""),
    Mistake("speedup.interleaved_speedup", "kept the warm-up rounds", says="warm-up round", code="""
for round_ in range(warmup + repeats):
    for name, fn in (("before", before), ("after", after)):
        start = clock()
        fn()
        times[name].append((clock() - start) * 1e3)
"""),
    Mistake("speedup.interleaved_speedup", "seconds, not milliseconds", says="not milliseconds", code="""
for round_ in range(warmup + repeats):
    for name, fn in (("before", before), ("after", after)):
        start = clock()
        fn()
        elapsed = clock() - start
        if round_ >= warmup:
            times[name].append(elapsed)
"""),
    Mistake("speedup.interleaved_speedup", "one clock reading per round", says="one clock reading per round", code="""
for round_ in range(warmup + repeats):
    start = clock()
    for name, fn in (("before", before), ("after", after)):
        fn()
        if round_ >= warmup:
            times[name].append((clock() - start) * 1e3)
"""),
    # ------------------------------------------------------------------ 07·04 serve the trained model
    Mistake("projects.load_inference_model", "read but never copied in", says="never copied", code="""
state = {f"model.{name}": torch.empty_like(p) for name, p in model.named_parameters()}
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    read_state(path, state, no_dist=True)
"""),
    Mistake("projects.load_inference_model", "copied only the weights", says="only the weights", code="""
state = {f"model.{name}": torch.empty_like(p) for name, p in model.named_parameters() if name.endswith("weight")}
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    read_state(path, state, no_dist=True)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            p.copy_(state[f"model.{name}"])
"""),
    Mistake("projects.load_inference_model", "loaded only the transformer layers", says="only the transformer layers",
            code="""
layers = {name: p for name, p in model.named_parameters() if name.startswith("decoder.")}
state = {f"model.{name}": torch.empty_like(p) for name, p in layers.items()}
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    read_state(path, state, no_dist=True)
with torch.no_grad():
    for name, p in layers.items():
        p.copy_(state[f"model.{name}"])
"""),
]
