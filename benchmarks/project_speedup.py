"""Chapter 07's measured speed-ups: project 3's fixed training step and project 2's blocked sliding window.

    python benchmarks/project_speedup.py            # batch 8 x 128 tokens; s = 512, 1024, 2048
    python benchmarks/project_speedup.py --quick    # CI smoke: batch 4 x 64 tokens; s = 256, 512

1. a GPT training step (fwd, bwd, AdamW): the fixed step (remove_hotspots: fused core attention, no recompute) vs
   the slow one (LoopedAttention in float64, full recompute), same loss and gradients checked first;
2. sliding-window attention fwd+bwd, 8 heads of 64, W = 64: blocked (2 s W scores) vs SDPA with the band mask (s^2).
Both measured with megalab.extras.speedup.interleaved_speedup (interleaved rounds, one warm-up, medians), one intra-op thread
by default (--threads); writes benchmarks/results/project_speedup.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.extras.sliding_window import blocked_sliding_window_attention, masked_sliding_window_attention  # noqa: E402
from megalab.extras.speedup import interleaved_speedup, make_train_step, remove_hotspots, slow_step_setup  # noqa: E402


def bench_step(batch: int, seq: int, repeats: int) -> list:
    config, spec = slow_step_setup(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256, seq_length=seq)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    slow_model, slow = make_train_step(config, spec, tokens)
    fast_model, fast = make_train_step(*remove_hotspots(config, spec), tokens)
    torch.testing.assert_close(fast(), slow())
    for p, q in zip(fast_model.parameters(), slow_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    r = interleaved_speedup(slow, fast, repeats=repeats)
    return [f"train step b={batch} s={seq}", r["after_ms"], r["before_ms"], r["speedup"]]


def bench_window(s: int, window: int, repeats: int) -> list:
    q, k, v = (torch.randn(1, 8, s, 64, requires_grad=True) for _ in range(3))
    torch.testing.assert_close(blocked_sliding_window_attention(q, k, v, window),
                               masked_sliding_window_attention(q, k, v, window), atol=1e-5, rtol=1e-5)
    r = interleaved_speedup(lambda: masked_sliding_window_attention(q, k, v, window).sum().backward(),
                            lambda: blocked_sliding_window_attention(q, k, v, window).sum().backward(), repeats=repeats)
    return [f"sliding window s={s} W={window}", r["after_ms"], r["before_ms"], r["speedup"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (CI smoke)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    rows = [bench_step(4, 64, repeats) if args.quick else bench_step(8, 128, repeats)]
    rows += [bench_window(s, 64, repeats) for s in ((256, 512) if args.quick else (512, 1024, 2048))]
    report("project_speedup", ["case", "ours ms", "reference ms", "speed-up"], rows,
           extra=dict(threads=args.threads, repeats=repeats, load_average=os.getloadavg(),
                      ours="fixed step / blocked window", reference="slow step / masked SDPA"))


if __name__ == "__main__":
    main()
