"""The five exercises of course/07_projects/06_rl_systems_loop.ipynb, each against an independent reference: the LCM
tiling against an element-by-element map of the two layouts, the resolved names against the whole model's own names,
the advantages and the loss against their formulas written as loops, the detector against each planted bug.

All in one process and small: `megalab grade ID` gives its verdict in about a second."""

from __future__ import annotations

import copy
import re
import statistics
from types import SimpleNamespace

import pytest
import torch

from megalab.core.models.gpt.gpt_model import GPTModel, build_gpt_stages
from megalab.core.resharding.planner import lcm_tiles
from megalab.core.resharding.utils import named_resolved_params
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.lab.checks import close, equal, mistake, require, wrong
from megalab.rl.logprob_check import REPORTS, diagnose
from megalab.rl.rl_utils import calculate_grpo_advantages, compute_logprobs, reduce_loss

# --------------------------------------------------------------------------- resharding.lcm_tiles

def _owner(g: int, full_len: int, world: int, stride: int) -> tuple[int, int]:
    """Element g of the full dimension -> (TP rank, index in its shard): stride parts, each cut into world slices."""
    part_len = full_len // stride
    n = part_len // world
    part, rem = divmod(g, part_len)
    return rem // n, part * n + rem % n


def _reference_tiles(full_len, src_world, src_stride, dst_world, dst_stride, dst_rank):
    """The maximal runs of the destination shard whose elements come from one source rank, consecutively."""
    local = {_owner(g, full_len, dst_world, dst_stride)[1]: g
             for g in range(full_len) if _owner(g, full_len, dst_world, dst_stride)[0] == dst_rank}
    tiles = []
    for j in sorted(local):
        src_rank, src_j = _owner(local[j], full_len, src_world, src_stride)
        last = tiles[-1] if tiles else None
        if last and last[0] == src_rank and last[1] + last[3] == src_j and last[2] + last[3] == j:
            last[3] += 1
        else:
            tiles.append([src_rank, src_j, j, 1])
    return [tuple(t) for t in tiles]


LCM_CASES = [(2, 1, 1), (1, 2, 1), (2, 4, 1), (4, 2, 1), (2, 3, 1), (2, 1, 2), (2, 4, 2), (4, 2, 2)]


@pytest.mark.exercise("resharding.lcm_tiles")
def test_lcm_tiles_cover_each_destination_shard_from_the_right_source_slices():
    for src_tp, dst_tp, stride in LCM_CASES:
        full_len = 24 * stride
        full = torch.arange(full_len, dtype=torch.float32)  # element g holds g: a wrong source shows which
        sources = [torch.stack([full[g] for g in range(full_len) if _owner(g, full_len, src_tp, stride)[0] == r])
                   for r in range(src_tp)]
        for d in range(dst_tp):
            case = f"tp{src_tp} -> tp{dst_tp} (stride {stride}), destination rank {d}"
            expected_tiles = _reference_tiles(full_len, src_tp, stride, dst_tp, stride, d)
            tiles = [tuple(int(x) for x in t) for t in lcm_tiles(full_len, src_tp, stride, dst_tp, stride, d, "w")]
            if stride > 1 and sorted(tiles) == sorted(_reference_tiles(full_len, src_tp, 1, dst_tp, 1, d)):
                require(mistake("the stride ignored: each rank's shard taken as one contiguous block of the full "
                                "dimension", f"{case}: with stride {stride} a rank holds its slice of each of the "
                                f"{stride} parts"))
            expected = torch.stack([full[g] for g in range(full_len) if _owner(g, full_len, dst_tp, stride)[0] == d])
            got = torch.full_like(expected, float("nan"))
            for src_rank, src_start, dst_start, n in tiles:
                shard_len = len(sources[src_rank]) if 0 <= src_rank < src_tp else 0
                if not (0 <= src_start and src_start + n <= shard_len and 0 <= dst_start and dst_start + n <= len(got)):
                    full_start = [t for t in tiles if t[1] + t[3] > shard_len]
                    if full_start and all(full[t[1]:t[1] + t[3]].tolist() == expected[t[2]:t[2] + t[3]].tolist()
                                          for t in tiles):
                        require(mistake("the source start counted in the full dimension, not in the source rank's "
                                        "shard", f"{case}: tile {(src_rank, src_start, dst_start, n)} reads past "
                                        f"source rank {src_rank}'s {shard_len} elements"))
                    require(wrong(f"{case}: tile {(src_rank, src_start, dst_start, n)} (source rank, start in its "
                                  f"shard, start in the destination shard, length) reaches outside source rank "
                                  f"{src_rank}'s shard of {shard_len} elements or the destination's {len(got)}"))
                got[dst_start:dst_start + n] = sources[src_rank][src_start:src_start + n]
            require(close(got, expected, f"{case}: the destination shard assembled from your tiles (element g "
                                         f"of the full dimension holds g; NaN where no tile wrote)"))
            if len(tiles) > len(expected_tiles):
                require(mistake("neighbouring units not merged into one tile",
                                f"{case}: {len(tiles)} tiles where {len(expected_tiles)} contiguous copies do: "
                                f"{expected_tiles}"))
            require(equal(sorted(tiles), sorted(expected_tiles), f"{case}: the tiles"))


# --------------------------------------------------------------------------- resharding.named_resolved_params

_LAYER_OF = re.compile(r"^decoder\.layers\.(\d+)\.")
PP_CONFIG = dict(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=32, seq_length=16,
                 hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.exercise("resharding.named_resolved_params")
def test_resolved_names_are_the_whole_models_names_on_every_pipeline_stage():
    torch.manual_seed(0)
    whole = GPTModel(TransformerConfig(**PP_CONFIG))  # tied embeddings: the last stage holds a copy
    names = {id(p): n for n, p in whole.named_parameters()}
    for pp, chunks_per_rank in [(2, 1), (2, 2)]:
        seen = {}
        for pp_rank in range(pp):
            chunks = build_gpt_stages(whole, pp, pp_rank, chunks_per_rank)  # share the whole model's modules
            for resolved, local, p in named_resolved_params(chunks if chunks_per_rank > 1 else chunks[0]):
                case = f"pp={pp}, {chunks_per_rank} chunk(s) per rank, rank {pp_rank}: {local!r}"
                truth = names[id(p)]
                if resolved != truth:
                    if local == "word_embeddings.weight":
                        require(mistake("the last stage's copy of the tied embeddings kept",
                                        f"{case} yielded as {resolved!r}: the engine has no such parameter, the "
                                        f"first stage's embedding.word_embeddings.weight is the source"))
                    if resolved == local:
                        require(mistake("the chunk's local layer number kept",
                                        f"{case} is the model's {truth!r}: each stage counts its layers from 0"))
                    got_layer, true_layer = _LAYER_OF.match(resolved), _LAYER_OF.match(truth)
                    if got_layer and true_layer and int(got_layer[1]) == int(true_layer[1]) + 1:
                        require(mistake("layer_number used as it is (it counts from 1)",
                                        f"{case} resolved to {resolved!r}, the model calls it {truth!r}"))
                    require(equal(resolved, truth, f"{case}'s resolved name"))
                seen[resolved] = seen.get(resolved, 0) + 1
        expected = {n: 1 for n in names.values()}
        require(equal(seen, expected, f"pp={pp}, {chunks_per_rank} chunk(s) per rank: how often each resolved name "
                                      "was yielded over all ranks"))


# --------------------------------------------------------------------------- rl.calculate_grpo_advantages

def _advantages_loop(rewards, std=statistics.pstdev, eps=1e-4, whole_batch=False):
    flat = [r for row in rewards for r in row]
    out = []
    for row in rewards:
        pool = flat if whole_batch else row
        mean, spread = statistics.fmean(pool), std(pool)
        out.append([(r - mean) / (eps + spread) if eps or spread else float("nan") for r in row])
    return torch.tensor(out)


@pytest.mark.exercise("rl.calculate_grpo_advantages")
def test_grpo_advantages_are_group_relative():
    g = torch.Generator().manual_seed(0)
    rewards = torch.cat([torch.randint(0, 2, (3, 8), generator=g).float(), torch.rand(2, 8, generator=g) * 3])
    rewards[0] = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0.0])  # one success among 8
    rows = rewards.tolist()
    got = calculate_grpo_advantages(rewards)
    require(close(got, _advantages_loop(rows), "the advantages of 5 groups of 8 rollouts", mistakes={
        "the sample std (divided by G - 1): Megatron's is the population std": lambda: _advantages_loop(
            rows, statistics.stdev),
        "the whole batch's mean and std, not each group's": lambda: _advantages_loop(rows, whole_batch=True),
        "no 1e-4 in the denominator": lambda: _advantages_loop(rows, eps=0.0),
        "not divided by the group's std": lambda: _advantages_loop(rows, std=lambda _: 1.0, eps=0.0)}))
    equal_group = calculate_grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    if equal_group.isnan().any():
        require(mistake("no 1e-4 in the denominator", "a group of equal rewards gives 0 / 0 = NaN; it teaches "
                                                        "nothing, so its advantages must be 0"))
    require(close(equal_group, torch.zeros(2, 4), "the advantages of groups whose rollouts all scored the same"))
    require(equal(got.dtype, torch.float32, "the advantages' dtype"))


# --------------------------------------------------------------------------- rl.reduce_loss

def _loss_loop(per_token, mask, normalization):
    rows = [(sum(x for x, m in zip(lr, mr) if m), sum(mr)) for lr, mr in zip(per_token.tolist(), mask.tolist())]
    if normalization == "token":
        return sum(s for s, _ in rows) / max(sum(c for _, c in rows), 1)
    return statistics.fmean(s / max(c, 1) for s, c in rows)


@pytest.mark.exercise("rl.reduce_loss")
def test_loss_is_normalised_per_token_as_megatron():
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]])
    token = reduce_loss(per_token, mask, "token")
    require(close(token, _loss_loop(per_token, mask, "token"),
                  "the per-token loss (Σ over the batch's response tokens / their number)", mistakes={
                      "per-sequence normalisation where Megatron's is per token (Megatron-LM #4590)":
                          lambda: _loss_loop(per_token, mask, "sequence"),
                      "divided by every position, not by the number of response tokens":
                          lambda: (per_token * mask).sum() / mask.numel(),
                      "the masked-out positions' losses added in": lambda: per_token.sum() / mask.sum()}))
    sequence = reduce_loss(per_token, mask, "sequence")
    require(close(sequence, _loss_loop(per_token, mask, "sequence"),
                  "the per-sequence loss (the mean over rows of each row's mean over its response tokens)", mistakes={
                      "the masked-out positions' losses added in": lambda: (per_token.sum(-1) / mask.sum(-1)).mean(),
                      "per-token normalisation in the per-sequence mode": lambda: _loss_loop(per_token, mask, "token")}))
    empty = reduce_loss(per_token, torch.zeros_like(mask), "token")
    require(close(empty, 0.0, "the per-token loss of a batch with no response token (0, not NaN)"))
    per_token.requires_grad_()
    reduce_loss(per_token, mask, "token").backward()
    require(close(per_token.grad, mask / mask.sum(), "the gradient of the per-token loss (1 / number of tokens on "
                                                     "each response token, 0 elsewhere)"))


# --------------------------------------------------------------------------- rl.diagnose

TEMPERATURE = 0.7


def _policy(seed: int) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=16,
                                      seq_length=8, hidden_dropout=0.0, attention_dropout=0.0)).eval()


COUNTER_BEHIND = ("a refit counter behind the trainer's, the weights equal (an engine that woke on its old version: "
                  "trl #5312)")


def _planted_cases():
    """(what was planted, expected cause or None, diagnose's result) for a clean batch and each planted bug."""
    trainer, old = _policy(0), _policy(1)  # `old`: the weights of a step before
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4, 7), generator=g)
    loss_mask = torch.zeros(4, 6)
    loss_mask[:, 3:] = 1  # the last 3 tokens are the response
    mask = loss_mask.bool()

    def run(engine_model, version=1, trainer_version=1, engine_t=1.0, trainer_t=1.0):
        engine = SimpleNamespace(model=engine_model, weights_version=version)
        with torch.no_grad():
            trainer_lp = compute_logprobs(trainer, tokens, trainer_t)[mask]
            engine_lp = compute_logprobs(copy.deepcopy(engine_model).float(), tokens, engine_t)[mask]
        return diagnose(trainer, engine, tokens, loss_mask, trainer_lp, engine_lp, TEMPERATURE, trainer_version)

    swapped = copy.deepcopy(trainer)
    with torch.no_grad():
        w = swapped.decoder.layers[0].mlp.linear_fc1.weight  # column-parallel: its two TP halves swapped
        w.copy_(torch.cat(w.chunk(2)[::-1]))
        rounded = copy.deepcopy(trainer)
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    bf16 = copy.deepcopy(trainer).to(torch.bfloat16)
    return [
        ("nothing (the engine holds the trainer's weights)", None, run(copy.deepcopy(trainer))),
        ("a skipped refit (the engine at weights_version 0, the trainer expects 1)", "stale weights",
         run(copy.deepcopy(old), version=0)),
        ("an older step's weights, no version given", "stale weights", run(copy.deepcopy(old), trainer_version=None)),
        (COUNTER_BEHIND, "stale weights", run(copy.deepcopy(trainer), version=0)),
        ("linear_fc1's two TP halves swapped", "wrong slice", run(swapped)),
        ("the trainer's weights rounded to bf16", "precision", run(rounded)),
        ("an engine in bf16", "precision", run(bf16)),
        (f"temperature {TEMPERATURE} applied by the engine only", "temperature (engine side only)",
         run(copy.deepcopy(trainer), engine_t=TEMPERATURE)),
        (f"temperature {TEMPERATURE} applied by the trainer only", "temperature (trainer side only)",
         run(copy.deepcopy(trainer), trainer_t=TEMPERATURE)),
    ]


_DIAGNOSE_MISTAKES = {  # (expected cause or the planted case, what was named first) -> the likely mistake
    (COUNTER_BEHIND, None): "weights_version never compared with trainer_version: an engine behind by a refit "
                            "goes unnamed while its weights happen to match",
    ("precision", "stale weights"): "bf16-rounded weights called stale: compare with the trainer's values rounded "
                                    "to bf16",
    ("wrong slice", "stale weights"): "a permutation of the trainer's values called stale: compare the sorted values",
    ("stale weights", None): "the weights never compared: a stale engine goes unnamed",
    ("wrong slice", None): "the weights never compared: a stale engine goes unnamed",
    ("temperature (trainer side only)", None): "temperature tested on the engine's side only",
    ("temperature (engine side only)", None): "temperature tested on the trainer's side only",
}


@pytest.mark.exercise("rl.diagnose")
def test_diagnose_names_each_planted_bug_and_its_report():
    for planted, cause, found in _planted_cases():
        named = [c for c, *_ in found]
        if cause is None:
            require(equal(named, [], f"diagnose's causes for {planted}"))
            continue
        first = named[0] if named else None
        if first != cause:
            likely = _DIAGNOSE_MISTAKES.get((planted, first)) or _DIAGNOSE_MISTAKES.get((cause, first))
            if likely:
                require(mistake(likely, f"{planted}: named {named}, expected {cause!r}"))
            require(wrong(f"diagnose named {named} for {planted}; expected {cause!r} ({REPORTS[cause]}) first"))
        require(equal(found[0][1], REPORTS[cause], f"the public report cited for {cause!r}"))
        require(equal(isinstance(found[0][2], str) and bool(found[0][2]), True,
                      f"the evidence (a sentence) given for {cause!r}"))
