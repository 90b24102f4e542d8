"""Named mistakes of chapter 03's pipeline, context-parallel, MoE and combining exercises (issue 27).

Each is a typical wrong answer, runnable and different in behaviour from the reference; the exercise's first
failing test must fail on it and its verdict must contain `says` (tests/ch03_checks.py and the focused first
tests in tests/test_{p2p_model,pipeline_parallel,context_parallel,moe,hybrid}.py do the naming).
"""

from tests.mistakes import Mistake

MISTAKES = [
    # ------------------------------------------------------------------ pp.communicate
    Mistake("pp.communicate", "each isend/irecv posted on its own (no batch)", says="not as ONE batch_isend_irecv", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = []
if tensor_send_next is not None:
    requests.append(dist.isend(tensor_send_next, next_rank, group=group, tag=ACTIVATION_TAG))
if tensor_recv_prev is not None:
    requests.append(dist.irecv(tensor_recv_prev, prev_rank, group=group, tag=ACTIVATION_TAG))
if tensor_send_prev is not None:
    requests.append(dist.isend(tensor_send_prev, prev_rank, group=group, tag=GRADIENT_TAG))
if tensor_recv_next is not None:
    requests.append(dist.irecv(tensor_recv_next, next_rank, group=group, tag=GRADIENT_TAG))
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "returns the buffers without waiting for the batch", says="forgot to wait()", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
_batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                 tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                 group=group, prev_rank=prev_rank, next_rank=next_rank)
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "receive buffers in the default fp32, not the model's dtype", says="not in the model's dtype",
            code="""
empty = lambda: torch.empty(tensor_shape, device=device, requires_grad=True)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                            group=group, prev_rank=prev_rank, next_rank=next_rank)
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    Mistake("pp.communicate", "receive buffers without requires_grad", says="without requires_grad", code="""
empty = lambda: torch.empty(tensor_shape, dtype=dtype, device=device)
tensor_recv_prev = empty() if recv_prev else None
tensor_recv_next = empty() if recv_next else None
requests = _batched_p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                            group=group, prev_rank=prev_rank, next_rank=next_rank)
for request in requests:
    request.wait()
return tensor_recv_prev, tensor_recv_next
"""),
    # ------------------------------------------------------------------ pp.stage_split
    Mistake("pp.stage_split", "inclusive stop (start + per_stage - 1)", says="the stop is inclusive", code="""
per_stage = num_layers // num_stages
start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
return start, start + per_stage - 1
"""),
    Mistake("pp.stage_split", "a rank's chunks adjacent: stage pp_rank * v + chunk", says="pp_rank * v + chunk", code="""
per_stage = num_layers // num_stages
start = (pp_rank * num_model_chunks + chunk) * per_stage
return start, start + per_stage
"""),
    Mistake("pp.stage_split", "layers per stage from pp_size only", says="the model chunks (v) left out", code="""
per_stage = num_layers // pp_size
start = virtual_stage(pp_size, pp_rank, chunk) * per_stage
return start, start + per_stage
"""),
    # ------------------------------------------------------------------ pp.num_warmup
    Mistake("pp.num_warmup", "off by one: pp - rank warmup forwards (the last stage warms up too)", says="off by one",
            code="""
total = num_microbatches * num_model_chunks
if pp_size == 1:
    return 0
if num_model_chunks == 1:
    warmup = pp_size - pp_rank
else:
    warmup = (pp_size - pp_rank) * 2 + (num_model_chunks - 1) * pp_size
return min(warmup, total)
"""),
    Mistake("pp.num_warmup", "forgot to cap the warmup at the number of forwards", says="no cap", code="""
if pp_size == 1:
    return 0
if num_model_chunks == 1:
    return pp_size - pp_rank - 1
return (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * pp_size
"""),
    Mistake("pp.num_warmup", "interleaved: the (v - 1) * pp term missing", says="other chunks' group", code="""
total = num_microbatches * num_model_chunks
if pp_size == 1:
    return 0
warmup = pp_size - pp_rank - 1
if num_model_chunks > 1:
    warmup *= 2
return min(warmup, total)
"""),
    # ------------------------------------------------------------------ pp.schedule_table
    Mistake("pp.schedule_table", "loops swapped: micro-batch outer, chunk inner", says="loops swapped", code="""
table = []
for first in range(0, num_microbatches, group_size):
    group = range(first, min(first + group_size, num_microbatches))
    table.extend((microbatch, chunk) for microbatch in group for chunk in range(num_model_chunks))
return table
"""),
    Mistake("pp.schedule_table", "group_size ignored", says="group_size ignored", code="""
return [(microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in range(num_microbatches)]
"""),
    Mistake("pp.schedule_table", "the last group not capped at num_microbatches", says="last group runs past", code="""
table = []
for first in range(0, num_microbatches, group_size):
    group = range(first, first + group_size)
    table.extend((microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in group)
return table
"""),
    # ------------------------------------------------------------------ pp.one_f_one_b
    Mistake("pp.one_f_one_b", "steady state: backward before forward", says="backward before the forward", code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [backwards[i], forwards[num_warmup + i]]
return ops + backwards[len(forwards) - num_warmup:]
"""),
    Mistake("pp.one_f_one_b", "no cooldown backwards", says="no cooldown", code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [forwards[num_warmup + i], backwards[i]]
return ops
"""),
    Mistake("pp.one_f_one_b", "steady state runs the backward of the micro-batch just forwarded", says="its OWN backward",
            code="""
ops = forwards[:num_warmup]
for i in range(len(forwards) - num_warmup):
    ops += [forwards[num_warmup + i], backwards[num_warmup + i]]
return ops + backwards[:num_warmup]
"""),
]
