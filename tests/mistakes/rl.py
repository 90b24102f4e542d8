"""Typical wrong answers to the RL systems loop's exercises (course/07_projects/06_rl_systems_loop.ipynb: the refit
plan's LCM tiling and resolved names, GRPO's advantages and loss normalisation, the train/serve detector)."""

from tests.mistakes import Mistake

_TILES_HEAD = """
unit = full_len // lcm
per_src, per_dst = lcm // ns, lcm // nd
tiles = []
"""

_DIAGNOSE_WEIGHTS = """
found = []
trainer_params = dict(trainer_model.named_parameters())
engine_params = dict(engine.model.named_parameters())
different = [n for n, p in engine_params.items() if not torch.equal(p, trainer_params[n].to(p.dtype))]
if trainer_version is not None and engine.weights_version != trainer_version:
    found.append(("stale weights", REPORTS["stale weights"], "refit counter behind"))
elif any(engine_params[n].dtype != trainer_params[n].dtype for n in engine_params):
    found.append(("precision", REPORTS["precision"], "another dtype"))
"""

_DIAGNOSE_TEMPERATURE = """
reference = compute_logprobs(trainer_model, tokens)[loss_mask.bool()]
tempered = compute_logprobs(trainer_model, tokens, temperature)[loss_mask.bool()]
if not _close(reference, engine_logprobs, tolerance) and _close(tempered, engine_logprobs, tolerance):
    found.append(("temperature (engine side only)", REPORTS["temperature (engine side only)"], "engine tempered"))
"""

_DIAGNOSE_TEMPERATURE_TRAINER = """
if not _close(reference, trainer_logprobs, tolerance) and _close(tempered, trainer_logprobs, tolerance):
    found.append(("temperature (trainer side only)", REPORTS["temperature (trainer side only)"], "trainer tempered"))
"""

MISTAKES = [
    Mistake("resharding.lcm_tiles", "ignored the stride (a rank's shard taken as one contiguous block)",
            says="stride ignored", code=_TILES_HEAD + """
per_src_rank, per_dst_rank = lcm // src_world, lcm // dst_world
for off in range(per_dst_rank):
    g = dst_local_rank * per_dst_rank + off
    src_rank, src_start = g // per_src_rank, (g % per_src_rank) * unit
    dst_start = off * unit
    last = tiles[-1] if tiles else None
    if last and last[0] == src_rank and last[1] + last[3] == src_start and last[2] + last[3] == dst_start:
        last[3] += unit
    else:
        tiles.append([src_rank, src_start, dst_start, unit])
return [tuple(t) for t in tiles]
"""),
    Mistake("resharding.lcm_tiles", "one tile per unit, neighbours never merged", says="not merged",
            code=_TILES_HEAD + """
for k in range(dst_stride):
    for off in range(per_dst):
        g = (k * dst_world + dst_local_rank) * per_dst + off
        seg = g // per_src
        src_rank, src_start = seg % src_world, ((seg // src_world) * per_src + g % per_src) * unit
        tiles.append((src_rank, src_start, (k * per_dst + off) * unit, unit))
return tiles
"""),
    Mistake("resharding.lcm_tiles", "the source start taken in the full dimension", says="in the full dimension",
            code=_TILES_HEAD + """
for k in range(dst_stride):
    for off in range(per_dst):
        g = (k * dst_world + dst_local_rank) * per_dst + off
        src_rank, src_start = (g // per_src) % src_world, g * unit
        dst_start = (k * per_dst + off) * unit
        last = tiles[-1] if tiles else None
        if last and last[0] == src_rank and last[1] + last[3] == src_start and last[2] + last[3] == dst_start:
            last[3] += unit
        else:
            tiles.append([src_rank, src_start, dst_start, unit])
return [tuple(t) for t in tiles]
"""),
    Mistake("resharding.named_resolved_params", "kept each chunk's local layer numbers", says="local layer number",
            code="""
for chunk in chunks:
    for name, p in chunk.named_parameters():
        if name == "word_embeddings.weight":
            continue
        yield name, name, p
"""),
    Mistake("resharding.named_resolved_params", "used layer_number without the - 1", says="counts from 1", code="""
for chunk in chunks:
    layers = chunk.decoder.layers
    for name, p in chunk.named_parameters():
        if name == "word_embeddings.weight":
            continue
        m = _LAYER.match(name)
        resolved = f"decoder.layers.{layers[int(m.group(1))].layer_number}." + name[m.end():] if m else name
        yield resolved, name, p
"""),
    Mistake("resharding.named_resolved_params", "yielded the last stage's tied embedding copy too",
            says="tied embeddings kept", code="""
for chunk in chunks:
    layers = chunk.decoder.layers
    for name, p in chunk.named_parameters():
        m = _LAYER.match(name)
        resolved = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}." + name[m.end():] if m else name
        yield resolved, name, p
"""),
    Mistake("rl.calculate_grpo_advantages", "the sample standard deviation (G - 1)", says="sample std", code="""
rewards = rewards.double()
mean = rewards.mean(-1, keepdim=True)
std = rewards.std(-1, keepdim=True)
return ((rewards - mean) / (1e-4 + std)).float()
"""),
    Mistake("rl.calculate_grpo_advantages", "the batch's statistics instead of each group's", says="whole batch",
            code="""
rewards = rewards.double()
return ((rewards - rewards.mean()) / (1e-4 + rewards.std(correction=0))).float()
"""),
    Mistake("rl.calculate_grpo_advantages", "no epsilon: a group of equal rewards gives NaN", says="no 1e-4", code="""
rewards = rewards.double()
mean = rewards.mean(-1, keepdim=True)
std = rewards.std(-1, keepdim=True, correction=0)
return ((rewards - mean) / std).float()
"""),
    Mistake("rl.calculate_grpo_advantages", "centred but never scaled", says="not divided by the group's std",
            code="""
return (rewards - rewards.mean(-1, keepdim=True)).float()
"""),
    Mistake("rl.reduce_loss", "per-sequence normalisation in the per-token mode", says="Megatron-LM #4590", code="""
mask = loss_mask.to(per_token.dtype)
return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
"""),
    Mistake("rl.reduce_loss", "the mean over every position (prompt and padding counted)", says="every position",
            code="""
mask = loss_mask.to(per_token.dtype)
if normalization == "token":
    return (per_token * mask).mean()
return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
"""),
    Mistake("rl.reduce_loss", "the mask only in the denominator", says="masked-out positions", code="""
mask = loss_mask.to(per_token.dtype)
if normalization == "token":
    return per_token.sum() / mask.sum().clamp(min=1)
return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
"""),
    Mistake("rl.reduce_loss", "no clamp: a batch without response tokens gives NaN", says="0, not NaN", code="""
mask = loss_mask.to(per_token.dtype)
if normalization == "token":
    return (per_token * mask).sum() / mask.sum()
return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
"""),
    Mistake("rl.diagnose", "only the log-probs examined, never the weights", says="weights never compared", code="""
found = []
""" + _DIAGNOSE_TEMPERATURE + _DIAGNOSE_TEMPERATURE_TRAINER + """
return found
"""),
    Mistake("rl.diagnose", "every weight difference called stale", says="called stale",
            code=_DIAGNOSE_WEIGHTS + """
if different and not found:
    found.append(("stale weights", REPORTS["stale weights"], "weights differ"))
if found:
    return found
""" + _DIAGNOSE_TEMPERATURE + _DIAGNOSE_TEMPERATURE_TRAINER + """
return found
"""),
    Mistake("rl.diagnose", "temperature looked for on the engine's side only", says="engine's side only",
            code=_DIAGNOSE_WEIGHTS + """
for n in different:
    mine, theirs = engine_params[n].float(), trainer_params[n].float()
    if torch.equal(mine, theirs.bfloat16().float()):
        found.append(("precision", REPORTS["precision"], "bf16"))
        break
    if torch.equal(mine.flatten().sort().values, theirs.flatten().sort().values):
        found.append(("wrong slice", REPORTS["wrong slice"], "another order"))
        break
if different and not found:
    found.append(("stale weights", REPORTS["stale weights"], "weights differ"))
if found:
    return found
""" + _DIAGNOSE_TEMPERATURE + """
return found
"""),
    Mistake("rl.diagnose", "the refit counter never compared (only the weights)", says="weights_version never compared",
            code=_DIAGNOSE_WEIGHTS.replace(
                "if trainer_version is not None and engine.weights_version != trainer_version:\n"
                "    found.append((\"stale weights\", REPORTS[\"stale weights\"], \"refit counter behind\"))\nelif",
                "if") + """
for n in different:
    mine, theirs = engine_params[n].float(), trainer_params[n].float()
    if torch.equal(mine, theirs.bfloat16().float()):
        found.append(("precision", REPORTS["precision"], "bf16"))
        break
    if torch.equal(mine.flatten().sort().values, theirs.flatten().sort().values):
        found.append(("wrong slice", REPORTS["wrong slice"], "another order"))
        break
if different and not found:
    found.append(("stale weights", REPORTS["stale weights"], "weights differ"))
if found:
    return found
""" + _DIAGNOSE_TEMPERATURE + _DIAGNOSE_TEMPERATURE_TRAINER + """
return found
"""),
]
