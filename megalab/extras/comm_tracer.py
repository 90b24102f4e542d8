"""Count the bytes of every collective a piece of code issues.

    with CollectiveTracer() as trace:
        loss.backward()
    trace.records        [Collective("all_reduce", payload_bytes=..., group_size=2, wire_bytes=...), ...]

The tracer wraps the torch.distributed functions for the duration of the block (code must
call them as `dist.all_reduce(...)`, looked up at call time, as megalab does). For each call it
keeps the payload (the full, unsharded tensor: the input of an all-reduce or reduce-scatter, the
output of an all-gather) and the bytes each rank sends with the bandwidth-optimal ring
algorithms, n the payload and t the group size:

    all-reduce       2 (t-1)/t n     (a reduce-scatter, then an all-gather)
    all-gather       (t-1)/t n
    reduce-scatter   (t-1)/t n
    all-to-all       (t-1)/t n       (all_to_all_single, n its input: every rank keeps 1/t of it)
    isend            n               (point to point, each send of a dist.batch_isend_irecv; the
                                      matching irecv is not counted)

Narayanan et al. 2021 count tensor-parallel traffic this way ("8 b s h (t-1)/t per layer").
Megatron has no such tool; NCCL's own counters or a profiler trace play its role there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

# name -> (index of the argument holding the full payload, bytes on the wire per payload byte given t)
_RING = {
    "all_reduce": (0, lambda t: 2 * (t - 1) / t),
    "all_gather": (0, lambda t: (t - 1) / t),  # a list of t outputs
    "all_gather_single": (0, lambda t: (t - 1) / t),  # the [t n] output
    "reduce_scatter_single": (1, lambda t: (t - 1) / t),  # the [t n] input
    "all_gather_into_tensor": (0, lambda t: (t - 1) / t),  # older names of the two above
    "reduce_scatter_tensor": (1, lambda t: (t - 1) / t),
    "all_to_all_single": (1, lambda t: (t - 1) / t),  # the [t n/t] input, one slice kept
}
_RECORDED_AS = {"all_to_all_single": "all_to_all"}  # the kind step_time / calibrate know it by
# Point-to-point sends are counted inside dist.batch_isend_irecv (ring attention, pipeline p2p): a wrapped
# dist.isend would not pass P2POp's check that its op is torch.distributed.isend itself.


@dataclass(frozen=True)
class Collective:
    op: str
    payload_bytes: int
    group_size: int
    wire_bytes: float  # sent by each rank, ring algorithm


def _nbytes(arg) -> int:
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return arg.numel() * arg.element_size() if isinstance(arg, torch.Tensor) else 0


class CollectiveTracer:
    """Records every all-reduce, all-gather, reduce-scatter, all-to-all and batched send issued inside the `with` block."""

    def __init__(self):
        self.records: list[Collective] = []
        self._originals = {}

    def _wrap(self, name, fn, payload_index, factor):
        def traced(*args, **kwargs):
            t = dist.get_world_size(kwargs.get("group"))
            n = _nbytes(args[payload_index])
            self.records.append(Collective(_RECORDED_AS.get(name, name), n, t, factor(t) * n))
            return fn(*args, **kwargs)

        return traced

    def _wrap_batch(self, fn):
        def traced(p2p_op_list):
            for op in p2p_op_list:
                if op.op is dist.isend:
                    self.records.append(Collective("isend", _nbytes(op.tensor), 2, float(_nbytes(op.tensor))))
            return fn(p2p_op_list)

        return traced

    def __enter__(self) -> CollectiveTracer:
        for name, (index, factor) in _RING.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._originals[name], index, factor))
        self._originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(dist.batch_isend_irecv)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    @property
    def wire_bytes(self) -> float:
        return sum(r.wire_bytes for r in self.records)

    def counts(self) -> Counter:
        return Counter(r.op for r in self.records)

    def table(self) -> str:
        """One line per kind of collective: calls, payload bytes, wire bytes per rank."""
        lines = [f"{'collective':<24}{'calls':>6}{'payload B':>12}{'wire B/rank':>14}"]
        for op in sorted({r.op for r in self.records}):
            rs = [r for r in self.records if r.op == op]
            lines.append(f"{op:<24}{len(rs):>6}{sum(r.payload_bytes for r in rs):>12}"
                         f"{sum(r.wire_bytes for r in rs):>14.0f}")
        return "\n".join(lines)
