"""FP8 training: 8-bit floats, per-tensor scaling, and an FP8 Linear on torch._scaled_mm.

Two 8-bit formats (sign . exponent . mantissa), as in Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", and NVIDIA Transformer Engine (TE):

    E4M3  s.eeee.mmm   bias 7,  max 448    more precision: weights and activations (forward)
    E5M2  s.eeeee.mm   bias 15, max 57344  more range:     gradients (backward)

TE's HYBRID recipe uses E4M3 forward and E5M2 backward. So few bits only work if every tensor
is first multiplied by a per-tensor *scale* that moves its largest magnitude (amax) near the
format's max; the matmul multiplies by the inverse scales again:

    x (bf16/fp32) ── x scale_x ──► cast to fp8 ──┐
                                                 ├─► _scaled_mm(x8, w8^T, 1/scale_x, 1/scale_w) ─► y
    w (fp32 main) ── x scale_w ──► cast to fp8 ──┘        (FP8 tensor cores on Ada/Hopper)

Delayed scaling (TE's DelayedScaling): the scale used at step t comes from the amaxes recorded
at earlier steps (a history of `amax_history_len`, reduced by "max" or "most_recent"):

    scale = (fp8_max / amax) / 2^margin      (kept unchanged while amax is 0 or not finite;
                                              FP32 max where the quotient overflows)

Current scaling (TE's Float8CurrentScaling): amax of the tensor itself, just before the cast;
scale = fp8_max / max(amax, amax_epsilon), 1 where amax is 0, inf or NaN, FP32 max on overflow,
optionally rounded down to a power of two.

Transcribed from Transformer Engine: transformer_engine/pytorch/quantization.py (_default_sf_compute,
_update_amax_history, _default_get_amax_and_update_history), transformer_engine/common/recipe/
delayed_scaling.cu (the fused amax-and-scale update kernel) and recipe_common.cuh
(compute_scale_from_amax, current scaling); its tests: tests/pytorch/test_recipe.py
(test_scale_update_numeric_scenarios: zero, tiny, normal, inf and NaN amax).

The matmul picks its path automatically: `torch._scaled_mm` on FP8 tensor cores where the GPU
has them (compute capability >= 8.9: Ada, Hopper, Blackwell); elsewhere it is emulated --
on CPU by torch._scaled_mm's own CPU kernel, on older GPUs by an upcast matmul -- with the same
numerics: the fp8 rounding is real, only the speed is not. (`megalab doctor` says which.)

Megatron-LM: megatron/core/fp8_utils.py and megatron/core/extensions/transformer_engine.py
(TELinear, TELayerNormColumnParallelLinear); the recipe is transformer_engine.common.recipe.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from megalab.transformer_engine.float8_blockwise_tensor import Float8BlockQuantizer
from megalab.transformer_engine.mxfp8_tensor import MXFP8Quantizer

FP8_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
RECIPE_FORMATS = {"E4M3": ("E4M3", "E4M3"), "HYBRID": ("E4M3", "E5M2")}  # (forward, backward)
MATMUL_ALIGNMENT = 16  # FP8 tensor cores need every matmul dimension to be a multiple of 16


# ---------------------------------------------------------------- the formats, from their bits
def format_info(exponent_bits: int, mantissa_bits: int, ieee_specials: bool = True) -> dict:
    """Range and precision of a binary float format, computed from its bit layout.

    ieee_specials=True: the all-ones exponent is reserved for inf/NaN (fp16, bf16, E5M2).
    False: only s.1111.111 is NaN and there is no inf (E4M3 "fn", finite + NaN), which buys E4M3
    one more binade: max 1.75 * 2^8 = 448 instead of 240.
    """
    e, m = exponent_bits, mantissa_bits
    bias = 2 ** (e - 1) - 1
    if ieee_specials:
        max_exponent, max_mantissa = 2**e - 2 - bias, 2**m - 1
    else:
        max_exponent, max_mantissa = 2**e - 1 - bias, 2**m - 2
    max_value = (1 + max_mantissa / 2**m) * 2.0**max_exponent
    smallest_normal = 2.0 ** (1 - bias)
    smallest_subnormal = 2.0 ** (1 - bias - m)
    return {
        "bits": 1 + e + m, "exponent_bits": e, "mantissa_bits": m, "bias": bias,
        "max": max_value, "smallest_normal": smallest_normal, "smallest_subnormal": smallest_subnormal,
        "eps": 2.0**-m,  # gap between 1 and the next number: relative precision ~ eps / 2
        "binades": math.log2(max_value / smallest_subnormal),  # dynamic range in powers of two
    }


FORMAT_LAYOUTS = {  # name: (dtype, exponent bits, mantissa bits, ieee specials)
    "E4M3": (torch.float8_e4m3fn, 4, 3, False),
    "E5M2": (torch.float8_e5m2, 5, 2, True),
    "FP16": (torch.float16, 5, 10, True),
    "BF16": (torch.bfloat16, 8, 7, True),
}


def format_table() -> list[dict]:
    """One row per format: the values computed from the bits, and whether torch.finfo agrees."""
    rows = []
    for name, (dtype, e, m, ieee) in FORMAT_LAYOUTS.items():
        info = format_info(e, m, ieee)
        fi = torch.finfo(dtype)
        agrees = (info["max"] == fi.max and info["smallest_normal"] == fi.smallest_normal and info["eps"] == fi.eps)
        rows.append({"format": name, **info, "matches_torch_finfo": agrees})
    return rows


# ---------------------------------------------------------------- recipes and per-tensor scaling
@dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's DelayedScaling recipe (its defaults; TE also has `interval`, always 1 here).

    Megatron overrides two defaults (TransformerConfig.fp8_amax_history_len = 1, fp8_amax_compute_algo =
    "most_recent"): DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent") is Megatron's."""

    margin: int = 0
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f'amax_compute_algo must be "max" or "most_recent", got {self.amax_compute_algo!r}')
        if self.amax_history_len < 1 or self.margin < 0:
            raise ValueError(f"need amax_history_len >= 1 and margin >= 0, got {self.amax_history_len}, {self.margin}")


@dataclass(frozen=True)
class CurrentScaling:
    """Transformer Engine's Float8CurrentScaling: each tensor's own amax, measured just before the cast
    (its QParams: power_2_scale, amax_epsilon; no margin, no history)."""

    fp8_format: str = "HYBRID"
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """Transformer Engine's MXFP8BlockScaling recipe: one E8M0 (power-of-two) scale per 32 consecutive
    elements, rowwise and columnwise (megalab/transformer_engine/mxfp8_tensor.py). TE's default format is E4M3
    for every tensor, gradients included: blocks this small make E5M2's extra range unnecessary."""

    fp8_format: str = "E4M3"
    margin: int = 0

    def __post_init__(self):
        _check_format(self.fp8_format)


@dataclass(frozen=True)
class Float8BlockScaling:
    """Transformer Engine's Float8BlockScaling recipe: fp32 scales per 1x128 tile (block_scaling_dim 1) or
    128x128 block (2); activations x and gradients 1x128, weights 128x128 by default; power-of-two scales
    unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (megalab/transformer_engine/float8_blockwise_tensor.py)."""

    fp8_format: str = "E4M3"
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self):
        _check_format(self.fp8_format)
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if any(d not in (1, 2) for d in dims):
            raise ValueError(f"block scaling dims must be 1 (1x128 tiles) or 2 (128x128 blocks), got {dims}")
        x, w, grad = dims
        for (name_a, a), (name_b, b) in ((("x", x), ("w", w)), (("x", x), ("grad", grad)), (("w", w), ("grad", grad))):
            if a == 2 and b == 2:  # each pair meets in one of the three GEMMs
                raise ValueError(f"2D by 2D block GEMM is not supported (TE): give {name_a} or {name_b} "
                                 "block_scaling_dim 1")


def _check_format(fp8_format: str) -> None:
    if fp8_format not in RECIPE_FORMATS:
        raise ValueError(f'fp8_format must be "HYBRID" (E4M3 forward, E5M2 backward) or "E4M3", got {fp8_format!r}')


from megalab.transformer_engine.recipe_common import FP32_MAX, compute_current_scale  # noqa: E402  (re-exported)


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """Delayed scaling's new scale: (fp8_max / amax) / 2^margin; the old `scale` where amax is 0 or not
    finite; FP32 max where the quotient overflows (a tiny amax), so no zero becomes 0 * inf = NaN
    (TE's _default_sf_compute, transformer_engine/pytorch/quantization.py)."""
    # EXERCISE fp8.compute_scale: scale = (fp8_max / amax) / 2^margin, keep the old scale where amax is 0 or inf/NaN, FP32 max on overflow
    ### BEGIN SOLUTION
    # HINT 1: The scale maps the recorded amax onto the format's largest value fp8_max, with 2^margin of
    #         headroom: scale = (fp8_max / amax) / 2^margin. Where amax tells nothing (0, inf, NaN) keep the old scale.
    # HINT 2: Compute the quotient elementwise (a full tensor of fp8_max divided by amax, then by
    #         2.0**margin), pick the old `scale` with torch.where where amax is not > 0 or not finite, and replace an
    #         inf result (tiny amax) by FP32_MAX.
    # HINT 3: The fp8_max argument differs per format (448 for E4M3, 57344 for E5M2): never hard-code one,
    #         and the margin divides (it makes the scale smaller).
    new = torch.full_like(amax, fp8_max) / amax / 2.0**margin  # a true division (scalar / tensor is a reciprocal)
    new = torch.where(amax > 0.0, new, scale)
    new = torch.where(torch.isfinite(amax), new, scale)
    return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
    ### END SOLUTION


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale cast to fp8, saturating at the format's max (as TE's casts do)."""
    # EXERCISE fp8.quantize: multiply by the scale in fp32, clamp to +-fp8 max, cast to `dtype`
    ### BEGIN SOLUTION
    # HINT 1: Quantizing is x * scale cast to the FP8 dtype; values beyond the format's max must
    #         saturate at +-max, the way Transformer Engine's casts do, not become NaN or inf.
    # HINT 2: Read the max from torch.finfo(dtype); multiply in fp32 (x.float()), clamp to
    #         [-max, max], and only then cast with .to(dtype).
    # HINT 3: A plain cast need not saturate (E5M2 overflows to inf, E4M3 has no inf at all), and each
    #         dtype has its own max.
    fp8_max = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    ### END SOLUTION


class ScalingMeta:
    """The scaling state of one tensor (TE's FP8TensorMeta): fp8 dtype, scale, amax history.

    `quantize(x)` casts with the scale for this step and returns (x_fp8, scale_inv); with delayed
    scaling it then records amax(x) and computes the scale for the next step.
    """

    def __init__(self, recipe: DelayedScaling | CurrentScaling, fp8_format: str):
        self.recipe, self.dtype = recipe, FP8_DTYPES[fp8_format]
        self.fp8_max = torch.finfo(self.dtype).max
        self.scale = torch.ones(())
        self.amax_history = torch.zeros(recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1)

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale.device != x.device:
            self.scale, self.amax_history = self.scale.to(x.device), self.amax_history.to(x.device)
        amax = x.detach().abs().max().float() if x.numel() else torch.zeros((), device=x.device)
        if isinstance(self.recipe, CurrentScaling):
            self.amax_history[0] = amax
            self.scale = compute_current_scale(amax, self.fp8_max, self.recipe.use_power_2_scales,
                                               self.recipe.amax_epsilon)
            return quantize(x, self.scale, self.dtype), self.scale.reciprocal()
        x_fp8, scale_inv = quantize(x, self.scale, self.dtype), self.scale.reciprocal()
        # Newest amax at index 0; the oldest falls off the end.
        self.amax_history = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        reduced = self.amax_history.max() if self.recipe.amax_compute_algo == "max" else self.amax_history[0]
        self.scale = compute_scale(reduced, self.scale, self.fp8_max, self.recipe.margin)
        return x_fp8, scale_inv


# ---------------------------------------------------------------- the matmul and the layer
def fp8_path(device: torch.device | str) -> str:
    """ "tensor cores" where torch._scaled_mm runs on FP8 hardware (CUDA, sm >= 8.9), else "emulated"."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "tensor cores"
    return "emulated"


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) for fp8 a [M, K] (row-major) and b [K, N] (column-major).

    torch._scaled_mm on CPU (emulated by PyTorch) and on FP8 GPUs (tensor cores); an upcast
    matmul on GPUs without FP8.
    """
    if a.is_cuda and fp8_path(a.device) == "emulated":
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16 (zero rows add nothing to any product): the token count
    is a GEMM dimension too (M forward, K of the wgrad)."""
    return nn.functional.pad(t, (0, 0, 0, -t.shape[0] % MATMUL_ALIGNMENT))


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with three FP8 GEMMs: forward (E4M3 x E4M3), dgrad and wgrad (E5M2 grads)."""

    @staticmethod
    def forward(ctx, x, weight, bias, meta_input, meta_weight, meta_grad):
        tokens = x.shape[:-1].numel()
        x_fp8, x_scale_inv = meta_input.quantize(_pad_rows(x.reshape(tokens, -1).contiguous()))  # [M', K]
        w_fp8, w_scale_inv = meta_weight.quantize(weight)                             # [N, K]
        y = scaled_mm(x_fp8, w_fp8.t(), x_scale_inv, w_scale_inv, out_dtype=x.dtype)[:tokens]  # [M, N]
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x_fp8, x_scale_inv, w_fp8, w_scale_inv)
        ctx.meta_grad, ctx.x_shape, ctx.has_bias, ctx.w_dtype = meta_grad, x.shape, bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        x_fp8, x_scale_inv, w_fp8, w_scale_inv = ctx.saved_tensors
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()               # [M, N]
        g_fp8, g_scale_inv = ctx.meta_grad.quantize(_pad_rows(g))                     # [M', N] E5M2
        tokens = g.shape[0]
        # dgrad [M, K] = g [M, N] @ W [N, K];  wgrad [N, K] = g^T [N, M] @ x [M, K]
        grad_x = scaled_mm(g_fp8, _column_major(w_fp8), g_scale_inv, w_scale_inv, out_dtype=grad_output.dtype)
        grad_w = scaled_mm(g_fp8.t().contiguous(), _column_major(x_fp8), g_scale_inv, x_scale_inv,
                           out_dtype=torch.float32)
        grad_b = g.float().sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x[:tokens].reshape(ctx.x_shape), grad_w.to(ctx.w_dtype), grad_b, None, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 with per-tensor scaling (TE's Linear under fp8_autocast).

    Weights stay in their own dtype (fp32 or bf16); each forward casts input and weight to the
    recipe's forward format, the backward casts the output grad to its backward format.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: DelayedScaling | CurrentScaling | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe or DelayedScaling()
        forward_format, backward_format = RECIPE_FORMATS[self.recipe.fp8_format]
        self.fp8_meta = {"input": ScalingMeta(self.recipe, forward_format),
                         "weight": ScalingMeta(self.recipe, forward_format),
                         "grad_output": ScalingMeta(self.recipe, backward_format)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: DelayedScaling | CurrentScaling | None = None) -> Fp8Linear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {list(x.shape)}")
        if fp8_path(x.device) == "tensor cores" and (self.in_features % 16 or self.out_features % 16):
            raise ValueError(f"FP8 tensor cores need in/out features divisible by {MATMUL_ALIGNMENT}, "
                             f"got {self.in_features} x {self.out_features}: pad the layer")
        if isinstance(self.recipe, (MXFP8BlockScaling, Float8BlockScaling)):  # per-block scales, no ScalingMeta
            return block_linear(x, self.weight, self.bias, self.recipe)
        m = self.fp8_meta
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, m["input"], m["weight"], m["grad_output"])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_fp8(module: nn.Module, recipe: DelayedScaling | CurrentScaling | None = None) -> nn.Module:
    """Replace every nn.Linear inside `module` (in place) by an Fp8Linear with the same weights."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and not isinstance(child, Fp8Linear):
            setattr(module, name, Fp8Linear.from_linear(child, recipe))
        else:
            convert_to_fp8(child, recipe)
    return module


def gemm_seconds(m: int, k: int, n: int, device: torch.device | str = "cpu", repeats: int = 5) -> dict:
    """Median seconds of one [m, k] x [k, n] GEMM in FP8 (scaled_mm, E4M3, bf16 out) and in BF16,
    and which FP8 path ran ("tensor cores" or "emulated")."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(device), torch.randn(n, k, generator=g).to(device)
    a8, b8, one = a.to(FP8_DTYPES["E4M3"]), b.to(FP8_DTYPES["E4M3"]), torch.ones((), device=device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    gemms = {"fp8": lambda: scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), "bf16": lambda: a16 @ b16.t()}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    out = {"path": fp8_path(device)}
    for name, gemm in gemms.items():
        gemm()  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            gemm()
            sync()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


# ------------------------------------------------------------------ Linear under the block recipes


def fp8_dtype(recipe, role: str) -> torch.dtype:
    """E4M3 for inputs and weights; the recipe's backward format (E5M2 under HYBRID) for output gradients."""
    forward, backward = RECIPE_FORMATS[recipe.fp8_format]
    return FP8_DTYPES[backward if role == "grad_output" else forward]


def quantizer(recipe, role: str):
    """The TE quantizer a block recipe uses for `role`, with both usages (rowwise, columnwise)."""
    dtype = fp8_dtype(recipe, role)
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(dtype)
    dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
           "grad_output": recipe.grad_block_scaling_dim}[role]
    return Float8BlockQuantizer(dtype, amax_epsilon=recipe.amax_epsilon, force_pow_2_scales=recipe.power_2_scale,
                                block_scaling_dim=dim)


class _BlockFp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with block-scaled operands, each GEMM contracting over its operands' blocks:

        fprop  y  [M, N] = x [M, K] W^T       x rowwise, W rowwise        (blocks along K)
        dgrad  dx [M, K] = g [M, N] W         g rowwise, W columnwise     (blocks along N)
        wgrad  dW [N, K] = g^T x              g columnwise, x columnwise  (blocks along M)

    The GEMMs are emulated as fp32 matmuls of the dequantized operands (block_scaled_mm gives the same)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        qx = quantizer(recipe, "input")(x.reshape(-1, x.shape[-1]))                  # [M, K]
        qw = quantizer(recipe, "weight")(weight)                                      # [N, K]
        y = (qx.dequantize() @ qw.dequantize().t()).to(x.dtype)                      # [M, N]
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.qx, ctx.qw, ctx.recipe, ctx.x_shape, ctx.has_bias, ctx.w_dtype = qx, qw, recipe, x.shape, \
            bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        g = grad_output.reshape(-1, grad_output.shape[-1])                            # [M, N]
        qg = quantizer(ctx.recipe, "grad_output")(g)
        grad_x = (qg.dequantize() @ ctx.qw.dequantize(columnwise=True)).to(grad_output.dtype)       # [M, K]
        grad_w = qg.dequantize(columnwise=True).t() @ ctx.qx.dequantize(columnwise=True)             # [N, K]
        grad_b = g.float().sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w.to(ctx.w_dtype), grad_b, None


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe) -> torch.Tensor:
    """Fp8Linear's forward under MXFP8BlockScaling or Float8BlockScaling."""
    return _BlockFp8LinearFunction.apply(x, weight, bias, recipe)
