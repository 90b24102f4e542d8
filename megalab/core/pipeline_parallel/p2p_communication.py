"""Point-to-point communication between pipeline stages: send/recv of activations and their gradients.

Megatron: megatron/core/pipeline_parallel/p2p_communication.py (recv_forward, send_backward,
send_forward_recv_backward, ...). Shapes are known in advance; the combined calls post both
operations together (batch_isend_irecv) so two neighbours never wait on each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalab.core import parallel_state as ps


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
    group = ps.resolve_group(group, "pp", alone=False)  # the current state's pipeline group unless given
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peer = lambda r: dist.get_global_rank(group, r)
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
