"""Tensor parallelism: split each weight matrix across the ranks of a TP group (Megatron's way).

Two ways to split Y = X A (A is [in, out]; nn.Linear stores A^T as weight [out, in]):

    column-parallel  A = [A_1 | A_2]     rank i computes Y_i = X A_i        (needs all of X)
    row-parallel     A = [A_1 ; A_2]     rank i computes X_i A_i, Y = sum_i X_i A_i  (an all-reduce)

An MLP puts them back to back, so the [s, b, ffn] activation never leaves its rank:

    X ─ f ─> X A_i ─ GeLU ─> Z_i B_i ─ g ─> Y          f: identity fwd, all-reduce bwd
              column            row                     g: all-reduce fwd, identity bwd

Sequence parallelism (Korthikanti et al. 2022) also splits the regions between the parallel
linears (norms, dropout, residual) along the sequence: g becomes a reduce-scatter and f an
all-gather, the same bytes on the wire, and those activations take 1/t of the memory.

    [s/t, b, h] ─ all-gather ─> [s, b, h] ─ column ─ ... ─ row ─ reduce-scatter ─> [s/t, b, h]

The vocabulary is split by rows: VocabParallelEmbedding, and vocab_parallel_cross_entropy on
logits [b, s, V/t] that are never gathered. TensorParallelGPTModel is chapter 02's GPT built
from these pieces (tensor_parallel_layer_spec swaps them into its LayerSpec).

Megatron: megatron/core/tensor_parallel/mappings.py (the f/g functions and their names),
layers.py (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding),
cross_entropy.py (vocab_parallel_cross_entropy). Every function takes the TP group explicitly
or uses the current ParallelState's (megalab.core.parallel_state). Not here: Megatron's overlap of
communication with the matmuls, and its per-rank RNG tracker for dropout inside split regions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.packed_seq_params import PackedSeqParams, packed_position_ids
from megalab.core.transformer.attention import CoreAttention
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import Linear


def _group(group):
    return group if group is not None else ps.get_tensor_model_parallel_group()


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """numerator / denominator, or a clear error if it does not divide (Megatron's `divide`)."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
                         "change one of them")
    return numerator // denominator


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """The vocabulary padded up to a multiple of make_vocab_size_divisible_by * TP, so every rank
    holds an equal, aligned slice. Megatron: _vocab_size_with_padding (megatron/training/tokenizer)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


# ------------------------------------------------------------------ the collectives
def _all_gather_single():
    """dist.all_gather_single; before PyTorch 2.13 (and in Megatron) all_gather_into_tensor."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    """dist.reduce_scatter_single; before PyTorch 2.13 (and in Megatron) reduce_scatter_tensor."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) across the TP group, into a new tensor (autograd may share the input)."""
    if dist.get_world_size(group) == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(output, group=group)
    return output


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t slice of the last dimension."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    chunk = divide(input_.shape[-1], world, "last dimension")
    return input_[..., dist.get_rank(group) * chunk:(dist.get_rank(group) + 1) * chunk].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dimension: [..., n] -> [..., t n]."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    # EXERCISE tp.gather_last_dim: all-gather every rank's tensor, concatenate them along the last dimension
    ### BEGIN SOLUTION
    pieces = [torch.empty_like(input_) for _ in range(world)]
    dist.all_gather(pieces, input_.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)
    ### END SOLUTION


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t slice of the first (sequence) dimension."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    chunk = divide(input_.shape[0], world, "sequence length")
    return input_[dist.get_rank(group) * chunk:(dist.get_rank(group) + 1) * chunk].contiguous()


def _gather_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence: [s/t, b, h] -> [s, b, h]."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    # EXERCISE tp.sp_gather: all-gather the sequence shards into one [t * s/t, ...] tensor (_all_gather_single())
    ### BEGIN SOLUTION
    output = torch.empty((world * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    _all_gather_single()(output, input_.contiguous(), group=group)
    return output
    ### END SOLUTION


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum across ranks and keep this rank's sequence slice: [s, b, h] -> [s/t, b, h]."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    # EXERCISE tp.sp_reduce_scatter: sum the ranks' tensors and keep this rank's 1/t of the first dim (_reduce_scatter_single())
    ### BEGIN SOLUTION
    chunk = divide(input_.shape[0], world, "sequence length")
    output = torch.empty((chunk, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    _reduce_scatter_single()(output, input_.contiguous(), group=group)
    return output
    ### END SOLUTION


# ------------------------------------------------------------------ the mappings (autograd Functions)
class _CopyToModelParallelRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces (every rank's branch contributed to dX)."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # EXERCISE tp.copy_to_region: the backward of f sums the gradient over the TP group
        ### BEGIN SOLUTION
        return _reduce(grad_output, ctx.group), None
        ### END SOLUTION


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial products); identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        # EXERCISE tp.reduce_from_region: the forward of g sums the partial results over the TP group
        ### BEGIN SOLUTION
        return _reduce(input_, group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim; backward gathers the slices."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Concatenate the slices of the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence slice; backward all-gathers."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence; backward reduce-scatters (the consumers on every rank each
    produced a partial gradient) or, if tensor_parallel_output_grad is False, just splits."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter forward (g under SP); all-gather backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


def copy_to_tensor_model_parallel_region(input_, group=None):
    return _CopyToModelParallelRegion.apply(input_, _group(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    return _ReduceFromModelParallelRegion.apply(input_, _group(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    return _ScatterToModelParallelRegion.apply(input_, _group(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    return _GatherFromModelParallelRegion.apply(input_, _group(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    return _ScatterToSequenceParallelRegion.apply(input_, _group(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None):
    return _GatherFromSequenceParallelRegion.apply(input_, _group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _group(group))


# ------------------------------------------------------------------ the linear layers
class LinearWithSequenceParallel(torch.autograd.Function):
    """Y = all_gather(X) W^T + b that keeps only the [s/t, b, h] shard of X for backward and
    gathers it again there: the memory saving sequence parallelism promises. Megatron:
    LinearWithGradAccumulationAndAsyncCommunication (layers.py), with sequence_parallel=True."""

    @staticmethod
    def forward(ctx, input_, weight, bias, group):
        ctx.save_for_backward(input_, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        total_input = _gather_along_first_dim(input_, group)  # [s, b, h]
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        total_input = _gather_along_first_dim(input_, ctx.group)  # gathered again, not stored
        grad_input = _reduce_scatter_along_first_dim(grad_output @ weight, ctx.group)  # [s/t, b, h]
        grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t() @ total_input.reshape(-1, total_input.shape[-1])
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def column_parallel_linear(input_, weight, bias, sequence_parallel: bool, group):
    """The column-parallel matmul: all-gather (SP) or f, then the local shard's product."""
    if sequence_parallel:
        return LinearWithSequenceParallel.apply(input_, weight, bias, group)
    return F.linear(copy_to_tensor_model_parallel_region(input_, group), weight, bias)


def _split_master(master: torch.Tensor, dim: int, group, stride: int = 1) -> torch.Tensor:
    """This rank's slice of a full (master) weight along `dim`: with stride k the dimension is
    k concatenated parts and the rank takes its slice of each (Megatron's partition stride)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = master.detach().chunk(stride, dim)
    size = divide(parts[0].shape[dim], world, f"dimension {dim} of the weight (per part)")
    return torch.cat([part.narrow(dim, rank * size, size) for part in parts], dim).clone()


def full_shard_of(full: torch.Tensor, local: torch.Tensor, rank: int, stride: int = 1) -> torch.Tensor:
    """The slice of a single-device tensor that `local` holds on TP rank `rank` (to compare a
    parallel run with one device): along the first dimension where their shapes differ; with
    stride k, the rank's slice of each of the k parts (a fused [gate; up])."""
    for dim, (a, b) in enumerate(zip(full.shape, local.shape)):
        if a != b:
            n = b // stride
            return torch.cat([part.narrow(dim, rank * n, n) for part in full.chunk(stride, dim)], dim)
    return full


class ColumnParallelLinear(nn.Module):
    """Y = X A with A's columns split: this rank holds weight [out/t, in] and bias [out/t].

    gather_output=True all-gathers Y (else each rank keeps its Y_i, the usual case before a
    RowParallelLinear). With config.sequence_parallel the input is [s/t, b, h] and is
    all-gathered first. The full weight is built and initialized as the single-device `Linear`
    would be (same random draws), then split: TP=t computes exactly what TP=1 does
    (Megatron's use_cpu_initialization path, _initialize_affine_weight_cpu).
    Unlike Megatron's, forward returns only the output (the bias is added, not returned).
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], torch.Tensor], bias: bool = True,
                 gather_output: bool = False, stride: int = 1, tp_group=None):
        super().__init__()
        self.tp_group = _group(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, dist.get_world_size(self.tp_group), "output_size")
        self.gather_output, self.sequence_parallel = gather_output, config.sequence_parallel
        if gather_output and self.sequence_parallel:
            raise ValueError("gather_output=True does not combine with sequence_parallel (Megatron neither)")
        master = Linear(input_size, output_size, config=config, init_method=init_method, bias=bias)
        self.weight = nn.Parameter(_split_master(master.weight, 0, self.tp_group, stride))  # [out/t, in]
        self.bias = nn.Parameter(_split_master(master.bias, 0, self.tp_group, stride)) if bias else None
        for param in (self.weight, self.bias):  # Megatron's attribute: the slice is `stride` parts (checkpoints)
            if param is not None:
                param.partition_stride = stride

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (this rank: {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # [s, b, in] (SP: [s/t, b, in]) -> [s, b, out/t] (gather_output: [s, b, out])
        # EXERCISE tp.column_forward: the local product (column_parallel_linear), then all-gather Y if gather_output
        ### BEGIN SOLUTION
        output_parallel = column_parallel_linear(input_, self.weight, self.bias, self.sequence_parallel, self.tp_group)
        if self.gather_output:
            return gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        return output_parallel
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """Y = X A with A's rows split: this rank holds weight [out, in/t]; the bias is whole.

    input_is_parallel=True takes X already split along its last dim (the output of a
    ColumnParallelLinear); else X is split here. The partial products are all-reduced, or
    reduce-scattered along the sequence with config.sequence_parallel; the bias is added after.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], torch.Tensor], bias: bool = True,
                 input_is_parallel: bool = True, stride: int = 1, tp_group=None):
        super().__init__()
        self.tp_group = _group(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, dist.get_world_size(self.tp_group), "input_size")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, config.sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True (Megatron's rule)")
        master = Linear(input_size, output_size, config=config, init_method=init_method, bias=bias)
        self.weight = nn.Parameter(_split_master(master.weight, 1, self.tp_group, stride))  # [out, in/t]
        self.bias = nn.Parameter(master.bias.detach().clone()) if bias else None
        if self.bias is not None:  # under SP each rank sees 1/t of the tokens: all-reduce its grad
            self.bias.sequence_parallel = self.sequence_parallel

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (this rank: {self.input_size_per_partition}), out={self.output_size}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # [s, b, in/t] (or [s, b, in] if not input_is_parallel) -> [s, b, out] (SP: [s/t, b, out])
        # EXERCISE tp.row_forward: split X unless input_is_parallel, local product, all-reduce (SP: reduce-scatter), + bias
        ### BEGIN SOLUTION
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = F.linear(input_, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        return output + self.bias if self.bias is not None else output
        ### END SOLUTION


# ------------------------------------------------------------------ the vocabulary
def vocab_range(vocab_size: int, group) -> tuple[int, int]:
    """[first, last) token ids of this rank's vocabulary slice (Megatron's VocabUtility)."""
    per_partition = divide(vocab_size, dist.get_world_size(group), "vocab_size (pad it: vocab_size_with_padding)")
    first = dist.get_rank(group) * per_partition
    return first, first + per_partition


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary (rows) split: this rank holds rows [first, last).

    Each rank looks up the ids it owns, writes zeros for the others, and an all-reduce sums
    the pieces. init_method draws the full [V, h] weight, which is then split.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 init_method: Callable[[torch.Tensor], torch.Tensor], tp_group=None):
        super().__init__()
        self.tp_group = _group(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, self.tp_group)
        master = torch.empty(num_embeddings, embedding_dim)
        with torch.no_grad():
            init_method(master)
        self.weight = nn.Parameter(_split_master(master, 0, self.tp_group))  # [V/t, h]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, {self.vocab_end_index})"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        # EXERCISE tp.vocab_embedding: look up the ids in [start, end), zeros for the others, sum over the TP group
        ### BEGIN SOLUTION
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        ### END SOLUTION


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
        # EXERCISE tp.vocab_cross_entropy: the three all-reduces above, loss = log S - z_y; save softmax for backward
        ### BEGIN SOLUTION
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
        a = ctx.label_smoothing
        # EXERCISE tp.vocab_cross_entropy_backward: softmax - (1-a) onehot(y) - a/V on this rank's slice, times grad_output; no communication
        ### BEGIN SOLUTION
        grad_input = softmax.clone()
        onehot = torch.zeros_like(grad_input).scatter_(-1, local_target.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)  # the label lives on another rank
        grad_input -= (1.0 - a) * onehot + a / ctx.vocab_size
        grad_input *= grad_output.unsqueeze(-1)
        ### END SOLUTION
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group=None) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary: [..., V/t], [...] -> [...]."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, _group(group))


# ------------------------------------------------------------------ sequence-parallel gradients
def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum, across TP, the gradients of parameters marked `sequence_parallel` (norms, row biases):
    under SP each rank saw only its 1/t of the tokens. Megatron: _allreduce_layernorm_grads
    in finalize_model_grads (megatron/core/distributed/finalize_model_grads.py). Under DDP the
    gradient is in its buffer, `param.main_grad` (reduced here before DDP's own reduction)."""
    grads = [getattr(p, "main_grad", p.grad) for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_group(group))
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(new.view_as(g))


# ------------------------------------------------------------------ a tensor-parallel GPT
def tensor_parallel_layer_spec(tp_group=None, core_attention: Callable = CoreAttention) -> LayerSpec:
    """Chapter 02's layer with the parallel linears: linear_qkv and linear_fc1 column-parallel
    (each rank gets whole query groups and a slice of ffn), linear_proj and linear_fc2 row-parallel.
    Megatron: get_gpt_layer_local_spec (megatron/core/models/gpt/gpt_layer_specs.py)."""
    return LayerSpec(column_linear=partial(ColumnParallelLinear, tp_group=tp_group),
                     row_linear=partial(RowParallelLinear, input_is_parallel=True, tp_group=tp_group),
                     core_attention=core_attention)


class TensorParallelGPTModel(GPTModel):
    """GPTModel over a TP group: vocab-parallel embedding and logits, parallel layers, and (with
    config.sequence_parallel) the hidden states split along the sequence between the embedding
    and the logits. The loss is vocab_parallel_cross_entropy; without labels the logits are
    gathered to [b, s, V]. Built with the same random draws as GPTModel(config), so the same seed
    gives the same model. Under SP call allreduce_sequence_parallel_grads(model) after backward.
    """

    def __init__(self, config: TransformerConfig, tp_group=None, core_attention: Callable = CoreAttention):
        group = _group(tp_group)
        t = dist.get_world_size(group)
        divide(config.num_query_groups, t, "num_query_groups")
        divide(config.vocab_size, t, "vocab_size (pad it with vocab_size_with_padding)")
        super().__init__(config, tensor_parallel_layer_spec(group, core_attention))
        self.tp_group = group
        full = self.embedding.word_embeddings.weight  # drawn exactly as on one device, then split
        self.embedding.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, init_method=lambda w: w.copy_(full), tp_group=group)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        sp, group = self.config.sequence_parallel, self.tp_group
        if packed_seq_params is not None:  # packed documents: every rank holds all tokens, attention needs no change
            position_ids = packed_position_ids(input_ids, position_ids, packed_seq_params)
        hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h], summed over vocab slices
        if sp:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, group)  # [s/t, b, h]
        rotary = self.rotary_pos_emb
        rotary_pos_emb = rotary(input_ids.shape[1], packed_seq_params) if rotary is not None else None
        hidden_states = self.decoder(hidden_states, rotary_pos_emb, packed_seq_params)
        if self.output_layer is None:
            logits = column_parallel_linear(hidden_states, self.shared_embedding_or_output_weight(), None, sp, group)
        else:
            logits = self.output_layer(hidden_states)  # [s, b, V/t]
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V/t]
        if labels is None:
            return gather_from_tensor_model_parallel_region(logits, group)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits.float(), labels, group=group)  # [b, s]
