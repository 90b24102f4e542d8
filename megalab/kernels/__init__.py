"""Hand-written kernels (Triton).

Triton compiles `@triton.jit` kernels for a GPU. Without one, `TRITON_INTERPRET=1` runs the same
kernels on CPU tensors with NumPy (slow, but exact in fp32). Triton reads that variable when it is
imported (its own library functions are decorated then), so the kernel module sets it just before
importing triton, on a machine without CUDA, if triton is not imported yet and you set no value
yourself (flash_attention.py). Importing this package changes nothing; `INTERPRET` says which mode
the kernels run (or will run) in.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()

# Backends of CoreAttention (config.attention_backend) that dispatch here; "unfused" stays in the model.
FUSED_BACKENDS = ("sdpa", "triton", "flash_attn", "auto")


def flash_attn_available() -> bool:
    """Tri Dao's flash-attn package is importable (it only installs on a CUDA machine)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32,
                              dropout_p: float = 0.0, packed: bool = False) -> str:
    """The backend `requested` runs as on `device`: "auto" picks the fastest that supports the call.

    auto: flash-attn (CUDA, fp16/bf16) > Triton kernels (CUDA, no dropout) > PyTorch SDPA. On CPU auto
    is SDPA: the Triton interpreter is exact but far too slow for a model; ask for "triton" by name.
    Packed documents (`packed`): flash-attn's varlen kernel, else SDPA with the document-causal mask.
    """
    if requested not in FUSED_BACKENDS:
        raise ValueError(f"attention backend must be one of {FUSED_BACKENDS}, got {requested!r}")
    cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        if cuda and flash_attn_available() and dtype in (torch.float16, torch.bfloat16):
            return "flash_attn"
        return "triton" if cuda and dropout_p == 0.0 and not packed else "sdpa"
    if requested == "flash_attn" and not (cuda and flash_attn_available()):
        raise ValueError('attention_backend="flash_attn" needs a CUDA GPU and `pip install flash-attn`; '
                         'use "auto" to fall back to Triton or SDPA')
    if requested == "triton" and packed:
        raise ValueError('the Triton kernels take no document boundaries: with packed sequences use '
                         'attention_backend "auto", "sdpa", "flash_attn" or "unfused"')
    if requested == "triton" and dropout_p > 0.0:
        raise ValueError('the Triton kernels have no attention dropout: set attention_dropout=0.0 or use "auto"/"sdpa"')
    return requested


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
              dropout_p: float = 0.0, causal: bool = True, packed_seq_params=None) -> torch.Tensor:
    """Attention on [b, h, s, d] tensors through the chosen backend (see resolve_attention_backend).

    With packed_seq_params (megalab/core/packed_seq_params.py) the tokens are packed documents: causal attention
    within each document only."""
    backend = resolve_attention_backend(backend, q.device, q.dtype, dropout_p, packed=packed_seq_params is not None)
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
