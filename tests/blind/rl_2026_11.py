"""Blind solutions of the exercises of 07 · 06, the RL systems loop (resharding.lcm_tiles,
resharding.named_resolved_params, rl.calculate_grpo_advantages, rl.reduce_loss, rl.diagnose): written from the
student workspace's text alone (the notebook, the task lines, the docstrings and `megalab hint`), by a writer who
had not seen the reference, the tests or the named mistakes (issue 34; see __init__.py)."""

_LCM_TILES = '''
unit = full_len // lcm
src_seg, dst_seg = full_len // ns, full_len // nd  # a segment's length on each side
units_per_src, units_per_dst = lcm // ns, lcm // nd
tiles = []
for k in range(dst_stride):  # the destination's local segments, in its local order
    seg = k * dst_world + dst_local_rank  # its index in the full dimension
    for j in range(units_per_dst):
        g = seg * units_per_dst + j  # the unit's index in the full dimension
        s = g // units_per_src  # the source segment holding it
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

_NAMED_RESOLVED = '''
for chunk in chunks:
    for name, p in chunk.named_parameters():
        if name == "word_embeddings.weight":  # the last stage's copy of the tied embedding
            continue
        m = _LAYER.match(name)
        if m:
            layer = chunk.decoder.layers[int(m.group(1))]
            resolved = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        else:
            resolved = name
        yield resolved, name, p
'''

_ADVANTAGES = '''
r = rewards.double()
mean = r.mean(dim=-1, keepdim=True)
std = r.std(dim=-1, keepdim=True, correction=0)  # population std
return ((r - mean) / (1e-4 + std)).float()
'''

_REDUCE = '''
mask = loss_mask.to(per_token.dtype)
masked = per_token * mask
if normalization == "token":
    return masked.sum() / mask.sum().clamp(min=1)
return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()
'''

_DIAGNOSE = '''
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

SOLUTIONS = [
    dict(exercise='resharding.lcm_tiles', name='first try', code=_LCM_TILES),
    dict(exercise='resharding.named_resolved_params', name='first try', code=_NAMED_RESOLVED),
    dict(exercise='rl.calculate_grpo_advantages', name='first try', code=_ADVANTAGES),
    dict(exercise='rl.reduce_loss', name='first try', code=_REDUCE),
    dict(exercise='rl.diagnose', name='first try', code=_DIAGNOSE),
]
