"""Named mistakes for the exercises of chapters 04 (models) and 05 (training): typical wrong region bodies.

Each one runs and differs from the solution; the first test marked with its exercise must fail on it with a
verdict that contains `says` (see megalab/lab/mutants.py).
"""

from tests.mistakes import Mistake


def _variant(base: str, *changes: tuple[str, str]) -> str:
    """`base` with each (old, new) replaced once: a mistake that differs from the solution in one place."""
    for old, new in changes:
        if base.count(old) != 1:
            raise ValueError(f"{old!r} occurs {base.count(old)} times in the base body, expected once")
        base = base.replace(old, new)
    return base


_GET_LR = """
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
"""

_SAMPLE_INDEX = """
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
"""

_BLENDING = """
taken = np.zeros(len(weights), dtype=np.int64)
for i in range(size):
    errors = weights * max(i, 1) - taken
    d = int(np.argmax(errors))
    dataset_index[i] = d
    dataset_sample_index[i] = taken[d]
    taken[d] += 1
"""

MISTAKES = [
    # ------------------------------------------------------------------ model.rope_interleaved (rotate_interleaved)
    Mistake("model.rope_interleaved", "rotated the two halves (GPT-NeoX rotate_half) instead of interleaved pairs",
            says="halves instead of interleaved pairs", code="""
x1, x2 = x.chunk(2, dim=-1)
return torch.cat([-x2, x1], dim=-1)
"""),
    Mistake("model.rope_interleaved", "the minus sign on the wrong channel: (x1, -x0), the sine term's sign flipped",
            says="wrong sign of the sine term", code="""
even, odd = x[..., 0::2], x[..., 1::2]
return torch.stack((odd, -even), dim=-1).flatten(-2)
"""),
    Mistake("model.rope_interleaved", "concatenated the turned odd and even channels instead of interleaving them",
            says="concatenated instead of interleaved", code="""
even, odd = x[..., 0::2], x[..., 1::2]
return torch.cat((-odd, even), dim=-1)
"""),
    # ------------------------------------------------------------------ model.gqa_repeat (repeat_kv)
    Mistake("model.gqa_repeat", "Tensor.repeat tiles the heads (k0 k1 k0 k1) instead of repeat_interleave",
            says="tiled the kv heads", code="""
return x.repeat(1, 1, n_rep, 1)
"""),
    Mistake("model.gqa_repeat", "repeated along the head dim hn (the last dim) instead of the heads dim",
            says="repeated along the head dim", code="""
return x.repeat_interleave(n_rep, dim=-1)
"""),
    # ------------------------------------------------------------------ model.hf_qkv (fuse_qkv)
    Mistake("model.hf_qkv", "stacked all q, then all k, then all v rows (no per-group interleave)",
            says="without the per-group interleave", code="""
return torch.cat([q, k, v], dim=0)
"""),
    Mistake("model.hf_qkv", "wrong order inside a group: key and value before the query heads",
            says="wrong order inside each group", code="""
ng, h = num_query_groups, q.shape[1]
q, k, v = q.view(ng, -1, h), k.view(ng, -1, h), v.view(ng, -1, h)
return torch.cat([k, v, q], dim=1).reshape(-1, h)
"""),
    Mistake("model.hf_qkv", "grouped every ng-th query head (view(-1, ng, h)) instead of consecutive heads",
            says="every ng-th query head", code="""
ng, h = num_query_groups, q.shape[1]
hn = k.shape[0] // ng
q = q.view(-1, ng, hn, h).transpose(0, 1).reshape(ng, -1, h)  # group g: heads g, g + ng, ...
k, v = k.view(ng, -1, h), v.view(ng, -1, h)
return torch.cat([q, k, v], dim=1).reshape(-1, h)
"""),
    # ------------------------------------------------------------------ data.build_blending_indices
    Mistake("data.build_blending_indices", "rounded each share (round(weight * size)) and laid the datasets out "
            "in blocks", says="rounding instead of Megatron's greedy error rule", code="""
counts = np.round(weights * size).astype(np.int64)
counts[-1] = size - counts[:-1].sum()
dataset_index[:] = np.repeat(np.arange(len(weights)), counts)
for d in range(len(weights)):
    dataset_sample_index[dataset_index == d] = np.arange(counts[d])
"""),
    Mistake("data.build_blending_indices", "the error uses weights * i, without Megatron's max(i, 1)",
            says="without Megatron's max(i, 1)", code=_variant(_BLENDING, ("weights * max(i, 1)", "weights * i"))),
    Mistake("data.build_blending_indices", "dataset_sample_index[i] = i (the blend position, not the dataset's count)",
            says="position in the blend instead of", code=_variant(
                _BLENDING, ("dataset_sample_index[i] = taken[d]", "dataset_sample_index[i] = i"))),
    # ------------------------------------------------------------------ data.build_sample_index
    Mistake("data.build_sample_index", "each sample reads seq_length tokens instead of seq_length + 1",
            says="seq_length tokens instead of seq_length + 1", code=_variant(
                _SAMPLE_INDEX, ("remaining = seq_length + 1", "remaining = seq_length"))),
    Mistake("data.build_sample_index", "the next sample starts after the last label token (samples share no token)",
            says="after the sample's last token", code=_variant(
                _SAMPLE_INDEX, ("doc_offset += remaining + doc_length - 1", "doc_offset += remaining + doc_length"))),
    Mistake("data.build_sample_index", "counted the whole current document, not what is left after the offset",
            says="whole document instead of what is left", code=_variant(
                _SAMPLE_INDEX, ("int(sizes[document_index[doc_pos]]) - doc_offset", "int(sizes[document_index[doc_pos]])"))),
    # ------------------------------------------------------------------ optimizer.grad_norm (get_grad_norm_fp32)
    Mistake("optimizer.grad_norm", "summed the gradients' norms instead of their squares",
            says="summed norms instead of squares", code="""
total = torch.zeros((), dtype=torch.float32, device=device)
for g in grads:
    total += g.detach().float().norm()
if model_parallel_group is not None:
    dist.all_reduce(total, group=model_parallel_group)
return total.item()
"""),
    Mistake("optimizer.grad_norm", "looped over every parameter: TP duplicates and shared ones counted on every rank",
            says="counted TP-duplicated", code="""
total = torch.zeros((), dtype=torch.float32, device=device)
for p in params:
    if p.grad is not None:
        total += p.grad.detach().float().pow(2).sum()
if model_parallel_group is not None:
    dist.all_reduce(total, group=model_parallel_group)
return total.sqrt().item()
"""),
    Mistake("optimizer.grad_norm", "forgot the all-reduce over the model-parallel group (this rank's norm only)",
            says="forgot the all-reduce", code="""
total = torch.zeros((), dtype=torch.float32, device=device)
for g in grads:
    total += g.detach().float().pow(2).sum()
return total.sqrt().item()
"""),
    Mistake("optimizer.grad_norm", "took the square root before the all-reduce (added the ranks' norms)",
            says="square root before the all-reduce", code="""
total = torch.zeros((), dtype=torch.float32, device=device)
for g in grads:
    total += g.detach().float().pow(2).sum()
total = total.sqrt()
if model_parallel_group is not None:
    dist.all_reduce(total, group=model_parallel_group)
return total.item()
"""),
    # ------------------------------------------------------------------ optimizer.get_lr
    Mistake("optimizer.get_lr", "warmup off by one: (step + 1) / lr_warmup_steps, so step 0 is already one step up",
            says="warmup off by one", code=_variant(
                _GET_LR, ("step <= self.lr_warmup_steps", "step < self.lr_warmup_steps"),
                ("* step / self.lr_warmup_steps", "* (step + 1) / self.lr_warmup_steps"))),
    Mistake("optimizer.get_lr", "warmup (step + 1) / lr_warmup_steps, up to and including lr_warmup_steps (overshoots)",
            says="warmup off by one", code=_variant(
                _GET_LR, ("* step / self.lr_warmup_steps", "* (step + 1) / self.lr_warmup_steps"))),
    Mistake("optimizer.get_lr", "decayed from max_lr to 0, without the min_lr floor", says="without the min_lr floor",
            code=_variant(_GET_LR, ("return self.min_lr + coeff * delta_lr", "return coeff * self.max_lr"))),
    Mistake("optimizer.get_lr", "the decay ratio counts from step 0 (step / lr_decay_steps), not from the end of warmup",
            says="decay counted from step 0", code=_variant(
                _GET_LR, ("ratio = (step - self.lr_warmup_steps) / num_decay", "ratio = step / self.lr_decay_steps"))),
    # ------------------------------------------------------------------ training.masked_loss
    Mistake("training.masked_loss", "averaged over all b*s tokens (masked ones counted) instead of the unmasked ones",
            says="averaged over all tokens", code="""
return (losses * loss_mask).mean()
"""),
    Mistake("training.masked_loss", "the micro-batch's own token mean: the executor then takes a mean of means",
            says="mean of the micro-batch means", code="""
return (losses * loss_mask).sum() / loss_mask.sum()
"""),
    Mistake("training.masked_loss", "forgot the m * dp pre-scale", says="forgot the m * dp pre-scale", code="""
return (losses * loss_mask).sum() / num_tokens
"""),
    Mistake("training.masked_loss", "forgot the loss mask (masked tokens' losses counted)", says="forgot the loss mask",
            code="""
return losses.sum() / num_tokens * (m * dp)
"""),
    # ------------------------------------------------------------------ checkpoint.commit (commit_checkpoint)
    Mistake("checkpoint.commit", "wrote the tracker before the data was in place", says="tracker before the data",
            code="""
tracker.with_suffix(".tmp").write_text(str(iteration))
os.replace(tracker.with_suffix(".tmp"), tracker)
if final.exists():
    shutil.rmtree(final)
os.rename(tmp, final)
"""),
    Mistake("checkpoint.commit", "wrote the tracker in place (not atomic: a crash mid-write leaves it empty)",
            says="not atomic", code="""
if final.exists():
    shutil.rmtree(final)
os.rename(tmp, final)
tracker.write_text(str(iteration))
"""),
    Mistake("checkpoint.commit", "renamed onto an existing checkpoint of the same iteration without removing it",
            says="without removing it first", code="""
os.rename(tmp, final)
tracker.with_suffix(".tmp").write_text(str(iteration))
os.replace(tracker.with_suffix(".tmp"), tracker)
"""),
    Mistake("checkpoint.commit", "shutil.move onto an existing checkpoint nests tmp inside it", says="nested",
            code="""
shutil.move(tmp, final)
tracker.with_suffix(".tmp").write_text(str(iteration))
os.replace(tracker.with_suffix(".tmp"), tracker)
"""),
]
