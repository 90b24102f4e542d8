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
import torch.nn.functional as F
from torch import nn

from megalab.core.tensor_parallel.layers import column_parallel_linear, scatter_to_sequence_parallel_region

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


# --------------------------------------------------------------------------------------- schedules (pure)
def bubble_fraction(pp_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """Idle time over ideal compute time, (p − 1)/(v·m) (Narayanan et al. 2021, eq. for t_pb/t_id)."""
    return (pp_size - 1) / (num_model_chunks * num_microbatches)


def bubble_fraction_of_total(pp_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """The same bubble as a share of the whole step: (p − 1)/(v·m + p − 1); (p − 1)/(m + p − 1) for v = 1."""
    return (pp_size - 1) / (num_model_chunks * num_microbatches + pp_size - 1)


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


def peak_in_flight(ops: Sequence[Op]) -> int:
    """The most (micro-batch, chunk) forwards whose backward has not run yet, along a schedule."""
    alive = peak = 0
    for op in ops:
        alive += 1 if op.kind == "F" else -1
        peak = max(peak, alive)
    return peak


def simulate(pp_size: int, num_microbatches: int, num_model_chunks: int = 1, kind: str = "1f1b",
             forward_time: float = 1.0, backward_time: float = 2.0) -> list[OpRecord]:
    """Run every rank's schedule on an ideal machine (fixed op times, free communication).

    An op starts when its rank finished the previous op and its input exists: F needs the
    previous virtual stage's F of the same micro-batch, B the next stage's B (and its own F).
    Raises RuntimeError if the schedules deadlock (a rank waits for an op that waits for it).
    """
    v = num_model_chunks
    num_stages = pp_size * v
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
                end = start + (forward_time if op.kind == "F" else backward_time)
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


# --------------------------------------------------------------------------------------- stages
def get_layer_range(num_layers: int, pp_size: int, pp_rank: int, chunk: int = 0,
                    num_model_chunks: int = 1) -> tuple[int, int]:
    """[start, stop) of the layers in virtual stage chunk·pp + rank, num_layers/(pp·v) layers each."""
    num_stages = pp_size * num_model_chunks
    if num_layers % num_stages != 0:
        raise ValueError(f"{num_layers} layers do not split evenly into pp_size*num_model_chunks={num_stages} stages; "
                         f"use a multiple of {num_stages} layers")
    # EXERCISE pp.stage_split: the contiguous block of layers of virtual stage chunk*pp_size + pp_rank
    ### BEGIN SOLUTION
    per_stage = num_layers // num_stages
    start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
    return start, start + per_stage
    ### END SOLUTION


class GPTStage(nn.Module):
    """One virtual stage of a GPTModel: [embedding] + decoder layers [start, stop) + [final norm, output layer].

    The first stage takes input_ids [b, s] and the others hidden states [s, b, h]; the last
    returns logits [b, s, V], the others hidden states [s, b, h]. The modules are the model's
    own (shared, not copied), so gradients land in the model's parameters. With tied
    embeddings the first and last stage both use the word embeddings: sum their gradients
    over the embedding group (`allreduce_word_embedding_grads`).
    (Megatron builds the same thing with GPTModel(pre_process=..., post_process=...).)
    """

    def __init__(self, model: nn.Module, start: int, stop: int, pre_process: bool, post_process: bool):
        super().__init__()
        self.model = [model]  # a list, so the whole model is not registered as a submodule
        self.pre_process, self.post_process, self.start = pre_process, post_process, start
        self.embedding = model.embedding if pre_process else None
        self.layers = model.decoder.layers[start:stop]
        self.final_layernorm = model.decoder.final_layernorm if post_process else None
        self.output_layer = model.output_layer if post_process else None
        self.word_embeddings = (model.embedding.word_embeddings
                                if post_process and model.output_layer is None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model[0]
        tp_group = getattr(model, "tp_group", None)  # a TensorParallelGPTModel's stages
        sp = model.config.sequence_parallel and tp_group is not None
        if self.pre_process:  # [b, s] -> [s, b, h]; a CP model's tokens are chunks of the sequence
            x = self.embedding(x, model.local_position_ids(x) if hasattr(model, "local_position_ids") else None)
            if sp:
                x = scatter_to_sequence_parallel_region(x, tp_group)  # [s/t, b, h]
        rotary, s = model.rotary_pos_emb, x.shape[0] * (dist.get_world_size(tp_group) if sp else 1)
        rotary_pos_emb = rotary(s) if rotary is not None else None
        for layer in self.layers:
            x = layer(x, rotary_pos_emb)
        if not self.post_process:
            return x  # [s, b, h] ([s/t, b, h] with SP)
        x = self.final_layernorm(x)
        if self.output_layer is not None:
            logits = self.output_layer(x)
        elif tp_group is not None:  # tied, vocab-parallel: [s, b, V/t]
            logits = column_parallel_linear(x, self.word_embeddings.weight, None, sp, tp_group)
        else:
            logits = F.linear(x, self.word_embeddings.weight)
        return logits.transpose(0, 1).contiguous()  # [b, s, V] ([b, s, V/t] under TP)


def build_gpt_stages(model: nn.Module, pp_size: int, pp_rank: int, num_model_chunks: int = 1) -> list[GPTStage]:
    """This rank's model chunks of `model` (chapter 02's GPTModel), chunk k = virtual stage k·pp + rank."""
    num_stages = pp_size * num_model_chunks
    stages = []
    for chunk in range(num_model_chunks):
        start, stop = get_layer_range(model.config.num_layers, pp_size, pp_rank, chunk, num_model_chunks)
        stage = virtual_stage(pp_size, pp_rank, chunk)
        stages.append(GPTStage(model, start, stop, stage == 0, stage == num_stages - 1))
    return stages


def allreduce_word_embedding_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the tied word-embedding gradient of the first and last stage (Megatron: _allreduce_word_embedding_grads).

    Under DDP the gradient is in its buffer, `weight.main_grad` (reduced here before DDP's own reduction).
    """
    if group is None or not model.config.share_embeddings_and_output_weights:
        return
    weight = model.shared_embedding_or_output_weight()
    if getattr(weight, "main_grad", None) is not None:
        dist.all_reduce(weight.main_grad, group=group)
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


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


# --------------------------------------------------------------------------------------- p2p communication
def _communicate(tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                 recv_prev: bool, recv_next: bool, tensor_shape: Sequence[int], *, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor | None, torch.Tensor | None, list]:
    """Send to / receive from the neighbouring pipeline ranks in one batch.

    Returns (tensor from prev, tensor from next, send requests). The shape is agreed up front
    ([s, b, h] for every stage), so no shape is ever sent. The ring wraps around (rank p−1's
    next is rank 0): that is how the last rank feeds chunk k+1 of rank 0 in the interleaved
    schedule. Activations travel with tag 0, gradients with tag 1, so the two streams between
    the same two ranks never mix. Waits for the receives only: a send completes when its peer
    posts the matching receive, and the caller waits for it later (see `forward_backward_pipelining`).
    (Megatron: p2p_communication._communicate with batch_p2p_comm.)
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peer = lambda r: dist.get_global_rank(group, r) if group is not None else r
    next_rank, prev_rank = peer((rank + 1) % size), peer((rank - 1) % size)
    # EXERCISE pp.communicate: allocate the receive buffers, batch the isend/irecv ops, wait for the receives
    ### BEGIN SOLUTION
    tensor_recv_prev = torch.empty(tensor_shape, dtype=dtype, requires_grad=True) if recv_prev else None
    tensor_recv_next = torch.empty(tensor_shape, dtype=dtype, requires_grad=True) if recv_next else None
    sends, recvs = [], []
    if tensor_send_prev is not None:  # gradients go backward
        sends.append(dist.P2POp(dist.isend, tensor_send_prev, prev_rank, group, tag=1))
    if tensor_recv_prev is not None:  # activations come from the previous stage
        recvs.append(dist.P2POp(dist.irecv, tensor_recv_prev, prev_rank, group, tag=0))
    if tensor_send_next is not None:  # activations go forward
        sends.append(dist.P2POp(dist.isend, tensor_send_next, next_rank, group, tag=0))
    if tensor_recv_next is not None:  # gradients come from the next stage
        recvs.append(dist.P2POp(dist.irecv, tensor_recv_next, next_rank, group, tag=1))
    requests = dist.batch_isend_irecv(sends + recvs) if sends or recvs else []
    for request in requests[len(sends):]:
        request.wait()
    return tensor_recv_prev, tensor_recv_next, requests[:len(sends)]
    ### END SOLUTION


def _exchange(tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, **kw):
    """_communicate, then wait for the sends too: the blocking form the helpers below offer."""
    tensor_recv_prev, tensor_recv_next, sends = _communicate(tensor_send_next, tensor_send_prev, recv_prev,
                                                             recv_next, tensor_shape, **kw)
    for request in sends:
        request.wait()
    return tensor_recv_prev, tensor_recv_next


def recv_forward(tensor_shape, **kw) -> torch.Tensor:
    """The activation from the previous stage."""
    return _exchange(None, None, True, False, tensor_shape, **kw)[0]


def recv_backward(tensor_shape, **kw) -> torch.Tensor:
    """The gradient of this stage's output, from the next stage."""
    return _exchange(None, None, False, True, tensor_shape, **kw)[1]


def send_forward(output_tensor: torch.Tensor, **kw) -> None:
    _exchange(output_tensor, None, False, False, output_tensor.shape, **kw)


def send_backward(input_tensor_grad: torch.Tensor, **kw) -> None:
    _exchange(None, input_tensor_grad, False, False, input_tensor_grad.shape, **kw)


def send_forward_recv_backward(output_tensor: torch.Tensor, tensor_shape, **kw) -> torch.Tensor:
    """Send this micro-batch's output on, receive the gradient for the backward that comes next (1F1B)."""
    return _exchange(output_tensor, None, False, True, tensor_shape, **kw)[1]


def send_backward_recv_forward(input_tensor_grad: torch.Tensor, tensor_shape, **kw) -> torch.Tensor:
    """Send this backward's input gradient back, receive the activation for the next forward (1F1B)."""
    return _exchange(None, input_tensor_grad, True, False, tensor_shape, **kw)[0]


def send_forward_recv_forward(output_tensor: torch.Tensor, tensor_shape, **kw) -> torch.Tensor:
    return _exchange(output_tensor, None, True, False, tensor_shape, **kw)[0]


def send_backward_recv_backward(input_tensor_grad: torch.Tensor, tensor_shape, **kw) -> torch.Tensor:
    return _exchange(None, input_tensor_grad, False, True, tensor_shape, **kw)[1]


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


def run_fixed_duration_pipeline(num_microbatches: int, kind: str = "1f1b", num_model_chunks: int = 1,
                                forward_ms: float = 10.0, backward_ms: float = 20.0,
                                group: dist.ProcessGroup | None = None) -> PipelineResult:
    """One step of `kind` over FixedDurationStage chunks: each rank's work is forward_ms + backward_ms per
    micro-batch, split over its `num_model_chunks` chunks, so schedules compare at equal work. Collective
    over `group` (the pipeline ranks start together after a barrier)."""
    v = num_model_chunks
    chunks = [FixedDurationStage(forward_ms / v, backward_ms / v) for _ in range(v)]
    shape = (4, 8)
    inputs = [torch.ones(shape) for _ in range(num_microbatches)]
    dist.barrier(group=group)
    return forward_backward_pipelining(chunks, inputs, inputs, lambda out, target: (out * target).sum(), shape,
                                       kind=kind, group=group)
