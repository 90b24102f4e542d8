"""Cross-entropy over vocab-parallel logits [b, s, V/t] without gathering them: max, sum of exp and
the target logit are reduced over the TP group.

Megatron: megatron/core/tensor_parallel/cross_entropy.py (vocab_parallel_cross_entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalab.core.tensor_parallel.mappings import _group
from megalab.core.tensor_parallel.utils import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split along the vocabulary, without gathering them.

        m   = max_v z_v                    all-reduce MAX   (numerical safety)
        z_y = the label's logit - m        all-reduce SUM   (only its owner has it)
        S   = sum_v exp(z_v - m)           all-reduce SUM
        loss = log S - z_y                 per token
    Backward needs no communication: dloss/dz = softmax(z) - onehot(y), all local.
    With label smoothing a (PyTorch's definition), loss = (1-a)(log S - z_y) + a(log S - mean_v z_v):
    the sum of z travels in the same all-reduce as S.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group):
        # vocab_parallel_logits [..., V/t] float, target [...] -> loss [...]
        # EXERCISE tp.vocab_cross_entropy: the three all-reduces above, loss = log S - z_y; save softmax, outside, local_target, ctx.label_smoothing and ctx.vocab_size (V) for backward
        ### BEGIN SOLUTION
        # HINT 1: log-sum-exp and the target logit need the whole vocabulary, but each rank has V/t logits; three
        #         small all-reduces (a max, then sums) give every rank what it needs without gathering [.., V] logits.
        # HINT 2: All-reduce MAX of the row max and subtract it; the target logit is known only to the rank whose
        #         vocab_range holds it: shift the target into the local range, zero it on the other ranks, all-reduce
        #         SUM; all-reduce SUM of exp (and of the logits, for label smoothing); loss = log S - z_y.
        # HINT 3: Save softmax = exp / S, the masks and the local target for backward (ctx.save_for_backward), and set
        #         ctx.label_smoothing and ctx.vocab_size (the whole V): the backward reads them.
        logits = vocab_parallel_logits.float()
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        first, last = vocab_range(logits.shape[-1] * dist.get_world_size(group), group)
        outside = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(outside, 0)
        predicted_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted_logits, group=group)

        exp_logits = logits.exp()
        sums = torch.stack([exp_logits.sum(dim=-1), logits.sum(dim=-1)])  # S and sum_v z_v, one all-reduce
        dist.all_reduce(sums, group=group)
        sum_exp_logits, sum_logits = sums
        loss = sum_exp_logits.log() - predicted_logits
        vocab_size = logits.shape[-1] * dist.get_world_size(group)
        if label_smoothing > 0:
            loss = (1 - label_smoothing) * loss + label_smoothing * (sum_exp_logits.log() - sum_logits / vocab_size)

        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        a, V = ctx.label_smoothing, ctx.vocab_size  # V: the whole vocabulary, t * V/t
        # EXERCISE tp.vocab_cross_entropy_backward: softmax - (1-a) onehot(y) - a/V on this rank's slice, times grad_output; no communication
        ### BEGIN SOLUTION
        # HINT 1: d loss / d logits = softmax - onehot(target) (with smoothing: minus a/V everywhere and (1 - a) on
        #         the target), and every piece of it is local to this rank's slice of the vocabulary.
        # HINT 2: Start from a copy of the saved softmax, build the one-hot of local_target on this slice, zero it
        #         where the target lives on another rank (outside), subtract, and scale each row by grad_output. No
        #         collective.
        grad_input = softmax.clone()
        onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)  # the label lives on another rank
        grad_input -= (1.0 - a) * onehot + a / V
        grad_input *= grad_output.unsqueeze(-1)
        ### END SOLUTION
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group=None) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary: [..., V/t], [...] -> [...]."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, _group(group))
