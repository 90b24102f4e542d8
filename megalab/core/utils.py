"""Small helpers used across megalab.core, at Megatron's megatron/core/utils.py.

    init_method_normal, scaled_init_method_normal   how every weight is drawn (N(0, std^2); the output
                                                    projections scaled by 1/sqrt(2 L))
    get_batch_on_this_cp_rank, cp_rank_positions    a context-parallel rank's chunks of each sequence
                                                    (zigzag: rank r holds chunks r and 2cp-1-r)

The single-device `Linear` that plays both linear roles of the local layer spec is in
megalab/core/tensor_parallel/layers.py, beside the ColumnParallelLinear and RowParallelLinear
that replace it under tensor parallelism (the spec, megalab/core/transformer/spec_utils.py, says which).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, std^2): Megatron's init_method for embeddings, linear_qkv and linear_fc1."""
    return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (std / sqrt(2 L))^2) for the layers that write into the residual stream
    (linear_proj, linear_fc2): 2 L of them add up, so each one starts smaller (GPT-2's rule)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


# ------------------------------------------------------------------ the split
def check_seq_length(seq_length: int, cp_size: int) -> int:
    """The chunk length seq_length / (2 cp), or a clear error: both splits cut 2 cp equal chunks."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 * context_parallel_size = "
                         f"{2 * cp_size}: context parallelism cuts the sequence into 2*cp equal chunks; "
                         "pad or trim the sequence, or change context_parallel_size")
    return seq_length // (2 * cp_size)


def rank_chunks(cp_size: int, cp_rank: int, zigzag: bool = True) -> tuple[int, int]:
    """The two chunk ids (of 2 cp) rank cp_rank holds: (r, 2cp-1-r) zigzag, (2r, 2r+1) plain."""
    # EXERCISE cp.zigzag_split: the load-balanced pair of chunks, or the plain contiguous pair
    ### BEGIN SOLUTION
    # HINT 1: With 2*cp chunks under a causal mask, early chunks are cheap and late chunks are expensive;
    #         pairing a cheap chunk with an expensive one gives every rank the same work.
    # HINT 2: Zigzag: rank r holds chunk r and its mirror image counted from the end, 2*cp - 1 - r.
    #         Plain: two neighbouring chunks, 2r and 2r + 1.
    if zigzag:
        return cp_rank, 2 * cp_size - 1 - cp_rank
    return 2 * cp_rank, 2 * cp_rank + 1
    ### END SOLUTION


def cp_rank_positions(seq_length: int, cp_size: int, cp_rank: int, zigzag: bool = True) -> torch.Tensor:
    """Positions (token indices) of this rank's tokens in the full sequence, [seq_length / cp]."""
    c = check_seq_length(seq_length, cp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in rank_chunks(cp_size, cp_rank, zigzag)])


def get_batch_on_this_cp_rank(batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int,
                              zigzag: bool = True) -> dict[str, torch.Tensor]:
    """This rank's tokens of every [b, s] tensor in the batch (Megatron's name and split); an
    "attention_mask" [b, 1, s, s] is split on its query dim 2, as Megatron does; position_ids are added
    (the global positions of the kept tokens) if the batch has none."""
    s = next(t for name, t in batch.items() if name != "attention_mask").shape[1]
    positions = cp_rank_positions(s, cp_size, cp_rank, zigzag)
    out = {name: t[:, :, positions.to(t.device)] if name == "attention_mask" else t[:, positions.to(t.device)]
           for name, t in batch.items()}
    if "position_ids" not in out:
        b, device = next(iter(batch.values())).shape[0], next(iter(batch.values())).device
        out["position_ids"] = positions.to(device).expand(b, -1)
    return out
