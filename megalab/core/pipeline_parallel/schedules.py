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
from megalab.core.pipeline_parallel import p2p_communication as p2p
from megalab.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

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
    """Megatron's constraints for the interleaved schedule with its default micro-batch group size
    (microbatch_group_size_per_vp_stage = pp), with an error that says what to change."""
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
    # HINT 1: In 1F1B the last stage can start its first backward right after its first forward; each
    #         earlier stage is one forward further from the loss, so it runs one more forward before its first
    #         backward.
    # HINT 2: One chunk: pp_size - pp_rank - 1. Interleaved (v chunks): twice that, plus (v - 1) *
    #         pp_size for the other chunks' first group. A single stage (pp_size 1) has no warmup; never more than the
    #         total number of forwards, m * v (Megatron: get_pp_rank_microbatches).
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
    # HINT 1: Interleaving runs micro-batches in groups of group_size; inside a group every model chunk
    #         processes the whole group before the next chunk starts, then the next group begins.
    # HINT 2: Loop over group starts in steps of group_size (the last group may be shorter); for each
    #         group, loop over chunks, and inside that over the group's micro-batches, appending (microbatch, chunk).
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
    # HINT 1: 1F1B has three phases: the warmup forwards, a steady state that alternates one forward and one
    #         backward, and a cooldown that runs the backwards still owed.
    # HINT 2: Take the first num_warmup forwards; then for each remaining forward append it and the
    #         oldest backward not yet run; finish with the backwards left over. Every op appears exactly once.
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


def synchronized_time(device: torch.device) -> float:
    """time.perf_counter() once `device` has finished its queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Steps:
    """One rank's forward and backward steps over its chunks, the activations they keep alive, and the
    record of when each ran (Megatron: forward_step / backward_step and the schedules' tensor lists)."""

    def __init__(self, chunks, inputs, targets, loss_func, pp_size, pp_rank, device, deallocate,
                 moe_aux_loss_scale=None):
        self.chunks, self.inputs, self.targets, self.loss_func = chunks, inputs, targets, loss_func
        self.pp_size, self.pp_rank, self.device, self.deallocate = pp_size, pp_rank, device, deallocate
        self.moe_aux_loss_scale = moe_aux_loss_scale
        self.num_stages = pp_size * len(chunks)
        self.input_tensors, self.output_tensors = {}, {}  # (microbatch, chunk) -> tensor, alive from F to B
        self.result = PipelineResult(losses=[])

    def is_first(self, chunk: int) -> bool:
        return virtual_stage(self.pp_size, self.pp_rank, chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return virtual_stage(self.pp_size, self.pp_rank, chunk) == self.num_stages - 1

    def forward(self, op: Op, input_tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Run F; return the activation to send on (None on the last virtual stage, which computes the loss:
        loss_func(output, target) / m, so gradients are those of the mean loss, as Megatron's forward_step)."""
        start, key = synchronized_time(self.device), (op.microbatch, op.chunk)
        x = self.inputs[op.microbatch] if self.is_first(op.chunk) else input_tensor
        if self.moe_aux_loss_scale is not None:  # the aux losses weigh as this micro-batch's loss does
            MoEAuxLossAutoScaler.set_loss_scale(self.moe_aux_loss_scale)
        output = send = self.chunks[op.chunk](x)
        if output is x:  # an empty stage (a layout's "||"): send a tensor of its own, freeing it keeps the input
            output = send = x.clone()
        if self.is_last(op.chunk):
            loss = self.loss_func(output, self.targets[op.microbatch])
            self.result.losses.append(loss.item())
            output, send = loss / len(self.inputs), None
        self.input_tensors[key], self.output_tensors[key] = x, output
        self.result.peak_in_flight = max(self.result.peak_in_flight, len(self.output_tensors))
        self.result.timeline.append(OpRecord(dist.get_rank(), op, start, synchronized_time(self.device)))
        return send

    def backward(self, op: Op, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Run B; return the gradient of the stage's input to send back (None on the first virtual stage)."""
        start, key = synchronized_time(self.device), (op.microbatch, op.chunk)
        x, output = self.input_tensors.pop(key), self.output_tensors.pop(key)
        if self.is_last(op.chunk):
            output.backward()
        else:
            custom_backward(output, output_grad)
        self.result.timeline.append(OpRecord(dist.get_rank(), op, start, synchronized_time(self.device)))
        if self.is_first(op.chunk):
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)  # a stage that ignores its input

    def sent(self, output: torch.Tensor | None) -> None:
        """The output went to the next stage (the exchange waited for it): free its memory, keep its graph."""
        if output is not None and self.deallocate:
            deallocate_output_tensor(output)


def forward_backward_pipelining(
    chunks: Sequence[nn.Module], inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
    loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tensor_shape: Sequence[int], *,
    kind: str = "1f1b", group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
    deallocate: bool = True, cp_size: int | None = None,
) -> PipelineResult:
    """One training step's forward and backward over len(inputs) micro-batches on this rank's `chunks`.

    Runs the ops of `get_schedule(...)` in that order, communicating as Megatron's schedules do: after
    each step one batched exchange (p2p_communication) that is exactly the complement of what the
    neighbours post at the same step, so it cannot deadlock under NCCL (tests/test_p2p_model.py checks
    every schedule for pp 2-8, m up to 16). Received tensors get the chunks' dtype and device (or
    `dtype`). The first virtual stage reads `inputs[mb]`, the last computes the loss; gradients
    accumulate in the chunks' parameters. Op times are taken after a CUDA synchronize on GPUs.

    MoE chunks (config.num_moe_experts set): every micro-batch's forward sets the aux-loss gradient
    scale to cp_size / m (MoEAuxLossAutoScaler.set_loss_scale; Megatron's forward_step_calc_loss with
    loss_scale 1), cp_size by default the current state's CP size; the scale before the call is
    restored after it.
    """
    group = ps.resolve_group(group, "pp", alone=False)  # the current state's pipeline group unless given
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    get_schedule(pp_size, pp_rank, len(inputs), len(chunks), kind)  # validates the configuration
    param = next((p for c in chunks for p in c.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    kw = dict(group=group, dtype=dtype or (param.dtype if param is not None else torch.float32), device=device)
    moe = any(getattr(getattr(c, "config", None), "num_moe_experts", None) for c in chunks)
    if moe and cp_size is None:
        cp_size = ps.get_parallel_state().get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    steps = _Steps(chunks, inputs, targets, loss_func, pp_size, pp_rank, device, deallocate,
                   cp_size / len(inputs) if moe else None)
    with MoEAuxLossAutoScaler.loss_scale(MoEAuxLossAutoScaler.main_loss_backward_scale):  # restored afterwards
        if kind == "interleaved":
            forward_backward_pipelining_with_interleaving(steps, tensor_shape, kw)
        else:  # GPipe is 1F1B with every forward in the warmup; "none" (pp=1) is 1F1B without warmup
            num_warmup = len(inputs) if kind == "gpipe" else get_num_warmup_microbatches(pp_size, pp_rank, len(inputs))
            forward_backward_pipelining_without_interleaving(steps, num_warmup, tensor_shape, kw)
    return steps.result


def forward_backward_pipelining_without_interleaving(steps: _Steps, num_warmup: int, tensor_shape, kw) -> None:
    """1F1B (Megatron's function of this name), and GPipe when num_warmup = m.

        warmup    recv_forward · F · send_forward                      (num_warmup times)
        steady    F · send_forward_recv_backward · B · send_backward_recv_forward
        cooldown  recv_backward · B · send_backward                    (num_warmup times)

    On the first stage the receives from / sends to the previous stage are skipped, on the last
    those to / from the next: each exchange pairs with the neighbour's complementary one.
    """
    m, first, last = len(steps.inputs), steps.is_first(0), steps.is_last(0)
    remaining = m - num_warmup
    recv_forward = lambda: None if first else p2p.recv_forward(tensor_shape, **kw)
    recv_backward = lambda: None if last else p2p.recv_backward(tensor_shape, **kw)
    for i in range(num_warmup):
        output = steps.forward(Op("F", i), recv_forward())
        p2p.send_forward(output, **kw)
        steps.sent(output)
    input_tensor = recv_forward() if remaining > 0 else None
    for i in range(remaining):
        output = steps.forward(Op("F", num_warmup + i), input_tensor)
        output_grad = p2p.send_forward_recv_backward(output, tensor_shape, **kw)
        steps.sent(output)
        input_grad = steps.backward(Op("B", i), output_grad)
        if i == remaining - 1:
            p2p.send_backward(input_grad, **kw)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, tensor_shape, **kw)
    for i in range(remaining, m):
        p2p.send_backward(steps.backward(Op("B", i), recv_backward()), **kw)


def _arrival_order(pp_size: int, pp_rank: int, num_microbatches: int, num_model_chunks: int) -> tuple[list, list]:
    """The (microbatch, chunk) keys of the activations and of the gradients this rank receives, in
    arrival order: the order in which its neighbours' schedules produce them (p2p is FIFO)."""
    prev, next_ = (pp_rank - 1) % pp_size, (pp_rank + 1) % pp_size
    last = pp_size * num_model_chunks - 1
    acts = [(op.microbatch, op.chunk + (pp_rank == 0))
            for op in get_schedule(pp_size, prev, num_microbatches, num_model_chunks, "interleaved")
            if op.kind == "F" and virtual_stage(pp_size, prev, op.chunk) < last]
    grads = [(op.microbatch, op.chunk - (pp_rank == pp_size - 1))
             for op in get_schedule(pp_size, next_, num_microbatches, num_model_chunks, "interleaved")
             if op.kind == "B" and virtual_stage(pp_size, next_, op.chunk) > 0]
    return acts, grads


def forward_backward_pipelining_with_interleaving(steps: _Steps, tensor_shape, kw) -> None:
    """Interleaved 1F1B (Megatron's function of this name, batch_p2p_comm without overlap).

    Virtual micro-batch k is the k-th entry of get_schedule_table. After every step (warmup: F_k;
    steady: F_{w+k} then B_k; cooldown: B_k) ONE exchange sends what the step produced and receives
    what the neighbours send at the same step. The first rank runs pp−1 steps ahead of the last, so
    what it receives from the last rank is for a later forward: received tensors are kept by key.
    """
    pp_size, pp_rank, v, m = steps.pp_size, steps.pp_rank, len(steps.chunks), len(steps.inputs)
    total = m * v
    num_warmup = get_num_warmup_microbatches(pp_size, pp_rank, m, v)
    remaining = total - num_warmup
    table = get_schedule_table(m, v, pp_size)
    fwd = lambda k: Op("F", table[k][0], table[k][1])
    bwd = lambda k: Op("B", table[k][0], v - 1 - table[k][1])  # backward runs the chunks in reverse
    act_keys, grad_keys = (iter(keys) for keys in _arrival_order(pp_size, pp_rank, m, v))
    acts, grads = {}, {}  # (microbatch, chunk) -> received tensor, until its op runs

    def keep(act: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        if act is not None:
            acts[next(act_keys)] = act
        if grad is not None:
            grads[next(grad_keys)] = grad

    def forward(op: Op) -> torch.Tensor | None:
        return steps.forward(op, None if steps.is_first(op.chunk) else acts.pop((op.microbatch, op.chunk)))

    def backward(op: Op) -> torch.Tensor | None:
        return steps.backward(op, None if steps.is_last(op.chunk) else grads.pop((op.microbatch, op.chunk)))

    def peer_sends(k: int, forward: bool) -> bool:
        """Does the neighbour send at the exchange after step k (Megatron: recv_tensor_from_previous_stage)?
        Only the leading rank (the first going forward, the last going backward) can find it silent: it is
        pp−1 steps ahead, so nothing yet, and nothing for the last chunk's output."""
        leading = pp_rank == (0 if forward else pp_size - 1)
        if not leading:
            return True
        if k < pp_size - 1:
            return False
        aligned = (fwd if forward else bwd)(k - (pp_size - 1))
        return aligned.chunk != (v - 1 if forward else 0)

    if pp_rank != 0:
        keep(p2p.recv_forward(tensor_shape, **kw), None)
    for k in range(num_warmup):
        output = forward(fwd(k))
        recv_prev = peer_sends(k, True) and k != total - 1
        if k == num_warmup - 1 and remaining > 0:  # the last warmup step also fetches the first gradient
            keep(*p2p.send_forward_backward_recv_forward_backward(output, None, recv_prev, pp_rank != pp_size - 1,
                                                                  tensor_shape, **kw))
        else:
            keep(p2p.send_forward_recv_forward(output, recv_prev, tensor_shape, **kw), None)
        steps.sent(output)
    for k in range(remaining):
        output, input_grad = forward(fwd(num_warmup + k)), backward(bwd(k))
        recv_prev = peer_sends(num_warmup + k, True) and k != remaining - 1
        keep(*p2p.send_forward_backward_recv_forward_backward(output, input_grad, recv_prev, peer_sends(k, False),
                                                              tensor_shape, **kw))
        steps.sent(output)
    if remaining == 0 and pp_rank != pp_size - 1:
        keep(None, p2p.recv_backward(tensor_shape, **kw))
    for k in range(remaining, total):
        input_grad = backward(bwd(k))
        keep(None, p2p.send_backward_recv_backward(input_grad, peer_sends(k, False) and k != total - 1,
                                                   tensor_shape, **kw))
