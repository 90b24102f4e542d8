"""The four FP8 recipes side by side: Megatron's `--fp8-recipe` flag, and their quantisation error on real tensors.

    --fp8-recipe delayed     DelayedScaling        one scale per tensor, from earlier steps' amax
    --fp8-recipe tensorwise  CurrentScaling        one scale per tensor, from its own amax (TE: Float8CurrentScaling)
    --fp8-recipe blockwise   Float8BlockScaling    fp32 scale per 1x128 tile (x, grads) / 128x128 block (weights)
    --fp8-recipe mxfp8       MXFP8BlockScaling     E8M0 scale per 32 elements

Megatron-LM: megatron/core/fp8_utils.py (get_fp8_recipe), megatron/core/transformer/transformer_config.py
(fp8, fp8_recipe, fp8_margin, fp8_amax_history_len, fp8_amax_compute_algo), megatron/core/enums.py (Fp8Recipe).
"""

from __future__ import annotations

import contextlib

import torch

from megalab.transformer_engine.float8_blockwise_tensor import Float8BlockQuantizer
from megalab.transformer_engine.fp8 import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    compute_current_scale,
    compute_scale,
    fp8_dtype,
    quantize,
)
from megalab.transformer_engine.mxfp8_tensor import MXFP8Quantizer

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")  # Megatron's Fp8Recipe, less "custom"
FP8_FORMATS = {"e4m3": "E4M3", "hybrid": "HYBRID"}             # --fp8-format -> TE's Format
ROLES = ("input", "weight", "grad_output")                     # the three operands of a Linear's GEMMs


@contextlib.contextmanager
def _one_thread():
    """Small tensors: one intra-op thread is faster, and much faster on a busy machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def get_fp8_recipe(config):
    """The recipe object Megatron builds from its config (megatron/core/fp8_utils.py get_fp8_recipe).

    `config` is anything with Megatron's TransformerConfig fields: fp8 ("e4m3" / "hybrid"), fp8_recipe, and for
    delayed scaling fp8_margin, fp8_amax_history_len, fp8_amax_compute_algo (missing ones take Megatron's
    defaults: "delayed", 0, 1, "most_recent")."""
    fmt = FP8_FORMATS.get(getattr(config, "fp8", None))
    if fmt is None:
        raise ValueError(f"E4M3 and HYBRID are the only supported FP8 formats: set fp8 (--fp8-format) to 'e4m3' or "
                         f"'hybrid', got {getattr(config, 'fp8', None)!r}")
    name = getattr(getattr(config, "fp8_recipe", "delayed"), "value", getattr(config, "fp8_recipe", "delayed"))
    if name == "delayed":
        return DelayedScaling(margin=getattr(config, "fp8_margin", 0), fp8_format=fmt,
                              amax_history_len=getattr(config, "fp8_amax_history_len", 1),
                              amax_compute_algo=getattr(config, "fp8_amax_compute_algo", "most_recent"))
    if name == "tensorwise":
        return CurrentScaling(fp8_format=fmt)
    if name == "blockwise":
        return Float8BlockScaling(fp8_format=fmt)
    if name == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"fp8_recipe (--fp8-recipe) must be one of {', '.join(FP8_RECIPES)} here, got {name!r}")


@torch.no_grad()
def fake_quantize(x: torch.Tensor, recipe, role: str, previous_amax: torch.Tensor | float | None = None
                  ) -> torch.Tensor:
    """x [..., K] quantized by `recipe` as the operand `role` of a Linear, and dequantized back (fp32).

    Delayed scaling needs `previous_amax`: the amax its history holds (Megatron's default history of 1: the
    previous step's amax of this tensor)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    dtype, x = fp8_dtype(recipe, role), x.detach()
    fp8_max = torch.finfo(dtype).max
    if isinstance(recipe, DelayedScaling):
        if previous_amax is None:
            raise ValueError("delayed scaling quantizes with the amax of earlier steps: pass previous_amax")
        amax = torch.as_tensor(previous_amax, dtype=torch.float32)
        scale = compute_scale(amax, torch.ones(()), fp8_max, recipe.margin)
        return quantize(x, scale, dtype).float() / scale
    if isinstance(recipe, CurrentScaling):
        scale = compute_current_scale(x.abs().max().float(), fp8_max, recipe.use_power_2_scales, recipe.amax_epsilon)
        return quantize(x, scale, dtype).float() / scale
    if isinstance(recipe, Float8BlockScaling):
        dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
               "grad_output": recipe.grad_block_scaling_dim}[role]
        q = Float8BlockQuantizer(dtype, columnwise=False, amax_epsilon=recipe.amax_epsilon,
                                 force_pow_2_scales=recipe.power_2_scale, block_scaling_dim=dim)
        return q(x).dequantize()
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(dtype, columnwise=False)(x).dequantize()
    raise TypeError(f"not an FP8 recipe: {recipe!r}")


def quantization_error(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """rel_error ||x_hat - x|| / ||x||; zeroed: the share of x's nonzero values that became 0 (underflow);
    p90: the 90th percentile of |x_hat - x| / |x| over x's nonzero values (what the small values suffer)."""
    x, x_hat = x.detach().float(), x_hat.float()
    nonzero = x != 0
    per_value = ((x_hat - x).abs() / x.abs())[nonzero]
    return {"rel_error": ((x_hat - x).norm() / x.norm()).item(),
            "zeroed": ((x_hat == 0) & nonzero).sum().item() / max(int(nonzero.sum()), 1),
            "p90": per_value.quantile(0.9).item() if per_value.numel() else 0.0}


def default_recipes(fp8_format: str = "HYBRID") -> dict:
    """The four recipes as Megatron builds them for --fp8-format `fp8_format`."""
    fmt = {v: k for k, v in FP8_FORMATS.items()}[fp8_format]
    return {name: get_fp8_recipe(type("Config", (), {"fp8": fmt, "fp8_recipe": name})()) for name in FP8_RECIPES}


def recipe_errors(tensors: dict, previous: dict, recipes: dict) -> list[dict]:
    """One row per tensor: its role and, per recipe, the quantisation error (quantization_error)."""
    rows = []
    with _one_thread():
        for name, (role, x) in tensors.items():
            row = {"tensor": name, "role": role, "shape": list(x.shape)}
            for label, recipe in recipes.items():
                prev = previous[name][1].abs().max() if isinstance(recipe, DelayedScaling) else None
                row[label] = quantization_error(x, fake_quantize(x, recipe, role, previous_amax=prev))
            rows.append(row)
    return rows


def tiny_gpt_tensors(steps: int = 2, batch_size: int = 4, seq_length: int = 128, seed: int = 0) -> list[dict]:
    """Real operands of every Linear of the course's tiny GPT (megalab/extras/tiny_gpt.py, trained weights) on real
    text: for each of `steps` batches a dict name -> (role, tensor [tokens, features]) with the Linear's input,
    its weight and the gradient of its output, from one forward and backward (no update in between)."""
    from megalab.core.datasets import DATA_DIR
    from megalab.extras.tiny_gpt import load_tiny_gpt
    from megalab.training.tokenizer.tokenizer import Tokenizer, iter_jsonl_texts

    model = load_tiny_gpt()
    seq_length = min(seq_length, model.config.seq_length)
    text = next(iter_jsonl_texts([DATA_DIR / "shakespeare.jsonl"]))[:50_000]
    tokens = torch.tensor(Tokenizer.from_file().tokenize(text))
    g = torch.Generator().manual_seed(seed)
    linears = {n.removeprefix("decoder."): m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    out = []
    with _one_thread():
        for _ in range(steps):
            out.append(_operands(model, linears, tokens, batch_size, seq_length, g))
    return out


def _operands(model, linears: dict, tokens: torch.Tensor, batch_size: int, seq_length: int,
              g: torch.Generator) -> dict:
    """One batch's forward and backward: name -> (role, tensor) for every Linear's three GEMM operands."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(f"{n} input", i[0].detach()))
             for n, m in linears.items()]
    hooks += [m.register_full_backward_hook(lambda m, gi, go, n=n: seen.__setitem__(f"{n} grad", go[0].detach()))
              for n, m in linears.items()]
    starts = torch.randint(0, len(tokens) - seq_length - 1, (batch_size,), generator=g)
    window = torch.stack([tokens[i:i + seq_length + 1] for i in starts.tolist()])    # [b, s + 1]
    model.zero_grad()
    model(window[:, :-1], labels=window[:, 1:]).mean().backward()
    for h in hooks:
        h.remove()
    step = {}
    for n, m in linears.items():
        step[f"{n} input"] = ("input", seen[f"{n} input"].reshape(-1, m.in_features))
        step[f"{n} weight"] = ("weight", m.weight.detach().clone())
        step[f"{n} grad"] = ("grad_output", seen[f"{n} grad"].reshape(-1, m.out_features))
    return step


def block_scaled_mm(a_data: torch.Tensor, a_scale_inv: torch.Tensor, b_data: torch.Tensor, b_scale_inv: torch.Tensor,
                    block_k: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] = A B^T for block-scaled fp8 A [M, K] and B [N, K], one scale per row and K-block of `block_k`
    (a_scale_inv [M, ceil(K / block_k)], b_scale_inv [N, ceil(K / block_k)], dequantization scales).

    Each K-block is one torch._scaled_mm with rowwise scales (which PyTorch runs on CPU), the partial products
    summed in fp32: the block-scaled GEMM as a sum of per-block GEMMs, like cuBLAS's block-scaled kernels with
    their split accumulator. Expand a 128x128 block's scales to its rows first."""
    M, K = a_data.shape
    out = torch.zeros(M, b_data.shape[0], dtype=torch.float32, device=a_data.device)
    for t, start in enumerate(range(0, K, block_k)):
        a = a_data[:, start:start + block_k].contiguous()                            # [M, k]
        b = b_data[:, start:start + block_k].contiguous().t()                        # [k, N] column-major
        out += torch._scaled_mm(a, b, scale_a=a_scale_inv[:, t:t + 1].float().contiguous(),
                                scale_b=b_scale_inv[:, t:t + 1].float().t().contiguous(), out_dtype=torch.float32)
    return out.to(out_dtype)
