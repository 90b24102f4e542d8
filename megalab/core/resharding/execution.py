"""Run a ReshardPlan: every send and receive of this rank in one batch_isend_irecv, same-rank slices copied directly.

Sends are listed in task_id order and receives in task_id order, so between two ranks the k-th message sent is
the k-th one expected (gloo matches point-to-point messages of one tag in order). A
receive lands in a staging buffer, never in the live weights: the caller installs them only once every
receive has completed (refit.py), so a failed refit leaves the old weights whole.

Megatron: megatron/core/resharding/execution.py (execute_reshard_plan) with copy_services/gloo_copy_service.py
(GlooCopyService: same-rank ops short-circuit into tensor.copy_, matched by task_id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalab.core.resharding.utils import ReshardPlan


@dataclass
class RefitStats:
    """What one rank moved in one refit."""
    bytes_sent: int = 0  # over the wire (gloo)
    bytes_received: int = 0
    bytes_local: int = 0  # same-rank copies (no communication)
    num_sends: int = 0
    num_recvs: int = 0
    seconds: float = 0.0


@torch.no_grad()
def execute_reshard_plan(plan: ReshardPlan, src_params: dict[str, torch.Tensor],
                         dst_buffers: dict[str, torch.Tensor], group=None) -> RefitStats:
    """Fill dst_buffers (resolved name -> this rank's destination-shaped tensor) from src_params (resolved name ->
    this rank's source tensor) as the plan says. Returns the bytes moved."""
    rank, stats = plan.rank, RefitStats()
    local = {}
    ops = []  # [dist.P2POp]: posted together (batch_isend_irecv), so no rank waits on a send before its receives
    for op in plan.send_ops:
        piece = src_params[op.param_name][op.my_slice].detach()
        if op.peer_rank == rank:
            local[op.task_id] = piece
            continue
        piece = piece.to(op.dtype).contiguous().cpu()  # the wire carries the destination's dtype
        ops.append(dist.P2POp(dist.isend, piece, op.peer_rank, group))
        stats.bytes_sent += op.nbytes
        stats.num_sends += 1
    received = []
    for op in plan.recv_ops:
        target = dst_buffers[op.param_name]
        if op.peer_rank == rank:
            target[op.my_slice].copy_(local.pop(op.task_id))
            stats.bytes_local += op.nbytes
            continue
        buffer = torch.empty(target[op.my_slice].shape, dtype=target.dtype, device=target.device)
        ops.append(dist.P2POp(dist.irecv, buffer, op.peer_rank, group))
        received.append((op, buffer))
        stats.bytes_received += op.nbytes
        stats.num_recvs += 1
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    for op, buffer in received:
        dst_buffers[op.param_name][op.my_slice].copy_(buffer)
    return stats

