"""MXFP8: FP8 with one power-of-two scale per 32 consecutive elements (TE's MXFP8BlockScaling recipe).

A per-tensor scale serves the tensor's largest value; every other value shares its binade budget. MXFP8
(the OCP Microscaling format, native on Blackwell tensor cores) gives each block of 32 elements along
the last dim its own scale, stored in one byte as E8M0 (an exponent, no mantissa: a power of two):

    x [M, K] ─ blocks of 32 along K ─► amax per block ─► e = float_to_e8m0(amax / fp8_max)  [M, K/32] uint8
                                                        data = fp8(x * 2^(127 - e))          [M, K]

Dequantized, x ~ data * 2^(e - 127). The exponent is rounded UP (to the next power of two >= amax / fp8_max),
so the block's amax scales to at most fp8_max and nothing saturates. A GEMM contracts over K, so the
weight-gradient GEMM (which contracts over M) needs a *columnwise* copy: blocks of 32 down each column,
scales [M/32, K], quantized again from the high-precision tensor (not from the rowwise copy).

Transcribed from Transformer Engine (the pinned tree at d0067d0, 2026-08-22):
  transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh (quantize_mxfp8_kernel: "2. Compute E8M0 scaling
      factor": biased_exponent = ptx::float_to_e8m0(thread_amax * Quantized_Limits<OType>::max_norm_rcp),
      "3. Scale elements": static_cast<OType>(in * ptx::exp2f_rcp<float>(biased_exponent)));
  transformer_engine/common/util/ptx_arch_spec.cuh (float_to_e8m0, the pre-Blackwell branch; Blackwell's
      cvt.rp.satfinite.ue8m0x2.f32 rounds the same way: towards +inf, saturating at 2^127);
  transformer_engine/common/util/ptx.cuh (exp2f_rcp, exp2f: the scale back from the E8M0 byte);
  transformer_engine/common/utils.cuh (Quantized_Limits::max_norm_rcp = 1.0 / max_norm, as fp32);
  transformer_engine/pytorch/csrc/quantizer.cpp (MXFP8Quantizer::create_tensor refuses: "MXFP8 requires tensor
      dims that are divisible by 32") and pytorch/tensor/mxfp8_tensor.py (MXFP8Quantizer.is_quantizable): both the
      last dim and the product of the others must be multiples of MXFP8_BLOCK_SCALING_SIZE = 32.
TE's CPU reference for its kernel tests computes the same: tests/cpp/test_common.h (float_to_e8m0, exp2f_rcp) used
by tests/cpp/operator/test_cast_mxfp8.cu (scale = float_to_e8m0(block_amax * max_reciprocal)).
One difference: TE's block amax uses fmaxf, which skips a NaN element; torch's amax here makes the block NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MXFP8_BLOCK_SCALING_SIZE = 32  # transformer_engine/pytorch/constants.py


def max_norm_rcp(fp8_dtype: torch.dtype) -> torch.Tensor:
    """1 / fp8_max, computed in double and stored as fp32 (TE's Quantized_Limits<OType>::max_norm_rcp)."""
    return torch.tensor(1.0 / torch.finfo(fp8_dtype).max, dtype=torch.float32)


def float_to_e8m0(val: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte (a biased exponent, uint8) of the power of two >= each fp32 value (TE's float_to_e8m0).

    Rounds the exponent up whenever the mantissa is not zero; NaN -> 0xFF, inf -> 0xFE, 0 -> 0x00; saturates at
    0xFE (2^127); a subnormal up to 2^-127 stays 0x00 (2^-127)."""
    val = val.float()
    bits = val.view(torch.int32)
    exponent = (bits >> 23) & 0xFF  # [..] int32, the sign bit dropped as TE's uint8 cast drops it
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + round_up.int()
    exponent = torch.where(val == 0, 0, exponent)
    exponent = torch.where(torch.isinf(val), 0xFE, exponent)
    exponent = torch.where(torch.isnan(val), 0xFF, exponent)
    return exponent.to(torch.uint8)


def exp2f_rcp(biased_exp: torch.Tensor) -> torch.Tensor:
    """2^(127 - e) as fp32, the multiplier that quantizes a block (TE's ptx::exp2f_rcp<float>): NaN for 0xFF,
    2^-127 (a subnormal) for 0xFE."""
    e = biased_exp.to(torch.int32)
    out = ((254 - e).clamp(min=0) << 23).view(torch.float32)
    out = torch.where(e == 254, torch.tensor(0x00400000, dtype=torch.int32).view(torch.float32), out)
    return torch.where(e == 255, torch.tensor(float("nan")), out)


def e8m0_to_float(biased_exp: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32 (TE's ptx::exp2f): the dequantization scale. Equal to torch's own decoding of
    torch.float8_e8m0fnu (`biased_exp.view(torch.float8_e8m0fnu).float()`)."""
    return biased_exp.to(torch.uint8).view(torch.float8_e8m0fnu).float()


def check_mxfp8_shape(shape: torch.Size | tuple[int, ...]) -> None:
    """Refuse a shape MXFP8 cannot block, as TE does (quantizer.cpp, MXFP8Quantizer::create_tensor), saying what
    to change."""
    if len(shape) < 2:
        raise ValueError(f"MXFP8 quantizes tensors of 2 or more dims, got shape {list(shape)}: reshape to "
                         "[tokens, hidden]")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if cols % MXFP8_BLOCK_SCALING_SIZE or rows % MXFP8_BLOCK_SCALING_SIZE:
        raise ValueError(
            f"MXFP8 scales blocks of {MXFP8_BLOCK_SCALING_SIZE} elements along the last dim (rowwise) and along the "
            f"others (columnwise): shape {list(shape)} has last dim {cols} and {rows} rows (the product of the other "
            f"dims); both must be multiples of {MXFP8_BLOCK_SCALING_SIZE}. Pad the hidden size / the token count "
            f"to a multiple of {MXFP8_BLOCK_SCALING_SIZE} (Megatron's get_fp8_align_size('mxfp8') = 32), or use "
            "the blockwise recipe, whose 1x128 and 128x128 tiles may be partial")


def mxfp8_quantize_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] with one E8M0 scale per 32 consecutive elements of each row.

    Returns data [M, K] in fp8_dtype and scale_inv [M, K // 32], uint8 E8M0 biased exponents: the dequantized
    value is data * 2^(scale_inv - 127)."""
    M, K = x.shape
    # EXERCISE mxfp8.quantize_rowwise: per block of 32 along each row: amax, E8M0 exponent rounded up, scale, cast
    ### BEGIN SOLUTION
    # HINT 1: Each run of 32 consecutive elements of a row is one block with its own scale. The scale is a power
    #         of two: the smallest one that brings the block's amax down to at most the format's max, so the
    #         block uses the top of the FP8 range without saturating. Its exponent is what is stored.
    # HINT 2: View the rows as [M, K // 32, 32] blocks and take each block's amax over the last dim, in fp32;
    #         float_to_e8m0 turns amax * max_norm_rcp(fp8_dtype) into the rounded-up exponent byte, and
    #         exp2f_rcp of that byte is the multiplier for the block's elements; clamp to +-fp8 max and cast.
    # HINT 3: The amax is per block, never of the whole tensor or of a column; the scale stays a power of two
    #         (never fp8_max / amax itself); and rounding the exponent to the nearest power of two (what a plain
    #         cast to torch.float8_e8m0fnu does) lets the block's largest values saturate.
    fp8_max = torch.finfo(fp8_dtype).max
    blocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)  # [M, K/32, 32]
    amax = blocks.abs().amax(dim=-1)                                                          # [M, K/32]
    scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype))                                # [M, K/32] uint8
    scaled = blocks * exp2f_rcp(scale_inv).unsqueeze(-1)
    data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)
    ### END SOLUTION
    return data, scale_inv


@dataclass
class MXFP8Tensor:
    """A quantized tensor in TE's layout (unswizzled scales): rowwise data + scales [M, K/32] for the GEMMs
    that contract over K; columnwise data (same [M, K] layout) + scales [M/32, K] for the wgrad GEMM."""

    shape: torch.Size
    fp8_dtype: torch.dtype
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None      # uint8 E8M0, [M, K/32]
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None   # uint8 E8M0, [M/32, K]

    def dequantize(self, columnwise: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * 2^(e - 127), back to `shape` (TE's dequantize_mxfp8.cuh: static_cast<OType>(block_scale * elt))."""
        if columnwise:
            data, scale = self.columnwise_data, e8m0_to_float(self.columnwise_scale_inv)   # [M, K], [M/32, K]
            out = data.float() * scale.repeat_interleave(MXFP8_BLOCK_SCALING_SIZE, dim=0)
        else:
            data, scale = self.rowwise_data, e8m0_to_float(self.rowwise_scale_inv)         # [M, K], [M, K/32]
            out = data.float() * scale.repeat_interleave(MXFP8_BLOCK_SCALING_SIZE, dim=1)
        return out.to(dtype).reshape(self.shape)


class MXFP8Quantizer:
    """TE's MXFP8Quantizer: rowwise and/or columnwise 1x32 blocks, each from the high-precision input."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = True, columnwise: bool = True):
        self.dtype, self.rowwise_usage, self.columnwise_usage = fp8_dtype, rowwise, columnwise

    def __call__(self, x: torch.Tensor) -> MXFP8Tensor:
        return self.quantize(x)

    def quantize(self, x: torch.Tensor) -> MXFP8Tensor:
        check_mxfp8_shape(x.shape)
        x2 = x.reshape(-1, x.shape[-1])                                            # [M, K]
        row = mxfp8_quantize_rowwise(x2, self.dtype) if self.rowwise_usage else (None, None)
        col = (None, None)
        if self.columnwise_usage:  # blocks of 32 down each column: quantize the transpose, transpose back
            data_t, scale_t = mxfp8_quantize_rowwise(x2.t(), self.dtype)          # [K, M], [K, M/32]
            col = (data_t.t().contiguous(), scale_t.t().contiguous())             # [M, K], [M/32, K]
        return MXFP8Tensor(x.shape, self.dtype, *row, *col)
