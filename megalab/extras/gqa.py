"""Grouped-query attention: ng key/value heads shared by np query heads (Ainslie et al. 2023).

    query heads   q0 q1 q2 q3 | q4 q5 q6 q7        np = 8
    kv heads          k0      |     k1             ng = 2 (num_query_groups), n_rep = np / ng = 4
    repeat_kv     k0 k0 k0 k0 | k1 k1 k1 k1        query head j attends with kv head j // n_rep

Only the k/v projections and the KV cache shrink (by np/ng); the attention math is MHA on the
repeated heads. LLaMA-2 70B and LLaMA-3 use ng = 8. Megatron: num_query_groups; its
DotProductAttention repeats key/value the same way (chapter 02's CoreAttention does it inline),
and PyTorch's F.scaled_dot_product_attention(..., enable_gqa=True) does it inside the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[s, b, ng, hn] -> [s, b, ng * n_rep, hn]: each key/value head repeated for its n_rep query heads."""
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1 (num_attention_heads // num_query_groups), got {n_rep}")
    # EXERCISE model.gqa_repeat: repeat each kv head n_rep times, adjacent (k0 k0 k1 k1, not k0 k1 k0 k1)
    ### BEGIN SOLUTION
    # HINT 1: The idea. Query head j uses kv head j // n_rep, so the n_rep copies of each kv head sit next to each
    #         other (k0 k0 k1 k1), and only the heads dim (dim 2) grows: [s, b, ng, hn] -> [s, b, ng * n_rep, hn].
    # HINT 2: The approach. Add a new dim right after the heads dim, expand it to n_rep (a view, no copy), then
    #         reshape the two into one heads dim. torch.repeat_interleave along dim 2 does the same with a copy.
    # HINT 3: A pitfall. Tensor.repeat tiles the whole block of heads (k0 k1 k0 k1: query head j would get kv head
    #         j % ng), and repeating along the last dim makes the heads longer instead of more numerous.
    s, b, ng, hn = x.shape
    return x[:, :, :, None, :].expand(s, b, ng, n_rep, hn).reshape(s, b, ng * n_rep, hn)
    ### END SOLUTION


def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention with GQA: q [s, b, np, hn], k/v [s, b, ng, hn] -> context [s, b, np * hn]."""
    s, b, np_, hn = query.shape
    if np_ % key.shape[2]:
        raise ValueError(f"{np_} query heads do not split into {key.shape[2]} key/value groups")
    n_rep = np_ // key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, repeat_kv(key, n_rep), repeat_kv(value, n_rep)))  # [b, np, s, hn]
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
