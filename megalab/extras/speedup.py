"""Find a training step's hotspots with the profiler, remove them, and measure the speed-up honestly.

The slow step (slow_step_setup) is correct, and slow for two reasons a profiler table shows:

    what the code does                              what top_ops / the Chrome trace show
    core attention: a Python loop over batch x      aten::mm, aten::softmax, aten::masked_fill, aten::triu
      heads, upcast to float64 "for safety", the      with thousands of calls per step (the calls column),
      causal mask rebuilt each time (LoopedAttention) aten::_to_copy (the fp32 <-> fp64 casts)
    full activation recompute (every layer) that    every forward op twice per step, CheckpointFunctionBackward
      the memory budget does not need

The fix keeps the model (same parameters, same random draws) and swaps two choices: chapter 02's
CoreAttention (one fused SDPA call for every batch and head) through the layer spec, and no recompute.
Same loss and gradients, fewer and bigger ops.

Measuring on a shared machine: the two steps alternate (before, after, before, after, ...) so both
see the same machine state, the first rounds are warm-up, and the speed-up is the ratio of the
medians, which a few disturbed steps do not move (interleaved_speedup).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig


class LoopedAttention(nn.Module):
    """Causal attention one (sequence, head) at a time in float64: right, and deliberately slow.

    Same signature as CoreAttention: q [s, b, np, hn], k/v [s, b, ng, hn] -> context [s, b, np * hn].
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        s, b, np_, hn = query.shape
        heads_per_group = np_ // key.shape[2]
        rows = []
        for i in range(b):
            heads = []
            for h in range(np_):
                q = query[:, i, h].double()  # [s, hn]
                k, v = key[:, i, h // heads_per_group].double(), value[:, i, h // heads_per_group].double()
                future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
                scores = (q @ k.T / math.sqrt(hn)).masked_fill(future, float("-inf"))  # [s, s]
                heads.append((scores.softmax(-1) @ v).to(query.dtype))  # [s, hn]
            rows.append(torch.cat(heads, dim=-1))  # [s, np * hn]
        return torch.stack(rows, dim=1)  # [s, b, np * hn]


def slow_step_setup(**sizes) -> tuple[TransformerConfig, LayerSpec]:
    """The slow model: LoopedAttention in the spec and full recompute of every layer (dropout off)."""
    config = TransformerConfig(**{**dict(hidden_dropout=0.0, attention_dropout=0.0), **sizes},
                               recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return config, LayerSpec(core_attention=LoopedAttention)


def remove_hotspots(config: TransformerConfig, spec: LayerSpec) -> tuple[TransformerConfig, LayerSpec]:
    """The same model without the two hotspots: chapter 02's fused core attention, and no recompute."""
    # EXERCISE speedup.remove_hotspots: return (config without recompute, spec with CoreAttention on the sdpa backend)
    ### BEGIN SOLUTION
    # HINT 1: The slow step is correct but does two costly things the memory budget does not need:
    #         recomputing every layer in the backward, and attention looped over (batch, head) in float64.
    # HINT 2: Use dataclasses.replace on the config: recompute_granularity, recompute_method and
    #         recompute_num_layers set to None and attention_backend "sdpa"; return a LayerSpec that keeps the
    #         spec's column/row linears but leaves core_attention at its default (CoreAttention).
    # HINT 3: Both hotspots must go; the profiler's op counts show either one left behind.
    config = replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                     attention_backend="sdpa")
    return config, LayerSpec(column_linear=spec.column_linear, row_linear=spec.row_linear)
    ### END SOLUTION


def make_train_step(config: TransformerConfig, spec: LayerSpec, tokens: torch.Tensor, seed: int = 0,
                    lr: float = 1e-3) -> tuple[GPTModel, Callable[[], torch.Tensor]]:
    """A GPTModel built from `seed` and its AdamW training step on tokens [b, s + 1]; step() returns the loss."""
    torch.manual_seed(seed)
    model = GPTModel(config, spec).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return model, step


def interleaved_speedup(before: Callable[[], object], after: Callable[[], object], repeats: int = 7,
                        warmup: int = 1, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time `before` and `after` alternately (warmup untimed rounds, then `repeats` timed rounds).

    Returns before_ms and after_ms (the medians), speedup = before_ms / after_ms, and the raw times.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    times = {"before": [], "after": []}
    # EXERCISE speedup.interleaved_speedup: alternate before/after each round, time each call with clock(), drop warm-up rounds
    ### BEGIN SOLUTION
    # HINT 1: Alternate before, after, before, after, ... so both see the same machine state; the
    #         first `warmup` rounds are run but not recorded.
    # HINT 2: For warmup + repeats rounds, call before then after, each between two clock()
    #         readings; from round `warmup` on, append each elapsed time in milliseconds to times[name].
    # HINT 3: Time each call on its own (a clock reading right before and right after it), in ms.
    for round_ in range(warmup + repeats):
        for name, fn in (("before", before), ("after", after)):
            start = clock()
            fn()
            elapsed = clock() - start
            if round_ >= warmup:
                times[name].append(elapsed * 1e3)
    ### END SOLUTION
    before_ms, after_ms = statistics.median(times["before"]), statistics.median(times["after"])
    return dict(before_ms=before_ms, after_ms=after_ms, speedup=before_ms / after_ms, times_ms=times)


def op_calls(prof, steps: int) -> dict[str, float]:
    """Calls per step of every aten op recorded by a profile_step(..., steps=steps) profiler."""
    return {e.key: e.count / steps for e in prof.key_averages() if e.key.startswith("aten::")}
