"""Inference: KV-cache decode vs recompute, and continuous vs static batching on mixed-length requests.

1. One request, greedy: megalab's engine with a KV cache (one new token per forward) against the
   reference without a cache (generate_by_recompute: a full forward over the whole sequence per
   token). Both produce the same tokens (checked); we report tokens/s and the speed-up.
2. Mixed-length requests (random prompt and output lengths), the same engine and budgets:
   continuous batching (requests join and leave every step) against static batching (a batch
   runs until its longest request ends). We report generated tokens/s, forward steps and the ratio.
3. The dynamic engine on requests sharing a system prompt, one small KV pool: admission by final length
   (the worst case reserved) against Megatron's growing admission (blocks taken one at a time, requests
   paused and evicted under pressure), each with and without prefix caching and chunked prefill. All give
   the same tokens (checked); we report tokens/s, steps, the most requests running at once, the peak of
   blocks held, pauses and evictions, and each case's throughput over final-length admission.
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
    # 3. the dynamic engine: final-length vs growing admission, prefix caching, chunked prefill
    system = torch.randint(0, 256, (64,), generator=g).tolist()  # the shared prefix: 4 blocks of 16
    n = args.requests
    chat = [system + torch.randint(0, 256, (int(torch.randint(4, 32, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    chat_params = [SamplingParams(top_k=1, num_tokens_to_generate=int(m))
                   for m in torch.randint(16, 96 if not args.quick else 32, (n,), generator=g)]
    blocks = 48  # 768 positions: far fewer than the requests' final lengths together
    cases = {"final length": dict(admission="final_length"), "growing": dict(),
             "growing + prefix cache": dict(enable_prefix_caching=True),
             "growing + chunked prefill": dict(max_tokens=64),
             "growing + prefix + chunked": dict(enable_prefix_caching=True, max_tokens=64)}

    def serve(admission="growing", max_tokens=256, **cache_settings):
        cache = PagedKVCache(config, blocks, 16, **cache_settings)
        engine = InferenceEngine(model, cache, max_batch_size=16, max_tokens=max_tokens, admission=admission,
                                 enable_chunked_prefill=max_tokens < 256)
        requests = [engine.add_request(p, sp) for p, sp in zip(chat, chat_params)]
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, len(engine.active))
        assert cache.allocator.get_referenced_count() == 0, "blocks leaked"
        return engine, most, [r.generated_tokens for r in requests]

    t, out = _timed({name: lambda kw=kw: serve(**kw) for name, kw in cases.items()}, args.repeats)
    generated = sum(sp.num_tokens_to_generate for sp in chat_params)
    for name in cases:
        assert out[name][2] == out["final length"][2], f"{name}: tokens differ from final-length admission"
        engine, most = out[name][:2]
        rows.append([f"{n} shared-prefix requests, {name}", 16, n, engine.steps, generated / t[name]])
        extra.setdefault("dynamic_engine", {})[name] = {
            "tokens_per_s": generated / t[name], "steps": engine.steps, "most_running": most,
            "peak_blocks_held": engine.peak_blocks_used, "pool_blocks": blocks, "paused": engine.pause_count,
            "evicted_requests": engine.evicted_request_count, "prefix_cache_hit_tokens": engine.prefix_cache_hit_tokens,
            "chunked_prefill_chunks": engine.chunked_prefill_chunks,
            "throughput_over_final_length": t["final length"] / t[name]}
    print(f"{'dynamic engine, ' + str(blocks) + ' blocks':28s} {'steps':>6s} {'at once':>8s} {'peak blocks':>12s} "
          f"{'paused':>7s} {'evicted':>8s} {'cached tok':>11s} {'chunks':>7s} {'x final':>8s}")
    for name, d in extra["dynamic_engine"].items():
        print(f"{name:28s} {d['steps']:6d} {d['most_running']:8d} {d['peak_blocks_held']:12d} {d['paused']:7d} "
              f"{d['evicted_requests']:8d} {d['prefix_cache_hit_tokens']:11d} {d['chunked_prefill_chunks']:7d} "
              f"{d['throughput_over_final_length']:7.2f}x")
    report("inference", ["case", "max batch", "requests/tokens", "forward steps", "tokens/s"], rows, extra)
    print(f"KV cache vs recompute decode speed-up = {extra['kv_cache_speedup']:.2f}x; continuous / static "
          f"batching throughput = {extra['continuous_over_static_throughput']:.2f}x in {extra['static_over_continuous_steps']:.2f}x fewer steps (load {extra['load_average'][0]:.1f})")


if __name__ == "__main__":
    main()
