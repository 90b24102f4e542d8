"""Context parallelism: split the SEQUENCE of every layer across the CP ranks; attention passes K/V.

Everything but attention works token by token, so a rank can run it on its own s/cp tokens.
Attention needs every earlier key: ring attention (Megatron's "p2p" CP, Transformer Engine's
AttnFuncWithCPAndKVP2P) passes the K/V blocks around the CP ring, cp steps, computing the next
block's attention while the following one is in flight, and merges the partial results exactly
with their log-sum-exp (the online softmax of FlashAttention):

    step 0: rank r attends to its own K/V block        send K/V_r     -> r+1, recv K/V_{r-1}
    step 1: rank r attends to K/V_{r-1}                send K/V_{r-1} -> r+1, recv K/V_{r-2}
    ...     out = merge(out, block_out) by lse        (cp-1 blocks received, forward)

Under a causal mask a plain split is lopsided (rank 0 attends to one block, the last rank to
all). The zigzag (load-balanced) split cuts the sequence into 2 cp chunks and gives rank r the
chunks r and 2cp-1-r, so every rank does the same work (cp=2: rank 0 holds 0,3; rank 1 holds 1,2):

    chunks  0 1 2 3          query chunk i vs key chunk j:  j < i full,  j == i causal,  j > i skip
    rank    0 1 1 0

Backward runs the ring again: K/V travel once more (cp-1 hops) and their gradients dK/dV travel
with them, each rank adding its share, until they are back home (cp hops). Our all-gather variant
gathers all K/V instead, keeps them for backward, and reduce-scatters dK/dV: fewer messages, no
overlap, the full K/V in memory on every rank. TE's AttnFuncWithCPAndKVAllGather saves only the local
K/V and all-gathers them again in backward: re-communication instead of that memory (`"all_gather_te"` here).

All-to-all (Ulysses, TE's AttnFuncWithCPAndQKVOA2A, cp_comm_type "a2a") swaps what is split instead:

    [b, h, s/cp, hn] --all-to-all--> [b, h/cp, s, hn] --causal attention--> --all-to-all--> [b, h, s/cp, hn]

so heads AND key/value heads (GQA) must divide cp. "a2a+p2p" (hierarchical_context_parallel_sizes = [a2a, p2p])
runs the all-to-all inside each a2a group and the ring across the p2p group (hierarchical_attention).

Megatron: the CP group is `get_context_parallel_group()` (rank order tp-cp-ep-dp-pp); the batch is
split by `get_batch_on_this_cp_rank` (megatron/core/utils.py), RoPE angles by
`get_pos_emb_on_this_cp_rank` (rope_utils.py); the attention is TE's
`attn_forward_func_with_cp` (transformer_engine/pytorch/attention/.../context_parallel.py) behind
TEDotProductAttention; gradients are reduced over the dp-cp group. Here the online-softmax math is
written out in fp32 on [b, heads, tokens, hn] tensors; TE calls flash-attention kernels per block.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalab.core import parallel_state as ps
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import cp_rank_positions, rank_chunks


def _group(group):
    """`group`, or the current ParallelState's context-parallel group (parallel_state.resolve_group)."""
    return ps.resolve_group(group, "cp", alone=False)


# ------------------------------------------------------------------ one block pair, exactly
def causal_block_mask(q_chunk: int, kv_chunk: int) -> str:
    """How chunk q_chunk's queries see chunk kv_chunk's keys under a causal mask:
    "full" (all earlier), "causal" (the same chunk: lower triangle) or "skip" (all later)."""
    # EXERCISE cp.causal_block_mask: compare the chunk ids
    ### BEGIN SOLUTION
    # HINT 1: Under a causal mask a query sees the keys at its own position and before. Between whole chunks
    #         that means: keys from an earlier chunk are all visible, from a later chunk none.
    # HINT 2: Compare the key chunk id with the query chunk id: smaller -> "full", equal -> "causal"
    #         (the lower triangle of the diagonal block), larger -> "skip".
    if kv_chunk < q_chunk:
        return "full"
    return "causal" if kv_chunk == q_chunk else "skip"
    ### END SOLUTION


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: [b, ng, s, hn] -> [b, np, s, hn], each key/value head serving np/ng query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores(q, k, mask):
    scores = q @ _expand_kv(k, q.shape[1]).transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))  # [b, np, sq, sk]
    return scores if mask is None else scores.masked_fill(mask, float("-inf"))


def block_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(hn)) v on one block pair, and the log-sum-exp of each query's scores.

    q [b, np, sq, hn], k/v [b, ng, sk, hn], mask [sq, sk] bool (True: hidden) or None
    -> out [b, np, sq, hn], lse [b, np, sq]   (every query must see at least one key)
    """
    scores = _scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ _expand_kv(v, q.shape[1])
    return out, lse


def block_attention_backward(q, k, v, out, lse, dout, mask=None):
    """Gradients of one block pair given the FINAL out and lse of the merged attention (as
    FlashAttention's backward): p = exp(scores - lse), dS = p * (dP - rowsum(dout * out)).
    Returns dq [b, np, sq, hn] and dk, dv [b, ng, sk, hn] (GQA: summed over each group's heads)."""
    np_, ng = q.shape[1], k.shape[1]
    p = torch.exp(_scores(q, k, mask) - lse.unsqueeze(-1))  # [b, np, sq, sk]
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ _expand_kv(v, np_).transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * (1.0 / math.sqrt(q.shape[-1]))
    dq = ds @ _expand_kv(k, np_)
    dk = ds.transpose(-1, -2) @ q
    if ng != np_:
        dk, dv = (t.unflatten(1, (ng, np_ // ng)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def merge_attention(out, lse, block_out, block_lse):
    """Combine two partial attentions over disjoint key sets into the attention over both.

    out, block_out [b, np, sq, hn], lse, block_lse [b, np, sq] -> (out, lse), out weighted by
    each part's share of the total softmax mass: exp(lse_part - lse_total). lse may be -inf
    (nothing seen yet). TE: flash_attn_fwd_out_correction / softmax_lse correction.
    """
    # EXERCISE cp.lse_merge: new lse = log(e^lse + e^block_lse); rescale both outputs by their share and add
    ### BEGIN SOLUTION
    # HINT 1: Two partial softmaxes over disjoint key sets: the log-sum-exp of the union is the log of the
    #         sum of their exponentials, and each partial output counts with its share of the total mass.
    # HINT 2: torch.logaddexp gives the new lse stably (no overflow, -inf handled); rescale each output
    #         by exp(its lse - new lse), unsqueezed over the head dim, and add them.
    # HINT 3: exp(lse) on its own overflows for large scores; the shares are exp of differences, always <=
    #         1.
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse
    ### END SOLUTION


def _mask(kind: str, c: int, device) -> torch.Tensor | None:
    """The [c, c] mask of a block pair: none for "full", the upper triangle for "causal"."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1) if kind == "causal" else None


@dataclass
class AttentionWork:
    """What one rank's attention computed: block pairs, as a causal kernel counts them
    (a diagonal block is half a block), their FLOPs (QK^T and PV, 4 b np sq sk hn per full block)
    and the seconds spent computing them (forward only; `compute_clock`: on CPU this thread's time, so
    other processes sharing the cores do not count; on a GPU wall time after a synchronize)."""

    blocks: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, kind: str, q: torch.Tensor, num_keys: int, seconds: float) -> None:
        """One computed block pair: q [b, np, sq, hn] its queries against num_keys keys."""
        share = 0.5 if kind == "causal" else 1.0
        b, np_, sq, hn = q.shape
        self.blocks += share
        self.flops += share * 4 * b * np_ * sq * num_keys * hn
        self.seconds += seconds


def _block_pairs(q_chunks, kv_chunks, c):
    """(rows, cols, kind) of the block pairs a causal mask does not skip;
    rows/cols slice this rank's queries and the K/V block (two chunks of c tokens each)."""
    return [(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), causal_block_mask(qc, kc))
            for i, qc in enumerate(q_chunks) for j, kc in enumerate(kv_chunks) if causal_block_mask(qc, kc) != "skip"]


def compute_clock(device: torch.device) -> float:
    """A clock for compute time: CPU time of this thread, or on CUDA (kernels run asynchronously) the
    wall time once the device has finished its queued work."""
    if device.type == "cuda":
        from megalab.extras.profiling import device_time

        return device_time(device)
    return time.thread_time()


# ------------------------------------------------------------------ the ring
def ring_step(tensor: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Post the exchange around the CP ring: send `tensor` to the next rank, receive the previous
    rank's into a new buffer. Returns (buffer, requests); wait on the requests before reading it.

    Send and receive go out as ONE batch (`dist.batch_isend_irecv`): a lone isend on every rank of the
    ring can wait forever under NCCL for a receive its neighbour posts only after its own send
    (megalab/extras/p2p_model.py). TE's flash_attn_p2p_communicate batches too at cp = 2 on GPUs
    before Blackwell (or with NVTE_BATCH_MHA_P2P_COMM=1) and otherwise orders the two by rank parity
    (even ranks send first, odd ranks receive first), also safe; its backward ring runs the other way
    (to rank − 1), carrying K/V and dK/dV in one buffer, where ours sends them as two batches per
    step, in the same order on every rank."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    # EXERCISE cp.ring_step: one batch_isend_irecv: send to ranks[me+1], receive from ranks[me-1] (mod cp)
    ### BEGIN SOLUTION
    # HINT 1: One hop of the ring: everybody passes its block to the next rank and gets the previous rank's,
    #         all at once, so nobody waits for a neighbour that is itself waiting.
    # HINT 2: A fresh buffer like the tensor; two dist.P2POp's (isend to ranks[(me + 1) % n], irecv from
    #         ranks[(me - 1) % n]) handed together to dist.batch_isend_irecv; return the buffer and the requests.
    # HINT 3: Peers are GLOBAL ranks: index `ranks` with the group rank. Never receive into the tensor you
    #         are sending.
    buffer = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), ranks[(me + 1) % len(ranks)], group),
                                       dist.P2POp(dist.irecv, buffer, ranks[(me - 1) % len(ranks)], group)])
    return buffer, requests
    ### END SOLUTION


def _wait(requests):
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """Ring attention over the CP group: q [b, np, s/cp, hn], kv [2, b, ng, s/cp, hn] (K and V in
    one buffer, one message per step) -> out [b, np, s/cp, hn]. fp32 throughout."""

    @staticmethod
    def forward(ctx, q, kv, group, zigzag, work):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        q_chunks, c = rank_chunks(cp, rank, zigzag), q.shape[2] // 2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = kv
        for step in range(cp):
            owner = (rank - step) % cp  # whose K/V this is
            if step + 1 < cp:
                next_block, requests = ring_step(block, group)  # in flight while we compute
            for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):
                start = compute_clock(q.device) if work is not None else 0.0
                block_out, block_lse = block_attention(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols],
                                                       _mask(kind, c, q.device))
                out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows],
                                                                   block_out, block_lse)
                if work is not None:
                    work.add(kind, q[:, :, rows], c, compute_clock(q.device) - start)
            if step + 1 < cp:
                _wait(requests)
                block = next_block
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, zigzag = ctx.group, ctx.zigzag
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        q_chunks, c = rank_chunks(cp, rank, zigzag), q.shape[2] // 2
        dq = torch.zeros_like(q)
        block, dkv = kv, None
        # K/V go round again; each rank adds to its dq, and adds its share of the visiting block's dK/dV to
        # the dkv travelling with that block; one last hop brings every dkv home to its owner.
        # EXERCISE cp.backward_ring: the backward ring: K/V and their dK/dV around the CP group, dq accumulated locally
        ### BEGIN SOLUTION
        # HINT 1: Each visiting K/V block collects its gradient on every rank it passes: dK/dV travel with
        #         their block around the ring, each rank adding its share, and one last hop brings them home.
        # HINT 2: cp steps: start dkv at zeros, later ring_step the previous step's dkv along (and
        #         wait); start the next K/V hop; for every block pair add dq into this rank's rows and dK/dV into the
        #         dkv's cols (block_attention_backward); wait for the K/V; after the loop one more ring_step of dkv if
        #         cp > 1.
        for step in range(cp):
            owner = (rank - step) % cp
            if dkv is None:
                dkv = torch.zeros_like(kv)
            else:  # the previous step's dkv moves one hop, with its block
                dkv, dkv_requests = ring_step(dkv, group)
                _wait(dkv_requests)
            if step + 1 < cp:
                next_block, kv_requests = ring_step(block, group)  # in flight while we compute
            for rows, cols, kind in _block_pairs(q_chunks, rank_chunks(cp, owner, zigzag), c):
                dq_ij, dk, dv = block_attention_backward(
                    q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
                    dout[:, :, rows], _mask(kind, c, q.device))
                dq[:, :, rows] += dq_ij
                dkv[0][:, :, cols] += dk
                dkv[1][:, :, cols] += dv
            if step + 1 < cp:
                _wait(kv_requests)
                block = next_block
        if cp > 1:  # the last hop home
            dkv, dkv_requests = ring_step(dkv, group)
            _wait(dkv_requests)
        ### END SOLUTION
        return dq, dkv, None, None, None


class AllGatherAttention(torch.autograd.Function):
    """The all-gather variant: gather every rank's K/V ([cp, 2, b, ng, s/cp, hn]), attend with a
    mask built from the global positions, keep the gathered K/V for backward, reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, q, kv, group, zigzag, work):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = kv.new_empty(cp * kv.shape[0], *kv.shape[1:])  # the ranks' blocks along dim 0
        dist.all_gather_single(gathered, kv.contiguous(), group=group)
        gathered = gathered.unflatten(0, (cp, 2))  # [cp, 2, b, ng, s/cp, hn]
        k, v = gathered.permute(1, 2, 3, 0, 4, 5).flatten(3, 4).unbind(0)  # [b, ng, s, hn], rank-major tokens
        s_local = q.shape[2]
        positions = [cp_rank_positions(s_local * cp, cp, r, zigzag) for r in range(cp)]
        mask = (positions[rank][:, None] < torch.cat(positions)[None, :]).to(q.device)  # key after query: hidden
        start = compute_clock(q.device) if work is not None else 0.0
        out, lse = block_attention(q, k, v, mask)
        if work is not None:
            work.add("masked", q, k.shape[2], compute_clock(q.device) - start)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        cp = dist.get_world_size(ctx.group)
        dq, dk, dv = block_attention_backward(q, k, v, out, lse, dout, mask)
        dkv_all = torch.stack([dk, dv]).unflatten(3, (cp, -1)).permute(3, 0, 1, 2, 4, 5)  # [cp, 2, b, ng, s/cp, hn]
        dkv = dkv_all.new_empty(dkv_all.shape[1:])
        dist.reduce_scatter_single(dkv, dkv_all.flatten(0, 1).contiguous(), group=ctx.group)  # summed, this rank's
        return dq, dkv, None, None, None


def _sequence_order(gathered: torch.Tensor, cp: int, zigzag: bool) -> torch.Tensor:
    """[..., cp * s/cp, hn] in rank-major order (rank 0's tokens, rank 1's, ...) -> the same in sequence order."""
    s = gathered.shape[-2]
    positions = torch.cat([cp_rank_positions(s, cp, r, zigzag) for r in range(cp)]).to(gathered.device)
    return gathered.index_select(-2, positions.argsort())


def _rank_major(full: torch.Tensor, cp: int, zigzag: bool) -> torch.Tensor:
    """The inverse of _sequence_order: [..., s, hn] in sequence order -> rank-major."""
    s = full.shape[-2]
    positions = torch.cat([cp_rank_positions(s, cp, r, zigzag) for r in range(cp)]).to(full.device)
    return full.index_select(-2, positions)


def _gather_kv(kv: torch.Tensor, group, zigzag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's [2, b, ng, s/cp, hn] -> k, v [b, ng, s, hn] in sequence order."""
    cp = dist.get_world_size(group)
    gathered = kv.new_empty(cp * kv.shape[0], *kv.shape[1:])
    dist.all_gather_single(gathered, kv.contiguous(), group=group)
    kv_all = gathered.unflatten(0, (cp, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [2, b, ng, s], rank-major
    return _sequence_order(kv_all, cp, zigzag).unbind(0)


def _prefix_mask(chunk: int, c: int, device) -> torch.Tensor:
    """Queries of chunk `chunk` (c tokens) against the keys 0 .. (chunk+1) c - 1: True (hidden) after the query."""
    return torch.ones(c, (chunk + 1) * c, dtype=torch.bool, device=device).triu(1 + chunk * c)


class AttnFuncWithCPAndKVAllGather(torch.autograd.Function):
    """All-gather CP as Transformer Engine does it (transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py, `AttnFuncWithCPAndKVAllGather`, Megatron's cp_comm_type "all_gather"): gather every
    rank's K/V (`gather_along_first_dim`, then reorder the chunks into sequence order), attend with each of
    this rank's two query chunks to the keys up to its end only (`get_kv_seq_info_after_all_gather`: the
    causal prefix, no work on later keys), and save only the LOCAL K/V for backward; the backward all-gathers
    them again, accumulates dK/dV over the whole sequence and reduce-scatters them
    (`reduce_scatter_along_first_dim`). q [b, np, s/cp, hn], kv [2, b, ng, s/cp, hn], fp32."""

    @staticmethod
    def forward(ctx, q, kv, group, zigzag, work):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        k, v = _gather_kv(kv, group, zigzag)  # [b, ng, s, hn], freed after the forward
        c = q.shape[2] // 2
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1])
        for i, chunk in enumerate(rank_chunks(cp, rank, zigzag)):
            rows, end = slice(i * c, (i + 1) * c), (chunk + 1) * c
            start = compute_clock(q.device) if work is not None else 0.0
            out[:, :, rows], lse[:, :, rows] = block_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end],
                                                               _prefix_mask(chunk, c, q.device))
            if work is not None:
                work.add("masked", q[:, :, rows], end, compute_clock(q.device) - start)
        ctx.save_for_backward(q, kv, out, lse)  # the local K/V only
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, zigzag = ctx.group, ctx.zigzag
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        k, v = _gather_kv(kv, group, zigzag)  # gathered again: communication instead of memory
        c = q.shape[2] // 2
        dq, dkv_all = torch.empty_like(q), kv.new_zeros(2, *k.shape)  # dK/dV of the whole sequence
        for i, chunk in enumerate(rank_chunks(cp, rank, zigzag)):
            rows, end = slice(i * c, (i + 1) * c), (chunk + 1) * c
            dq[:, :, rows], dk, dv = block_attention_backward(
                q[:, :, rows], k[:, :, :end], v[:, :, :end], out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
                _prefix_mask(chunk, c, q.device))
            dkv_all[0][:, :, :end] += dk
            dkv_all[1][:, :, :end] += dv
        by_rank = _rank_major(dkv_all, cp, zigzag).unflatten(3, (cp, -1)).movedim(3, 0)  # [cp, 2, b, ng, s/cp, hn]
        dkv = torch.empty_like(kv)
        dist.reduce_scatter_single(dkv, by_rank.flatten(0, 1).contiguous(), group=group)  # summed over the ranks
        return dq, dkv, None, None, None


# ------------------------------------------------------------------ all-to-all (Ulysses) and a2a+p2p
def seq_chunk_ids_for_a2a(cp: int, before_attn: bool, zigzag: bool = True) -> list[int]:
    """The chunk permutation around the all-to-all, TE's get_seq_chunk_ids_for_reordering_before_attn /
    _after_attn. Before attention the 2 cp received chunks are rank-major (rank j's two at 2j, 2j + 1: chunks
    j and 2cp-1-j under zigzag); position r of the output takes 2r, position cp + r takes 2cp-2r-1: sequence
    order. After attention the inverse: position 2r takes chunk r, 2r + 1 takes 2cp-1-r. Plain split: none."""
    if not zigzag:
        return list(range(2 * cp))
    ids = [0] * (2 * cp)
    for r in range(cp):
        if before_attn:
            ids[r], ids[r + cp] = 2 * r, 2 * cp - 2 * r - 1
        else:
            ids[2 * r], ids[2 * r + 1] = r, 2 * cp - r - 1
    return ids


def check_a2a_heads(num_heads: int, num_query_groups: int, a2a_size: int, seq_local: int,
                    variant: str = "a2a") -> None:
    """All-to-all CP scatters the heads over its `a2a_size` ranks: query heads and key/value heads (GQA) must
    both divide, and each rank must hold two equal chunks. A ValueError says what to change."""
    if variant == "a2a+p2p":
        fix = "a smaller a2a size in hierarchical_context_parallel_sizes=[a2a, p2p] (a divisor of the heads)"
    else:
        fix = ("cp_comm_type 'p2p' or 'a2a+p2p' with hierarchical_context_parallel_sizes=[a2a, p2p] whose a2a size "
               "divides them, or a context_parallel_size that divides them")
    if num_heads % a2a_size:
        raise ValueError(f"cp_comm_type={variant!r} scatters the attention heads over {a2a_size} ranks: "
                         f"num_attention_heads={num_heads} (per tensor-parallel rank) is not divisible by {a2a_size}; "
                         f"change num_attention_heads, or use {fix}")
    if num_query_groups % a2a_size:
        raise ValueError(f"cp_comm_type={variant!r} scatters the key/value heads over {a2a_size} ranks too: "
                         f"num_query_groups={num_query_groups} (GQA, per tensor-parallel rank) is "
                         f"{'fewer than' if num_query_groups < a2a_size else 'not divisible by'} {a2a_size}; "
                         f"change num_query_groups, or use {fix}")
    if seq_local % 2:
        raise ValueError(f"this rank holds {seq_local} tokens: it must hold two equal chunks; split the sequence with "
                         "get_batch_on_this_cp_rank (length divisible by 2 * context_parallel_size)")


def flash_attn_a2a_communicate(x: torch.Tensor, group, before_attn: bool, zigzag: bool = True) -> torch.Tensor:
    """The all-to-all of Ulysses CP (TE's flash_attn_a2a_communicate, here for the [b, h, s, hn] "bhsd" format).

    before_attn: x [b, h, s/cp, hn] (this rank's two chunks, all heads) -> [b, h/cp, s, hn] (the whole
        sequence of the group, in sequence order, this rank's h/cp heads: rank j gets heads j h/cp ..).
    after: the inverse, [b, h/cp, s, hn] -> [b, h, s/cp, hn].
    One all_to_all_single over the group each way; each rank keeps 1/cp of what it had and sends the rest.
    """
    cp = dist.get_world_size(group)
    if before_attn:
        b, h, s_local, hn = x.shape
        # EXERCISE cp.a2a_communicate: heads scattered, sequence gathered: one all_to_all_single, chunks in order
        ### BEGIN SOLUTION
        # HINT 1: Rank j must receive head block j (h/cp heads) of every rank's tokens: cut the head dim into cp
        #         blocks and put the block index first, so that all_to_all_single's dim-0 split sends block j to
        #         rank j; what arrives is stacked by source rank, rank-major.
        # HINT 2: view [b, cp, h/cp, s/cp, hn], block dim to the front (contiguous), all_to_all_single into a
        #         buffer like it; then move the source-rank dim next to the tokens ([b, h/cp, cp, s/cp, hn]),
        #         cut the tokens into 2 cp chunks of s/(2cp), index_select them with
        #         seq_chunk_ids_for_a2a(cp, True, zigzag) and flatten chunks and tokens into s.
        # HINT 3: Received chunk 2j is rank j's first chunk (chunk j), 2j + 1 its second (2cp-1-j under zigzag):
        #         without the reorder the keys sit in the wrong places and the causal mask hides the wrong ones.
        send = x.view(b, cp, h // cp, s_local, hn).movedim(1, 0).contiguous()  # [cp, b, h/cp, s/cp, hn]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens of this rank's heads
        chunks = recv.movedim(0, 2).reshape(b, h // cp, 2 * cp, s_local // 2, hn)  # rank-major chunks
        ids = torch.tensor(seq_chunk_ids_for_a2a(cp, True, zigzag), device=x.device)
        return chunks.index_select(2, ids).flatten(2, 3)  # [b, h/cp, s, hn], sequence order
        ### END SOLUTION
    b, h_local, s, hn = x.shape
    ids = torch.tensor(seq_chunk_ids_for_a2a(cp, False, zigzag), device=x.device)
    chunks = x.reshape(b, h_local, 2 * cp, s // (2 * cp), hn).index_select(2, ids)  # rank j's chunks at 2j, 2j + 1
    send = chunks.reshape(b, h_local, cp, s // cp, hn).movedim(2, 0).contiguous()  # [cp, b, h/cp, s/cp, hn]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: head block j of this rank's tokens
    return recv.movedim(0, 1).reshape(b, cp * h_local, s // cp, hn)


class _AllToAll(torch.autograd.Function):
    """flash_attn_a2a_communicate as an autograd step: the gradient goes back through the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, before_attn, zigzag):
        ctx.group, ctx.before_attn, ctx.zigzag = group, before_attn, zigzag
        return flash_attn_a2a_communicate(x, group, before_attn, zigzag)

    @staticmethod
    def backward(ctx, grad):
        return flash_attn_a2a_communicate(grad, ctx.group, not ctx.before_attn, ctx.zigzag), None, None, None


class AttnFuncWithCPAndQKVOA2A(torch.autograd.Function):
    """Ulysses CP as Transformer Engine's `AttnFuncWithCPAndQKVOA2A` (cp_comm_type "a2a"): all-to-all q, k, v
    (heads scattered, sequence gathered), ordinary causal attention of h/cp heads over the whole sequence,
    all-to-all the output back; backward: all-to-all dout, the attention's backward, all-to-all dq, dk, dv.
    Saves the post-all-to-all q, k, v, out and lse (as many elements as the ring's). q [b, np, s/cp, hn],
    k/v [b, ng, s/cp, hn], fp32 -> [b, np, s/cp, hn]."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, work):
        cp = dist.get_world_size(group)
        check_a2a_heads(q.shape[1], k.shape[1], cp, q.shape[2])
        q, k, v = (flash_attn_a2a_communicate(t, group, True, zigzag) for t in (q, k, v))  # [b, h/cp, s, hn]
        s = q.shape[2]
        start = compute_clock(q.device) if work is not None else 0.0
        out, lse = block_attention(q, k, v, _mask("causal", s, q.device))
        if work is not None:
            work.add("causal", q, s, compute_clock(q.device) - start)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return flash_attn_a2a_communicate(out, group, False, zigzag)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = flash_attn_a2a_communicate(dout, ctx.group, True, ctx.zigzag)
        grads = block_attention_backward(q, k, v, out, lse, dout, _mask("causal", q.shape[2], q.device))
        return (*(flash_attn_a2a_communicate(g, ctx.group, False, ctx.zigzag) for g in grads), None, None, None)


def hierarchical_attention(q, k, v, groups, zigzag=True, work=None):
    """cp_comm_type "a2a+p2p" (TE: AttnFuncWithCPAndKVP2P with cp_group = [a2a group, p2p group]): the
    all-to-all inside the a2a group, then the ring across the p2p group on h/a2a heads and the a2a group's
    tokens, then the all-to-all back. The a2a of the zigzag chunks of cp = a2a x p2p ranks leaves each a2a
    group exactly the zigzag chunks of p2p rank p (in 2 p2p chunks), so the ring runs unchanged.
    q [b, np, s/cp, hn], k/v [b, ng, s/cp, hn] fp32 -> [b, np, s/cp, hn]."""
    a2a_group, p2p_group = groups
    check_a2a_heads(q.shape[1], k.shape[1], dist.get_world_size(a2a_group), q.shape[2], "a2a+p2p")
    q, k, v = (_AllToAll.apply(t, a2a_group, True, zigzag) for t in (q, k, v))  # [b, h/a2a, s/p2p, hn]
    out = RingAttention.apply(q, torch.stack([k, v]), p2p_group, zigzag, work)
    return _AllToAll.apply(out, a2a_group, False, zigzag)


VARIANTS = {"p2p": RingAttention, "all_gather": AllGatherAttention, "all_gather_te": AttnFuncWithCPAndKVAllGather,
            "a2a": AttnFuncWithCPAndQKVOA2A, "a2a+p2p": hierarchical_attention}


def context_parallel_attention(q, k, v, group=None, zigzag=True, variant="p2p", work=None):
    """Causal attention of this rank's tokens over the whole CP-split sequence.

    q [b, np, s/cp, hn], k/v [b, ng, s/cp, hn] (this rank's two chunks, rank_chunks order)
    -> [b, np, s/cp, hn], computed in fp32 and returned in q's dtype. `variant` (Megatron's cp_comm_type):
    "p2p" (the ring), "a2a" (Ulysses), "a2a+p2p" (group: [a2a group, p2p group], default the current state's
    hierarchical groups), "all_gather_te" (TE's all-gather) or "all_gather" (ours: keeps the gathered K/V).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if q.shape[2] % 2:
        raise ValueError(f"this rank holds {q.shape[2]} tokens: it must hold two equal chunks; split the "
                         "sequence with get_batch_on_this_cp_rank (length divisible by 2 * context_parallel_size)")
    q32, k32, v32 = q.float(), k.float(), v.float()
    if variant == "a2a+p2p":
        groups = group if isinstance(group, (list, tuple)) else ps.get_hierarchical_context_parallel_groups()
        return hierarchical_attention(q32, k32, v32, groups, zigzag, work).to(q.dtype)
    if variant == "a2a":
        return AttnFuncWithCPAndQKVOA2A.apply(q32, k32, v32, _group(group), zigzag, work).to(q.dtype)
    return VARIANTS[variant].apply(q32, torch.stack([k32, v32]), _group(group), zigzag, work).to(q.dtype)


def communication_per_layer(seq_length: int, micro_batch_size: int, num_attention_heads: int,
                            num_query_groups: int, kv_channels: int, context_parallel_size: int,
                            variant: str = "p2p", a2a_size: int | None = None,
                            bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes each rank sends for one layer's attention, forward and backward, every cp_comm_type.

    block = one rank's K/V, 2 b (s/cp) ng hn elements; x = b (s/cp) hn elements per head:
        p2p            forward (cp-1) blocks, backward (cp-1) K/V + cp dK/dV blocks
        all_gather     (cp-1) blocks each way (all-gather, reduce-scatter)
        all_gather_te  forward (cp-1), backward 2 (cp-1): K/V gathered again, then dK/dV reduce-scattered
        a2a            each way (cp-1)/cp x (np + 2 ng + np) x: q, k, v and out (dout, dq, dk, dv)
        a2a+p2p        the a2a within a2a_size ranks (same x) + the ring over p2p = cp/a2a_size ranks, whose
                       post-a2a block (s/p2p tokens, ng/a2a heads) is as large as `block`
    """
    s, b, np_, ng, hn, cp = (seq_length, micro_batch_size, num_attention_heads, num_query_groups, kv_channels,
                             context_parallel_size)
    block = 2 * b * (s // cp) * ng * hn * bytes_per_element
    per_head = b * (s // cp) * hn * bytes_per_element

    def ring(n):
        return (n - 1) * block, ((n - 1) + (n if n > 1 else 0)) * block

    def a2a(n):
        return (n - 1) / n * (2 * np_ + 2 * ng) * per_head

    if variant == "p2p":
        forward, backward = ring(cp)
    elif variant == "all_gather":
        forward = backward = (cp - 1) * block
    elif variant == "all_gather_te":
        forward, backward = (cp - 1) * block, 2 * (cp - 1) * block
    elif variant == "a2a":
        forward = backward = a2a(cp)
    elif variant == "a2a+p2p":
        if not a2a_size or cp % a2a_size:
            raise ValueError(f"a2a+p2p needs a2a_size (hierarchical_context_parallel_sizes[0]) dividing cp={cp}, "
                             f"got {a2a_size!r}")
        f, bw = ring(cp // a2a_size)
        forward, backward = a2a(a2a_size) + f, a2a(a2a_size) + bw
    else:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return {"forward": forward, "backward": backward, "total": forward + backward}


def saved_bytes_per_layer(seq_length: int, micro_batch_size: int, num_attention_heads: int, num_query_groups: int,
                          kv_channels: int, context_parallel_size: int, variant: str = "p2p",
                          bytes_per_element: int = 4) -> dict[str, float]:
    """What one rank's core attention keeps for backward ("saved"), and the K/V it holds at once while
    computing ("kv_buffer"), one layer; block = 2 b (s/cp) ng hn elements, local = b (s/cp) hn per head.

        saved:  q, out (np), k, v (ng), lse (np, fp32) of s/cp tokens, for every TE variant (a2a: the
                post-a2a tensors, h/cp heads of s tokens, as many elements); our "all_gather": k, v of all s
                tokens and the [s/cp, s] boolean mask
        kv_buffer:  p2p and a2a+p2p 2 blocks (the one computed on, the one in flight), all_gather(_te) cp
                blocks (the whole sequence), a2a 1 block (h/cp heads of all s tokens)
    """
    s, b, np_, ng, hn, cp = (seq_length, micro_batch_size, num_attention_heads, num_query_groups, kv_channels,
                             context_parallel_size)
    local = s // cp
    block = 2 * b * local * ng * hn * bytes_per_element
    saved = 2 * b * local * np_ * hn * bytes_per_element + 4 * b * np_ * local + block
    kv_buffer = {"p2p": 2 * block if cp > 1 else block, "a2a+p2p": 2 * block, "a2a": block,
                 "all_gather": cp * block, "all_gather_te": cp * block}
    if variant not in kv_buffer:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if variant == "all_gather":
        saved += (cp - 1) * block + local * s
    return {"saved": saved, "kv_buffer": kv_buffer[variant]}


# ------------------------------------------------------------------ in the model
def check_not_packed(packed_seq_params) -> None:
    """Packed documents would need each document split across the CP ranks (Megatron: cu_seqlens_q_padded)."""
    if packed_seq_params is not None:
        raise ValueError("context parallelism here takes whole sequences, not packed documents (PackedSeqParams): "
                         "use context_parallel_size=1 for packed batches, or pad the documents")


class ContextParallelAttention(CoreAttention):
    """Core attention over the CP group, for LayerSpec.core_attention: the same [s, b, heads, hn]
    in, [s, b, np * hn] out as CoreAttention, but s is this rank's s/cp tokens. `work` accumulates
    what the forward computed (AttentionWork)."""

    def __init__(self, config: TransformerConfig, cp_group=None, zigzag: bool = True, variant: str = "p2p"):
        super().__init__(config)
        if config.attention_dropout > 0:
            raise ValueError("context-parallel attention here has no attention dropout: set attention_dropout=0.0")
        self.cp_group, self.zigzag, self.variant = _group(cp_group), zigzag, variant
        self.work = AttentionWork()

    def extra_repr(self) -> str:
        return f"cp={dist.get_world_size(self.cp_group)}, zigzag={self.zigzag}, variant={self.variant!r}"

    def forward(self, query, key, value, packed_seq_params=None):
        check_not_packed(packed_seq_params)
        s, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s/cp, hn]
        context = context_parallel_attention(q, k, v, self.cp_group, self.zigzag, self.variant, self.work)
        return context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


