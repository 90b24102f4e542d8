"""Inference: KV-cache decode vs recompute, and continuous vs static batching on mixed-length requests.

1. One request, greedy: megalab's engine with a KV cache (one new token per forward) against the
   reference without a cache (generate_by_recompute: a full forward over the whole sequence per
   token). Both produce the same tokens (checked); we report tokens/s and the speed-up.
2. Mixed-length requests (random prompt and output lengths), the same engine and budgets:
   continuous batching (requests join and leave every step) against static batching (a batch
   runs until its longest request ends). We report generated tokens/s, forward steps and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.core.inference import (
    ContiguousKVCache,
    InferenceEngine,
    PagedKVCache,
    SamplingParams,
    generate_by_recompute,
)
from megalab.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megalab.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def _timed(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median seconds of each function, run interleaved (a load spike hits all of them alike), and its last result."""
    times, out = {name: [] for name in fns}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="CI smoke: fewer tokens and requests, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.requests, args.repeats = 32, 12, 1
    torch.set_num_threads(1)  # steady timings on a shared machine
    config = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=256, seq_length=256,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    g = torch.Generator().manual_seed(0)
    rows, extra = [], {"load_average": os.getloadavg()}

    # 1. decode with and without the KV cache
    prompt = torch.randint(0, 256, (16,), generator=g).tolist()
    params = SamplingParams(top_k=1, num_tokens_to_generate=args.new_tokens)
    t, out = _timed({
        "cache": lambda: InferenceEngine(model, ContiguousKVCache(config, 1), max_batch_size=1).generate([prompt], params),
        "recompute": lambda: generate_by_recompute(model, prompt, params)}, args.repeats)
    assert out["cache"][0].generated_tokens == out["recompute"], "KV-cache decode differs from recompute"
    n = args.new_tokens
    rows += [[f"decode {n} tokens, KV cache", 1, n, n, n / t["cache"]],
             [f"decode {n} tokens, recompute", 1, n, n, n / t["recompute"]]]
    extra["kv_cache_speedup"] = t["recompute"] / t["cache"]

    # 2. continuous vs static batching on mixed lengths
    prompts = [torch.randint(0, 256, (int(torch.randint(4, 48, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    lengths = torch.randint(4, 160 if not args.quick else 48, (args.requests,), generator=g).tolist()
    many = [SamplingParams(top_k=1, num_tokens_to_generate=m) for m in lengths]
    def run(mode):
        engine = InferenceEngine(model, PagedKVCache(config, 512, 16), max_batch_size=8, max_tokens=256, mode=mode)
        engine.generate(prompts, many)
        return engine.steps

    t, steps = _timed({mode: lambda mode=mode: run(mode) for mode in ("continuous", "static")}, args.repeats)
    for mode in ("continuous", "static"):
        rows.append([f"{args.requests} mixed requests, {mode}", 8, args.requests, steps[mode], sum(lengths) / t[mode]])
    extra["continuous_over_static_throughput"] = t["static"] / t["continuous"]
    extra["static_over_continuous_steps"] = steps["static"] / steps["continuous"]
    report("inference", ["case", "max batch", "requests/tokens", "forward steps", "tokens/s"], rows, extra)
    print(f"KV cache vs recompute decode speed-up = {extra['kv_cache_speedup']:.2f}x; continuous / static "
          f"batching throughput = {extra['continuous_over_static_throughput']:.2f}x in {extra['static_over_continuous_steps']:.2f}x fewer steps (load {extra['load_average'][0]:.1f})")


if __name__ == "__main__":
    main()
