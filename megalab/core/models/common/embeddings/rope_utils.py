"""Rotary position embeddings: the two conventions for which channels form a pair.

RoPE rotates pairs of channels of each query/key head by the angle pos * theta_i with
theta_i = base^(-2i/d). Which two channels make pair i is a convention, and checkpoints differ:

    interleaved  (x0, x1) (x2, x3) ... (x_{d-2}, x_{d-1})        Meta's LLaMA code, the paper;
                                                                   Megatron's rotary_interleaved=True
    half-split   (x0, x_{d/2}) (x1, x_{d/2+1}) ... ("rotate half") GPT-NeoX, Hugging Face LLaMA,
                                                                   Megatron's default

The attention scores are the same if the q/k projection rows are permuted to match: inside each
head, the half-split layout lists the even channels of the interleaved one, then the odd ones.

    interleaved rows  [0 1 2 3 4 5 6 7]  -- interleaved_to_half_split -->  [0 2 4 6 | 1 3 5 7]

Hugging Face's convert_llama_weights_to_hf.py applies exactly this permutation (`permute`) to
Meta's wq/wk, which is why HF LLaMA runs "rotate_half" on weights that were trained interleaved.
"""

from __future__ import annotations

import torch


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): each pair (x_{2i}, x_{2i+1}) turned by 90 degrees."""
    # EXERCISE model.rope_interleaved: rotate each interleaved pair (x_{2i}, x_{2i+1}) to (-x_{2i+1}, x_{2i})
    ### BEGIN SOLUTION
    # HINT 1: The idea. Channels pair up as neighbours (x0, x1), (x2, x3), ...; turning a pair (a, b) by 90 degrees
    #         gives (-b, a). With cos and sin in apply_rotary_pos_emb this is Meta's complex product (a + ib) e^(ia).
    # HINT 2: The approach. Take the even and the odd channels with strided slices of the last dim, put each turned
    #         pair side by side in a new last dim (torch.stack), then flatten those two dims back into one.
    # HINT 3: A pitfall. Concatenating the two slices gives (-x1, -x3, ..., x0, x2, ...): each pair must stay
    #         neighbours in the output, and the minus sign goes on the odd (second) channel of the pair.
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)
    ### END SOLUTION


def interleaved_to_half_split(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute the output rows of a q or k projection [num_heads * d, in] from interleaved to half-split pairs."""
    rows, cols = weight.shape
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even head dim")
    d = rows // num_heads
    return weight.view(num_heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)  # evens, then odds


def half_split_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_half_split."""
    rows, cols = weight.shape
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even head dim")
    d = rows // num_heads
    return weight.view(num_heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first rotary_dim channels of t [s, b, heads, head_dim]; the rest pass through."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    rotate = rotate_interleaved if interleaved else _rotate_half
    return torch.cat([t_rot * cos + rotate(t_rot) * sin, t_pass], dim=-1)
