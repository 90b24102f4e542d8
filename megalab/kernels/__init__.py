"""Hand-written kernels (Triton).

Triton compiles `@triton.jit` kernels for a GPU. Without one, `TRITON_INTERPRET=1` runs the same
kernels on CPU tensors with NumPy (slow, but exact in fp32). Triton reads that variable when it is
imported (its own library functions are decorated then), so the kernel module sets it just before
importing triton, on a machine without CUDA, if triton is not imported yet and you set no value
yourself (flash_attention.py). Importing this package changes nothing; `INTERPRET` says which mode
the kernels run (or will run) in.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()

@functools.cache
def triton_status() -> tuple[bool, str]:
    """Whether Triton can be imported here, and why not: Triton publishes wheels for Linux only (WSL2 is Linux),
    so on macOS the Triton kernels cannot run at all; their algorithm (online_softmax_attention) is plain
    PyTorch and runs everywhere."""
    import sys

    try:
        found = sys.modules["triton"] is not None if "triton" in sys.modules else importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return True, "triton installed"
    if sys.platform == "darwin":
        return False, ("Triton publishes no wheels for macOS, so the Triton kernels cannot run on a Mac (on a Linux "
                       "machine, WSL2 included, they run interpreted on CPU or compiled on a GPU); the online-softmax "
                       "algorithm, online_softmax_attention, is plain PyTorch and runs here")
    return False, ("triton is not installed (pip install -e . installs it on Linux; it has wheels for Linux only); "
                   "online_softmax_attention, the kernels' algorithm in plain PyTorch, runs without it")


# Backends of CoreAttention (config.attention_backend) that dispatch here; "unfused" stays in the model.
FUSED_BACKENDS = ("sdpa", "triton", "flash_attn", "auto")


@functools.cache
def flash_attn_status() -> tuple[bool, str]:
    """Whether Tri Dao's flash-attn really runs here, and why (not).

    Finding the package is not enough: a wheel built for another torch or CUDA installs fine and fails at
    the first forward ("undefined symbol"). So its CUDA extension, `flash_attn_2_cuda`, is imported."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, "not installed (optional, on a CUDA machine: make flash-attn)"
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    if not torch.cuda.is_available():
        return False, f"flash-attn {version} installed, but there is no CUDA GPU"
    try:
        import flash_attn_2_cuda  # noqa: F401  (the compiled kernels)
    except (ImportError, OSError) as e:
        return False, (f"flash-attn {version} installed, but its CUDA extension does not load ({type(e).__name__}: "
                       f"{str(e)[:120]}): rebuild it for torch {torch.__version__} (pip install --no-build-isolation "
                       "--force-reinstall flash-attn)")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"flash-attn {version} needs an Ampere or newer GPU (sm_80+); this one is sm_{major}{minor}"
    return True, f"flash-attn {version}, CUDA extension loads (sm_{major}{minor})"


def flash_attn_available() -> bool:
    """flash-attn's CUDA kernels load on this machine (flash_attn_status says why not)."""
    return flash_attn_status()[0]


def flash_attn_supports(head_dim: int | None, dtype: torch.dtype) -> tuple[bool, str]:
    """flash-attn 2's limits: fp16/bf16 inputs, head dim at most 256."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"flash-attn computes in fp16/bf16 only, the inputs are {dtype}"
    if head_dim is not None and head_dim > 256:
        return False, f"flash-attn supports head dims up to 256, got {head_dim}"
    return True, "fp16/bf16, head dim <= 256"


def explain_attention_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32,
                              dropout_p: float = 0.0, packed: bool = False,
                              head_dim: int | None = None) -> tuple[str, str]:
    """(backend, why): the backend `requested` runs as on `device`, and the reason for auto's choice.

    auto picks the fastest backend that is also exact for the inputs' dtype:
      CPU                 -> sdpa (the Triton kernels run in the interpreter: exact, far too slow for a model)
      CUDA, fp16/bf16     -> flash_attn if its CUDA extension loads and takes this head dim, else sdpa (which
                             runs PyTorch's own FlashAttention-2 / cuDNN kernels for 16-bit inputs)
      CUDA, fp32          -> sdpa (its memory-efficient kernel computes in fp32; flash-attn has no fp32, and
                             fp32 must not silently become TF32 or bf16)
    The Triton kernels (megalab/kernels/flash_attention.py) are the course's own: selectable by name ("triton").
    Packed documents: flash-attn's varlen kernel, else SDPA with the document-causal mask.
    """
    if requested not in FUSED_BACKENDS:
        raise ValueError(f"attention backend must be one of {FUSED_BACKENDS}, got {requested!r}")
    cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        if not cuda:
            return "sdpa", "no CUDA device: PyTorch SDPA (the Triton kernels run interpreted on CPU: ask by name)"
        if dtype == torch.float32:
            return "sdpa", ("fp32 on CUDA: SDPA's memory-efficient kernel computes in fp32 (flash-attn has no fp32; "
                            "TF32 only if you enable torch.backends.cuda.matmul.allow_tf32)")
        ok, why = flash_attn_status()
        if ok:
            ok, why = flash_attn_supports(head_dim, dtype)
        if ok:
            return "flash_attn", f"{dtype} on CUDA: flash-attn ({why})"
        return "sdpa", f"{dtype} on CUDA: PyTorch SDPA's FlashAttention kernels (flash-attn not used: {why})"
    if requested == "flash_attn":
        ok, why = flash_attn_status() if cuda else (False, "needs a CUDA GPU")
        if ok:
            ok, why = flash_attn_supports(head_dim, dtype)
        if not ok:
            raise ValueError(f'attention_backend="flash_attn" cannot run: {why}. flash-attn needs a CUDA GPU and '
                             '`pip install flash-attn`; use "auto" to fall back to SDPA')
    if requested == "triton" and not triton_status()[0]:
        raise ValueError(f'attention_backend="triton" cannot run: {triton_status()[1]}. Use "auto" or "sdpa"')
    if requested == "triton" and packed:
        raise ValueError('the Triton kernels take no document boundaries: with packed sequences use '
                         'attention_backend "auto", "sdpa", "flash_attn" or "unfused"')
    if requested == "triton" and dropout_p > 0.0:
        raise ValueError('the Triton kernels have no attention dropout: set attention_dropout=0.0 or use "auto"/"sdpa"')
    if requested == "triton" and head_dim is not None and head_dim > 256:
        raise ValueError(f'the Triton kernels take head dims up to 256, got {head_dim}: use "sdpa"')
    return requested, "asked for by name"


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32,
                              dropout_p: float = 0.0, packed: bool = False, head_dim: int | None = None) -> str:
    """The backend `requested` runs as on `device` (explain_attention_backend gives the reason too)."""
    return explain_attention_backend(requested, device, dtype, dropout_p, packed, head_dim)[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
              dropout_p: float = 0.0, causal: bool = True, packed_seq_params=None) -> torch.Tensor:
    """Attention on [b, h, s, d] tensors through the chosen backend (see resolve_attention_backend).

    With packed_seq_params (megalab/core/packed_seq_params.py) the tokens are packed documents: causal attention
    within each document only."""
    backend = resolve_attention_backend(backend, q.device, q.dtype, dropout_p, packed=packed_seq_params is not None,
                                        head_dim=q.shape[-1])
    if packed_seq_params is not None:
        if not causal:
            raise ValueError("packed documents are attended causally here (a decoder); pass causal=True")
        return packed_attention(q, k, v, packed_seq_params, backend, dropout_p)
    if backend == "triton":
        from megalab.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal)
    if backend == "flash_attn":
        from flash_attn import flash_attn_func

        out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=dropout_p, causal=causal)  # [b, s, h, d]
        return out.transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params, backend: str,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each packed document, [b, h, s, d] -> [b, h, s, d] (tokens read row by row).

    flash_attn: flash_attn_varlen_func on the [T, h, d] stream, which skips the blocks between documents
    (cost: the sum of the documents' squares). sdpa: the [b, 1, s, s] document-causal mask (cost: b s^2).
    """
    b, h, s, d = q.shape
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        stream = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [T, h, d]
        cu_q, cu_kv = (cu.to(q.device, torch.int32) for cu in (params.cu_seqlens_q, params.cu_seqlens_kv))
        out = flash_attn_varlen_func(*stream, cu_q, cu_kv, params.max_seqlen_q, params.max_seqlen_kv,
                                     dropout_p=dropout_p, causal=True)  # [T, h, d]
        return out.view(b, s, h, d).transpose(1, 2)
    mask = params.attention_mask(b, s, q.device)  # [b, 1, s, s]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
