"""FlashAttention in Triton: exact attention without ever storing the [s, s] score matrix.

One program owns a BLOCK_M tile of queries and walks over the keys in BLOCK_N tiles, keeping a
running max m, a running denominator l and an unnormalized output acc ("online softmax"):

          keys ─────────────────────────────>
        ┌──────┬──────┬──────┬──────┐
  q tile│ S_0  │ S_1  │ S_2  │ (skip│   S_j = q k_j^T * scale           [BLOCK_M, BLOCK_N]
        │      │      │  ◣   │causal│   m'  = max(m, rowmax(S_j))
        └──────┴──────┴──────┴──────┘   acc = acc * e^(m - m') + e^(S_j - m') v_j
                                        l   = l   * e^(m - m') + rowsum(e^(S_j - m'))
  out = acc / l,  and the row's log-sum-exp L = m + log l is kept for the backward.

The backward recomputes P = e^(S - L) tile by tile instead of loading it (Dao, FlashAttention-2):
    dV = P^T dO      dP = dO V^T      dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = scale * dS K                 dK = scale * dS^T Q
one kernel per key tile accumulates dK, dV over the query tiles; one per query tile accumulates dQ.
Causal programs skip the tiles above the diagonal: about half the work.
The grid is (b*h, tiles): b*h on axis 0, the only CUDA grid axis that takes more than 65,535 blocks
(launch_grid).

Tensors are [b, h, s, d] (like F.scaled_dot_product_attention). The kernels use plain pointer
arithmetic (`tl.make_block_ptr` is gone in triton 3.9), int64 where b*h*s*d can pass 2**31. On a GPU,
fp32 dots run in IEEE fp32 (Triton's default is TF32), and the tiles and pipeline stages are chosen per
head dim and dtype to fit Hopper's 227 KB of shared memory per block (kernel_configs).

Megatron-LM does not write its own dense attention kernel: `TEDotProductAttention` (megatron/core/extensions/transformer_engine.py)
calls Transformer Engine, which dispatches to cuDNN's or Tri Dao's flash-attn kernels. (Its own attention kernels are
TileLang ones for DeepSeek's sparse attention: megatron/core/transformer/experimental_attention_variant/ops/.)
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

from megalab.kernels import INTERPRET, triton_status

if INTERPRET and "triton" not in sys.modules:  # the interpreter is chosen when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
NO_TRITON = None  # why triton cannot be imported here (None: it can)
try:
    import triton
    import triton.language as tl
except ImportError as e:  # no Triton wheels for macOS: the kernels stay plain functions, flash_attention says why
    NO_TRITON = triton_status()[1] if not triton_status()[0] else f"triton does not import ({type(e).__name__}: {e})"

    class _NoTriton:
        """Stands in for triton and triton.language where they cannot be imported: `@triton.jit` leaves the
        kernel a plain (never called) function, so the module and online_softmax_attention still load."""

        @staticmethod
        def jit(fn):
            return fn

        def __getattr__(self, name):
            raise RuntimeError(NO_TRITON)

    triton = tl = _NoTriton()


@triton.jit
def _fwd_kernel(Q, K, V, Out, L, scale, seqlen, stride_bh, stride_s,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: bh * stride_bh passes 2**31 on large b*h*s*d
    start_m = tl.program_id(1) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)  # query positions of this tile
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    base = bh * stride_bh
    q = tl.load(Q + base + rows[:, None] * stride_s + offs_d[None, :], mask=rows[:, None] < seqlen, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, seqlen) if CAUSAL else seqlen
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = base + cols[:, None] * stride_s + offs_d[None, :]
        k = tl.load(K + kv_off, mask=cols[:, None] < seqlen, other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + kv_off, mask=cols[:, None] < seqlen, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        valid = cols[None, :] < seqlen
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(Out + base + rows[:, None] * stride_s + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=rows[:, None] < seqlen)
    tl.store(L + bh * seqlen + rows, m_i + tl.log(l_i), mask=rows < seqlen)


@triton.jit
def _bwd_preprocess(Out, DO, Delta, seqlen, stride_bh, stride_s, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: bh * stride_bh passes 2**31 on large b*h*s*d
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    off = bh * stride_bh + rows[:, None] * stride_s + tl.arange(0, HEAD_D)[None, :]
    o = tl.load(Out + off, mask=rows[:, None] < seqlen, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=rows[:, None] < seqlen, other=0.0).to(tl.float32)
    tl.store(Delta + bh * seqlen + rows, tl.sum(o * do, 1), mask=rows < seqlen)  # delta = rowsum(dO * O)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV, scale, seqlen, stride_bh, stride_s,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: bh * stride_bh passes 2**31 on large b*h*s*d
    start_n = tl.program_id(1) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)  # key positions of this tile
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    base = bh * stride_bh
    kv_off = base + cols[:, None] * stride_s + offs_d[None, :]
    k = tl.load(K + kv_off, mask=cols[:, None] < seqlen, other=0.0)
    v = tl.load(V + kv_off, mask=cols[:, None] < seqlen, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0  # earlier queries never see these keys
    for start_m in range(lo, seqlen, BLOCK_M):
        rows = start_m + offs_m
        q_off = base + rows[:, None] * stride_s + offs_d[None, :]
        q = tl.load(Q + q_off, mask=rows[:, None] < seqlen, other=0.0)
        do = tl.load(DO + q_off, mask=rows[:, None] < seqlen, other=0.0)
        lse = tl.load(L + bh * seqlen + rows, mask=rows < seqlen, other=0.0)
        delta = tl.load(Delta + bh * seqlen + rows, mask=rows < seqlen, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        valid = (rows[:, None] < seqlen) & (cols[None, :] < seqlen)
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)  # the forward's probabilities, recomputed
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=INPUT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=INPUT_PRECISION)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None] < seqlen)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=cols[:, None] < seqlen)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, L, Delta, DQ, scale, seqlen, stride_bh, stride_s,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: bh * stride_bh passes 2**31 on large b*h*s*d
    start_m = tl.program_id(1) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    base = bh * stride_bh
    q_off = base + rows[:, None] * stride_s + offs_d[None, :]
    q = tl.load(Q + q_off, mask=rows[:, None] < seqlen, other=0.0)
    do = tl.load(DO + q_off, mask=rows[:, None] < seqlen, other=0.0)
    lse = tl.load(L + bh * seqlen + rows, mask=rows < seqlen, other=0.0)
    delta = tl.load(Delta + bh * seqlen + rows, mask=rows < seqlen, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, seqlen) if CAUSAL else seqlen
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = base + cols[:, None] * stride_s + offs_d[None, :]
        k = tl.load(K + kv_off, mask=cols[:, None] < seqlen, other=0.0)
        v = tl.load(V + kv_off, mask=cols[:, None] < seqlen, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
        valid = (rows[:, None] < seqlen) & (cols[None, :] < seqlen)
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None] < seqlen)


# Hopper (H100/H200) gives one block at most 227 KB of shared memory (228 KB per SM); Ampere A100 163 KB.
SMEM_BUDGET = 227 * 1024
MAX_HEAD_DIM = 256
# (BLOCK_M, BLOCK_N, num_stages) from the fastest to the leanest; the first that fits the budget is used.
TILE_CONFIGS = ((64, 64, 3), (64, 64, 2), (64, 64, 1), (32, 64, 2), (64, 32, 1), (32, 32, 2), (32, 32, 1), (16, 16, 1))


def shared_memory_bytes(kind: str, block_m: int, block_n: int, d: int, itemsize: int, num_stages: int) -> int:
    """An estimate of a kernel's shared memory: the tiles streamed through the loop, num_stages deep (software
    pipelining), the tiles held for the whole loop, and the [BLOCK_M, BLOCK_N] tiles fed back into tl.dot.

    fwd: K, V streamed; Q held; P.   bwd (dK dV, the larger backward kernel): Q, dO streamed; K, V held; P, dS.
    """
    if kind == "fwd":
        tiles = num_stages * 2 * block_n * d + block_m * d + block_m * block_n
    else:
        tiles = num_stages * 2 * block_m * d + 2 * block_n * d + 2 * block_m * block_n
    return tiles * itemsize


def kernel_configs(kind: str, d: int, dtype: torch.dtype, seqlen: int | None = None,
                   budget: int = SMEM_BUDGET) -> list[dict]:
    """Launch parameters for the fwd/bwd kernels at head dim d (padded, a power of two) and input dtype, best first:
    every TILE_CONFIGS entry whose estimated shared memory fits `budget`; num_warps 8 from d = 128.

    fp32 inputs: tl.dot in IEEE fp32 (Triton's default on NVIDIA is TF32: ~1e-3 error, and the interpreter ignores
    the setting, so CPU runs cannot show it). In the interpreter: tiles no larger than the sequence."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is over the Triton kernels' {MAX_HEAD_DIM}: use attention_backend='sdpa'")
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for block_m, block_n, stages in TILE_CONFIGS:
        if shared_memory_bytes(kind, block_m, block_n, d, itemsize, stages) > budget:
            continue
        if INTERPRET and seqlen is not None:
            cap = max(16, triton.next_power_of_2(seqlen))
            block_m, block_n = min(block_m, cap), min(block_n, cap)
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_stages=stages, num_warps=8 if d >= 128 else 4,
                   INPUT_PRECISION="ieee" if dtype == torch.float32 else None)  # None: the backend's default
        if cfg not in out:
            out.append(cfg)
    if not out:
        raise ValueError(f"no tile configuration of the Triton kernels fits {budget} bytes of shared memory at head "
                         f"dim {d} in {dtype}: use attention_backend='sdpa'")
    return out


def kernel_config(kind: str, d: int, dtype: torch.dtype, seqlen: int | None = None) -> dict:
    """The first (fastest) of kernel_configs."""
    return kernel_configs(kind, d, dtype, seqlen)[0]


# CUDA's launch limits: grid axis 0 up to 2**31 - 1 blocks, axes 1 and 2 up to 65,535.
MAX_GRID = (2**31 - 1, 65_535, 65_535)


def launch_grid(heads: int, seqlen: int, block: int) -> tuple[int, int]:
    """(b*h, tiles): one program per (head, tile of `block` rows). b*h goes on axis 0, the only one that
    takes more than 65,535 blocks (b*h passes that: 512 x 128 heads); the tiles of one head on axis 1."""
    grid = (heads, triton.cdiv(seqlen, block))
    for axis, (n, limit) in enumerate(zip(grid, MAX_GRID)):
        if n > limit:
            what = "b*h" if axis == 0 else f"sequence tiles ({seqlen} / {block})"
            raise ValueError(f"the Triton attention kernels would launch {n} blocks on grid axis {axis} ({what}), "
                             f"over CUDA's {limit}: split the batch, or use attention_backend='sdpa'")
    return grid


def _launch(kernel, grid, args, kind: str, d: int, dtype: torch.dtype, seqlen: int, **meta) -> dict:
    """kernel[grid(config)](*args) with the best config; if Triton finds it too large when compiling (the
    shared-memory estimate was short: OutOfResources), the next leaner one. Returns the config used."""
    configs = kernel_configs(kind, d, dtype, seqlen)
    for i, cfg in enumerate(configs):
        try:
            kernel[grid(cfg)](*args, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                              INPUT_PRECISION=cfg["INPUT_PRECISION"], num_stages=cfg["num_stages"],
                              num_warps=cfg["num_warps"], **meta)
            return cfg
        except triton.runtime.errors.OutOfResources as e:
            if i == len(configs) - 1:
                raise ValueError(f"the Triton {kind} kernel does not fit this GPU at head dim {d} in {dtype} ({e}): "
                                 "use attention_backend='sdpa'") from e
    raise AssertionError("unreachable")


class FlashAttentionFunction(torch.autograd.Function):
    """Triton forward and backward; saves q, k, v, o and the log-sum-exp L [b*h, s], never P."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        b, h, s, d = q.shape  # d is a power of two >= 16 (flash_attention pads it)
        q, k, v = (t.contiguous() for t in (q, k, v))
        o = torch.empty_like(q)
        lse = torch.empty(b * h, s, device=q.device, dtype=torch.float32)
        _launch(_fwd_kernel, lambda c: launch_grid(b * h, s, c["BLOCK_M"]), (q, k, v, o, lse, scale, s, s * d, d),
                "fwd", d, q.dtype, s, CAUSAL=causal, HEAD_D=d)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        b, h, s, d = q.shape
        do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        block = kernel_config("bwd", d, q.dtype, s)["BLOCK_M"]
        _bwd_preprocess[launch_grid(b * h, s, block)](o, do, delta, s, s * d, d, BLOCK_M=block, HEAD_D=d)
        _launch(_bwd_dkdv_kernel, lambda c: launch_grid(b * h, s, c["BLOCK_N"]),
                (q, k, v, do, lse, delta, dk, dv, ctx.scale, s, s * d, d), "bwd", d, q.dtype, s,
                CAUSAL=ctx.causal, HEAD_D=d)
        _launch(_bwd_dq_kernel, lambda c: launch_grid(b * h, s, c["BLOCK_M"]),
                (q, k, v, do, lse, delta, dq, ctx.scale, s, s * d, d), "bwd", d, q.dtype, s,
                CAUSAL=ctx.causal, HEAD_D=d)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v with the Triton kernels; q, k, v [b, h, s, d], same shape.

    Any head dim works: d is zero-padded to a power of two >= 16 (tl.dot's smallest tile), which
    leaves q k^T unchanged. In the interpreter the kernels compute in fp32 (`tl.dot` on bf16 is
    wrong there); the output has the input's dtype.
    """
    if NO_TRITON:
        raise RuntimeError(f"flash_attention needs Triton: {NO_TRITON}")
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k, v must all be [b, h, s, d] with the same shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (repeat k/v heads for GQA first)")
    if q[0, 0].numel() >= 2**31:
        raise ValueError(f"one head holds {q[0, 0].numel()} elements: the kernels' in-head offsets are int32; "
                         "split the sequence (context parallelism) or use attention_backend='sdpa'")
    if q.device.type != ("cpu" if INTERPRET else "cuda"):
        raise ValueError(f"tensors are on {q.device}, but triton runs {'in the interpreter (CPU)' if INTERPRET else 'on CUDA'}:"
                         " move them there (for CPU, TRITON_INTERPRET=1 must be set before triton is first imported)")
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dtype = q.dtype
    if INTERPRET:
        q, k, v = q.float(), k.float(), v.float()
    d_pad = max(16, triton.next_power_of_2(d))
    if d_pad != d:
        q, k, v = (F.pad(t, (0, d_pad - d)) for t in (q, k, v))
    out = FlashAttentionFunction.apply(q, k, v, causal, scale)
    return out[..., :d].to(dtype)


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                             block_n: int = 16) -> torch.Tensor:
    """The forward kernel's algorithm in plain PyTorch: keys in tiles of block_n, online softmax.

    q, k, v [b, h, s, d] -> [b, h, s, d]. Never builds more than an [s, block_n] slice of scores.
    """
    s, d = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    rows = torch.arange(s, device=q.device)[:, None]  # [s, 1] query positions
    # EXERCISE kernels.online_softmax: loop over key tiles keeping running max m, denominator l, output acc
    ### BEGIN SOLUTION
    # HINT 1: Walk the keys tile by tile, keeping per query row the running max m, the running
    #         denominator l = sum exp(score - m) and the unnormalised output acc; divide acc by l only at the end.
    # HINT 2: Per tile: scores (scaled, causal-masked with -inf), m_new = max(m, tile max),
    #         alpha = exp(m - m_new); rescale BOTH l and acc by alpha before adding this tile's exp(scores - m_new)
    #         (summed for l, times the tile's values for acc).
    # HINT 3: When the max grows, everything accumulated so far was exponentiated against the old max:
    #         forgetting the alpha factor on l or on acc is the classic bug.
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [b, h, s]
    l = torch.zeros_like(m)  # noqa: E741
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [b, h, s, d]
    for start in range(0, s, block_n):
        cols = torch.arange(start, min(start + block_n, s), device=q.device)[None, :]  # [1, n]
        scores = (q.float() @ k[..., start:start + block_n, :].float().transpose(-1, -2)) * scale  # [b, h, s, n]
        if causal:
            scores = scores.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)  # 0 where m was -inf (nothing accumulated yet)
        p = torch.exp(scores - m_new[..., None])  # [b, h, s, n]
        l = l * alpha + p.sum(-1)  # noqa: E741
        acc = acc * alpha[..., None] + p @ v[..., start:start + block_n, :].float()
        m = m_new
    out = acc / l[..., None]
    ### END SOLUTION
    return out.to(q.dtype)
