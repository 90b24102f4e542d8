"""EP communication overlap: one micro-batch's all-to-alls hidden behind another micro-batch's compute
(Megatron's `overlap_moe_expert_parallel_comm`).

A MoE layer is cut into four nodes (Megatron: TransformerLayerSchedulePlan._build_callable_nodes):

    pre_dispatch  compute   dense part (attention's place) + router + permute     x [T, h] -> rows [T·k, h]
    moe_dispatch  comm      all-to-all: each row to the rank of its expert               -> [N, h]
    mlp           compute   sort by local expert, the experts, sort back                 -> [N, h]
    moe_combine   comm      all-to-all back, then unpermute (prob-weighted) + residual   -> [T, h]

Each node runs on its own small autograd graph (inputs detached at its boundary), so a node's backward
can run at any moment. Combined 1F1B runs micro-batch i's forward together with micro-batch i−1's
backward, layer by layer (forward layer j with backward layer L−1−j), and inside a layer
(`TransformerLayerSchedulePlan.run`) every all-to-all of one micro-batch is in flight while the other
micro-batch computes:

    comm:  combine_bwd (b)      | dispatch_fwd (f) -> dispatch_bwd (b)  | combine_fwd (f)
    comp:  pre_dispatch_fwd (f) | mlp_bwd (b)      -> mlp_fwd (f)       | pre_dispatch_bwd (b)

On GPUs the two lanes are CUDA streams. Here a comm node starts its all-to-all with
`dist.all_to_all_single(..., async_op=True)` (gloo runs it on its own threads) and returns a `Pending`
whose `wait()` is called only when the result is needed; the other micro-batch's compute runs in between.
The first micro-batch's forward and the last one's backward have no partner: their all-to-alls are exposed.

Megatron: megatron/core/pipeline_parallel/combined_1f1b.py (combined_1f1b_schedule_for_no_pipelining,
combined_forward_backward_step), megatron/core/models/common/model_chunk_schedule_plan.py
(TransformerLayerSchedulePlan.run, TransformerModelChunkSchedulePlan.run), megatron/core/pipeline_parallel/
utils.py (ScheduleNode) and megatron/core/models/gpt/fine_grained_callables.py (the nodes' functions);
`--overlap-moe-expert-parallel-comm` in TransformerConfig. Not here: the pipelined version (combined 1F1B
inside interleaved 1F1B), delayed weight-gradient compute (`delay_wgrad_compute`), shared experts, aux losses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megalab.core.transformer.moe.experts import SequentialMLP
from megalab.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, topk_softmax_with_capacity, unpermute
from megalab.core.transformer.transformer_config import TransformerConfig


# ------------------------------------------------------------------ the layer
class MoETransformerLayer(nn.Module):
    """A transformer layer reduced to what the overlap needs: x + dense(x) (in attention's place), then a top-k
    MoE whose E experts are split over the `ep_group` ranks (E/EP each, drawn as on one device: with the same
    seed, EP = n holds the same model as EP = 1). `forward` is the plain, unsplit layer."""

    def __init__(self, config: TransformerConfig, ep_group=None):
        super().__init__()
        self.config, self.ep_group = config, ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        rank = dist.get_rank(ep_group) if ep_group is not None else 0
        E = config.num_moe_experts
        if E % ep:
            raise ValueError(f"num_moe_experts={E} is not divisible by the expert-parallel size {ep}: change one")
        self.num_local_experts = E // ep
        self.local_experts = slice(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.router = nn.Linear(config.hidden_size, E, bias=False)
        self.experts = SequentialMLP(config, list(range(E))[self.local_experts])

    def route(self, x: torch.Tensor):
        """x [T, h] -> residual h [T, h], rows [T·k, h] grouped by expert, their probs [T·k], sorted_indices [T·k],
        and the all-to-all splits (rows to / from each rank, rows per (source rank, local expert))."""
        h = x + torch.tanh(self.dense(x))
        probs, routing_map, _ = topk_softmax_with_capacity(self.router(h), self.config.moe_router_topk)
        rows, row_probs, sorted_indices = permute(h, routing_map, probs)
        counts = routing_map.sum(dim=0)  # [E]
        ep, L = self.config.num_moe_experts // self.num_local_experts, self.num_local_experts
        if ep > 1:
            gathered = [torch.empty_like(counts) for _ in range(ep)]
            dist.all_gather(gathered, counts, group=self.ep_group)
            per_local = torch.stack(gathered)[:, self.local_experts]  # [ep, L]: rows from rank r for my expert l
        else:
            per_local = counts.view(1, L)
        input_splits = counts.view(ep, L).sum(dim=1).tolist()
        output_splits = per_local.sum(dim=1).tolist()
        return h, rows, row_probs, sorted_indices, (output_splits, input_splits, per_local)

    def expert_compute(self, received: torch.Tensor, per_local: torch.Tensor) -> torch.Tensor:
        """Rows as received ([source rank][local expert]) -> expert outputs in the same order."""
        ep, L = per_local.shape
        by_expert = sort_chunks_by_idxs(received, per_local.reshape(-1), torch.arange(ep * L).view(ep, L).t().reshape(-1).tolist())
        out = self.experts(by_expert, per_local.sum(dim=0))
        return sort_chunks_by_idxs(out, per_local.t().reshape(-1), torch.arange(L * ep).view(L, ep).t().reshape(-1).tolist())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, h] -> [T, h], one autograd graph, blocking all-to-alls
        from megalab.core.tensor_parallel.mappings import all_to_all

        h, rows, row_probs, sorted_indices, (out_splits, in_splits, per_local) = self.route(x)
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            rows = all_to_all(self.ep_group, rows, out_splits, in_splits)
        out = self.expert_compute(rows, per_local)
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            out = all_to_all(self.ep_group, out, in_splits, out_splits)
        return unpermute(out, sorted_indices, x.shape[0], row_probs) + h


# ------------------------------------------------------------------ nodes and their timeline
class NodeRecord(NamedTuple):
    """One node's run on this rank: micro-batch, layer, node name, "F"/"B", lane ("comp"/"comm"), its start and
    end (time.perf_counter; a comm node: started .. waited for) and `exposed`, the seconds its wait blocked.
    `first`/`last`: the positions of its start and end in this rank's sequence of events (order, not time)."""

    microbatch: int
    layer: int
    name: str
    direction: str
    lane: str
    start: float
    end: float
    exposed: float
    first: int
    last: int


class Recorder:
    """The rank's node records, and a counter that orders its events."""

    def __init__(self):
        self.records: list[NodeRecord] = []
        self.events = 0

    def tick(self) -> int:
        self.events += 1
        return self.events


class Pending:
    """An all-to-all in flight: `wait()` blocks until it is done, then runs `then` on its output (once).
    Its record ends when the all-to-all completed (gloo's future calls back then), else when the wait returned."""

    def __init__(self, node, direction, output, work, then, start, first):
        self.node, self.direction, self.output, self.work, self.then = node, direction, output, work, then
        self.start, self.first, self.completed = start, first, None
        try:
            work.get_future().then(self._complete)
        except (AttributeError, RuntimeError):  # no work (one rank), or a stand-in without futures
            pass

    def _complete(self, future):
        self.completed = time.perf_counter()

    def wait(self) -> torch.Tensor:
        waiting = time.perf_counter()
        if self.work is not None:
            self.work.wait()
        done = time.perf_counter()
        result = self.then(self.output)
        node = self.node
        end = min(self.completed or done, done)
        node.recorder.records.append(NodeRecord(node.microbatch, node.layer, node.name, self.direction, "comm",
                                                self.start, end, done - waiting, self.first, node.recorder.tick()))
        return result


class ComputeNode:
    """A compute node: forward(*inputs) on a graph of its own (inputs detached), backward(*grads) -> input grads."""

    lane = "comp"

    def __init__(self, name: str, func: Callable, microbatch: int, layer: int, recorder: Recorder):
        self.name, self.func, self.microbatch, self.layer, self.recorder = name, func, microbatch, layer, recorder

    def _record(self, direction, start, first):
        self.recorder.records.append(NodeRecord(self.microbatch, self.layer, self.name, direction, "comp", start,
                                                time.perf_counter(), 0.0, first, self.recorder.tick()))

    def forward(self, *inputs):
        start, first = time.perf_counter(), self.recorder.tick()
        self.inputs = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
        with torch.enable_grad():
            outputs = self.func(*self.inputs)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        detached = tuple(y.detach().requires_grad_() if y.is_floating_point() else y for y in self.outputs)
        self._record("F", start, first)
        return detached if isinstance(outputs, tuple) else detached[0]

    def backward(self, *grads):
        start, first = time.perf_counter(), self.recorder.tick()
        pairs = [(y, g) for y, g in zip(self.outputs, grads) if g is not None and y.requires_grad]
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(x.grad if x.is_floating_point() else None for x in self.inputs)
        self.inputs = self.outputs = None  # this micro-batch's graph is done
        self._record("B", start, first)
        return input_grads if len(input_grads) > 1 else input_grads[0]


def _all_to_all_start(x: torch.Tensor, output_splits, input_splits, group):
    """Start x's all-to-all (async_op=True); (output buffer, work) — work is None without a group to talk to."""
    if group is None or dist.get_world_size(group) == 1:
        return x, None
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    return out, dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)


class DispatchNode:
    """moe_dispatch: forward sends the routed rows to their experts' ranks, backward sends their gradient back."""

    lane = "comm"

    def __init__(self, plan, microbatch: int, layer: int, recorder: Recorder, name="moe_dispatch"):
        self.plan, self.name, self.microbatch, self.layer, self.recorder = plan, name, microbatch, layer, recorder

    def _start(self, x, direction, output_splits, input_splits, then=lambda y: y):
        start, first = time.perf_counter(), self.recorder.tick()
        out, work = _all_to_all_start(x, output_splits, input_splits, self.plan.layer.ep_group)
        return Pending(self, direction, out, work, then, start, first)

    def forward(self, rows: torch.Tensor) -> Pending:
        out_splits, in_splits, _ = self.plan.splits
        return self._start(rows.detach(), "F", out_splits, in_splits)

    def backward(self, grad: torch.Tensor) -> Pending:
        out_splits, in_splits, _ = self.plan.splits
        return self._start(grad, "B", in_splits, out_splits)


class CombineNode(DispatchNode):
    """moe_combine: forward sends the expert outputs home, then unpermutes them (prob-weighted) and adds the
    residual; backward runs that unpermute's backward, then sends the gradient to the experts' ranks."""

    def __init__(self, plan, microbatch, layer, recorder):
        super().__init__(plan, microbatch, layer, recorder, name="moe_combine")

    def forward(self, expert_out: torch.Tensor) -> Pending:
        out_splits, in_splits, _ = self.plan.splits
        plan = self.plan

        def finish(received):
            self.received = received.detach().requires_grad_()
            with torch.enable_grad():
                self.output = unpermute(self.received, plan.sorted_indices, plan.num_tokens, plan.row_probs) + plan.h
            return self.output.detach().requires_grad_()

        return self._start(expert_out.detach(), "F", in_splits, out_splits, finish)

    def backward(self, grad: torch.Tensor) -> Pending:
        out_splits, in_splits, _ = self.plan.splits
        self.output.backward(grad)  # -> grads of the received rows, of the probs and of the residual
        received_grad, self.output = self.received.grad, None
        return self._start(received_grad, "B", out_splits, in_splits)


class PreDispatchNode(ComputeNode):
    """pre_dispatch: x -> the routed rows; the residual and the rows' probs wait on the plan for moe_combine, and
    their gradients (from moe_combine's backward) join the rows' gradient in this node's backward."""

    def __init__(self, plan, microbatch, layer, recorder):
        super().__init__("pre_dispatch", plan.layer_pre_dispatch, microbatch, layer, recorder)
        self.plan = plan

    def forward(self, x):
        rows, self.plan.h, self.plan.row_probs = super().forward(x)
        return rows

    def backward(self, rows_grad):
        plan = self.plan
        grad = super().backward(rows_grad, plan.h.grad, plan.row_probs.grad)
        plan.h = plan.row_probs = None
        return grad


class TransformerLayerSchedulePlan:
    """One layer's nodes for one micro-batch (Megatron's class of this name): pre_dispatch, moe_dispatch, mlp,
    moe_combine, sharing the layer's parameters."""

    def __init__(self, layer: MoETransformerLayer, microbatch: int, layer_number: int, recorder: Recorder):
        self.layer = layer
        args = (microbatch, layer_number, recorder)
        self.pre_dispatch = PreDispatchNode(self, *args)
        self.moe_dispatch = DispatchNode(self, *args)
        self.mlp = ComputeNode("mlp", lambda rows: layer.expert_compute(rows, self.splits[2]), *args)
        self.moe_combine = CombineNode(self, *args)

    def layer_pre_dispatch(self, x):  # [T, h] -> rows [T·k, h], residual [T, h], row probs [T·k]
        h, rows, row_probs, self.sorted_indices, self.splits = self.layer.route(x)
        self.num_tokens = x.shape[0]
        return rows, h, row_probs

    @staticmethod
    def run(f_layer: TransformerLayerSchedulePlan | None, b_layer: TransformerLayerSchedulePlan | None,
            f_input: torch.Tensor | None = None, b_grad: torch.Tensor | None = None):
        """f_layer's forward (of f_input) and b_layer's backward (of b_grad), each all-to-all of one in flight while
        the other computes (the picture in the module docstring); either may be None. -> (f output, b input grad).

        Comm nodes: node.forward(x) / node.backward(g) start the all-to-all and return a Pending; pending.wait()
        gives its result. Compute nodes: node.forward(x) / node.backward(g) return theirs."""
        # EXERCISE moe.ep_overlap: start each all-to-all, run the other micro-batch's compute, then wait for it
        ### BEGIN SOLUTION
        # HINT 1: Four rounds, each pairing one micro-batch's all-to-all with the other's compute: b's combine
        #         backward under f's pre_dispatch; f's dispatch under b's mlp backward; b's dispatch backward under f's
        #         mlp; f's combine under b's pre_dispatch backward. A node's input must be waited for before it runs.
        # HINT 2: In each round: pending = <comm node>.forward/backward(...) first, then the compute node of the
        #         other micro-batch, then pending.wait(). Guard every step of f with `if f_layer is not None` and of b
        #         with `if b_layer is not None`, so that one alone still runs (its waits then hide nothing).
        if b_layer is not None:
            pending_b = b_layer.moe_combine.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.pre_dispatch.forward(f_input)
            pending_f = f_layer.moe_dispatch.forward(f_input)
        if b_layer is not None:
            b_grad = b_layer.mlp.backward(pending_b.wait())
            pending_b = b_layer.moe_dispatch.backward(b_grad)
        if f_layer is not None:
            f_input = f_layer.mlp.forward(pending_f.wait())
            pending_f = f_layer.moe_combine.forward(f_input)
        if b_layer is not None:
            b_grad = b_layer.pre_dispatch.backward(pending_b.wait())
        if f_layer is not None:
            f_input = pending_f.wait()
        return f_input, b_grad
        ### END SOLUTION


# ------------------------------------------------------------------ the schedules
def _loss_grad(output: torch.Tensor, target: torch.Tensor, loss_func, num_microbatches: int):
    """loss_func(output, target) / m, its value and d(loss)/d(output)."""
    output = output.detach().requires_grad_()
    loss = loss_func(output, target) / num_microbatches
    loss.backward()
    return loss.detach(), output.grad


def combined_1f1b_schedule_for_no_pipelining(layers: Sequence[MoETransformerLayer], inputs: Sequence[torch.Tensor],
                                             targets: Sequence[torch.Tensor], loss_func, overlap: bool = True):
    """One step over the micro-batches (no pipeline): gradients accumulate in the layers' parameters.

    overlap=True (Megatron's combined 1F1B):  F0 | F1+B0 | F2+B1 | ... | B(m-1), each pair layer by layer
    overlap=False (the usual order):          F0 B0 F1 B1 ...  the same nodes, every all-to-all waited at once
    -> (losses, gradients of the inputs, this rank's NodeRecords).
    """
    m, L = len(inputs), len(layers)
    recorder = Recorder()
    plans = [[TransformerLayerSchedulePlan(layer, i, j, recorder) for j, layer in enumerate(layers)] for i in range(m)]
    losses, input_grads, grads = [], [None] * m, [None] * m

    def forward_backward(f: int | None, b: int | None):
        x = inputs[f] if f is not None else None
        g = grads[b] if b is not None else None
        for j in range(L):
            f_plan = plans[f][j] if f is not None else None
            b_plan = plans[b][L - 1 - j] if b is not None else None
            x, g = TransformerLayerSchedulePlan.run(f_plan, b_plan, x, g)
        if f is not None:
            loss, grads[f] = _loss_grad(x, targets[f], loss_func, m)
            losses.append(loss)
        if b is not None:
            input_grads[b] = g

    if overlap:
        forward_backward(0, None)
        for i in range(1, m):
            forward_backward(i, i - 1)
        forward_backward(None, m - 1)
    else:
        for i in range(m):
            forward_backward(i, None)
            forward_backward(None, i)
    return losses, input_grads, recorder.records


def exposed_all_to_alls(records: Sequence[NodeRecord]) -> list[NodeRecord]:
    """The comm records during which no compute of another micro-batch started (between start and wait, in this
    rank's order of events): all-to-alls nothing was hidden behind."""
    comps = [r for r in records if r.lane == "comp"]
    return [c for c in records if c.lane == "comm" and not any(
        p.microbatch != c.microbatch and c.first < p.first < c.last for p in comps)]
