"""megalab.extras.comm: collectives from send/recv checked against torch.distributed's own; the cost model
against hand-computed values.

One launch per world size (2, 3, 4) runs every collective on every length and dtype (and, on 4
ranks, on the even/odd subgroups); each exercise's test then reads its own part of the report.
"""

import collections
import math
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from megalab.extras import comm
from megalab.lab import dist as mdist
from megalab.lab import launch
from megalab.lab.checks import RIGHT, close, mistake, require
from megalab.lab.dist import shard_bounds

LENGTHS = (0, 1, 2, 3, 5, 7, 10, 13, 64, 1001)  # below, at, and not divisible by the world size
DTYPES = (torch.float32, torch.int64)


def _data(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU (same values on any device), then on the rank's
    if dtype.is_floating_point:
        return torch.randn(length, generator=g, dtype=dtype).to(mdist.device())
    return torch.randint(-1000, 1000, (length,), generator=g, dtype=dtype).to(mdist.device())


def _mismatch(ours: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None if ours is torch.distributed's result (floats within 1e-5), else what differs, in words."""
    if not isinstance(ours, torch.Tensor):
        return f"returned {type(ours).__name__}, not a tensor"
    if ours.shape != ref.shape:
        return f"the result has shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    if ours.dtype != ref.dtype:
        return f"the result is {ours.dtype}, expected {ref.dtype} (the input's)"
    if ours.dtype.is_floating_point:  # a ring adds in another order than gloo does
        bad = ~torch.isclose(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        bad = ours != ref
    if not bad.any():
        return None
    i = tuple(int(j) for j in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {ref.numel()} elements differ from torch.distributed's, the first at index "
            f"{i[0] if len(i) == 1 else i}: got {ours[i].item():.6g}, expected {ref[i].item():.6g}")


def _padded_chunks(flat: torch.Tensor, world: int) -> torch.Tensor:
    """[world * max_chunk]: chunk r of `flat` at r * max_chunk, zero-padded (torch wants equal chunks)."""
    width = shard_bounds(flat.numel(), world, 0)[1]
    out = flat.new_zeros(world * width)
    for r in range(world):
        start, stop = shard_bounds(flat.numel(), world, r)
        out[r * width : r * width + stop - start] = flat[start:stop]
    return out


def _check_broadcast(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            for src in range(world):
                data = _data(length, dtype, seed=length) if rank == src else torch.zeros(length, dtype=dtype, device=mdist.device())
                ref = data.clone()
                dist.broadcast(ref, src=global_rank(src), group=group)
                ours = comm.broadcast(data, src=src, group=group)
                if why := _mismatch(ours, ref):
                    bad.append(f"length {length}, {dtype}, src {src}: {why}")
    matrix = torch.arange(12.0, device=mdist.device()).reshape(3, 4) * (rank == 0)  # any contiguous shape
    if why := _mismatch(comm.broadcast(matrix, src=0, group=group), torch.arange(12.0, device=mdist.device()).reshape(3, 4)):
        bad.append(f"a 3x4 matrix from src 0: {why}")
    return bad


def _check_all_gather(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            start, stop = shard_bounds(length, world, rank)
            shard = _data(stop - start, dtype, seed=1000 * length + rank)
            width = shard_bounds(length, world, 0)[1]
            padded = shard.new_zeros(width)
            padded[: shard.numel()] = shard
            gathered = shard.new_zeros(world * width)
            dist.all_gather_single(gathered, padded, group=group)
            ref = torch.cat([gathered[r * width : r * width + b - a] for r, (a, b) in
                             enumerate(shard_bounds(length, world, r) for r in range(world))])
            ours = comm.all_gather(torch.full((length,), -7, dtype=dtype, device=mdist.device()), shard, group=group)
            if why := _mismatch(ours, ref):
                bad.append(f"length {length}, {dtype}: {why}")
    try:
        comm.all_gather(torch.zeros(10, device=mdist.device()), torch.zeros(11, device=mdist.device()), group=group)
        bad.append("a wrongly sized shard was accepted")
    except ValueError:
        pass
    return bad


def _check_reduce_scatter(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            data = _data(length, dtype, seed=1000 * length + rank)
            kept = data.clone()
            start, stop = shard_bounds(length, world, rank)
            padded = _padded_chunks(data, world)
            reduced = data.new_zeros(padded.numel() // world)
            dist.reduce_scatter_single(reduced, padded, group=group)
            ours = comm.reduce_scatter(data.new_zeros(stop - start), data, group=group)
            if why := _mismatch(ours, reduced[: stop - start]):
                bad.append(f"length {length}, {dtype}: {why}")
            if not torch.equal(data, kept):
                bad.append(f"length {length}, {dtype}: the input was modified (work on a copy)")
    return bad


def _check_ring_all_reduce(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            data = _data(length, dtype, seed=1000 * length + rank)
            ref = data.clone()
            dist.all_reduce(ref, group=group)
            if why := _mismatch(comm.ring_all_reduce(data, group=group), ref):
                bad.append(f"length {length}, {dtype}: {why}")
    matrix = torch.full((3, 5), float(rank + 1), device=mdist.device())
    if why := _mismatch(comm.ring_all_reduce(matrix, group=group), torch.full((3, 5), float(sum(range(1, world + 1))), device=mdist.device())):
        bad.append(f"a 3x5 matrix: {why}")
    return bad


CHECKS = {
    "comm.broadcast": _check_broadcast,
    "comm.all_gather": _check_all_gather,
    "comm.reduce_scatter": _check_reduce_scatter,
    "comm.ring_all_reduce": _check_ring_all_reduce,
}


def _collectives_worker() -> dict[str, list[str]]:
    """On every rank: run each check on the world group (and on 4 ranks, the even/odd groups)."""
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    groups = {"world": None}
    if world == 4:
        even, odd = dist.new_group([0, 2]), dist.new_group([1, 3])
        groups["even/odd"] = even if rank % 2 == 0 else odd
    report = {}
    for exercise, check in CHECKS.items():
        problems = []
        for name, group in groups.items():
            def global_rank(r, group=group):
                return r if group is None else dist.get_global_rank(group, r)

            try:
                problems += [f"{name} group: {p}" for p in check(dist.get_rank(group), dist.get_world_size(group), group, global_rank)]
            except Exception as exc:  # e.g. the exercise's NotImplementedError: report it, go on
                problems.append(f"{name} group: raised {type(exc).__name__}: {exc}")
                break
        report[exercise] = problems
    report["world"] = world
    return report


# --------------------------------------------------------------------------- n ranks as n threads: fast, named
# The first test of each collective runs it on n threads of this process, torch.distributed's point-to-point calls
# swapped for queues between them: milliseconds instead of a launch, and a wrong answer, a hang or a stray message
# becomes a verdict that names the likely mistake. The launches further down check the same code on real ranks.


class _Stuck(Exception):
    """Raised in every waiting thread once no message can arrive any more."""


class _Request:
    def __init__(self, wait=None):
        self._wait = wait

    def wait(self, *args, **kwargs) -> bool:
        if self._wait is not None:
            self._wait()
            self._wait = None
        return True

    def is_completed(self) -> bool:
        return self._wait is None


class _Group:
    """A subgroup of the threaded world: its global ranks, in group order."""

    def __init__(self, ranks):
        self.ranks = list(ranks)

    def __repr__(self) -> str:
        return f"the group {self.ranks}"


def _global(peer, group):
    """The global rank of group rank `peer` (of the whole world when `group` is not a subgroup)."""
    if isinstance(group, _Group) and peer is not None:
        if not 0 <= peer < len(group.ranks):
            raise ValueError(f"group rank {peer} does not exist in {group} ({_learner_line()})")
        return group.ranks[peer]
    return peer


class _Op:  # dist.P2POp's fields
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.peer = peer if peer is not None else _global(group_peer, group)


def _learner_line() -> str:
    """The line of megalab/extras/comm.py (outside the send_recv helper) this thread is in."""
    frames = [f for f in traceback.extract_stack() if f.filename.replace("\\", "/").endswith("extras/comm.py")]
    frames = [f for f in frames if f.name != "send_recv"] or frames
    return f"comm.py:{frames[-1].lineno} ({frames[-1].name}): {frames[-1].line}" if frames else "?"


class ThreadedWorld:
    """`world` ranks as threads; sends never block (as gloo's small messages), a receive waits for its message.

    run(fn) calls fn(rank) on every rank and returns {rank: result}; afterwards `errors` (rank -> exception),
    `stuck` (rank -> (peer it waits for, its line), when every live rank waited in a receive), `unreceived`
    ((src, dst) -> messages nobody received) and `sends` (rank -> messages sent) say what happened."""

    def __init__(self, world: int, deadline: float = 60.0):
        self.world, self.deadline = world, deadline
        self.local = threading.local()
        self.cond = threading.Condition()
        self.queues = collections.defaultdict(collections.deque)
        self.waiting, self.finished, self.stuck, self.errors = {}, set(), {}, {}
        self.sends = collections.Counter()
        self.pairs = collections.Counter()  # (src, dst) -> messages sent

    def _peer(self, peer) -> int:
        rank = self.local.rank
        if peer is None or not 0 <= peer < self.world or peer == rank:
            raise ValueError(f"rank {rank} addresses peer {peer} in a group of {self.world} ranks "
                             f"({_learner_line()})")
        return int(peer)

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = self._peer(_global(group_dst, group) if dst is None else dst)
        with self.cond:
            self.queues[(self.local.rank, peer)].append(tensor.detach().clone())
            self.sends[self.local.rank] += 1
            self.pairs[(self.local.rank, peer)] += 1
            self.cond.notify_all()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        rank, peer = self.local.rank, self._peer(_global(group_src, group) if src is None else src)
        start = time.monotonic()
        with self.cond:
            queue = self.queues[(peer, rank)]
            while not queue:
                if self.stuck:
                    raise _Stuck()
                self.waiting[rank] = (peer, _learner_line())
                if self._all_blocked() or time.monotonic() - start > self.deadline:
                    self.stuck = dict(self.waiting)
                    self.cond.notify_all()
                    raise _Stuck()
                self.cond.wait(0.5)
                self.waiting.pop(rank, None)
            self.waiting.pop(rank, None)
            message = queue.popleft()
        if message.shape != tensor.shape or message.dtype != tensor.dtype:
            raise ValueError(f"rank {rank} receives a {list(message.shape)} {message.dtype} message from rank {peer} "
                             f"into a {list(tensor.shape)} {tensor.dtype} buffer ({_learner_line()})")
        tensor.copy_(message)

    def _all_blocked(self) -> bool:
        """Every rank still running waits in a receive whose message is not there: none can ever arrive."""
        return all(r in self.waiting and not self.queues[(self.waiting[r][0], r)]
                   for r in range(self.world) if r not in self.finished)

    def namespace(self) -> dict:
        world = self

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            world.send(tensor, dst, group, tag, group_dst)
            return _Request()

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            return _Request(lambda: world.recv(tensor, src, group, tag, group_src))

        def batch_isend_irecv(ops):
            return [isend(o.tensor, o.peer, tag=o.tag) if o.op in (isend, dist.isend) else
                    irecv(o.tensor, o.peer, tag=o.tag) for o in ops]

        def unsupported(name):
            def call(*args, **kwargs):
                raise NotImplementedError(f"torch.distributed.{name}: the collectives here are built from "
                                          "point-to-point messages only (send, recv, send_recv)")
            return call

        names = dict(send=self.send, recv=self.recv, isend=isend, irecv=irecv, batch_isend_irecv=batch_isend_irecv,
                     P2POp=_Op, get_rank=lambda group=None: (group.ranks.index(world.local.rank) if world.local.rank
                                                             in group.ranks else -1) if isinstance(group, _Group)
                     else world.local.rank,
                     get_world_size=lambda group=None: len(group.ranks) if isinstance(group, _Group) else world.world,
                     group=type("group", (), {"WORLD": object()}), is_initialized=lambda: True,
                     get_global_rank=lambda group, group_rank: _global(group_rank, group),
                     get_group_rank=lambda group, global_rank: group.ranks.index(global_rank)
                     if isinstance(group, _Group) else global_rank)
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                     "reduce_scatter_single", "broadcast", "reduce", "barrier", "all_to_all_single"):
            names[name] = unsupported(name)
        return names

    def run(self, fn) -> dict:
        results = {}

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except _Stuck:
                pass
            except Exception as exc:  # noqa: BLE001 (reported, or re-raised by the test)
                self.errors[rank] = exc
            finally:
                with self.cond:
                    self.finished.add(rank)
                    self.cond.notify_all()

        saved = {name: getattr(dist, name, None) for name in self.namespace()}
        try:
            for name, value in self.namespace().items():
                setattr(dist, name, value)
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.deadline + 5)
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
        finally:
            for name, value in saved.items():
                setattr(dist, name, value)
        if alive:
            raise AssertionError(f"ranks {alive} did not finish within {self.deadline:g} s: an endless loop?")
        self.unreceived = {key: len(q) for key, q in self.queues.items() if q}
        return results


def _world_verdict(world: ThreadedWorld, what: str):
    """A verdict for what went wrong in the messages (re-raising a rank's own exception), or None."""
    for rank, exc in sorted(world.errors.items()):
        if isinstance(exc, ValueError) and "buffer" in str(exc):
            return mistake("a message does not fit its receive buffer: the wrong chunk is sent or received (sender "
                           "and receiver must agree on the chunk index of every step)", f"{what}: {exc}")
        if isinstance(exc, ValueError) and f"addresses peer {rank} " in str(exc):
            return mistake("a rank sends to or receives from itself: its peer is computed wrong (sender and receiver "
                           "must name each other)", f"{what}: {exc}")
        if isinstance(exc, ValueError) and "addresses peer" in str(exc) and "addresses peer None" not in str(exc):
            return mistake("a peer outside the group: compute it modulo the group size", f"{what}: {exc}")
        raise exc
    if world.stuck:
        stuck = "; ".join(f"rank {r} waits for rank {peer} at {line}" for r, (peer, line) in sorted(world.stuck.items()))
        strays = [f"rank {src} sent rank {dst} {n} message(s)" for (src, dst), n in sorted(world.unreceived.items())
                  if dst in world.stuck]
        if strays:
            return mistake("a rank receives from the wrong peer (it waits for a rank that sends it nothing, while "
                           "another rank's message to it is never received)", f"{what}: {stuck}; {'; '.join(strays)}")
        return mistake("a rank waits for a message no rank sends it (a recv without its send)", f"{what}: {stuck}")
    if world.unreceived:
        strays = "; ".join(f"rank {src} sent rank {dst} {n} message(s)" for (src, dst), n in
                           sorted(world.unreceived.items()))
        return mistake("a send without its matching recv: messages never received (NCCL would hang on them)",
                       f"{what}: {strays}")
    return None


P = 10**8  # value = P * position + 10**rank: the low digits say whose parts a sum holds (and how often), the high


def _encoded(positions: torch.Tensor, rank: int) -> torch.Tensor:  # part says where they came from
    return P * positions.long() + 10**rank


def _decode(value: int, position: int, world: int) -> tuple[list[int], bool]:
    """(how often each rank's part is in `value`, whether the parts all come from `position`)."""
    low, high = value % P, value // P
    counts = [low // 10**r % 10 for r in range(world)]
    return counts, high == sum(counts) * position and low < 10**world


def _first(*verdicts):
    """The first verdict that is not None (verdicts are falsy when wrong: never chain them with `or`), else RIGHT."""
    return next((v for v in verdicts if v is not None), RIGHT)


def _nccl_verdict(run, world: int, what: str):
    """The p2p model's verdict on the streams the collective issues (NCCL's rules), or None."""
    from megalab.extras import p2p_model as pm

    streams = pm.record(run, world)
    try:
        pm.replay(streams)
    except (pm.P2PDeadlock, pm.P2PMismatch) as e:
        if any(len(unit) == 1 and unit[0].op == "send" for stream in streams.values() for unit in stream):
            return mistake("sent and received one after the other: a ring of lone sends deadlocks under NCCL; post "
                           "each step's send and receive together with send_recv (one batch)",
                           f"{what}: {str(e).splitlines()[1].strip()}")
        return mistake("the messages deadlock under NCCL's rules", f"{what}: {e}")
    return None


def test_threaded_world_reports_deadlocks_stray_sends_and_misfits():
    """The harness of the checks below: a receive nobody serves is a deadlock (with its line), a message nobody
    receives is reported, a message that does not fit its buffer is an error; a plain ring completes, every time."""
    world = ThreadedWorld(3)
    world.run(lambda rank: dist.recv(torch.zeros(2), src=(rank + 1) % 3) if rank == 0 else None)
    assert list(world.stuck) == [0] and world.stuck[0][0] == 1, world.stuck
    world = ThreadedWorld(2)
    world.run(lambda rank: dist.send(torch.ones(2), dst=1) if rank == 0 else None)
    assert world.unreceived == {(0, 1): 1} and not world.stuck, (world.unreceived, world.stuck)
    world = ThreadedWorld(2)
    world.run(lambda rank: dist.send(torch.ones(3), dst=1) if rank == 0 else dist.recv(torch.zeros(2), src=0))
    assert "buffer" in str(world.errors.get(1)), world.errors
    for _ in range(50):  # no false alarm: each rank sends to the next and receives from the previous
        world = ThreadedWorld(4)

        def ring(rank, world=world):
            out = torch.zeros(1)
            comm.send_recv(torch.full((1,), float(rank)), (rank + 1) % 4, out, (rank - 1) % 4)
            return out.item()

        assert world.run(ring) == {r: float((r - 1) % 4) for r in range(4)} and not world.stuck and not world.unreceived


SUBGROUP = [2, 0, 3]  # of a 4-rank world: group rank i is global rank SUBGROUP[i], rank 1 stays out


def _subgroup_verdict(name: str):
    """comm.<name> on the subgroup [2, 0, 3] of 4 threaded ranks, where group ranks and global ranks differ
    (the case above passed on the whole world, where they are equal): RIGHT or what went wrong, named."""
    length, n = 7, len(SUBGROUP)
    what = f"comm.{name} passes on the whole world but is wrong on the subgroup {SUBGROUP} of 4 threaded ranks"
    group, chunks = _Group(SUBGROUP), [slice(*shard_bounds(length, n, r)) for r in range(n)]
    positions = torch.arange(length)
    total = sum(_encoded(positions, g) for g in range(n))  # group rank g contributes _encoded(., g)
    expected = {"broadcast": lambda g: _encoded(positions, 1), "all_gather": lambda g: torch.cat(
        [_encoded(positions[c], j) for j, c in enumerate(chunks)]), "reduce_scatter": lambda g: total[chunks[g]],
        "ring_all_reduce": lambda g: total}[name]

    def run(rank):
        if rank not in SUBGROUP:
            return None
        g = SUBGROUP.index(rank)
        if name == "broadcast":
            return comm.broadcast(_encoded(positions, g), src=1, group=group).clone()
        if name == "all_gather":
            return comm.all_gather(torch.full((length,), -1), _encoded(positions[chunks[g]], g), group).clone()
        if name == "reduce_scatter":
            return comm.reduce_scatter(torch.zeros(chunks[g].stop - chunks[g].start, dtype=torch.long),
                                       _encoded(positions, g), group).clone()
        return comm.ring_all_reduce(_encoded(positions, g), group).clone()

    world = ThreadedWorld(4)
    cause = ("group ranks and global ranks mixed up: dist.get_rank(group) and dist.get_world_size(group) give the "
             "position in the group; group_dst=/group_src= take group ranks, dst=/src= take global ones "
             "(dist.get_global_rank(group, r) converts)")
    got = world.run(run)
    if any(r not in SUBGROUP for r in world.sends) or any(src not in SUBGROUP or dst not in SUBGROUP
                                                         for src, dst in world.queues):
        strays = sorted({(src, dst) for src, dst in world.queues if src not in SUBGROUP or dst not in SUBGROUP})
        return mistake(cause, f"{what}: messages went to or from rank 1, which is not in the group: {strays}")
    for exc in world.errors.values():
        if isinstance(exc, ValueError):
            return mistake(cause, f"{what}: {exc}")
    if (verdict := _world_verdict(world, what)) is not None:
        return mistake(cause, verdict.reason.removeprefix("likely mistake: "))
    for g, rank in enumerate(SUBGROUP):
        if not torch.equal(got[rank], expected(g)):
            return mistake(cause, f"{what}: group rank {g} (global rank {rank}): "
                                  f"{close(got[rank], expected(g), 'its result').reason}")
    return RIGHT


@pytest.mark.exercise("comm.broadcast")
def test_broadcast_names_typical_mistakes():
    for world_size, src, length in [(4, 1, 5), (3, 2, 4), (8, 0, 3), (5, 3, 2), (2, 1, 3)]:
        what = f"comm.broadcast is wrong for {length} elements from src={src} on {world_size} threaded ranks"
        world = ThreadedWorld(world_size)
        got = world.run(lambda rank, src=src, length=length: comm.broadcast(_encoded(torch.arange(length), rank),
                                                                            src=src).clone())
        require(_first(_world_verdict(world, what)))
        expected = _encoded(torch.arange(length), src)
        holds = {r: next((k for k in range(world_size) if torch.equal(t, _encoded(torch.arange(length), k))), None)
                 for r, t in got.items()}
        if src != 0 and all(k == 0 for k in holds.values()):
            require(mistake("counted tree positions from rank 0, not from src (position = (rank - src) mod n)",
                            f"{what}: every rank ends with rank 0's data"))
        for rank, tensor in got.items():
            if holds[rank] == rank != src:
                require(mistake("a rank never received the data: check which positions receive in each round",
                                f"{what}: rank {rank} still holds its own data"))
            require(close(tensor, expected, f"{what}: rank {rank}'s tensor"))
        rounds = math.ceil(math.log2(world_size))
        if world.sends[src] > rounds:
            require(mistake("not a tree: src sends to every rank itself; in a binomial tree every rank that holds the "
                            "data sends, and src sends only ceil(log2 n) times",
                            f"{what}: src sent {world.sends[src]} messages, a tree needs {rounds}"))
    require(_subgroup_verdict("broadcast"))


def _reversed_ring(world: ThreadedWorld, what: str):
    """The evidence of a ring turned the other way: every message went from rank r to rank r - 1."""
    n = world.world
    if n > 2 and world.pairs and all(dst == (src - 1) % n for src, dst in world.pairs):
        return mistake("the ring turns the other way: every rank sent to rank - 1 and received from rank + 1; with "
                       "the task's chunk indices the data must flow to rank + 1 (send to next = rank + 1, receive "
                       "from prev = rank - 1)", f"{what}: messages went {sorted(world.pairs)[:4]}...")
    return None


def _all_gather_verdict(world_size: int, length: int):
    what = f"comm.all_gather is wrong for {length} elements on {world_size} threaded ranks"
    chunks = [slice(*shard_bounds(length, world_size, r)) for r in range(world_size)]
    expected = _encoded(torch.arange(length), 0) - 1
    for r, c in enumerate(chunks):
        expected[c] = _encoded(torch.arange(length)[c], r)
    world = ThreadedWorld(world_size)
    got = world.run(lambda rank: comm.all_gather(torch.full((length,), -1), expected[chunks[rank]].clone()))
    if (verdict := _world_verdict(world, what)) is not None:
        return verdict
    wrong = {r: [j for j, c in enumerate(chunks) if not torch.equal(t[c], expected[c])] for r, t in got.items()}
    if any(wrong.values()) and (verdict := _reversed_ring(world, what)) is not None:
        return verdict
    if not any(wrong.values()):
        return _first(_nccl_verdict(lambda rank, group: comm.all_gather(torch.empty(length), torch.ones(
            chunks[rank].stop - chunks[rank].start), group), world_size, what))
    if all((t[c] == -1).all() for r, t in got.items() for j, c in enumerate(chunks) if j != r):
        return mistake("the received chunks never reach output: receive straight into the view output[chunks[j]], "
                       "not into a copy", f"{what}: only each rank's own shard is filled")
    if all(torch.equal(got[r][chunks[j]], expected[chunks[(r - 1) % world_size]]) for r in wrong for j in wrong[r]):
        return mistake("always forwarded its own shard: in step s send the chunk received in the step before, "
                       "(rank - s) mod n", f"{what}: every wrong chunk on rank r holds rank r-1's shard")
    rank = next(r for r in wrong if wrong[r])
    if any((got[rank][chunks[j]] == -1).all() for j in wrong[rank]):
        return mistake("some chunks never arrived: n-1 steps, each receiving chunk (rank - s - 1) mod n",
                       f"{what}: rank {rank}'s chunks {wrong[rank]} are wrong")
    return mistake("the wrong chunk lands in a slot: send chunk (rank - s) mod n to rank + 1, receive chunk "
                   "(rank - s - 1) mod n from rank - 1", f"{what}: rank {rank}'s chunks {wrong[rank]} hold other "
                   f"ranks' shards ({close(got[rank], expected, 'its output').reason})")


@pytest.mark.exercise("comm.all_gather")
def test_all_gather_names_typical_mistakes():
    for world_size, length in [(3, 6), (4, 8), (3, 7), (4, 10), (5, 3), (2, 5)]:  # equal chunks first
        require(_all_gather_verdict(world_size, length))
    require(_subgroup_verdict("all_gather"))


def _sum_verdict(name: str, world_size: int, length: int):
    """comm.reduce_scatter or comm.ring_all_reduce of encoded parts on threads: RIGHT or the likely mistake."""
    what = f"comm.{name} is wrong for {length} elements on {world_size} threaded ranks"
    chunks = [slice(*shard_bounds(length, world_size, r)) for r in range(world_size)]
    positions = torch.arange(length)
    world = ThreadedWorld(world_size)
    if name == "reduce_scatter":
        def run(rank):
            size = chunks[rank].stop - chunks[rank].start
            return comm.reduce_scatter(torch.zeros(size, dtype=torch.long), _encoded(positions, rank))
    else:
        def run(rank):
            return comm.ring_all_reduce(_encoded(positions, rank)).clone()
    got = world.run(run)
    if (verdict := _world_verdict(world, what)) is not None:
        return verdict
    expected = sum(_encoded(positions, r) for r in range(world_size))
    if name == "reduce_scatter":
        expected_of = {r: expected[chunks[r]] for r in range(world_size)}
        positions_of = {r: positions[chunks[r]] for r in range(world_size)}
    else:
        expected_of = {r: expected for r in range(world_size)}
        positions_of = {r: positions for r in range(world_size)}
    if all(torch.equal(got[r], expected_of[r]) for r in range(world_size)):
        steps = (world_size - 1) * (1 if name == "reduce_scatter" else 2)
        extra = {r: world.sends[r] for r in range(world_size) if world.sends[r] > steps}
        if extra:
            r = min(extra)
            return mistake(f"more steps than the ring needs ({'n-1' if steps == world_size - 1 else '2(n-1)'} = "
                           f"{steps}): the result is right, but the extra messages cost time",
                           f"{what}: rank {r} sent {extra[r]} messages")
        if name == "reduce_scatter":
            def shape(rank, group):
                return comm.reduce_scatter(torch.ones(chunks[rank].stop - chunks[rank].start), torch.ones(length), group)
        else:
            def shape(rank, group):
                return comm.ring_all_reduce(torch.ones(length), group)
        return _first(_nccl_verdict(shape, world_size, what))
    if (verdict := _reversed_ring(world, what)) is not None:
        return verdict
    decoded = {r: [_decode(int(v), int(i), world_size) for v, i in zip(got[r], positions_of[r])] for r in got}
    first = next(r for r in range(world_size) if not torch.equal(got[r], expected_of[r]))
    numbers = close(got[first], expected_of[first], f"rank {first}'s result").reason
    if not all(ok for d in decoded.values() for _, ok in d):
        return mistake("the wrong chunk is sent, received or added: in step s send chunk (rank - s - 1) mod n and "
                       "receive chunk (rank - s - 2) mod n", f"{what}: parts of other positions were summed; {numbers}")
    if any(c > 1 for d in decoded.values() for counts, _ in d for c in counts):
        if name == "reduce_scatter":
            return mistake("a rank's part counted twice: one step too many? (n-1 steps, each adding the incoming "
                           "chunk once)", f"{what}: {numbers}")
        return mistake("the all-gather phase adds the finished chunks again: in the last n-1 steps copy the incoming "
                       "chunk (it is already the full sum)", f"{what}: {numbers}")
    if name == "reduce_scatter" and all(counts == [int(k == r) for k in range(world_size)]
                                        for r, d in decoded.items() for counts, _ in d):
        return mistake("used all_gather's chunk indices (send r - s, receive r - s - 1): each rank keeps only its own "
                       "part, the complete sum lands in another chunk; send chunk (rank - s - 1) mod n, receive "
                       "(rank - s - 2) mod n", f"{what}: {numbers}")
    if name == "reduce_scatter" and all(counts[r] == 0 for r, d in decoded.items() for counts, _ in d):
        return mistake("your own part is missing: the received partial sum overwrote it (receive into a separate "
                       "buffer, then add)", f"{what}: {numbers}")
    if name == "ring_all_reduce" and all(torch.equal(got[r][chunks[r]], expected[chunks[r]]) for r in got):
        return mistake("the all-gather phase is missing: after n-1 steps only chunk r is complete on rank r; n-1 more "
                       "steps must copy the finished chunks around the ring", f"{what}: {numbers}")
    return mistake("some ranks' parts are missing from the sums: too few steps, or the partial sums went to the wrong "
                   "chunks", f"{what}: {numbers}")


@pytest.mark.exercise("comm.reduce_scatter")
def test_reduce_scatter_names_typical_mistakes():
    for world_size, length in [(3, 6), (4, 8), (3, 7), (4, 10), (5, 3), (2, 5)]:
        require(_sum_verdict("reduce_scatter", world_size, length))
    require(_subgroup_verdict("reduce_scatter"))


@pytest.mark.exercise("comm.ring_all_reduce")
def test_ring_all_reduce_names_typical_mistakes():
    world = ThreadedWorld(3)  # floats first: a scale (a mean for a sum) shows as a factor
    got = world.run(lambda rank: comm.ring_all_reduce(torch.full((6,), rank + 1.0)).clone())
    what = "comm.ring_all_reduce of torch.full((6,), rank + 1.0) on 3 threaded ranks (expected all 6.0)"
    floats = _world_verdict(world, what)
    floats = floats if floats is not None else next(
        (v for rank, tensor in sorted(got.items()) if not (v := close(
            tensor, torch.full((6,), 6.0), f"{what}: rank {rank}'s tensor",
            mistakes={"averaged (divided by n): the all-reduce sums": torch.full((6,), 2.0)}))), RIGHT)
    if not floats and floats.reason.startswith("likely mistake"):
        require(floats)  # named here; other mistakes are named by the encoded parts below
    for world_size, length in [(3, 6), (4, 8), (3, 7), (4, 10), (5, 3), (2, 5)]:
        require(_sum_verdict("ring_all_reduce", world_size, length))
    require(floats)
    require(_subgroup_verdict("ring_all_reduce"))


@pytest.fixture(scope="module", params=[3, 4], ids=lambda n: f"{n}ranks")  # 4 ranks run the 2-rank groups too
def collectives_report(request):
    try:  # a deadlock is called after 60 s of every rank waiting; ranks still computing get 540 s
        result = launch.run_function(_collectives_worker, request.param, launch=dict(timeout=60, hard_timeout=540))
    except launch.LaunchTimeoutError as e:
        return {"stuck": e}
    return result.returns


def _assert_ok(report, exercise):
    if "stuck" in report:
        e = report["stuck"]
        require(mistake("the ranks hang: a rank waits for a message no rank sends it (a recv without its send, the "
                        "wrong peer, or a send without its recv)", f"{e.kind}: {str(e).splitlines()[0]}; " + "; ".join(
                            f"rank {r} at {s.strip().splitlines()[-1].strip()}" for r, s in sorted(e.stacks.items())
                            if s.strip())))
    problems = {rank: r[exercise] for rank, r in report.items() if r[exercise]}
    name = exercise.removeprefix("comm.")
    assert not problems, "\n".join(
        f"{report[rank]['world']} ranks, rank {rank}: comm.{name} is wrong in {len(p)} case(s); first, on the {p[0]}"
        for rank, p in problems.items())


@pytest.mark.integration
@pytest.mark.exercise("comm.broadcast")
def test_broadcast_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.broadcast")


@pytest.mark.integration
@pytest.mark.exercise("comm.all_gather")
def test_all_gather_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.all_gather")


@pytest.mark.integration
@pytest.mark.exercise("comm.reduce_scatter")
def test_reduce_scatter_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.reduce_scatter")


@pytest.mark.integration
@pytest.mark.exercise("comm.ring_all_reduce")
def test_ring_all_reduce_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.ring_all_reduce")


# --------------------------------------------------------------------------- cost model

ALPHA, BETA = 1e-5, 1e-9  # 10 µs per message, 1 GB/s


def _approx(got, expected, what, rel=None):
    assert got == pytest.approx(expected, rel=rel), f"{what} is {got:.6g}, expected {expected:.6g}"


def _close64(got, expected, what, mistakes, rel=1e-6):
    """close() of plain floats in float64 (as_tensor would round them to float32), naming the typical mistakes."""
    as64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return close(as64(got), as64(expected), what, rtol=rel, atol=0.0,
                 mistakes={name: as64(value) for name, value in mistakes.items()})


def _all_reduce_time_mistakes(n, m, algorithm):
    """What the typical wrong formulas give for all_reduce_time(n, m, ALPHA, BETA, algorithm)."""
    rounds = {"naive": n - 1, "tree": math.ceil(math.log2(n)) if n > 1 else 0, "ring": n - 1}[algorithm]
    per_round = ALPHA + (m / n if algorithm == "ring" else m) * BETA
    mistakes = {"counted one phase only (reduce, then broadcast: the factor 2)": rounds * per_round}
    if algorithm == "ring":
        mistakes["each ring step moves nbytes / n, not the whole message"] = 2 * rounds * (ALPHA + m * BETA)
    if algorithm == "tree":
        mistakes["log2(n) must be rounded up with ceil (a partial round is a whole round)"] = \
            2 * math.log2(n) * (ALPHA + m * BETA)
        mistakes["rounded log2(n) down (int or floor): a partial round is a whole round, use ceil"] = \
            2 * math.floor(math.log2(n)) * (ALPHA + m * BETA)
    if algorithm == "naive":
        mistakes["n messages each way: the root already holds its own part, it exchanges n-1"] = \
            2 * n * (ALPHA + m * BETA)
    return mistakes


@pytest.mark.exercise("comm.all_reduce_time")
def test_all_reduce_time_formulas():
    m = 1e6
    call = "all_reduce_time(n={}, m=1e6 bytes, alpha=1e-5, beta=1e-9, {!r})"
    # n = 4: ring 2*3*alpha + 2*3/4*m*beta; naive 2*3*(alpha + m*beta); tree 2*log2(4)*(alpha + m*beta)
    cases = [(4, "ring", 6e-5 + 1.5e-3, " (2(n-1) alpha + 2(n-1)/n m beta)"),
             (4, "naive", 6 * 1.01e-3, " (2(n-1) (alpha + m beta))"),
             (4, "tree", 4 * 1.01e-3, " (2 ceil(log2 n) (alpha + m beta))"),
             (5, "tree", 6 * 1.01e-3, " (ceil(log2 5) = 3)"),
             (1024, "ring", 2046e-5 + 2 * 1023 / 1024 * 1e-3, "")]
    for n, algorithm, expected, formula in cases:
        require(_close64(comm.all_reduce_time(n, m, ALPHA, BETA, algorithm), expected,
                         call.format(n, algorithm) + formula, _all_reduce_time_mistakes(n, m, algorithm)))
    for algorithm in comm.ALL_REDUCE_ALGORITHMS:
        _approx(comm.all_reduce_time(1, m, ALPHA, BETA, algorithm), 0, call.format(1, algorithm) + " (one rank: no "
                                                                                          "communication)")
    with pytest.raises(ValueError, match="ring"):
        comm.all_reduce_time(4, m, ALPHA, BETA, "butterfly")


BUSBW_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                 "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def _busbw_mistakes(nbytes, seconds, n, collective):
    """What the typical wrong factors give for busbw(nbytes, seconds, n, collective)."""
    algbw, factor = nbytes / seconds, BUSBW_FACTORS[collective](n)
    mistakes = {"divided algbw by the factor instead of multiplying": algbw / factor}
    if collective in ("all_gather", "reduce_scatter"):
        mistakes[f"gave {collective} the all-reduce's factor 2(n-1)/n; it moves each byte once: (n-1)/n"] = \
            algbw * 2 * (n - 1) / n
    if collective == "all_reduce":
        mistakes["an all-reduce's factor is 2(n-1)/n (reduce-scatter + all-gather), not (n-1)/n"] = \
            algbw * (n - 1) / n
    return mistakes


@pytest.mark.exercise("comm.busbw")
def test_busbw_factors():
    _approx(comm.algbw(1e9, 0.1), 1e10, "algbw(1e9 bytes, 0.1 s)")
    call = "busbw(1e9 bytes, 0.1 s, n={}, {!r})"
    for n, collective, expected, why in [(8, "all_reduce", 1e10 * 14 / 8, " (algbw x 2(n-1)/n)"),
                                         (8, "all_gather", 1e10 * 7 / 8, " (algbw x (n-1)/n)"),
                                         (8, "reduce_scatter", 1e10 * 7 / 8, " (algbw x (n-1)/n)"),
                                         (8, "broadcast", 1e10, " (algbw x 1)"),
                                         (2, "all_reduce", 1e10, " (2(n-1)/n = 1 on 2 ranks)")]:
        require(_close64(comm.busbw(1e9, 0.1, n, collective), expected, call.format(n, collective) + why,
                         _busbw_mistakes(1e9, 0.1, n, collective)))
    # a ring all-reduce in the model runs at busbw = 1/beta for large messages, whatever n is
    for n in (2, 8, 64):
        t = 2 * (n - 1) / n * 1e12 * BETA  # the ring's bandwidth term
        _approx(comm.busbw(1e12, t, n), 1 / BETA, f"busbw(1e12 bytes, the ring's time {t:.4g} s, n={n}) (the link's "
                                                  "bandwidth 1/beta, whatever n)")
    with pytest.raises(ValueError, match="all_reduce"):
        comm.busbw(1e9, 0.1, 8, "all_to_all")


def _absolute_fit(sizes, seconds, latency_steps, bytes_factor):
    """The fit a learner gets by forgetting to weight the rows: least squares in absolute seconds."""
    design = torch.tensor([[latency_steps, bytes_factor * s] for s in sizes], dtype=torch.float64)
    return torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64)[:, None]).solution.flatten().tolist()


@pytest.mark.exercise("comm.fit_alpha_beta")
def test_fit_alpha_beta_recovers_parameters():
    sizes = [2.0**k for k in range(2, 26, 2)]
    exact = [ALPHA + s * BETA for s in sizes]
    fit = comm.fit_alpha_beta(sizes, exact)
    where = "fit_alpha_beta on exact times alpha + m beta: (alpha, beta)"
    require(_close64(fit, (ALPHA, BETA), where, {"returned (beta, alpha): swapped": (BETA, ALPHA)}, rel=1e-9))
    # a ring all-reduce on 4 ranks: t = 6 alpha + 1.5 beta m; 3% multiplicative noise
    noise = torch.Generator().manual_seed(0)
    measured = [(6 * ALPHA + 1.5 * s * BETA) * math.exp(0.03 * torch.randn(1, generator=noise).item()) for s in sizes]
    fit = comm.fit_alpha_beta(sizes, measured, latency_steps=6, bytes_factor=1.5)
    where = "fit_alpha_beta(latency_steps=6, bytes_factor=1.5) on 4-rank ring times with 3% noise: (alpha, beta)"
    require(_close64(fit, (ALPHA, BETA), f"{where} (within 10%)", {
        "fitted absolute errors (divide each row by its time: the fit must weigh relative errors)":
            _absolute_fit(sizes, measured, 6, 1.5),
        "ignored latency_steps and bytes_factor (fitted one message: alpha 6x, beta 1.5x too large)":
            (6 * ALPHA, 1.5 * BETA),
        "ignored latency_steps (alpha's column must be latency_steps, not 1): alpha comes out 6x too large":
            (6 * ALPHA, BETA),
        "ignored bytes_factor (beta's column must be bytes_factor * nbytes): beta comes out 1.5x too large":
            (ALPHA, 1.5 * BETA),
        "returned (beta, alpha): swapped": (BETA, ALPHA)}, rel=0.1))
    with pytest.raises(ValueError, match="at least two"):
        comm.fit_alpha_beta([1.0], [1.0])
