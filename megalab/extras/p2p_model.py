"""Will it hang on NCCL? A model checker for point-to-point streams, runnable on one CPU process.

gloo forgives what NCCL does not. Under NCCL (the worst case it allows):

  1. operations on one communicator run in the order they were issued (one CUDA stream);
  2. a send may block until the peer has posted the matching receive (rendezvous);
  3. sends and receives between two ranks pair up in issue order: NCCL has no tags;
  4. a batch (`dist.batch_isend_irecv`, NCCL group) is posted as one unit, and completes
     when every operation in it has met its partner.

A plain ring of `isend` then `irecv` therefore deadlocks: every rank's first unit is a send whose
receive sits in the peer's second unit.

    rank 0: [send→1] [recv←3]          rank 0 waits for 1 to post recv←0 ...
    rank 1: [send→2] [recv←0]          ... but rank 1 is itself stuck in [send→2]: a cycle
    batched: [send→1, recv←3]          one unit per rank: every send meets its receive

This module records what each rank really issues, by running the real code (a pipeline schedule, a ring
collective, a ring-attention step) for every rank in turn with `torch.distributed` swapped for a
recording stand-in (`recording`), then replays all ranks together under the rules above (`replay`).
Receives hand back uninitialised buffers, so the recorded code must not branch on received values
(communication patterns never do). `replay` raises `P2PDeadlock` naming the stuck ranks and operations,
or `P2PMismatch` when a send pairs with a receive of another kind (tag), shape or dtype: NCCL would
hand one rank's gradient to the other rank's activation buffer. Rule 3 is how Megatron-LM's batched
`send_forward_backward_recv_forward_backward` crossed tensors at pp=2 (Megatron-LM issue #750, PR #5271).

Not in Megatron-LM; it relies on the same rules (megatron/core/pipeline_parallel/p2p_communication.py,
`_batched_p2p_ops`). One communicator per process group is assumed, the stricter case: torch's
ProcessGroupNCCL gives unbatched pairs their own two-rank communicators, where a schedule safe here is safe too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# --------------------------------------------------------------------------------------- what a rank issues
@dataclass(frozen=True)
class P2P:
    """One point-to-point operation as issued: `op` "send"/"recv", the peer's global rank, tag, shape, dtype."""

    op: str
    peer: int
    tag: int
    shape: tuple
    dtype: str

    def __str__(self) -> str:
        arrow = "→" if self.op == "send" else "←"
        return f"{self.op}{arrow}{self.peer}(tag {self.tag}, {list(self.shape)} {self.dtype})"


Unit = list  # the P2P operations posted together: one batch, or one lone isend/irecv/send/recv
Stream = list  # a rank's units in issue order


class P2PDeadlock(RuntimeError):
    """The ranks' streams cannot all complete under NCCL's rules; `stuck` maps rank -> (unit index, unit)."""

    def __init__(self, message: str, stuck: dict):
        super().__init__(message)
        self.stuck = stuck


class P2PMismatch(RuntimeError):
    """A send pairs (by issue order) with a receive of another tag, shape or dtype."""


# --------------------------------------------------------------------------------------- the recording stand-in
class _Group:
    """The recorded world: group ranks are global ranks."""

    def __init__(self, size: int):
        self.world_size = size

    def size(self) -> int:
        return self.world_size

    def __repr__(self) -> str:
        return f"<recorded group of {self.world_size}>"


class _Done:
    """A request that has completed (the replay, not the recording, decides what waits)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _P2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer if peer is not None else group_peer, group, tag


@dataclass
class _Recorder:
    world_size: int
    rank: int = 0
    streams: dict = field(default_factory=dict)  # rank -> Stream

    def _post(self, ops: list[P2P]) -> None:
        self.streams.setdefault(self.rank, []).append(ops)

    @staticmethod
    def _p2p(op: str, tensor: torch.Tensor, peer: int, tag: int) -> P2P:
        return P2P(op, int(peer), int(tag), tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))

    def _peer(self, peer, group_peer) -> int:
        peer = group_peer if peer is None else peer
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"rank {self.rank} addresses peer {peer} in a world of {self.world_size}")
        return peer

    def namespace(self) -> dict:
        """The torch.distributed names the recorded code may call, as recording functions."""
        group = _Group(self.world_size)

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            self._post([self._p2p("send", tensor, self._peer(dst, group_dst), tag)])
            return _Done()

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            self._post([self._p2p("recv", tensor, self._peer(src, group_src), tag)])
            return _Done()

        def send(tensor, dst=None, group=None, tag=0, group_dst=None):
            isend(tensor, dst, group, tag, group_dst)

        def recv(tensor, src=None, group=None, tag=0, group_src=None):
            irecv(tensor, src, group, tag, group_src)

        def batch_isend_irecv(p2p_op_list):
            unit = []
            for o in p2p_op_list:
                kind = "send" if o.op in (isend, dist.isend) else "recv"
                unit.append(self._p2p(kind, o.tensor, self._peer(o.peer, None), o.tag))
            self._post(unit)
            return [_Done() for _ in p2p_op_list]

        def unsupported(name):
            def call(*args, **kwargs):
                raise NotImplementedError(f"the p2p model records point-to-point operations only; the recorded code "
                                          f"called torch.distributed.{name}")
            return call

        names = dict(
            isend=isend, irecv=irecv, send=send, recv=recv, batch_isend_irecv=batch_isend_irecv, P2POp=_P2POp,
            get_rank=lambda group=None: self.rank, get_world_size=lambda group=None: self.world_size,
            get_global_rank=lambda group, group_rank: group_rank, get_group_rank=lambda group, global_rank: global_rank,
            get_process_group_ranks=lambda group: list(range(self.world_size)),
            is_initialized=lambda: True, is_available=lambda: True, get_backend=lambda group=None: "recorded",
            group=type("group", (), {"WORLD": group}),
        )
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                     "barrier", "all_to_all_single"):
            names[name] = unsupported(name)
        return names


@contextlib.contextmanager
def recording(world_size: int) -> Iterator[_Recorder]:
    """Swap torch.distributed's p2p functions for recording ones; set `.rank` before running each rank's code.

    The recorded code reaches them as `dist.isend(...)` etc. (module attribute look-ups at call time)."""
    recorder = _Recorder(world_size)
    saved = {}
    try:
        for name, value in recorder.namespace().items():
            saved[name] = getattr(dist, name, None)
            setattr(dist, name, value)
        yield recorder
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)


def record(fn: Callable[[int, object], None], world_size: int) -> dict[int, Stream]:
    """Run fn(rank, group) for every rank under `recording`; return rank -> its stream of units."""
    with recording(world_size) as recorder:
        group = dist.group.WORLD
        for rank in range(world_size):
            recorder.rank = rank
            recorder.streams.setdefault(rank, [])
            fn(rank, group)
    return recorder.streams


# --------------------------------------------------------------------------------------- NCCL's rules, replayed
def _pair_keys(streams: dict[int, Stream]) -> dict:
    """(rank, unit, index) -> (src, dst, n): the n-th message from src to dst, in issue order (rule 3)."""
    counts, keys = {}, {}
    for rank, stream in streams.items():
        for u, unit in enumerate(stream):
            for i, op in enumerate(unit):
                pair = (rank, op.peer) if op.op == "send" else (op.peer, rank)
                n = counts.get((op.op, pair), 0)
                counts[(op.op, pair)] = n + 1
                keys[(rank, u, i)] = (*pair, n)
    return keys


def replay(streams: dict[int, Stream]) -> None:
    """Run every rank's units under NCCL's rules (module docstring); raise P2PDeadlock or P2PMismatch."""
    keys = _pair_keys(streams)
    where = {}  # (src, dst, n, op) -> (rank, unit, index)
    for (rank, u, i), key in keys.items():
        where[(*key, streams[rank][u][i].op)] = (rank, u, i)
    position = {rank: 0 for rank in streams}
    done = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, stream in streams.items():
            while position[rank] < len(stream):
                u = position[rank]
                for i, op in enumerate(stream[u]):
                    if (rank, u, i) in done:
                        continue
                    partner = where.get((*keys[(rank, u, i)], "recv" if op.op == "send" else "send"))
                    if partner is None or position[partner[0]] != partner[1]:
                        continue  # never posted, or not posted yet: this op waits
                    other = streams[partner[0]][partner[1]][partner[2]]
                    if (op.tag, op.shape, op.dtype) != (other.tag, other.shape, other.dtype):
                        sender, receiver = ((rank, op), (partner[0], other)) if op.op == "send" else \
                            ((partner[0], other), (rank, op))
                        src, dst, n = keys[(rank, u, i)]
                        why = ("NCCL pairs sends and receives between two ranks in issue order, without tags, so the "
                               "data would land in the wrong buffer" if op.tag != other.tag else
                               "the receive buffer does not fit the message (gloo: an error; NCCL: wrong data)")
                        raise P2PMismatch(f"message #{n} from rank {src} to rank {dst}: rank {sender[0]} issues "
                                          f"{sender[1]} but rank {receiver[0]} posts {receiver[1]}; {why}")
                    done.update({(rank, u, i), partner})
                if all((rank, u, i) in done for i in range(len(stream[u]))):
                    position[rank] += 1
                    progressed = True
                else:
                    break
    stuck = {rank: (position[rank], streams[rank][position[rank]]) for rank in streams
             if position[rank] < len(streams[rank])}
    if stuck:
        lines = []
        for rank, (u, unit) in sorted(stuck.items()):
            waits = []
            for i, op in enumerate(unit):
                if (rank, u, i) in done:
                    continue
                partner = where.get((*keys[(rank, u, i)], "recv" if op.op == "send" else "send"))
                if partner is None:
                    why = f"rank {op.peer} never posts the matching {'receive' if op.op == 'send' else 'send'}"
                else:
                    why = (f"its partner is in rank {partner[0]}'s unit #{partner[1]}, "
                           f"which waits behind that rank's unit #{position[partner[0]]}")
                waits.append(f"{op} ({why})")
            lines.append(f"  rank {rank} is stuck in unit #{u} of {len(streams[rank])} "
                         f"[{', '.join(map(str, unit))}]: " + "; ".join(waits))
        raise P2PDeadlock("deadlock under NCCL's rules (in-order communicator, rendezvous sends):\n" + "\n".join(lines),
                          stuck)


# --------------------------------------------------------------------------------------- pipeline schedules
class _Scale(torch.nn.Module):
    """The smallest stage with a parameter: x * w."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def record_pipeline(pp_size: int, num_microbatches: int, num_model_chunks: int = 1, kind: str = "1f1b",
                    dtype: torch.dtype = torch.float32, layout=None) -> dict[int, Stream]:
    """Each rank's p2p stream from the real executor (`forward_backward_pipelining`) over stand-in chunks
    whose parameters (and so activations) have `dtype`; with a `layout` (PipelineParallelLayerLayout for
    pp_size ranks and num_model_chunks chunks), a chunk holds one stand-in layer per layer of its stage
    (an embedding- or loss-only stage: one)."""
    from megalab.core.pipeline_parallel import schedules

    if layout is not None and (layout.pipeline_model_parallel_size,
                               layout.virtual_pipeline_model_parallel_size) != (pp_size, num_model_chunks):
        raise ValueError(f"the layout {layout!r} is for pp={layout.pipeline_model_parallel_size}, "
                         f"v={layout.virtual_pipeline_model_parallel_size}, not pp={pp_size}, v={num_model_chunks}")
    shape = (1, 2)
    inputs = [torch.ones(shape, dtype=dtype) for _ in range(num_microbatches)]

    def layers(rank, chunk):
        return 1 if layout is None else max(1, len(layout.layout[rank][chunk]))

    def run(rank, group):
        chunks = [torch.nn.Sequential(*(_Scale() for _ in range(layers(rank, k)))).to(dtype)
                  for k in range(num_model_chunks)]
        schedules.forward_backward_pipelining(chunks, inputs, inputs, lambda out, target: (out * target).sum(), shape,
                                              kind=kind, group=group)

    return record(run, pp_size)


def check_pipeline(pp_size: int, num_microbatches: int, num_model_chunks: int = 1, kind: str = "1f1b",
                   dtype: torch.dtype = torch.float32, layout=None) -> None:
    """Record the executor's streams for this configuration and replay them; raises on deadlock or mismatch."""
    streams = record_pipeline(pp_size, num_microbatches, num_model_chunks, kind, dtype, layout)
    try:
        replay(streams)
    except (P2PDeadlock, P2PMismatch) as e:
        what = f"{kind} pp={pp_size} m={num_microbatches}" + (f" v={num_model_chunks}" if num_model_chunks > 1 else "")
        raise type(e)(f"{what}: {e}", *((e.stuck,) if isinstance(e, P2PDeadlock) else ())) from None
