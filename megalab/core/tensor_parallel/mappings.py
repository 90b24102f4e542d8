"""The communication of tensor and sequence parallelism as autograd functions.

    f  copy_to_tensor_model_parallel_region     forward identity      backward all-reduce
    g  reduce_from_tensor_model_parallel_region forward all-reduce    backward identity
       scatter/gather along the last dim (TP), along the first dim (SP: [s/t, b, h]), all_to_all (EP)

Megatron: megatron/core/tensor_parallel/mappings.py. `group=`: an explicit group or the current
ParallelState's tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalab.core import parallel_state as ps
from megalab.core.tensor_parallel.utils import divide


def _group(group):
    """`group`, or the current ParallelState's tensor-parallel group (parallel_state.resolve_group)."""
    return ps.resolve_group(group, "tp", alone=False)


# ------------------------------------------------------------------ the collectives
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
    # HINT 1: Every rank holds [..., n]; the result on every rank is the t pieces side by side along the LAST
    #         dimension, in rank order: [..., t n].
    # HINT 2: One receive buffer per rank (distinct tensors, shaped like the input), dist.all_gather into them over
    #         `group` (input made contiguous), then torch.cat along dim -1.
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
    # EXERCISE tp.sp_gather: all-gather the sequence shards into one [t * s/t, ...] tensor (dist.all_gather_single)
    ### BEGIN SOLUTION
    # HINT 1: Under sequence parallelism each rank holds [s/t, b, h], a slice of the SEQUENCE (dim 0); the result is
    #         the full [s, b, h], the slices in rank order.
    # HINT 2: Allocate an output whose first dimension is t times the input's, then dist.all_gather_single into it
    #         (contiguous input) over `group`.
    output = torch.empty((world * input_.shape[0], *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    dist.all_gather_single(output, input_.contiguous(), group=group)
    return output
    ### END SOLUTION


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum across ranks and keep this rank's sequence slice: [s, b, h] -> [s/t, b, h]."""
    world = dist.get_world_size(group)
    if world == 1:
        return input_
    # EXERCISE tp.sp_reduce_scatter: sum the ranks' tensors and keep this rank's 1/t of the first dim (dist.reduce_scatter_single)
    ### BEGIN SOLUTION
    # HINT 1: Each rank holds a partial [s, b, h] (a row-parallel product); this rank keeps the SUM over the group of
    #         its own sequence slice [s/t, b, h] (dim 0, not hidden).
    # HINT 2: Chunk = s / t (divide), allocate [chunk, b, h], and dist.reduce_scatter_single the contiguous input into
    #         it over `group`.
    chunk = divide(input_.shape[0], world, "sequence length")
    output = torch.empty((chunk, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_single(output, input_.contiguous(), group=group)
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
        # HINT 1: f copies X to every rank's branch; each branch's backward yields only part of dX, and the true
        #         gradient is their SUM over the tensor-parallel group.
        # HINT 2: Return the all-reduced gradient (the module's _reduce helper, on ctx.group) and None for the group
        #         argument.
        return _reduce(grad_output, ctx.group), None
        ### END SOLUTION


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial products); identity backward."""

    @staticmethod
    def forward(ctx, input_, group):
        # EXERCISE tp.reduce_from_region: the forward of g sums the partial results over the TP group
        ### BEGIN SOLUTION
        # HINT 1: g sits after a row-parallel matmul: each rank holds a partial sum of the output, the full output is
        #         their SUM over the tensor-parallel group (not the mean).
        # HINT 2: All-reduce on the given group: the module's _reduce helper (it clones first, because autograd may
        #         still need the input).
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


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        dist.all_to_all_single(output, input_.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        output_split_sizes, input_split_sizes = ctx.splits
        return None, _AllToAll.apply(ctx.group, grad_output, input_split_sizes, output_split_sizes), None, None


def all_to_all(group, input_, output_split_sizes: list[int], input_split_sizes: list[int]) -> torch.Tensor:
    """Megatron's tensor_parallel.all_to_all: rank r sends input_split_sizes[j] rows to rank j and
    receives output_split_sizes[j] rows from rank j, differentiably."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)
