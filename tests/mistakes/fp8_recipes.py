"""Typical wrong answers to the MXFP8 exercise of 06·02 (FP8 recipes), as mutants.

`python -m megalab.lab.mutants --file tests/mistakes/fp8_recipes.py` swaps each `code` in for its exercise's region
and checks that the exercise's first failing test names the mistake (its verdict contains `says`).
"""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake("mxfp8.quantize_rowwise", "scale not a power of two", says="not a power of two", code="""
fp8_max = torch.finfo(fp8_dtype).max
blocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)
amax = blocks.abs().amax(dim=-1)
scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype))
scaled = blocks * (fp8_max / amax).unsqueeze(-1)
data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)
"""),
    Mistake("mxfp8.quantize_rowwise", "amax of the whole tensor", says="amax of the whole tensor", code="""
fp8_max = torch.finfo(fp8_dtype).max
blocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)
amax = x.float().abs().max().expand(M, K // MXFP8_BLOCK_SCALING_SIZE)
scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype))
scaled = blocks * exp2f_rcp(scale_inv).unsqueeze(-1)
data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)
"""),
    Mistake("mxfp8.quantize_rowwise", "blocks along the wrong dimension", says="wrong dimension", code="""
fp8_max = torch.finfo(fp8_dtype).max
blocks = x.float().t().reshape(K, M // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)
amax = blocks.abs().amax(dim=-1)
scale_inv = float_to_e8m0(amax * max_norm_rcp(fp8_dtype))
scaled = blocks * exp2f_rcp(scale_inv).unsqueeze(-1)
data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(K, M).t()
scale_inv = scale_inv.t()
"""),
    Mistake("mxfp8.quantize_rowwise", "rounded the E8M0 exponent to nearest", says="to nearest", code="""
fp8_max = torch.finfo(fp8_dtype).max
blocks = x.float().reshape(M, K // MXFP8_BLOCK_SCALING_SIZE, MXFP8_BLOCK_SCALING_SIZE)
amax = blocks.abs().amax(dim=-1)
scale_inv = (amax / fp8_max).to(torch.float8_e8m0fnu).view(torch.uint8)
scaled = blocks * exp2f_rcp(scale_inv).unsqueeze(-1)
data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(M, K)
"""),
]
