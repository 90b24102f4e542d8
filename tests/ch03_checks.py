"""Checks that name the likely mistake, for chapter 03's pipeline, context-parallel and MoE exercises.

Each check compares a result with the right one and, when it differs, with what the typical wrong answers
give (tests/mistakes/ch03_pp_cp_moe.py lists them as mutants), so the verdict starts with
"likely mistake: <name>". The exercise tests call them first (fast, one process), before their heavy
multi-rank checks, and `megalab grade` shows the verdict's first line.
"""

from __future__ import annotations

from megalab.core.pipeline_parallel import schedules as pp
from megalab.core.pipeline_parallel.schedules import Op
from megalab.lab.checks import RIGHT, Verdict, equal, mistake, require


def named_equal(actual, expected, what: str, mistakes: dict | None = None) -> Verdict:
    """equal(), naming the first mistake whose value (or callable's value) `actual` equals."""
    verdict = equal(actual, expected, what)
    if verdict:
        return verdict
    for name, value in (mistakes or {}).items():
        if actual == (value() if callable(value) else value):
            return mistake(name, verdict.reason)
    return verdict


# ------------------------------------------------------------------ pipeline schedules (pure functions)
def _warmup_1f1b(p, r, m, v):
    return min(p - r - 1, m) if p > 1 else 0


def _warmup(p, r, m, v):
    """Megatron's get_pp_rank_microbatches warmup (the right answer, written independently)."""
    if p == 1:
        return 0
    return min((p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1, m * v)


WARMUP_MISTAKES = {  # name -> the warmup count that mistake gives
    "off by one: pp - rank instead of pp - rank - 1 (the last stage warms up too)":
        lambda p, r, m, v: 0 if p == 1 else min((p - r) * 2 + (v - 1) * p if v > 1 else p - r, m * v),
    "no cap: the warmup count is not limited to the number of forwards (m * v)":
        lambda p, r, m, v: 0 if p == 1 else ((p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1),
    "interleaved warmup without the doubling: (pp - rank - 1) + (v - 1) * pp":
        lambda p, r, m, v: 0 if p == 1 else min((p - r - 1) + (v - 1) * p if v > 1 else p - r - 1, m * v),
    "interleaved warmup without the other chunks' group: (v - 1) * pp missing":
        lambda p, r, m, v: 0 if p == 1 else min((p - r - 1) * 2 if v > 1 else p - r - 1, m * v),
}
WARMUP_CASES = [(4, 8, 1), (4, 2, 1), (1, 5, 1), (4, 8, 2), (2, 4, 3), (4, 4, 2)]


def check_num_warmup() -> Verdict:
    """get_num_warmup_microbatches for every rank of a few 1F1B and interleaved configurations."""
    for p, m, v in WARMUP_CASES:
        got = [pp.get_num_warmup_microbatches(p, r, m, v) for r in range(p)]
        verdict = named_equal(got, [_warmup(p, r, m, v) for r in range(p)],
                              f"get_num_warmup_microbatches(pp={p}, rank, m={m}{f', v={v}' if v > 1 else ''}) for ranks "
                              f"0..{p - 1}", {name: [f(p, r, m, v) for r in range(p)] for name, f in WARMUP_MISTAKES.items()})
        if not verdict:
            return verdict
    return RIGHT


def _table(m, v, g, *, loops_swapped=False, ignore_groups=False, overshoot=False):
    if ignore_groups:
        return [(mb, c) for c in range(v) for mb in range(m)]
    table = []
    for first in range(0, m, g):
        group = range(first, first + g if overshoot else min(first + g, m))
        table += ([(mb, c) for mb in group for c in range(v)] if loops_swapped else
                  [(mb, c) for c in range(v) for mb in group])
    return table


def check_schedule_table() -> Verdict:
    """get_schedule_table for Megatron's docstring example (m=5, v=2, groups of 3) and an even case."""
    for m, v, g in ((5, 2, 3), (4, 2, 2), (6, 3, 2)):
        got = [tuple(pair) for pair in pp.get_schedule_table(m, v, g)]
        verdict = named_equal(got, _table(m, v, g), f"get_schedule_table(m={m}, v={v}, group_size={g}) as (microbatch, "
                              "chunk) pairs", {
                                  "loops swapped: each micro-batch through every chunk, instead of each chunk through "
                                  "the whole group": _table(m, v, g, loops_swapped=True),
                                  "group_size ignored: all micro-batches on chunk 0, then all on chunk 1, ...":
                                      _table(m, v, g, ignore_groups=True),
                                  "the last group runs past the last micro-batch (group end not capped at m)":
                                      _table(m, v, g, overshoot=True)})
        if not verdict:
            return verdict
    return RIGHT


def _one_f_one_b(forwards, backwards, w, *, backward_first=False, no_cooldown=False, newest=False):
    ops = list(forwards[:w])
    n = len(forwards) - w
    for i in range(n):
        f, b = forwards[w + i], backwards[w + i] if newest else backwards[i]
        ops += [b, f] if backward_first else [f, b]
    if no_cooldown:
        return ops
    return ops + (list(backwards[:w]) if newest else list(backwards[n:]))


def check_one_f_one_b() -> Verdict:
    """_one_f_one_b on 4 micro-batches with 0, 2 and 4 warmup forwards (symbolic ops F0.. B0..)."""
    forwards, backwards = [Op("F", mb) for mb in range(4)], [Op("B", mb) for mb in range(4)]
    for w in (2, 0, 4, 3):
        got = pp._one_f_one_b(list(forwards), list(backwards), w)
        verdict = named_equal(got, _one_f_one_b(forwards, backwards, w),
                              f"_one_f_one_b(F0..F3, B0..B3, num_warmup={w})", {
                                  "steady state runs the backward before the forward (B F instead of F B)":
                                      _one_f_one_b(forwards, backwards, w, backward_first=True),
                                  "no cooldown: the backwards still owed after the steady state never run":
                                      _one_f_one_b(forwards, backwards, w, no_cooldown=True),
                                  "steady state pairs a forward with its OWN backward, not the oldest one in flight":
                                      _one_f_one_b(forwards, backwards, w, newest=True)})
        if not verdict:
            return verdict
    return RIGHT


def require_schedule_pieces() -> None:
    """The three schedule exercises, each named when wrong (warmup, interleaved table, 1F1B order)."""
    require(check_num_warmup())
    require(check_schedule_table())
    require(check_one_f_one_b())


# ------------------------------------------------------------------ p2p_communication._communicate
COMMUNICATE_MISTAKES = {
    "unbatched": "isend/irecv posted one by one, not as ONE batch_isend_irecv (_batched_p2p_ops): NCCL can deadlock",
    "no wait": "forgot to wait() on the requests: the buffers are returned before anything arrived",
    "dtype": "receive buffers not in the model's dtype (torch.empty without dtype=dtype: fp32)",
    "grad": "receive buffers without requires_grad=True: backward gives this stage no input gradient to send back",
    "order": "returned (from next, from prev) instead of (from prev, from next)",
}


def check_communicate() -> Verdict:
    """_communicate on 3 pipeline ranks, recorded with megalab/extras/p2p_model.py: rank 0 sends an activation on
    and receives a gradient, rank 2 the reverse, rank 1 both directions (as the interleaved steady state). One waited
    batch per call, buffers of the model's dtype (bf16 here) that require grad, NCCL's rules satisfied."""
    import torch

    from megalab.core.pipeline_parallel import p2p_communication as p2p
    from megalab.extras import p2p_model as pm

    shape, posted, returned = (2, 3), [], {}
    with pm.recording(3) as recorder:
        import torch.distributed as dist

        inner = {name: getattr(dist, name) for name in ("isend", "irecv", "batch_isend_irecv")}

        class Tracked:
            def __init__(self, request):
                self.request, self.done = request, False
                posted.append(self)

            def wait(self, *args, **kwargs):
                self.done = True
                return self.request.wait(*args, **kwargs)

            def is_completed(self):
                return self.done

        dist.isend = lambda *a, **k: Tracked(inner["isend"](*a, **k))
        dist.irecv = lambda *a, **k: Tracked(inner["irecv"](*a, **k))
        dist.batch_isend_irecv = lambda ops: [Tracked(r) for r in inner["batch_isend_irecv"](ops)]
        group = dist.group.WORLD
        for rank in range(3):
            recorder.rank = rank
            recorder.streams.setdefault(rank, [])
            x = torch.full(shape, float(rank), dtype=torch.bfloat16)
            before = len(recorder.streams[rank])
            send = (x, None, False, True) if rank == 0 else (None, x, True, False) if rank == 2 else (x, x, True, True)
            got = p2p._communicate(*send, shape, group=group)  # 0 <-> 1 <-> 2: each exchange complements the other
            returned[rank] = got
            units = recorder.streams[rank][before:]
            if len(units) > 1:
                return mistake(COMMUNICATE_MISTAKES["unbatched"],
                               f"rank {rank} posted {len(units)} separate units: {[[str(op) for op in u] for u in units]}")
            if any(not t.done for t in posted):
                return mistake(COMMUNICATE_MISTAKES["no wait"], f"rank {rank}: {sum(not t.done for t in posted)} of "
                               f"{len(posted)} requests never waited on")
    for rank, wants in ((0, (1,)), (2, (0,)), (1, (0, 1))):  # which of (from prev, from next) each call asked for
        got = returned[rank]
        if not isinstance(got, tuple) or len(got) != 2:
            return mistake(COMMUNICATE_MISTAKES["order"], f"rank {rank} returned {type(got).__name__}, expected a pair")
        present = [t is not None for t in got]
        if present != [i in wants for i in range(2)]:
            if present[::-1] == [i in wants for i in range(2)]:
                return mistake(COMMUNICATE_MISTAKES["order"], f"rank {rank} asked for the tensor from "
                               f"{'next' if wants == (1,) else 'prev'} and got it in the other position")
            return equal(present, [i in wants for i in range(2)],
                         f"rank {rank}: which of (from prev, from next) _communicate returned (not None)")
        for buffer in (got[i] for i in wants):
            if buffer.dtype != torch.bfloat16:
                return mistake(COMMUNICATE_MISTAKES["dtype"], f"rank {rank}'s receive buffer is {buffer.dtype}, the "
                               "model's dtype is torch.bfloat16")
            if tuple(buffer.shape) != shape:
                return equal(tuple(buffer.shape), shape, f"rank {rank}: the receive buffer's shape (tensor_shape)")
            if not buffer.requires_grad:
                return mistake(COMMUNICATE_MISTAKES["grad"], f"rank {rank}'s received tensor")
    try:
        pm.replay(recorder.streams)
    except (pm.P2PDeadlock, pm.P2PMismatch) as e:
        return mistake(f"the exchange breaks NCCL's rules ({type(e).__name__})", str(e).replace("\n", " "))
    return RIGHT
