"""Pipeline schedules simulated and timed: bubbles, in-flight micro-batches, fixed-duration stages, and
uneven stages from a pipeline layout (per-rank work, idle share, activation and parameter memory).

Not in Megatron-LM (it runs the schedules, core/pipeline_parallel/schedules.py); the course uses these to
draw a schedule, predict its bubble ((p-1)/m, or (p-1)/(v·m) interleaved) and measure it on real ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from megalab.core import parallel_state as ps
from megalab.core.pipeline_parallel.schedules import (
    Op,
    OpRecord,
    PipelineResult,
    forward_backward_pipelining,
    get_schedule,
    virtual_stage,
)
from megalab.core.transformer.pipeline_parallel_layer_layout import CHAR_TO_LAYER_TYPE, LayerType
from megalab.lab.dist import device

_CHAR = {t: c for c, t in CHAR_TO_LAYER_TYPE.items()}


# --------------------------------------------------------------------------------------- schedules (pure)
def bubble_fraction(pp_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """Idle time over ideal compute time, (p − 1)/(v·m) (Narayanan et al. 2021, eq. for t_pb/t_id)."""
    return (pp_size - 1) / (num_model_chunks * num_microbatches)


def bubble_fraction_of_total(pp_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """The same bubble as a share of the whole step: (p − 1)/(v·m + p − 1); (p − 1)/(m + p − 1) for v = 1."""
    return (pp_size - 1) / (num_model_chunks * num_microbatches + pp_size - 1)


def peak_in_flight(ops: Sequence[Op]) -> int:
    """The most (micro-batch, chunk) forwards whose backward has not run yet, along a schedule."""
    alive = peak = 0
    for op in ops:
        alive += 1 if op.kind == "F" else -1
        peak = max(peak, alive)
    return peak


def simulate(pp_size: int, num_microbatches: int, num_model_chunks: int = 1, kind: str = "1f1b",
             forward_time: float = 1.0, backward_time: float = 2.0,
             stage_cost: Sequence[float] | None = None) -> list[OpRecord]:
    """Run every rank's schedule on an ideal machine (fixed op times, free communication).

    An op starts when its rank finished the previous op and its input exists: F needs the
    previous virtual stage's F of the same micro-batch, B the next stage's B (and its own F).
    stage_cost[k] scales virtual stage k's op times (uneven stages: `layout_stage_cost`); 1 each by default.
    Raises RuntimeError if the schedules deadlock (a rank waits for an op that waits for it).
    """
    v = num_model_chunks
    num_stages = pp_size * v
    if stage_cost is not None and len(stage_cost) != num_stages:
        raise ValueError(f"stage_cost has {len(stage_cost)} entries; give one per virtual stage, pp*v = {num_stages}")
    cost = list(stage_cost) if stage_cost is not None else [1.0] * num_stages
    schedules = [get_schedule(pp_size, r, num_microbatches, v, kind) for r in range(pp_size)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time
    position, clock = [0] * pp_size, [0.0] * pp_size
    records: list[OpRecord] = []
    while len(records) < sum(map(len, schedules)):
        progressed = False
        for rank in range(pp_size):
            while position[rank] < len(schedules[rank]):
                op = schedules[rank][position[rank]]
                stage = virtual_stage(pp_size, rank, op.chunk)
                if op.kind == "F":
                    deps = [("F", op.microbatch, stage - 1)] if stage > 0 else []
                else:
                    deps = [("F", op.microbatch, stage)]
                    deps += [("B", op.microbatch, stage + 1)] if stage < num_stages - 1 else []
                if any(d not in done for d in deps):
                    break
                start = max([clock[rank]] + [done[d] for d in deps])
                end = start + (forward_time if op.kind == "F" else backward_time) * cost[stage]
                done[(op.kind, op.microbatch, stage)] = clock[rank] = end
                records.append(OpRecord(rank, op, start, end))
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: schedules[r][position[r]] for r in range(pp_size) if position[r] < len(schedules[r])}
            raise RuntimeError(f"schedule {kind!r} deadlocks; ranks wait at {stuck}")
    return records


def measured_bubble(records: Sequence[OpRecord]) -> float:
    """Share of the step (first start to last end, all ranks) that ranks spend not computing."""
    ranks = {r.rank for r in records}
    span = max(r.end for r in records) - min(r.start for r in records)
    busy = sum(r.end - r.start for r in records)
    return 1.0 - busy / (span * len(ranks))


# --------------------------------------------------------------------------------------- uneven stages (layouts)
def layout_stage_cost(layout, embedding: float = 0.0, loss: float = 1.0, mtp: float = 1.0) -> list[float]:
    """Each virtual stage's work in transformer layers: its 't' count, plus `embedding`, `loss` and `mtp` layers'
    worth for 'E', 'L' and 'm' (layout: a PipelineParallelLayerLayout). The defaults count the loss (the output
    layer's logits GEMM, 2·h·V FLOPs per token against a layer's ~24·h²) as one layer, the embedding lookup as free."""
    weight = {LayerType.decoder: 1.0, LayerType.embedding: embedding, LayerType.loss: loss, LayerType.mtp: mtp}
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    return [sum(weight[t] for t in layout.layout[k % pp][k // pp]) for k in range(pp * vpp)]


def rank_idle_fraction(records: Sequence[OpRecord]) -> list[float]:
    """Each rank's share of the step (first start to last end, all ranks) spent not computing: its own bubble."""
    ranks = sorted({r.rank for r in records})
    span = max(r.end for r in records) - min(r.start for r in records)
    return [1.0 - sum(r.end - r.start for r in records if r.rank == rank) / span for rank in ranks]


def peak_activation_memory(ops: Sequence[Op], chunk_memory: Sequence[float]) -> float:
    """The most activation memory a rank holds along its schedule: a chunk's forward keeps chunk_memory[chunk]
    (e.g. its layer count: one micro-batch's activations per layer) until that micro-batch's backward."""
    alive = peak = 0.0
    for op in ops:
        alive += chunk_memory[op.chunk] if op.kind == "F" else -chunk_memory[op.chunk]
        peak = max(peak, alive)
    return peak


def layout_report(layout, num_microbatches: int, embedding: float = 0.0, loss: float = 1.0,
                  embedding_params: float = 0.0) -> list[dict]:
    """Per pp rank, for `layout` under its schedule (1F1B, or interleaved when v > 1) on the ideal machine: the
    stages it holds, its transformer layers, its work per micro-batch (`layout_stage_cost`), its idle share of
    the step, its peak activations (layer-micro-batches: a stage's 't' plus `loss` for 'L') and its parameters
    (layers, plus `embedding_params` layers' worth for the embedding and again for an untied output layer);
    `step` is the simulated step time (a forward of one layer takes 1, a backward 2)."""
    pp, v = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    kind = "interleaved" if v > 1 else "1f1b"
    cost = layout_stage_cost(layout, embedding, loss)
    records = simulate(pp, num_microbatches, v, kind, stage_cost=cost)
    idle = rank_idle_fraction(records)
    rows = []
    for rank in range(pp):
        chunks = layout.layout[rank]
        activations = [s.count(LayerType.decoder) + loss * s.count(LayerType.loss) for s in chunks]
        params = sum(s.count(LayerType.decoder) + embedding_params * (s.count(LayerType.embedding)
                                                                        + s.count(LayerType.loss)) for s in chunks)
        rows.append(dict(rank=rank, stages=" | ".join("".join(_CHAR[t] for t in s) or "-" for s in chunks),
                         layers=sum(s.count(LayerType.decoder) for s in chunks),
                         work=sum(cost[vp * pp + rank] for vp in range(v)), idle=idle[rank],
                         activations=peak_activation_memory(get_schedule(pp, rank, num_microbatches, v, kind),
                                                            activations),
                         params=params, step=max(r.end for r in records)))
    return rows



class FixedDurationStage(nn.Module):
    """A stand-in stage whose forward takes `forward_ms` and backward `backward_ms` (sleeping).

    Sleeping needs no CPU, so timelines stay clean on a busy machine: what remains is the
    schedule. Output = input * weight, so activations and gradients flow as with a real layer.
    """

    def __init__(self, forward_ms: float = 10.0, backward_ms: float = 20.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        ctx.save_for_backward(x, weight)
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        time.sleep(ctx.backward_s)
        return grad * weight, (grad * x).sum(), None, None


def run_fixed_duration_pipeline(num_microbatches: int, kind: str = "1f1b", num_model_chunks: int = 1,
                                forward_ms: float = 10.0, backward_ms: float = 20.0,
                                group: dist.ProcessGroup | None = None) -> PipelineResult:
    """One step of `kind` over FixedDurationStage chunks: each rank's work is forward_ms + backward_ms per
    micro-batch, split over its `num_model_chunks` chunks, so schedules compare at equal work. Collective
    over `group` (the pipeline ranks start together after a barrier): the current state's pipeline group,
    or every rank when no state is current (a pure pipeline)."""
    if group is None:
        group = ps.get_pipeline_model_parallel_group() if ps.model_parallel_is_initialized() else dist.group.WORLD
    v, dev = num_model_chunks, device()
    chunks = [FixedDurationStage(forward_ms / v, backward_ms / v).to(dev) for _ in range(v)]
    shape = (4, 8)
    inputs = [torch.ones(shape, device=dev) for _ in range(num_microbatches)]
    dist.barrier(group=group)
    return forward_backward_pipelining(chunks, inputs, inputs, lambda out, target: (out * target).sum(), shape,
                                       kind=kind, group=group)
