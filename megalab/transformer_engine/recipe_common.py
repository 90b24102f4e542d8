"""The scale every current-scaling recipe computes from an amax (TE's transformer_engine/common/recipe/recipe_common.cuh):
one function shared by per-tensor current scaling (fp8.py) and the 1x128 / 128x128 block recipes
(float8_blockwise_tensor.py)."""

from __future__ import annotations

import torch

FP32_MAX = torch.finfo(torch.float32).max


def compute_current_scale(amax: torch.Tensor, fp8_max: float, use_power_2_scales: bool = False,
                          amax_epsilon: float = 0.0, value_for_inf: float = FP32_MAX) -> torch.Tensor:
    """Current scaling's scale from this tensor's amax (TE's compute_scale_from_amax,
    transformer_engine/common/recipe/recipe_common.cuh): amax raised to amax_epsilon; 1 where amax is 0,
    inf or NaN (there is no previous scale); `value_for_inf` (FP32 max; the blockwise kernels pass the input
    dtype's max) on overflow; optionally the power of two below."""
    amax = amax.float()
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(torch.isinf(amax) | (amax == 0) | torch.isnan(scale), torch.ones_like(scale), scale)
    if use_power_2_scales:  # keep sign and exponent bits: the largest power of two <= scale
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale
