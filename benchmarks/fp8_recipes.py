"""Quantisation error of Megatron's four FP8 recipes on the real GEMM operands of the course's tiny GPT.

Every Linear's input, weight and output gradient, from a forward and backward of the trained tiny GPT
(megalab/extras/tiny_gpt.py) on Shakespeare, quantized and dequantized by each recipe as TE computes it
(megalab/transformer_engine/{fp8,mxfp8_tensor,float8_blockwise_tensor}.py). Per tensor and recipe: the
relative error ||x^ - x|| / ||x|| (%) and the share of nonzero values flushed to zero (%). Delayed
scaling uses the previous batch's amax (Megatron's history of 1). Formats: per-tensor recipes under
--fp8-format hybrid (E5M2 gradients) and e4m3, block recipes in TE's default E4M3. Then the same with
injected massive activations (x factor at 1 token in 64, 2 channels; delayed scaling already saw the spike),
the error of the ordinary values.
These are numerics, not timings: the same on any machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.transformer_engine import fp8_recipes  # noqa: E402


def columns() -> dict:
    hybrid, e4m3 = fp8_recipes.default_recipes("HYBRID"), fp8_recipes.default_recipes("E4M3")
    return {"delayed": hybrid["delayed"], "tensorwise": hybrid["tensorwise"], "tensorwise e4m3": e4m3["tensorwise"],
            "mxfp8 e4m3": e4m3["mxfp8"], "blockwise e4m3": e4m3["blockwise"]}


def massive(x: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x with two channels of one token in 64 multiplied by `factor`, and the mask of the other values."""
    x = x.clone()
    hit, channels = torch.arange(0, x.shape[0], 64)[:, None], torch.tensor([3, 7])
    x[hit, channels] *= factor
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[hit, channels] = False
    return x, ordinary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences of 128 tokens per batch")
    parser.add_argument("--quick", action="store_true", help="CI smoke: 2 sequences, the massive case at x10^4 only")
    args = parser.parse_args()
    batch = 2 if args.quick else args.batch_size
    previous, current = fp8_recipes.tiny_gpt_tensors(steps=2, batch_size=batch)
    cols = columns()
    rows, table = fp8_recipes.recipe_errors(current, previous, cols), []
    for r in rows:
        x = current[r["tensor"]][1]
        table.append([r["tensor"], r["role"], "x".join(map(str, r["shape"])),
                      float((x.abs().max() / x.abs().median()).item()),
                      *(f"{100 * r[c]['rel_error']:.2f} / {100 * r[c]['zeroed']:.2f}" for c in cols)])
    massive_rows = []
    for name in ("layers.0.self_attention.linear_qkv input", "layers.1.mlp.linear_fc2 input"):
        for factor in ([1e4] if args.quick else [1e2, 1e3, 1e4]):
            x, ordinary = massive(current[name][1], factor)
            errs = {c: fp8_recipes.quantization_error(x[ordinary], fp8_recipes.fake_quantize(
                x, recipe, "input", previous_amax=x.abs().max())[ordinary]) for c, recipe in cols.items()}
            massive_rows.append({"tensor": name, "factor": factor, **errs})
            table.append([f"{name} (massive x{factor:g})", "input", "x".join(map(str, x.shape)),
                          float((x.abs().max() / x.abs().median()).item()),
                          *(f"{100 * errs[c]['rel_error']:.2f} / {100 * errs[c]['zeroed']:.2f}" for c in cols)])
    report("fp8_recipes", ["tensor", "role", "shape", "amax/median", *(f"{c} err% / zeroed%" for c in cols)], table,
           {"recipes": {c: repr(r) for c, r in cols.items()}, "tensors": rows, "massive_activations": massive_rows,
            "tokens_per_batch": batch * 128})
    grads = [r for r in rows if r["role"] == "grad_output"]
    mean = lambda c, key: 100 * sum(r[c][key] for r in grads) / len(grads)
    print("gradients, mean relative error %: " + ", ".join(f"{c} {mean(c, 'rel_error'):.2f}" for c in cols))


if __name__ == "__main__":
    main()
