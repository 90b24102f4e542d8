"""Collectives built from point-to-point messages, and what they cost.

Every collective in torch.distributed (and in NCCL, under Megatron-LM) can be written with two
primitives: send a tensor to one rank, receive a tensor from one rank. Here we do exactly that,
so you can see where every byte goes and count the messages:

    broadcast        binomial tree: the ranks holding the data double every round, ceil(log2 n) rounds
    all_gather       ring, n-1 steps: pass on the chunk you received last
    reduce_scatter   ring, n-1 steps: add your part to the chunk passing by
    ring_all_reduce  ring, 2(n-1) steps: reduce-scatter, then all-gather

The ring: rank r sends to r+1 and receives from r-1 (mod n); every link is busy in every step.

          ┌──────────► rank 1 ───────────┐
          │                              ▼
       rank 0                          rank 2
          ▲                              │
          └─────────── rank 3 ◄──────────┘

A tensor of `length` elements is cut into n contiguous chunks by `megalab.lab.dist.shard_bounds`
(sizes differ by at most one, so any length works). In step s of a ring all-reduce, rank r sends
chunk (r - s - 1) mod n and receives chunk (r - s - 2) mod n. In the first n-1 steps
(reduce-scatter) it adds what it receives, so that rank r ends up with the full sum of chunk r; in
the last n-1 steps (all-gather) it copies, and every finished chunk travels once around the ring.

The second half is the alpha-beta (Hockney) cost model: one message of M bytes takes
alpha + M * beta seconds (alpha: latency, beta: seconds per byte = 1 / link bandwidth), plus
algbw/busbw as nccl-tests report them, and a fit of alpha and beta to measured times.

Names follow torch.distributed (ranks are group ranks, as in `group_dst`/`group_src`) and
nccl-tests (`algbw`, `busbw`). Megatron-LM calls the library's collectives on its process groups in
megatron/core/tensor_parallel/mappings.py (`_reduce`, `_gather_along_first_dim`,
`_reduce_scatter_along_first_dim`) and on gradient buckets in
megatron/core/distributed/param_and_grad_buffer.py; NCCL runs the rings and trees underneath.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megalab.lab.dist import device, init, shard_bounds

# --------------------------------------------------------------------------- point to point


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """(group, this rank's index in it, its size); None means the default (world) group."""
    group = dist.group.WORLD if group is None else group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A 1-D view of a contiguous tensor (send/recv move raw memory, so no copies behind our back)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous: call .contiguous() on it first")
    return tensor.view(-1)


def _chunks(length: int, world: int) -> list[slice]:
    """The n chunks of a flat tensor of `length` elements, chunk r = rank r's shard."""
    return [slice(*shard_bounds(length, world, r)) for r in range(world)]


def _chunks_and_own(full: torch.Tensor, shard: torch.Tensor, shard_name: str, rank: int, world: int):
    """(chunks of `full`, this rank's chunk of it), checking `shard` has that chunk's size."""
    chunks = _chunks(full.numel(), world)
    own = full[chunks[rank]]
    if shard.numel() != own.numel():
        raise ValueError(
            f"rank {rank}'s shard of {full.numel()} elements on {world} ranks has {own.numel()} elements "
            f"(megalab.lab.dist.shard_bounds), but {shard_name} has {shard.numel()}"
        )
    return chunks, own


def send_recv(
    send_tensor: torch.Tensor,
    dst: int,
    recv_tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send `send_tensor` to group rank `dst` while receiving `recv_tensor` from group rank `src`.

    Both messages are posted as ONE batch (`dist.batch_isend_irecv`) before we wait. Posted one by
    one, a ring where every rank sends first can deadlock: each waits for a neighbour that is itself
    waiting to send. gloo happens to buffer small sends; NCCL runs a communicator's operations in issue
    order and a send may wait for its receive, so a lone `isend` then `irecv` on every rank of a ring
    hangs there (megalab/extras/p2p_model.py shows it). Megatron's pipeline p2p does the same
    (`_batched_p2p_ops` in megatron/core/pipeline_parallel/p2p_communication.py).
    """
    group = dist.group.WORLD if group is None else group
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send_tensor, group=group, group_peer=dst),
        dist.P2POp(dist.irecv, recv_tensor, group=group, group_peer=src),
    ])
    for request in requests:
        request.wait()


def wait(work, device: torch.device | str) -> None:
    """Block this process until `work` (the handle an isend/irecv or an async collective returns) is done, on
    every backend. gloo's work.wait() blocks the CPU; NCCL's only makes the current CUDA stream wait for the
    operation and returns at once -- a receive nobody sends would hang the GPU while the Python code ran on.
    So on CUDA the CPU then waits for that stream too."""
    work.wait()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# --------------------------------------------------------------------------- collectives


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy `tensor` from group rank `src` into `tensor` on every rank (like dist.broadcast).

    Binomial tree, ranks counted from src: in the round with step k = 1, 2, 4, ... every rank
    below k holds the data and sends it to the rank k further on.

        step 1:  0 ─► 1
        step 2:  0 ─► 2   1 ─► 3
        step 4:  0 ─► 4   1 ─► 5   2 ─► 6   3 ─► 7

    n ranks are done after ceil(log2 n) rounds instead of the n-1 sends of a loop over ranks.
    Returns `tensor`.
    """
    group, rank, world = _group_rank_size(group)
    if not 0 <= src < world:
        raise ValueError(f"src={src} is not a rank of this group (size {world})")
    _flat(tensor, "tensor")
    # EXERCISE comm.broadcast: binomial-tree broadcast from src with dist.send/dist.recv (group ranks)
    ### BEGIN SOLUTION
    # HINT 1: Count positions from src (src is position 0, src+1 is position 1, ... modulo the group size).
    #         After the round with step k, positions 0 .. 2k-1 hold the data: each holder at position p < k sends
    #         to position p + k.
    # HINT 2: Loop over step = 1, 2, 4, ... while step < world. In a round, a position below step sends with
    #         dist.send (if its partner position exists), a position in [step, 2 step) receives with dist.recv from
    #         position - step, the others sit the round out. Map positions back to group ranks with
    #         (src + position) mod world, and pass group_dst / group_src and group=group.
    # HINT 3: Every send needs exactly one matching recv in the same round: check that the position a receiver listens
    #         to is the one that sends to it, and that no position both sends and receives in one round.
    me = (rank - src) % world  # position counted from src, which is 0
    step = 1
    while step < world:
        if me < step and me + step < world:
            dist.send(tensor, group_dst=(src + me + step) % world, group=group)
        elif step <= me < 2 * step:
            dist.recv(tensor, group_src=(src + me - step) % world, group=group)
        step *= 2
    ### END SOLUTION
    return tensor


def all_gather(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's shard into `output_tensor` on every rank (like dist.all_gather_single).

    (PyTorch < 2.13 and Megatron-LM call it all_gather_into_tensor.)
    output_tensor: [length] (any contiguous shape, taken flat); input_tensor: this rank's shard,
    [stop - start] for (start, stop) = shard_bounds(length, n, rank), so shards may differ by one.
    Ring, n-1 steps: in step s rank r sends chunk (r - s) mod n (its own first, then the one it
    received in the step before) and receives chunk (r - s - 1) mod n. Returns `output_tensor`.
    """
    group, rank, world = _group_rank_size(group)
    output = _flat(output_tensor, "output_tensor")
    chunks, own = _chunks_and_own(output, input_tensor, "input_tensor", rank, world)
    own.copy_(input_tensor.reshape(-1))
    # EXERCISE comm.all_gather: ring all-gather into `output` with send_recv (n-1 steps, chunk (r-s) out, (r-s-1) in)
    ### BEGIN SOLUTION
    # HINT 1: Around a ring, each rank passes on what it received in the step before: after n-1 steps every shard has
    #         visited every rank. Your own shard is already in place in `output`.
    # HINT 2: n-1 steps; in step s, one send_recv sends chunk (rank - s) mod n of `output` to rank + 1 and receives
    #         chunk (rank - s - 1) mod n from rank - 1. `chunks[j]` is a slice: output[chunks[j]] is a view, so
    #         receive straight into it.
    # HINT 3: A received chunk must land in `output` itself: receiving into a copy (.clone(), torch.empty_like) and
    #         dropping it leaves that chunk unfilled.
    next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        outgoing = output[chunks[(rank - step) % world]]
        incoming = output[chunks[(rank - step - 1) % world]]
        send_recv(outgoing, next_rank, incoming, prev_rank, group)
    ### END SOLUTION
    return output_tensor


def reduce_scatter(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum `input_tensor` over ranks; keep this rank's shard in `output_tensor` (like dist.reduce_scatter_single).

    (PyTorch < 2.13 and Megatron-LM call it reduce_scatter_tensor.)
    input_tensor: [length] (any contiguous shape, taken flat), left unchanged; output_tensor:
    [stop - start] for (start, stop) = shard_bounds(length, n, rank). Ring, n-1 steps: in step s
    rank r sends its partial sum of chunk (r - s - 1) mod n and adds the partial sum of chunk
    (r - s - 2) mod n it receives; the last chunk it receives is its own, r, now complete.
    Returns `output_tensor`.
    """
    group, rank, world = _group_rank_size(group)
    partial = _flat(input_tensor, "input_tensor").clone()  # partial sums travel in this copy
    chunks, own = _chunks_and_own(partial, output_tensor, "output_tensor", rank, world)
    # EXERCISE comm.reduce_scatter: ring reduce-scatter of `partial` with send_recv (n-1 steps, chunk (r-s-1) out, add (r-s-2) in)
    ### BEGIN SOLUTION
    # HINT 1: Partial sums travel around the ring: in each step a rank adds its own part to the chunk passing by, so
    #         the chunk that reaches rank r in the last step carries every rank's part: it is chunk r, complete.
    # HINT 2: n-1 steps of send_recv to rank + 1 / from rank - 1: in step s send your partial sum of chunk
    #         (rank - s - 1) mod n and receive chunk (rank - s - 2) mod n into a separate buffer (as large as chunk 0;
    #         use its first numel elements), then add it into that chunk of `partial`.
    # HINT 3: Receiving directly into `partial` would overwrite your own part instead of adding to it.
    next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
    received = torch.empty_like(partial[: chunks[0].stop])  # chunk 0 is the largest
    for step in range(world - 1):
        outgoing = partial[chunks[(rank - step - 1) % world]]
        target = partial[chunks[(rank - step - 2) % world]]
        incoming = received[: target.numel()]
        send_recv(outgoing, next_rank, incoming, prev_rank, group)
        target += incoming
    ### END SOLUTION
    output_tensor.view(-1).copy_(own)
    return output_tensor


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over ranks, in place (like dist.all_reduce with ReduceOp.SUM), around a ring.

    2(n-1) steps; in step s rank r sends chunk (r - s - 1) mod n and receives chunk (r - s - 2) mod n:
        steps 0 .. n-2      reduce-scatter: add the incoming chunk to ours (rank r ends owning chunk r)
        steps n-1 .. 2n-3   all-gather: the incoming chunk is finished, copy it over ours
    Each rank sends 2(n-1)/n of the tensor in total, whatever n is: that is why rings scale.
    Returns `tensor`.
    """
    group, rank, world = _group_rank_size(group)
    flat = _flat(tensor, "tensor")
    chunks = _chunks(flat.numel(), world)
    # EXERCISE comm.ring_all_reduce: reduce-scatter then all-gather around the ring, in place, with send_recv
    ### BEGIN SOLUTION
    # HINT 1: An all-reduce is a reduce-scatter followed by an all-gather: after n-1 steps rank r holds the full sum
    #         of chunk r, and n-1 more steps carry the finished chunks around the ring.
    # HINT 2: 2(n-1) steps of send_recv to rank + 1 / from rank - 1; in step s send chunk (rank - s - 1) mod n of
    #         `flat` and receive chunk (rank - s - 2) mod n into a buffer. In the first n-1 steps add it into that
    #         chunk; in the last n-1 steps copy it over that chunk.
    # HINT 3: In the all-gather phase the incoming chunk is already the complete sum: adding it again counts it twice.
    next_rank, prev_rank = (rank + 1) % world, (rank - 1) % world
    received = torch.empty_like(flat[: chunks[0].stop])  # chunk 0 is the largest
    for step in range(2 * (world - 1)):
        outgoing = flat[chunks[(rank - step - 1) % world]]
        target = flat[chunks[(rank - step - 2) % world]]
        incoming = received[: target.numel()]
        send_recv(outgoing, next_rank, incoming, prev_rank, group)
        if step < world - 1:
            target += incoming  # reduce-scatter phase
        else:
            target.copy_(incoming)  # all-gather phase
    ### END SOLUTION
    return tensor


# --------------------------------------------------------------------------- cost model

ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring")
# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md), n = number of ranks.
BUSBW_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def all_reduce_time(n: int, nbytes: float, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """Seconds to all-reduce `nbytes` on n ranks in the alpha-beta model (no time for the additions).

        naive  reduce to one rank, then broadcast; that rank handles n-1 full messages each way:
               2 (n-1) (alpha + nbytes beta)
        tree   binomial-tree reduce, then binomial-tree broadcast: ceil(log2 n) rounds each way:
               2 ceil(log2 n) (alpha + nbytes beta)
        ring   reduce-scatter + all-gather, 2(n-1) steps of nbytes/n each:
               2 (n-1) alpha + 2 (n-1)/n nbytes beta
    (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", 2005.)
    """
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of {ALL_REDUCE_ALGORITHMS}")
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    # EXERCISE comm.all_reduce_time: the alpha-beta time of naive, tree and ring all-reduce
    ### BEGIN SOLUTION
    # HINT 1: In the alpha-beta model one message of m bytes costs alpha + m beta; an algorithm costs the sum, over
    #         its sequential rounds, of one message each (the rounds' messages travel in parallel).
    # HINT 2: naive: the root takes n-1 full messages in, then sends n-1 out. tree: ceil(log2 n) rounds down and as
    #         many up, full messages. ring: 2(n-1) steps, each moving only nbytes / n. (math.ceil, math.log2)
    # HINT 3: Every algorithm has two phases (reduce, then broadcast the result): don't forget the factor 2.
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes * beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    ### END SOLUTION


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth (bytes/s) as nccl-tests define it: the buffer size over the time."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth (bytes/s) as nccl-tests define it: algbw times the collective's factor.

        all_reduce  2(n-1)/n      all_gather, reduce_scatter  (n-1)/n      broadcast, reduce  1
    (nbytes is the full buffer: all-gather's output, reduce-scatter's input.) The factor counts
    the bytes each rank must move over its slowest link in the optimal algorithm, so busbw can
    be compared with the hardware's link bandwidth whatever n is.
    """
    if collective not in BUSBW_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}: choose one of {BUSBW_COLLECTIVES}")
    # EXERCISE comm.busbw: algbw times nccl-tests' factor for the collective
    ### BEGIN SOLUTION
    # HINT 1: busbw rescales algbw by the share of the buffer each rank must push through its own link: an
    #         all-reduce moves every byte about twice, an all-gather or reduce-scatter once (less the share a rank
    #         already holds), a broadcast or reduce exactly once.
    # HINT 2: Look up the factor for `collective` (nccl-tests' doc/PERFORMANCE.md: all_reduce 2(n-1)/n, all_gather
    #         and reduce_scatter (n-1)/n, broadcast and reduce 1) and multiply algbw(nbytes, seconds) by it.
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }[collective]
    return algbw(nbytes, seconds) * factor
    ### END SOLUTION


def fit_alpha_beta(
    nbytes: Sequence[float], seconds: Sequence[float], *, latency_steps: float = 1.0, bytes_factor: float = 1.0
) -> tuple[float, float]:
    """Least-squares (alpha, beta) of  seconds ≈ latency_steps * alpha + bytes_factor * nbytes * beta.

    latency_steps=1, bytes_factor=1 fits one message; a ring all-reduce on n ranks is
    latency_steps=2(n-1), bytes_factor=2(n-1)/n. Errors are measured relative to each time, so
    small messages (which fix alpha) count as much as large ones (which fix beta).
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(f"need matching nbytes and seconds, at least two of each; got {len(nbytes)} and {len(seconds)}")
    size = torch.as_tensor(nbytes, dtype=torch.float64)
    t = torch.as_tensor(seconds, dtype=torch.float64)
    # EXERCISE comm.fit_alpha_beta: linear least squares in relative error (divide each row by its time)
    ### BEGIN SOLUTION
    # HINT 1: The model is linear in the unknowns: seconds_i ~ latency_steps alpha + bytes_factor nbytes_i beta, one
    #         equation per measurement; least squares picks the (alpha, beta) that fits them best.
    # HINT 2: Build a [k, 2] design matrix with columns latency_steps and bytes_factor * nbytes, and divide each row
    #         and its right-hand side by that measurement's time, so every equation measures a relative error (the
    #         right-hand side becomes all ones); then torch.linalg.lstsq.
    # HINT 3: lstsq wants a 2-D right-hand side [k, 1]; its .solution is [2, 1]: alpha first, then beta.
    design = torch.stack([torch.full_like(size, latency_steps), bytes_factor * size], dim=1) / t[:, None]
    solution = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution
    alpha, beta = solution.flatten().tolist()
    return alpha, beta
    ### END SOLUTION


def time_collective(
    fn: Callable[[torch.Tensor], object],
    tensor: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 1,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Median seconds of `fn(tensor)` (call on every rank; `tensor` may be modified).

    Each run starts after a barrier and counts as long as its slowest rank took: a collective is
    done only when every rank is.
    """
    times = torch.zeros(repeats, dtype=torch.float64, device=tensor.device)
    for i in range(warmup + repeats):
        dist.barrier(group)
        start = time.perf_counter()
        fn(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.median().item()


def measure_all_reduce(
    numels: Sequence[int], *, repeats: int = 5, group: dist.ProcessGroup | None = None
) -> dict[str, list[float]]:
    """Median seconds of dist.all_reduce and of our ring_all_reduce on float32 tensors of each size.

    Call on every rank (it starts torch.distributed if needed, so `launch.run_function` can call
    it directly). Returns {"nbytes": [...], "dist": [...], "ring": [...]}, one entry per size.
    """
    init()
    results: dict[str, list[float]] = {"nbytes": [], "dist": [], "ring": []}
    for numel in numels:
        tensor = torch.zeros(numel, device=device())  # zeros stay zeros, however often we sum them
        results["nbytes"].append(numel * tensor.element_size())
        results["dist"].append(time_collective(lambda t: dist.all_reduce(t, group=group), tensor, repeats=repeats, group=group))
        results["ring"].append(time_collective(lambda t: ring_all_reduce(t, group=group), tensor, repeats=repeats, group=group))
    return results
