"""Small helpers of tensor parallelism: exact division with a clear error, vocabulary padding and ranges.

Megatron: megatron/core/tensor_parallel/utils.py (divide, VocabUtility).
"""

from __future__ import annotations

import torch.distributed as dist


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """numerator / denominator, or a clear error if it does not divide (Megatron's `divide`)."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
                         "change one of them")
    return numerator // denominator


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """The vocabulary padded up to a multiple of make_vocab_size_divisible_by * TP, so every rank
    holds an equal, aligned slice. Megatron: vocab_size_with_padding
    (megatron/core/tokenizers/utils/build_tokenizer.py)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


# ------------------------------------------------------------------ the vocabulary
def vocab_range(vocab_size: int, group) -> tuple[int, int]:
    """[first, last) token ids of this rank's vocabulary slice (Megatron's VocabUtility)."""
    per_partition = divide(vocab_size, dist.get_world_size(group), "vocab_size (pad it: vocab_size_with_padding)")
    first = dist.get_rank(group) * per_partition
    return first, first + per_partition
