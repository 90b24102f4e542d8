"""Attention forward + backward: megalab's Triton FlashAttention vs PyTorch SDPA (and flash-attn on a GPU).

Same q, k, v (causal, [b, h, s, d]) for every backend, timed interleaved; we report medians and the
ratio triton / sdpa (below 1 means ours is faster) and the largest output difference to SDPA.
Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, NumPy on CPU, fp32): the
table says so, and its ratio measures the interpreter, not the kernel.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import median, report  # noqa: E402

from megalab.kernels import INTERPRET, flash_attn_available  # noqa: E402
from megalab.kernels.flash_attention import flash_attention  # noqa: E402


def _backends() -> dict:
    backends = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "triton": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    if torch.cuda.is_available() and flash_attn_available():
        from flash_attn import flash_attn_func

        backends["flash_attn"] = lambda q, k, v: flash_attn_func(
            *(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    return backends


def _time(fn, q, k, v, dout) -> float:
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    if q.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny shapes, 2 steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.quick:
        defaults = (1, 2, [64], 2)
    else:
        defaults = (4, 16, [512, 1024, 2048, 4096], 20) if cuda else (1, 2, [64, 128, 256], 3)
    batch, heads, seqlens, steps = (a if a is not None else d for a, d in
                                    zip((args.batch, args.heads, args.seqlens, args.steps), defaults))
    backends = _backends()
    mode = "compiled (GPU)" if not INTERPRET else "interpreter (CPU, TRITON_INTERPRET=1)"
    rows = []
    for s in seqlens:
        g = torch.Generator().manual_seed(s)
        shape = (batch, heads, s, args.head_dim)
        q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
        dout = torch.randn(shape, generator=g).to(device, dtype)
        ref = backends["sdpa"](q, k, v)
        err = (backends["triton"](q, k, v) - ref).abs().max().item()
        times = {name: [] for name in backends}
        for step in range(steps + 1):  # one warm-up (compiles the kernels on a GPU)
            for name, fn in backends.items():
                t = _time(fn, q, k, v, dout)
                if step:
                    times[name].append(t)
        ms = {name: 1e3 * median(ts) for name, ts in times.items()}
        rows.append([s, mode, *(ms[n] for n in backends), ms["triton"] / ms["sdpa"], f"{err:.1e}"])
    header = ["seq", "triton mode", *(f"{n} ms (fwd+bwd)" for n in backends), "triton/sdpa", "max |triton - sdpa|"]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"causal attention, batch {batch}, heads {heads}, head dim {args.head_dim}, {dtype}, {device}; load: {load}")
    report("flash_attention", header, rows, extra=dict(device=device, dtype=str(dtype), load=load, interpret=INTERPRET))


if __name__ == "__main__":
    main()
