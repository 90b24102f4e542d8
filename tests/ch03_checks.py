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


def _one_f_one_b(forwards, backwards, w, *, backward_first=False, no_cooldown=False, newest=False, stack=False):
    ops = list(forwards[:w])
    n = len(forwards) - w
    for i in range(n):
        f, b = forwards[w + i], backwards[w + i] if newest else backwards[i]
        ops += [b, f] if backward_first else [f, b]
    if no_cooldown:
        return ops
    if stack:  # newest owed first everywhere: the cooldown in reverse too
        return ops + list(backwards[:w])[::-1]
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
                                      _one_f_one_b(forwards, backwards, w, newest=True),
                                  "the owed backwards run newest first (a stack): the steady state pairs each forward "
                                  "with its own backward and the cooldown runs in reverse; 1F1B runs the OLDEST owed "
                                  "backward (a queue)": _one_f_one_b(forwards, backwards, w, newest=True, stack=True)})
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


# ------------------------------------------------------------------ context parallelism
def check_rank_chunks() -> Verdict:
    """rank_chunks for cp 2-4, every rank, zigzag and plain."""
    from megalab.core.utils import rank_chunks

    for cp in (2, 3, 4):
        for zigzag in (True, False):
            got = [tuple(rank_chunks(cp, r, zigzag)) for r in range(cp)]
            right = [(r, 2 * cp - 1 - r) if zigzag else (2 * r, 2 * r + 1) for r in range(cp)]
            other = [(2 * r, 2 * r + 1) if zigzag else (r, 2 * cp - 1 - r) for r in range(cp)]  # the other split's
            if got == other and got != right:  # the other split's pairs: swapped, or the flag ignored?
                flipped = [tuple(rank_chunks(cp, r, not zigzag)) for r in range(cp)]
                name = ("zigzag and plain swapped" if flipped == right else
                        f"the zigzag flag is ignored: zigzag={zigzag} gives the same pairs as zigzag={not zigzag}")
                return mistake(name, f"rank_chunks(cp={cp}, rank, zigzag={zigzag}) for ranks 0..{cp - 1} is {got}, "
                                     f"expected {right}; with zigzag={not zigzag} it is {flipped}")
            verdict = named_equal(got, right, f"rank_chunks(cp={cp}, rank, zigzag={zigzag}) for ranks 0..{cp - 1}", {
                "zigzag gives rank r chunks r and r + 1; its second chunk is the mirror 2*cp - 1 - r":
                    [(r, r + 1) for r in range(cp)] if zigzag else None,
                "the mirror chunk off by one: 2*cp - r instead of 2*cp - 1 - r":
                    [(r, 2 * cp - r) for r in range(cp)] if zigzag else None,
                "plain split gives rank r chunks r and r + 1 instead of 2r and 2r + 1":
                    [(r, r + 1) for r in range(cp)] if not zigzag else None,
                "zigzag and plain swapped": [(2 * r, 2 * r + 1) if zigzag else (r, 2 * cp - 1 - r) for r in range(cp)]})
            if not verdict:
                return verdict
    return RIGHT


def check_causal_block_mask() -> Verdict:
    """causal_block_mask for every pair of 4 chunks."""
    from megalab.transformer_engine.context_parallel import causal_block_mask

    n = 4
    table = lambda rule: [[rule(i, j) for j in range(n)] for i in range(n)]  # [query chunk][key chunk]
    return named_equal(table(causal_block_mask), table(lambda i, j: "full" if j < i else "causal" if j == i else "skip"),
                       "causal_block_mask(query chunk i, key chunk j) for i, j in 0..3, as rows i", {
        "the wrong side of the diagonal: LATER key chunks full, earlier ones skipped (comparison reversed)":
            table(lambda i, j: "full" if j > i else "causal" if j == i else "skip"),
        "the diagonal block (same chunk) treated as full: no causal mask inside the chunk":
            table(lambda i, j: "full" if j <= i else "skip"),
        "the diagonal block skipped: a query then sees no key of its own chunk (not even itself)":
            table(lambda i, j: "full" if j < i else "skip"),
    })


def check_lse_merge() -> Verdict:
    """merge_attention of two key blocks vs attention over both: ordinary scores, starting from nothing
    (lse = -inf), and large scores (where exp(lse) alone overflows)."""
    import torch

    from megalab.lab.checks import close
    from megalab.transformer_engine.context_parallel import block_attention, merge_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))  # [b, np, s, hn]: keys 0..2
    k2, v2 = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)  # keys 3..7
    (o1, l1), (o2, l2) = block_attention(q, k, v), block_attention(q, k2, v2)
    ref_out, ref_lse = block_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    out, lse = merge_attention(o1, l1, o2, l2)
    new = torch.logaddexp(l1, l2).unsqueeze(-1)
    verdict = close(out, ref_out, "merge_attention's output (2 key blocks) vs attention over all keys", atol=1e-5,
                    mistakes={
        "the sign of the rescale flipped: exp(new_lse - lse) instead of exp(lse - new_lse)":
            o1 * torch.exp(new - l1.unsqueeze(-1)) + o2 * torch.exp(new - l2.unsqueeze(-1)),
        "the outputs added without rescaling each by its share exp(lse_part - new_lse)": o1 + o2,
        "the outputs averaged (0.5 each) instead of weighted by their softmax mass": (o1 + o2) / 2,
        "the rescale uses exp(lse_part) alone, not divided by exp(new_lse)":
            o1 * torch.exp(l1.unsqueeze(-1)) + o2 * torch.exp(l2.unsqueeze(-1)),
        "the new lse is the max of the two, not their log-sum-exp: the shares exp(lse_part - max) do not sum to 1":
            o1 * torch.exp(l1 - torch.maximum(l1, l2)).unsqueeze(-1) + o2 * torch.exp(l2 - torch.maximum(l1, l2)
                                                                                     ).unsqueeze(-1)})
    if not verdict:
        return verdict
    verdict = close(lse, ref_lse, "merge_attention's lse (2 key blocks) vs logsumexp over all keys", atol=1e-5, mistakes={
        "lse not updated: the old lse returned instead of log(e^lse + e^block_lse)": l1,
        "the new lse is the max of the two, not their log-sum-exp": torch.maximum(l1, l2),
        "the new lse is the sum of the two lse's": l1 + l2})
    if not verdict:
        return verdict
    out, lse = merge_attention(torch.zeros_like(o1), torch.full_like(l1, float("-inf")), o2, l2)
    verdict = close(out, o2, "merge_attention from nothing (out 0, lse -inf) and one block: the block's own output",
                    atol=1e-5)
    if not verdict:
        return verdict
    # fp32, as everywhere in the course: exp(1000) overflows (so would fp64's), and an lse of ~1000 is stored to
    # 6e-5 (fp32's spacing there), so the shares exp(lse - new_lse) may move by ~1e-4: the tolerance is 1e-3
    big_out, big_lse = merge_attention(o1, l1 + 1000.0, o2, l2 + 1000.0)  # the same shares, scores 1000 higher
    if not (torch.isfinite(big_out).all() and torch.isfinite(big_lse).all()):
        return mistake("log(exp(lse) + exp(block_lse)) without subtracting the max: exp overflows for large scores "
                       "(use torch.logaddexp)", "merging two blocks whose lse is ~1000 gives inf/NaN")
    return close(big_out, ref_out, "merge_attention with every lse 1000 higher (the shares, so the output, unchanged; "
                 "fp32, tolerance 1e-3: an lse of 1000 is stored to 6e-5 in fp32)", atol=1e-3, rtol=0)


RING_MISTAKES = {
    "unbatched": "isend and irecv posted one by one, not as ONE batch_isend_irecv: on NCCL every rank's lone send can "
                 "wait for a receive its neighbour never reaches (deadlock)",
    "backwards": "the ring runs backwards: sends to the previous rank (me - 1) and receives from the next (me + 1)",
    "in place": "receives into the tensor it is sending (no fresh buffer): the block being sent and read is overwritten",
    "returned": "returned the tensor it sent instead of the received buffer",
}


def check_ring_step() -> Verdict:
    """ring_step on 3 ranks: recorded (megalab/extras/p2p_model.py), ONE batch of send -> rank + 1 and receive <- rank - 1
    into a fresh buffer; run on a threaded world, each rank ends with its previous rank's tensor."""
    import torch

    from megalab.extras import p2p_model as pm
    from megalab.transformer_engine.context_parallel import ring_step
    from tests import threaded_world

    world, sent = 3, {}

    def record(rank, group):
        sent[rank] = torch.full((2,), float(rank))
        buffer, requests = ring_step(sent[rank], group)
        if buffer is sent[rank] or buffer.data_ptr() == sent[rank].data_ptr():
            raise _Named(RING_MISTAKES["in place"], f"rank {rank}'s buffer shares the sent tensor's memory")

    class _Named(Exception):
        pass

    try:
        streams = pm.record(record, world)
    except _Named as e:
        return mistake(*e.args)
    for rank, units in streams.items():
        ops = [op for unit in units for op in unit]
        peers = sorted((op.op, op.peer) for op in ops)
        if peers == sorted([("send", (rank - 1) % world), ("recv", (rank + 1) % world)]):
            return mistake(RING_MISTAKES["backwards"], f"rank {rank} posts {[str(op) for op in ops]}")
        if len(units) > 1:
            return mistake(RING_MISTAKES["unbatched"], f"rank {rank} posts {len(units)} separate units "
                           f"{[[str(op) for op in u] for u in units]}")
        verdict = equal(peers, sorted([("send", (rank + 1) % world), ("recv", (rank - 1) % world)]),
                        f"ring_step on rank {rank} of {world}: the (operation, peer) pairs it posts")
        if not verdict:
            return verdict

    def run(rank, group):
        buffer, requests = ring_step(torch.full((2,), float(rank)), group)
        for request in requests:
            request.wait()
        return buffer.tolist()

    got = threaded_world.run(world, run)
    verdict = named_equal([got[r] for r in range(world)], [[float((r - 1) % world)] * 2 for r in range(world)],
                          f"what ring_step's buffer holds after the wait on ranks 0..{world - 1} (each sends its rank)",
                          {RING_MISTAKES["returned"]: [[float(r)] * 2 for r in range(world)]})
    if not verdict:
        return verdict
    sub = threaded_world.Group([1, 2, 3])  # a CP group whose group ranks are not its global ranks

    def run_sub(rank, group):
        if rank not in sub.ranks:
            return None
        buffer, requests = ring_step(torch.full((2,), float(rank)), sub)
        for request in requests:
            request.wait()
        return buffer.tolist()

    what = "ring_step on the CP group of global ranks [1, 2, 3] of 4 threaded ranks (it passed on the whole world)"
    try:
        got = threaded_world.World(4, timeout=5.0).run(run_sub)
    except (threaded_world.WorldStuck, ValueError, RuntimeError) as e:
        return mistake("peers given as group ranks: the P2POp peers are GLOBAL ranks, ranks[(me + 1) % n] and "
                       "ranks[(me - 1) % n]", f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}")
    expected = {1: [3.0] * 2, 2: [1.0] * 2, 3: [2.0] * 2}
    return named_equal({r: got[r] for r in sub.ranks}, expected, f"{what}: the buffers of global ranks 1, 2, 3", {
        "peers given as group ranks: the P2POp peers are GLOBAL ranks, ranks[(me + 1) % n] and ranks[(me - 1) % n]":
            None})


def _cp_attention_grads(cp: int, seed: int = 3):
    """Ring attention (zigzag) on a threaded world of cp ranks vs SDPA on the full sequence: per rank the positions,
    ours (out, dq, dk, dv) and the reference's; plus the partial dK/dV that each rank's queries alone give."""
    import torch
    import torch.nn.functional as F

    from megalab.core.utils import cp_rank_positions
    from megalab.transformer_engine.context_parallel import context_parallel_attention
    from tests import threaded_world

    b, np_, ng, hn, s = 1, 2, 1, 4, 4 * cp
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, s, hn, generator=g) for n in (np_, ng, ng, np_))
    pos = {r: cp_rank_positions(s, cp, r) for r in range(cp)}

    def sdpa(dout_rows=None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(np_ // ng, 1) for t in leaves[1:]),
                                             is_causal=True)
        d = dout if dout_rows is None else torch.zeros_like(dout).index_copy(2, dout_rows, dout[:, :, dout_rows])
        out.backward(d)
        return out.detach(), *(t.grad for t in leaves)

    ref = sdpa()
    partial = {r: sdpa(pos[r]) for r in range(cp)}  # the gradients that rank r's queries alone produce

    def run(rank, group):
        local = [t[:, :, pos[rank]].clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, group)
        out.backward(dout[:, :, pos[rank]])
        return out.detach(), *(t.grad for t in local)

    def dq_overwritten(rank):  # the backward ring with dq[rows] = (not +=) each block pair's dq
        from megalab.core.utils import rank_chunks
        from megalab.transformer_engine import context_parallel as cpm

        ql, dl = q[:, :, pos[rank]], dout[:, :, pos[rank]]
        scores = ql @ k.repeat_interleave(np_ // ng, 1).transpose(-1, -2) / hn**0.5
        lse = scores.masked_fill(pos[rank][:, None] < torch.arange(s)[None, :], float("-inf")).logsumexp(-1)
        dq, c = torch.zeros_like(ql), s // (2 * cp)
        for step in range(cp):
            owner = (rank - step) % cp
            kb, vb = k[:, :, pos[owner]], v[:, :, pos[owner]]
            for rows, cols, kind in cpm._block_pairs(rank_chunks(cp, rank), rank_chunks(cp, owner), c):
                dq[:, :, rows] = cpm.block_attention_backward(ql[:, :, rows], kb[:, :, cols], vb[:, :, cols],
                                                              ref[0][:, :, pos[rank]][:, :, rows], lse[:, :, rows],
                                                              dl[:, :, rows], cpm._mask(kind, c, q.device))[0]
        return dq

    return pos, threaded_world.run(cp, run), ref, partial, dq_overwritten


def check_backward_ring() -> Verdict:
    """dq, dk, dv of ring attention (zigzag, cp = 2 and 3, threaded world) vs SDPA's on the full sequence."""
    import functools

    import torch

    from megalab.lab.checks import close
    from tests.threaded_world import WorldStuck

    for cp in (2, 3):
        try:
            pos, ours, ref, partial, dq_overwritten = _cp_attention_grads(cp)
        except WorldStuck as e:
            return mistake("a rank waits for a message no rank sends: the sends and receives of the backward ring do "
                           "not pair up (a ring_step on some ranks or steps only?)", f"cp={cp}: {e}")
        for rank in range(cp):
            where = f"ring attention, cp={cp}, rank {rank}"
            verdict = close(ours[rank][0], ref[0][:, :, pos[rank]], f"{where}: the output vs SDPA's", atol=1e-5)
            for i, name in ((2, "dk"), (3, "dv"), (1, "dq")):
                if not verdict:
                    return verdict
                mistakes = {"dq overwritten by each block pair (dq[rows] = ...) instead of accumulated (+=)":
                            functools.partial(dq_overwritten, rank)} if name == "dq" else {
                    "forgot the last hop home: each rank ends up with the dK/dV of the block one rank further on "
                    "(send dkv once more after the loop)": ref[i][:, :, pos[(rank + 1) % cp]],
                    "dK/dV never travel with their block: each rank adds every visiting block's gradient into its "
                    "own dkv": sum(partial[rank][i][:, :, pos[o]] for o in range(cp)),
                    "dK/dV left at zero (never accumulated)": torch.zeros_like(ours[rank][i]),
                    "dK/dV restarted at zero every step (they must travel with their block): only the last visitor's "
                    "share reaches the owner": partial[(rank - 1) % cp][i][:, :, pos[rank]]}
                verdict = close(ours[rank][i], ref[i][:, :, pos[rank]], f"{where}: {name} vs SDPA's", atol=1e-5,
                                mistakes=mistakes)
            if not verdict:
                return verdict
    return RIGHT


# ------------------------------------------------------------------ mixture of experts
def check_capacity(logits, topk: int, capacity_factor: float) -> Verdict:
    """topk_softmax_with_capacity's dropping: which (token, expert) pairs stay, and their weights."""
    import math

    import torch

    from megalab.core.transformer.moe.moe_utils import topk_softmax_with_capacity
    from megalab.lab.checks import close

    num_tokens, num_experts = logits.shape
    probs, routed, _ = topk_softmax_with_capacity(logits, topk)  # before dropping
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    arrival = routed.long().cumsum(0) - 1  # [T, E]
    by_weight = torch.zeros_like(routed)
    for e in range(num_experts):
        tokens = routed[:, e].nonzero().flatten()
        best = probs[tokens, e].argsort(descending=True, stable=True)[:capacity]
        by_weight[tokens[best], e] = True
    pairs = lambda m: sorted(map(tuple, m.nonzero().tolist()))
    got_probs, got_map, _ = topk_softmax_with_capacity(logits, topk, capacity_factor)
    where = f"topk_softmax_with_capacity({num_tokens} tokens, top-{topk}, capacity_factor={capacity_factor}: {capacity} " \
            "per expert)"
    verdict = named_equal(pairs(got_map), pairs(routed & (arrival < capacity)), f"{where}: the kept (token, expert) "
                          "pairs (each expert keeps its first tokens, in token order)", {
        "off by one: arrival <= capacity keeps capacity + 1 tokens per expert": pairs(routed & (arrival <= capacity)),
        "off by one: arrivals counted from 1 (cumsum without - 1) keep capacity - 1 tokens per expert":
            pairs(routed & (arrival + 1 < capacity)),
        "arrivals counted along the wrong dim (cumsum over experts, dim 1, instead of over tokens, dim 0)":
            pairs(routed & (routed.long().cumsum(1) - 1 < capacity)),
        "kept the highest weights per expert instead of the first arrivals (position is the policy here)":
            pairs(by_weight),
        "nothing dropped: the capacity never applied": pairs(routed)})
    if not verdict:
        return verdict
    return close(got_probs, probs * got_map, f"{where}: the weights (0 for dropped pairs)", rtol=0, atol=0, mistakes={
        "dropped tokens keep their weight: probs not masked with the kept map": probs})


def check_alltoall_dispatch() -> Verdict:
    """MoEAlltoAllTokenDispatcher.token_permutation on a threaded world (ep = 2, 2 local experts each, uneven
    routing): the rows each rank receives, grouped [local expert][source rank], and its tokens per local expert."""
    import torch

    from megalab.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megalab.lab.checks import close
    from tests import threaded_world

    ep, num_local, tokens = 2, 2, 5
    maps = {0: [[1, 1, 0, 0], [1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 1, 0], [1, 1, 0, 0]],  # [T, E] per source rank
            1: [[0, 0, 1, 1], [1, 0, 0, 1], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1]]}  # rank 0 sends 3 rows to 1, gets 2
    maps = {r: torch.tensor(m, dtype=torch.bool) for r, m in maps.items()}
    hidden = {r: (100 * r + torch.arange(tokens, dtype=torch.float)).unsqueeze(1).expand(tokens, 3).clone()
              for r in range(ep)}  # row value = 100 * rank + token

    def run(rank, group):
        dispatcher = MoEAlltoAllTokenDispatcher(num_local, [rank * num_local + i for i in range(num_local)], group)
        probs = maps[rank].float() / 2
        permuted, per_expert = dispatcher.token_permutation(hidden[rank], probs, maps[rank])
        return permuted[:, 0].tolist(), per_expert.tolist()

    world = threaded_world.World(ep)
    try:
        got = world.run(run)
    except (RuntimeError, ValueError, threaded_world.WorldStuck) as e:
        verdict = _alltoall_splits(world.log, maps, ep, num_local)
        if verdict is not None:
            return verdict
        if isinstance(e, threaded_world.WorldStuck):
            return mistake("a rank waits for a collective the others never join (all_gather / all_to_all on one "
                           "rank only, or on another group?)", str(e))
        raise
    verdict = _alltoall_splits(world.log, maps, ep, num_local)
    if verdict is not None:
        return verdict
    for rank in range(ep):
        local = [rank * num_local + i for i in range(num_local)]
        rows = lambda order: [100.0 * s + t for e, s in order for t in range(tokens) if maps[s][t, e]]
        expected = rows([(e, s) for e in local for s in range(ep)])
        where = f"ep=2, rank {rank}: the rows token_permutation returns (value = 100 * source rank + token)"
        verdict = close(got[rank][0], expected, where, rtol=0, atol=0, mistakes={
            "forgot to sort the received chunks by local expert (sort_chunks_by_idxs): they stay [source rank][expert]":
                rows([(e, s) for s in range(ep) for e in local])}) if len(got[rank][0]) == len(expected) else \
            equal(len(got[rank][0]), len(expected), f"ep=2, rank {rank}: the number of rows token_permutation returns "
                  "(every token copy routed to this rank's experts)")
        if not verdict:
            return verdict
        counts = [sum(int(maps[s][:, e].sum()) for s in range(ep)) for e in local]
        verdict = equal(got[rank][1], counts, f"ep=2, rank {rank}: tokens per local expert (over all source ranks)")
        if not verdict:
            return verdict
    return RIGHT


def _alltoall_splits(log, maps, ep: int, num_local: int) -> Verdict | None:
    """A named verdict when the all-to-all's split sizes (from the threaded world's log) are wrong, else None."""
    right = {}
    for rank in range(ep):
        local = [rank * num_local + i for i in range(num_local)]
        sends = [int(maps[rank][:, [d * num_local + i for i in range(num_local)]].sum()) for d in range(ep)]
        receives = [int(maps[s][:, local].sum()) for s in range(ep)]
        right[rank] = dict(output_split_sizes=receives, input_split_sizes=sends)
    calls = {rank: args for rank, name, args in log if name == "all_to_all_single"}
    gathered = {rank for rank, name, _ in log if name == "all_gather"}
    for rank in range(ep):
        if rank not in calls or calls[rank] == right[rank]:
            continue
        got, want = calls[rank], right[rank]
        detail = (f"rank {rank} passed output_split_sizes={got['output_split_sizes']}, input_split_sizes="
                  f"{got['input_split_sizes']}; it sends {want['input_split_sizes']} rows and receives "
                  f"{want['output_split_sizes']}")
        if (got["output_split_sizes"], got["input_split_sizes"]) == (want["input_split_sizes"],
                                                                      want["output_split_sizes"]):
            return mistake("output and input splits swapped: all_to_all(group, input, OUTPUT_split_sizes, "
                           "INPUT_split_sizes)", detail)
        if got["input_split_sizes"] == want["input_split_sizes"] and rank not in gathered:
            return mistake("the counts were never all_gathered: the output splits must come from what the OTHER "
                           "ranks route to this rank's experts", detail)
        return mistake("the all-to-all split sizes do not match the routing (input: rows per destination rank, "
                       "output: rows per source rank, from the all_gathered counts)", detail)
    return None
