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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _group,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalab.core.tensor_parallel.utils import divide, vocab_range
from megalab.core.transformer.transformer_config import TransformerConfig


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
            raise ValueError("gather_output=True does not combine with sequence_parallel here "
                             "(megalab's restriction; Megatron all-gathers the sequence, then the outputs)")
        master = Linear(input_size, output_size, config=config, init_method=init_method, bias=bias)
        self.weight = nn.Parameter(_split_master(master.weight, 0, self.tp_group, stride))  # [out/t, in]
        self.bias = nn.Parameter(_split_master(master.bias, 0, self.tp_group, stride)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                set_tensor_model_parallel_attributes(param, True, 0, stride)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (this rank: {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # [s, b, in] (SP: [s/t, b, in]) -> [s, b, out/t] (gather_output: [s, b, out])
        # EXERCISE tp.column_forward: the local product (column_parallel_linear), then all-gather Y if gather_output
        ### BEGIN SOLUTION
        # HINT 1: This rank's weight holds out/t output rows, so X times it gives the matching out/t slice of Y; every
        #         rank needs all of X (f in forward, or the all-gather under sequence parallelism).
        # HINT 2: column_parallel_linear (it picks f or the SP all-gather) gives the local slice; if gather_output,
        #         gather_from_tensor_model_parallel_region concatenates the slices along the last dim.
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
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
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
        # HINT 1: Each rank holds in/t input columns, so each computes a partial product of the full output; their SUM
        #         is Y. The bias is whole on every rank and must be added once.
        # HINT 2: Split X with scatter_to_tensor_model_parallel_region unless input_is_parallel; F.linear without
        #         bias; reduce_from_tensor_model_parallel_region (or reduce_scatter_to_sequence_parallel_region under
        #         sequence parallelism); then add the bias.
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = F.linear(input_, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        return output + self.bias if self.bias is not None else output
        ### END SOLUTION


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
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, {self.vocab_end_index})"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        # EXERCISE tp.vocab_embedding: look up the ids in [start, end), zeros for the others, sum over the TP group
        ### BEGIN SOLUTION
        # HINT 1: This rank holds rows [vocab_start_index, vocab_end_index) of the table: it can look up only those
        #         ids, and must contribute exact zeros for all others so a sum over the TP group gives the full
        #         lookup.
        # HINT 2: Mark the ids outside the range, shift the ids into local row numbers (any valid row, e.g. 0, for the
        #         outside ones), F.embedding, zero the outside rows, then reduce_from_tensor_model_parallel_region.
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        ### END SOLUTION


# ------------------------------------------------------------------ which tensors are split by TP
def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Megatron's marks, set where a parameter is created: `tensor_model_parallel` (a TP slice, not a
    copy), `partition_dim` (the dimension split) and `partition_stride` (how many parts it interleaves).
    The grad norm, checkpoints and TP gathers read them."""
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride


def tensor_parallel_dims(model: nn.Module) -> dict[str, int]:
    """name -> the dimension along which TP splits that parameter (absent: replicated on every TP rank)."""
    return {name: p.partition_dim for name, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def param_is_not_tensor_parallel_duplicate(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank owns the tensor for the norm: a TP slice, or a replicated one on TP rank 0."""
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


class Linear(nn.Linear):
    """y = x W^T + b on one device, initialized the Megatron way (weights by init_method, bias 0).

    `stride` says the output is made of that many concatenated parts (2 for a gated linear_fc1:
    [gate; up]); one device ignores it, ColumnParallelLinear splits each part across ranks.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], torch.Tensor], bias: bool = True, stride: int = 1):
        super().__init__(input_size, output_size, bias=bias)
        with torch.no_grad():
            init_method(self.weight)
            if bias:
                self.bias.zero_()
