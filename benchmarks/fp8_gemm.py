"""FP8 GEMM (torch._scaled_mm, E4M3 operands, per-tensor scales) vs a BF16 matmul of the same shape.

On a GPU with FP8 tensor cores (compute capability >= 8.9) this is the real speed-up (ideally
about 2x on Hopper). Anywhere else the FP8 figure is EMULATED -- PyTorch's CPU kernel or an upcast
matmul -- and says nothing about FP8 hardware; the table labels it. Ratio = bf16 time / fp8 time
(above 1 means FP8 is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.transformer_engine import fp8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="square GEMM sizes m = k = n")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="CI smoke: one small size, 3 repeats")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sizes is None:
        args.sizes = [2048, 4096, 8192] if device == "cuda" else [128, 256, 512]
    if args.quick:
        args.sizes, args.repeats = [args.sizes[0]], 3
    rows, ratios = [], {}
    for size in args.sizes:
        t = fp8.gemm_seconds(size, size, size, device, repeats=args.repeats)
        flops = 2 * size**3
        label = "FP8 tensor cores" if t["path"] == "tensor cores" else "FP8 emulated (not FP8 hardware)"
        ratios[size] = t["bf16"] / t["fp8"]
        rows.append([size, device, label, 1e3 * t["fp8"], 1e3 * t["bf16"], flops / t["fp8"] / 1e9,
                     flops / t["bf16"] / 1e9, ratios[size]])
    load = os.getloadavg()[0]
    report("fp8_gemm", ["m=k=n", "device", "fp8 path", "fp8 ms", "bf16 ms", "fp8 GFLOP/s", "bf16 GFLOP/s",
                        "bf16/fp8"], rows,
           {"ratio_bf16_over_fp8": ratios, "fp8_path": fp8.fp8_path(device), "load_1min": load})
    kind = "" if fp8.fp8_path(device) == "tensor cores" else " (FP8 emulated: not a hardware figure)"
    print(f"bf16 time / fp8 time = {', '.join(f'{r:.3g}' for r in ratios.values())}{kind}; load {load:.1f}")


if __name__ == "__main__":
    main()
