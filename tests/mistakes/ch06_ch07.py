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
