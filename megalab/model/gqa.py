"""Grouped-query attention: ng key/value heads shared by np query heads (Ainslie et al. 2023).

    query heads   q0 q1 q2 q3 | q4 q5 q6 q7        np = 8
    kv heads          k0      |     k1             ng = 2 (num_query_groups), n_rep = np / ng = 4
    repeat_kv     k0 k0 k0 k0 | k1 k1 k1 k1        query head j attends with kv head j // n_rep

Only the k/v projections and the KV cache shrink (by np/ng); the attention math is MHA on the
repeated heads. LLaMA-2 70B and LLaMA-3 use ng = 8. Megatron: num_query_groups; its
DotProductAttention repeats key/value the same way (repeat_interleave on the head dimension).
"""

from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[s, b, ng, hn] -> [s, b, ng * n_rep, hn]: each key/value head repeated for its n_rep query heads."""
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1 (num_attention_heads // num_query_groups), got {n_rep}")
    # EXERCISE model.gqa_repeat: repeat each kv head n_rep times, adjacent (k0 k0 k1 k1, not k0 k1 k0 k1)
    ### BEGIN SOLUTION
    s, b, ng, hn = x.shape
    return x[:, :, :, None, :].expand(s, b, ng, n_rep, hn).reshape(s, b, ng * n_rep, hn)
    ### END SOLUTION
