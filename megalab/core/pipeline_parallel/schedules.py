"""Pipeline parallelism: split the layers over ranks, stream micro-batches through them.

    rank 0   [ layers 0-1 ] ──activation──> rank 1  [ layers 2-3 ] ──> ... ──> rank p-1 [ ... loss ]
                          <──── grad ─────                        <──  ...  <──

A *schedule* is the order in which one rank runs the forward (F) and backward (B) passes of
the micro-batches. Schedules here are plain functions returning each rank's op list; the
executor `forward_backward_pipelining` runs exactly that list, talking to its neighbours with
batched point-to-point ops (Megatron: p2p_communication.py), and records when every op ran.

    kind="none"         F0 B0 F1 B1 ...                       gradient accumulation (pp = 1)
    kind="gpipe"        F0 F1 ... F(m-1)  B0 B1 ... B(m-1)     all forward, all backward
    kind="1f1b"         warmup F's, then F B F B ..., then the remaining B's   (PipeDream-Flush)
    kind="interleaved"  1F1B over v model chunks per rank; chunk k on rank r is virtual stage k·p + r

With p stages and m micro-batches of equal cost, every rank idles (p − 1) forward+backward
slots: the bubble is (p − 1)/m of the ideal time for GPipe and 1F1B, and (p − 1)/(v·m) with v
interleaved chunks (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM"). 1F1B's win over GPipe is memory: a rank holds at most
p − rank micro-batches' activations instead of m.

Megatron: megatron/core/pipeline_parallel/schedules.py (forward_backward_no_pipelining,
forward_backward_pipelining_without_interleaving, forward_backward_pipelining_with_interleaving,
get_pp_rank_microbatches, get_schedule_table, deallocate_output_tensor, custom_backward) and
p2p_communication.py (send_forward, recv_forward, send_forward_recv_backward, ..., _communicate).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.pipeline_parallel.p2p_communication import _communicate

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved")


class Op(NamedTuple):
    """One step of a rank's schedule: a forward ("F") or backward ("B") of one micro-batch on one model chunk."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class OpRecord(NamedTuple):
    """When an op ran on a rank (seconds on a clock shared by the ranks: time.perf_counter)."""

    rank: int
    op: Op
    start: float
    end: float


def check_interleaved(pp_size: int, num_microbatches: int, num_model_chunks: int) -> None:
    """Megatron's constraints for the interleaved schedule, with an error that says what to change."""
    if pp_size < 2 or num_model_chunks < 2:
        raise ValueError(f"the interleaved schedule needs pp_size >= 2 and num_model_chunks >= 2 "
                         f"(got pp_size={pp_size}, num_model_chunks={num_model_chunks}); use kind='1f1b' otherwise")
    if num_microbatches % pp_size != 0:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of pp_size={pp_size}, so "
                         f"num_microbatches must be a multiple of it (got {num_microbatches}; try "
                         f"{max(pp_size, num_microbatches - num_microbatches % pp_size)})")


def get_num_warmup_microbatches(pp_size: int, pp_rank: int, num_microbatches: int, num_model_chunks: int = 1) -> int:
    """How many forwards a rank runs before its first backward (1F1B and interleaved 1F1B).

    1F1B: the last stage starts backward at once, each earlier stage one forward earlier.
    Interleaved: every rank first runs all chunks but the last for one group of pp micro-batches,
    plus two slots per stage it is ahead of the last one. Both are capped by the total number of
    forwards (Megatron: get_pp_rank_microbatches).
    """
    # EXERCISE pp.num_warmup: Megatron's warmup count, capped at the total number of forwards
    ### BEGIN SOLUTION
    total = num_microbatches * num_model_chunks
    if pp_size == 1:
        return 0
    if num_model_chunks == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size
    return min(warmup, total)
    ### END SOLUTION


def get_schedule_table(num_microbatches: int, num_model_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """The interleaved forward order: (microbatch, chunk) pairs, `group_size` micro-batches per chunk at a time.

    pp=2, m=4, v=2:  (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)   (Megatron: get_schedule_table)
    """
    # EXERCISE pp.schedule_table: groups of group_size micro-batches; inside a group, every chunk in turn
    ### BEGIN SOLUTION
    table = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        table.extend((microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in group)
    return table
    ### END SOLUTION


def _one_f_one_b(forwards: list[Op], backwards: list[Op], num_warmup: int) -> list[Op]:
    """Warmup forwards, then (forward, backward) pairs, then the remaining backwards."""
    # EXERCISE pp.one_f_one_b: warmup forwards; steady state one forward then one backward; cooldown backwards
    ### BEGIN SOLUTION
    ops = forwards[:num_warmup]
    for i in range(len(forwards) - num_warmup):
        ops += [forwards[num_warmup + i], backwards[i]]
    return ops + backwards[len(forwards) - num_warmup:]
    ### END SOLUTION


def get_schedule(pp_size: int, pp_rank: int, num_microbatches: int, num_model_chunks: int = 1,
                 kind: str = "1f1b") -> list[Op]:
    """The ops rank `pp_rank` of `pp_size` runs, in order, for one training step (Megatron's semantics)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {SCHEDULES}")
    if not 0 <= pp_rank < pp_size or num_microbatches < 1 or num_model_chunks < 1:
        raise ValueError(f"need 0 <= pp_rank < pp_size and at least one micro-batch and chunk (got pp_size={pp_size}, "
                         f"pp_rank={pp_rank}, num_microbatches={num_microbatches}, num_model_chunks={num_model_chunks})")
    if kind != "interleaved" and num_model_chunks != 1:
        raise ValueError(f"kind={kind!r} runs one model chunk per rank; use kind='interleaved' for num_model_chunks > 1")
    if kind == "none" and pp_size != 1:
        raise ValueError("kind='none' (no pipelining, gradient accumulation) needs pp_size == 1")
    m = num_microbatches
    if kind == "interleaved":
        check_interleaved(pp_size, m, num_model_chunks)
        table = get_schedule_table(m, num_model_chunks, pp_size)
        forwards = [Op("F", mb, chunk) for mb, chunk in table]
        backwards = [Op("B", mb, num_model_chunks - 1 - chunk) for mb, chunk in table]  # last chunk first
    else:
        forwards = [Op("F", mb) for mb in range(m)]
        backwards = [Op("B", mb) for mb in range(m)]
    if kind == "gpipe":
        return forwards + backwards
    if kind == "none":
        return _one_f_one_b(forwards, backwards, 0)
    return _one_f_one_b(forwards, backwards, get_num_warmup_microbatches(pp_size, pp_rank, m, num_model_chunks))


def virtual_stage(pp_size: int, pp_rank: int, chunk: int) -> int:
    """Chunk k on rank r holds virtual stage k·pp + r (Megatron's layout for interleaving)."""
    return chunk * pp_size + pp_rank


def deallocate_output_tensor(output: torch.Tensor) -> None:
    """Free an output's memory once it is sent; its grad_fn stays, so backward still works.

    Only the next stage needs the values; this stage's backward needs the graph and the
    gradient (Megatron: deallocate_output_tensor; `custom_backward` then skips the shape check).
    """
    if output._base is not None:
        raise ValueError("deallocate_output_tensor: the output is a view; return a fresh tensor from the stage")
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Backward from `output` with `grad_output`, even if output's data was freed (Megatron: custom_backward)."""
    from torch.autograd.variable import Variable  # the engine torch.autograd.backward calls, minus its checks

    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


# --------------------------------------------------------------------------------------- the executor
@dataclass
class PipelineResult:
    losses: list[float]  # per micro-batch, on the rank holding the last stage (empty elsewhere)
    timeline: list[OpRecord] = field(default_factory=list)
    peak_in_flight: int = 0  # most micro-batch activations this rank held at once (all chunks)


def forward_backward_pipelining(
    chunks: Sequence[nn.Module], inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
    loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tensor_shape: Sequence[int], *,
    kind: str = "1f1b", group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
    deallocate: bool = True,
) -> PipelineResult:
    """One training step's forward and backward over len(inputs) micro-batches on this rank's `chunks`.

    Runs `get_schedule(...)` op by op. After each op one batched exchange sends what the op
    produced (an activation forward, an input gradient backward) and receives what the next op
    needs. Only the receives are waited for; a sent output is freed once its send completed
    (`deallocate`). Waiting for the sends as well can deadlock: with pp=2 interleaved, rank 0
    would wait for rank 1 to receive a gradient while rank 1 waits for rank 0 to receive one.
    (Megatron avoids that by sending and receiving forward and backward tensors in one batch
    in the steady state.) The first virtual stage reads `inputs[mb]`, the last computes
    loss_func(output, targets[mb]) / m, so gradients are those of the mean loss (as Megatron's
    forward_step divides by num_microbatches). Gradients accumulate in the chunks' parameters.
    """
    group = ps.resolve_group(group, "pp", alone=False)  # the current state's pipeline group unless given
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    v, m = len(chunks), len(inputs)
    num_stages = pp_size * v
    ops = get_schedule(pp_size, pp_rank, m, v, kind)
    kw = dict(group=group, dtype=dtype)
    is_first = lambda op: virtual_stage(pp_size, pp_rank, op.chunk) == 0
    is_last = lambda op: virtual_stage(pp_size, pp_rank, op.chunk) == num_stages - 1

    def needs_recv(op: Op) -> tuple[bool, bool]:  # (recv_prev, recv_next)
        return (op.kind == "F" and not is_first(op), op.kind == "B" and not is_last(op))

    input_tensors, output_tensors = {}, {}  # (microbatch, chunk) -> tensor, alive from F to B
    result = PipelineResult(losses=[])
    pending: list[tuple[dist.Work, torch.Tensor | None]] = []  # sends in flight, with the output to free after
    *received, _ = _communicate(None, None, *needs_recv(ops[0]), tensor_shape, **kw)
    for i, op in enumerate(ops):
        key = (op.microbatch, op.chunk)
        send_next = send_prev = None
        start = time.perf_counter()
        if op.kind == "F":
            input_tensor = inputs[op.microbatch] if is_first(op) else received[0]
            output = chunks[op.chunk](input_tensor)
            if is_last(op):
                loss = loss_func(output, targets[op.microbatch])
                result.losses.append(loss.item())
                output = loss / m
            else:
                send_next = output
            input_tensors[key], output_tensors[key] = input_tensor, output
            result.peak_in_flight = max(result.peak_in_flight, len(output_tensors))
        else:
            input_tensor, output = input_tensors.pop(key), output_tensors.pop(key)
            if is_last(op):
                output.backward()
            else:
                custom_backward(output, received[1])
            if not is_first(op):
                send_prev = input_tensor.grad
        result.timeline.append(OpRecord(dist.get_rank(), op, start, time.perf_counter()))
        next_recv = needs_recv(ops[i + 1]) if i + 1 < len(ops) else (False, False)
        *received, sends = _communicate(send_next, send_prev, *next_recv, tensor_shape, **kw)
        pending += [(request, send_next if deallocate else None) for request in sends]
        pending = _retire(pending, wait=i + 1 == len(ops))
    return result


def _retire(pending: list, wait: bool) -> list:
    """Free the outputs whose sends completed (all of them, waiting, if `wait`); return the rest."""
    still = []
    for request, output in pending:
        if wait:
            request.wait()
        if request.is_completed():
            if output is not None:
                deallocate_output_tensor(output)
        else:
            still.append((request, output))
    return still


