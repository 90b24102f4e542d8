"""Point-to-point communication between pipeline stages: send/recv of activations and their gradients.

Megatron: megatron/core/pipeline_parallel/p2p_communication.py (recv_forward, send_backward,
send_forward_recv_backward, ..., _communicate with _batched_p2p_ops). Shapes are known in advance.
Every exchange is ONE batch (`dist.batch_isend_irecv`, an NCCL group), because NCCL is strict where
gloo is lenient (see megalab/extras/p2p_model.py, which checks the schedules against these rules):

- a communicator runs its operations in issue order, and a send may block until the peer has posted
  the matching receive: two neighbours that each send first, then receive, can wait forever;
- NCCL has no tags: between two ranks, sends and receives pair up in issue order.

So the schedules (schedules.py) post, at each step, one batch that is exactly the complement of the
neighbours' batch at the same step, and a batch lists activations before gradients (with pp=2 the
previous and the next rank are the same rank, and this order keeps the pairs straight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalab.core import parallel_state as ps

ACTIVATION_TAG, GRADIENT_TAG = 0, 1  # gloo keeps the two streams apart by tag; NCCL by the order above


def _default_device(group) -> torch.device:
    """This rank's CUDA device under NCCL, else the CPU (Megatron's p2p buffers: torch.cuda.current_device())."""
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------- p2p communication
def _batched_p2p_ops(*, tensor_send_prev: torch.Tensor | None, tensor_recv_prev: torch.Tensor | None,
                     tensor_send_next: torch.Tensor | None, tensor_recv_next: torch.Tensor | None,
                     group: dist.ProcessGroup, prev_rank: int, next_rank: int) -> list:
    """Post the exchange as one batch: activations (send next, receive prev), then gradients (send prev,
    receive next). Megatron's _batched_p2p_ops lists send_prev, recv_prev, send_next, recv_next, which
    at pp=2 pairs one rank's gradient with the other's activation buffer (Megatron-LM #750)."""
    ops = []
    if tensor_send_next is not None:  # activations go forward
        ops.append(dist.P2POp(dist.isend, tensor_send_next, next_rank, group, tag=ACTIVATION_TAG))
    if tensor_recv_prev is not None:  # activations come from the previous stage
        ops.append(dist.P2POp(dist.irecv, tensor_recv_prev, prev_rank, group, tag=ACTIVATION_TAG))
    if tensor_send_prev is not None:  # gradients go backward
        ops.append(dist.P2POp(dist.isend, tensor_send_prev, prev_rank, group, tag=GRADIENT_TAG))
    if tensor_recv_next is not None:  # gradients come from the next stage
        ops.append(dist.P2POp(dist.irecv, tensor_recv_next, next_rank, group, tag=GRADIENT_TAG))
    return dist.batch_isend_irecv(ops) if ops else []


def _communicate(tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                 recv_prev: bool, recv_next: bool, tensor_shape: Sequence[int], *,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send to / receive from the neighbouring pipeline ranks in one batch, and wait for all of it.

    Returns (tensor from prev, tensor from next). The shape is agreed up front ([s, b, h] for every
    stage), so no shape is ever sent. Receive buffers get `dtype` and `device` (the model's), else those
    of the tensor being sent, else fp32 on this rank's device. The ring wraps around (rank p−1's next is
    rank 0): that is how the last rank feeds chunk k+1 of rank 0 in the interleaved schedule.
    (Megatron: p2p_communication._communicate with batch_p2p_comm, which waits on every request.)
    """
    group = ps.resolve_group(group, "pp", alone=False)  # the current state's pipeline group unless given
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peer = lambda r: dist.get_global_rank(group, r)
    next_rank, prev_rank = peer((rank + 1) % size), peer((rank - 1) % size)
    like = tensor_send_next if tensor_send_next is not None else tensor_send_prev
    dtype = dtype or (like.dtype if like is not None else torch.float32)
    device = device or (like.device if like is not None else _default_device(group))
    # EXERCISE pp.communicate: allocate the receive buffers (dtype, device), post one batch, wait for it all
    ### BEGIN SOLUTION
    # HINT 1: Each stage receives into buffers it allocates itself (the shape is agreed in advance), and
    #         what it receives must become part of its autograd graph, because backward has to produce a gradient for
    #         it.
    # HINT 2: Make the receive buffers with torch.empty of tensor_shape, in the model's dtype and on its
    #         device, with requires_grad; hand all four (maybe None) tensors to _batched_p2p_ops, which posts ONE
    #         batch_isend_irecv; wait() on every request it returns; return (from prev, from next).
    # HINT 3: Lone dist.isend/dist.irecv calls work on gloo but can deadlock on NCCL (check with
    #         megalab/extras/p2p_model.py), and a buffer read before its request is waited on may still be empty.
    empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device, requires_grad=True)
    tensor_recv_prev = empty() if recv_prev else None
    tensor_recv_next = empty() if recv_next else None
    requests = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                                tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                                group=group, prev_rank=prev_rank, next_rank=next_rank)
    for request in requests:
        request.wait()
    return tensor_recv_prev, tensor_recv_next
    ### END SOLUTION


def recv_forward(tensor_shape, **kw) -> torch.Tensor:
    """The activation from the previous stage."""
    return _communicate(None, None, True, False, tensor_shape, **kw)[0]


def recv_backward(tensor_shape, **kw) -> torch.Tensor:
    """The gradient of this stage's output, from the next stage."""
    return _communicate(None, None, False, True, tensor_shape, **kw)[1]


def send_forward(output_tensor: torch.Tensor | None, **kw) -> None:
    if output_tensor is not None:
        _communicate(output_tensor, None, False, False, output_tensor.shape, **kw)


def send_backward(input_tensor_grad: torch.Tensor | None, **kw) -> None:
    if input_tensor_grad is not None:
        _communicate(None, input_tensor_grad, False, False, input_tensor_grad.shape, **kw)


def send_forward_recv_backward(output_tensor: torch.Tensor | None, tensor_shape, **kw) -> torch.Tensor | None:
    """Send this micro-batch's output on, receive the gradient for the backward that comes next (1F1B).
    Nothing on the last stage (output_tensor None: it has no next stage)."""
    if output_tensor is None:
        return None
    return _communicate(output_tensor, None, False, True, tensor_shape, **kw)[1]


def send_backward_recv_forward(input_tensor_grad: torch.Tensor | None, tensor_shape, **kw) -> torch.Tensor | None:
    """Send this backward's input gradient back, receive the activation for the next forward (1F1B).
    Nothing on the first stage (input_tensor_grad None: it has no previous stage)."""
    if input_tensor_grad is None:
        return None
    return _communicate(None, input_tensor_grad, True, False, tensor_shape, **kw)[0]


def send_forward_recv_forward(output_tensor: torch.Tensor | None, recv_prev: bool, tensor_shape,
                              **kw) -> torch.Tensor | None:
    return _communicate(output_tensor, None, recv_prev, False, tensor_shape, **kw)[0]


def send_backward_recv_backward(input_tensor_grad: torch.Tensor | None, recv_next: bool, tensor_shape,
                                **kw) -> torch.Tensor | None:
    return _communicate(None, input_tensor_grad, False, recv_next, tensor_shape, **kw)[1]


def send_forward_backward_recv_forward_backward(output_tensor: torch.Tensor | None,
                                                input_tensor_grad: torch.Tensor | None, recv_prev: bool,
                                                recv_next: bool, tensor_shape, **kw):
    """The interleaved schedule's steady state: both directions, one batch. Returns (input, output grad)."""
    return _communicate(output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape, **kw)
