"""Blockwise FP8 (TE's Float8BlockScaling recipe, DeepSeek-V3's): one fp32 scale per 1x128 tile or 128x128 block.

Activations and gradients get 1x128 tiles (one scale per 128 consecutive elements of a row), weights
128x128 blocks (`x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1`). Each tile's
scale is current scaling's rule applied to the tile's amax (TE's compute_scale_from_amax), by default rounded
down to a power of two (`force_pow_2_scales`, TE's QParams.power_2_scale):

    x [M, K] ─ 1x128 tiles ─► amax [M, ceil(K/128)] ─► scale = fp8_max / max(amax, eps) ─► data = fp8(x * scale)
                                                       scale_inv = 1 / scale   (fp32, stored)

The columnwise copy, for the GEMM that contracts over M, is the transpose [K, M] quantized again with 1x128
tiles along M (so 128x1 tiles of x); a 128x128 block's columnwise copy is just the transpose. Tiles at the
edge may be partial (TE's kernels have an unaligned path; its reference pads with zeros, which changes no amax).

Transcribed from Transformer Engine (the pinned tree at d0067d0, 2026-08-22):
  transformer_engine/common/recipe/recipe_common.cuh (compute_scale_from_amax; compute_scale_from_types, whose
      value_for_inf is the INPUT dtype's max: fp32 max for fp32 input, bf16's for bf16, 65504 for fp16);
  transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu (1x128: "Step 2.4: Compute
      scale", "Step 2.5: Write scale_inv": scale_inv = 1.0 / scale, "Step 2.6: Quantize":
      static_cast<OType>(x * scale)) and quantize_transpose_square_blockwise.cu (128x128);
  tests/pytorch/references/blockwise_quantizer_reference.py (the partial-tile padding) and
  transformer_engine/common/recipe/__init__.py (Float8BlockScaling's defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from megalab.transformer_engine.recipe_common import compute_current_scale

BLOCK_LEN = 128  # TE's Float8BlockQuantizer.block_len (kTileDim in the kernels)


def _scale_and_inverse(amax: torch.Tensor, fp8_dtype: torch.dtype, input_dtype: torch.dtype,
                       force_pow_2_scales: bool, amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_scale_from_types<IType, OType>, then scale_inv = 1.0 / scale (a double division, stored as fp32)."""
    value_for_inf = torch.finfo(input_dtype).max if input_dtype.is_floating_point else torch.finfo(torch.float32).max
    scale = compute_current_scale(amax, torch.finfo(fp8_dtype).max, force_pow_2_scales, amax_epsilon,
                                  value_for_inf=value_for_inf)
    return scale, (1.0 / scale.double()).float()


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, block: tuple[int, int], force_pow_2_scales: bool = True,
                    amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in tiles of block = (rows, cols), edge tiles partial: data [M, K] fp8, scale_inv [ceil(M/rows),
    ceil(K/cols)] fp32."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks takes a 2-D [M, K] tensor, got shape {list(x.shape)}")
    (M, K), (br, bc) = x.shape, block
    mb, kb = math.ceil(M / br), math.ceil(K / bc)
    padded = F.pad(x.float(), (0, kb * bc - K, 0, mb * br - M))             # zeros change no tile's amax
    tiles = padded.reshape(mb, br, kb, bc)                                    # [M/br, br, K/bc, bc]
    amax = tiles.abs().amax(dim=(1, 3))                                       # [M/br, K/bc]
    scale, scale_inv = _scale_and_inverse(amax, fp8_dtype, x.dtype, force_pow_2_scales, amax_epsilon)
    fp8_max = torch.finfo(fp8_dtype).max
    data = (tiles * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return data.reshape(mb * br, kb * bc)[:M, :K].contiguous(), scale_inv


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale_inv of its tile (TE's blockwise dequantize)."""
    M, K = data.shape
    full = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:M, :K]
    return (data.float() * full).to(dtype)


@dataclass
class Float8BlockwiseQTensor:
    """Rowwise data [M, K] + scale_inv, and the columnwise copy: data [K, M] (the transpose) + its scale_inv.
    Scales are kept logical ([tiles of M, tiles of K]); TE stores the 1x128 ones transposed and padded for cuBLAS."""

    shape: torch.Size
    fp8_dtype: torch.dtype
    block: tuple[int, int]
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None

    def dequantize(self, columnwise: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if columnwise:
            out = dequantize_blocks(self.columnwise_data, self.columnwise_scale_inv, self.block, dtype).t()
        else:
            out = dequantize_blocks(self.rowwise_data, self.rowwise_scale_inv, self.block, dtype)
        return out.reshape(self.shape)


class Float8BlockQuantizer:
    """TE's Float8BlockQuantizer: block_scaling_dim 1 (1x128 tiles) or 2 (128x128 blocks), fp32 scales."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = True, columnwise: bool = True,
                 amax_epsilon: float = 0.0, force_pow_2_scales: bool = True, block_scaling_dim: int = 2):
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 (1x{BLOCK_LEN} tiles) or 2 ({BLOCK_LEN}x{BLOCK_LEN} "
                             f"blocks), got {block_scaling_dim}")
        self.dtype, self.rowwise_usage, self.columnwise_usage = fp8_dtype, rowwise, columnwise
        self.amax_epsilon, self.force_pow_2_scales, self.block_scaling_dim = amax_epsilon, force_pow_2_scales, \
            block_scaling_dim
        self.block = (1, BLOCK_LEN) if block_scaling_dim == 1 else (BLOCK_LEN, BLOCK_LEN)

    def __call__(self, x: torch.Tensor) -> Float8BlockwiseQTensor:
        return self.quantize(x)

    def quantize(self, x: torch.Tensor) -> Float8BlockwiseQTensor:
        if x.dim() < 2:
            raise ValueError(f"blockwise FP8 quantizes tensors of 2 or more dims, got shape {list(x.shape)}: "
                             "reshape to [tokens, hidden]")
        x2 = x.reshape(-1, x.shape[-1])                                        # [M, K]
        args = (self.dtype, self.block, self.force_pow_2_scales, self.amax_epsilon)
        row = quantize_blocks(x2, *args) if self.rowwise_usage else (None, None)
        col = (None, None)
        if self.columnwise_usage:
            if self.block_scaling_dim == 2 and self.rowwise_usage:  # square blocks: the same numbers, transposed
                col = (row[0].t().contiguous(), row[1].t().contiguous())
            else:                                                   # the transpose, tiled again along M
                col = quantize_blocks(x2.t(), *args)                # [K, M], [K, ceil(M/128)]
        return Float8BlockwiseQTensor(x.shape, self.dtype, self.block, *row, *col)
