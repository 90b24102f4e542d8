"""A world of N ranks as N threads of this process: fast, focused checks of multi-rank exercises.

The exercise tests check each multi-rank exercise FIRST here, in a fraction of a second (no torchrun, no
process start-up), so a wrong answer is named at once; the real multi-process launches (gloo, real
torchrun) come after, in the same test files. `torch.distributed`'s functions that the exercises call
are swapped, for the duration of `run`, for thread-aware stand-ins (the way megalab/extras/p2p_model.py
records streams):

    point-to-point   isend, irecv, send, recv, P2POp, batch_isend_irecv   (gloo-like: sends never block;
                     FIFO per (src, dst, tag); use p2p_model to check NCCL's stricter rules)
    collectives      all_gather, all_gather_object, all_gather_single (= all_gather_into_tensor), all_to_all_single, all_reduce
                     (SUM, AVG, MAX, MIN, PRODUCT), reduce_scatter_single (= reduce_scatter_tensor), broadcast,
                     barrier; every rank's k-th call on a group meets the others' k-th call, as gloo matches them
    groups, queries  new_group, get_rank, get_world_size, get_process_group_ranks, get_global_rank,
                     get_backend ("gloo"), is_initialized, ...

One rank runs at a time: a rank hands over only while it waits (in a collective or a receive) or when it is done.
So what a rank does between two waits is never interleaved with another rank: code that seeds torch's global RNG
and then draws from it (torch.manual_seed(0); nn.Linear(...)) gets the same numbers on every rank, as in
separate processes. Nothing can hang: when every rank that is not done waits for something that cannot come
(a collective another rank never joins, a receive never sent), those waits fail at once, and `run` raises
`WorldStuck` naming what each stuck rank was waiting for ("rank 1: irecv from rank 0 (tag 0), never sent"),
which a test turns into a named mistake. A rank that computes past `cpu_limit` seconds of CPU time (an endless
loop) is stopped at its line, and so are the ranks when the test itself is interrupted (a timeout, the
grader's CPU limit): no rank thread outlives `run`. No wall-clock limit: a loaded machine only makes it slower.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist


class RankStuck(TimeoutError):
    """Raised in a rank by a wait for what cannot come (or did not come within the timeout): its message says what."""


class WorldStuck(RuntimeError):
    """Some rank waited longer than the timeout; `stuck` maps rank -> what it waited for."""

    def __init__(self, stuck: dict[int, str]):
        super().__init__("; ".join(f"rank {r}: {what}" for r, what in sorted(stuck.items())))
        self.stuck = stuck


class Group:
    """A process group of the threaded world: its global ranks, in group order; `uid` tells apart two groups of
    the same ranks (the k-th new_group of every rank is one group, as in torch.distributed)."""

    def __init__(self, ranks: list[int], uid: int = 0):
        self.ranks, self.uid = list(ranks), uid

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"<threaded group {self.ranks}>"


class _Request:
    def __init__(self, wait: Callable[[], None] | None = None):
        self._wait, self.done = wait, wait is None

    def wait(self, *args, **kwargs) -> bool:
        if not self.done:
            self._wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class _P2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.peer = peer if peer is not None else group.ranks[group_peer]


class World:
    """N ranks as threads; `run(fn)` calls fn(rank, world_group) on every rank and returns {rank: result}."""

    def __init__(self, size: int, timeout: float | None = None, cpu_limit: float = 60.0):
        self.size, self.timeout, self.cpu_limit = size, timeout, cpu_limit  # timeout: a wait's wall-clock limit
        self.world = Group(list(range(size)))
        self._local = threading.local()
        self._cond = threading.Condition()
        self._turn = threading.Lock()  # held by the one rank that runs now
        self._mail: dict[tuple, deque] = {}  # (src, dst, tag) -> sent tensors, in order
        self._slots: dict[tuple, dict] = {}  # (group uid, group ranks, call number) -> {rank: contribution}
        self._calls: dict[tuple, int] = {}  # (rank, group uid, group ranks) -> collectives this rank called on it
        self._groups: dict[int, int] = {}  # rank -> new_group calls so far
        self._waiting: dict[int, tuple[str, Callable[[], bool]]] = {}  # rank -> (what it waits for, whether it came)
        self._stuck: set[int] = set()  # waiting ranks told that what they wait for cannot come
        self._done: set[int] = set()
        self.log: list[tuple] = []  # (rank, collective, its arguments) of the collectives called, for diagnosis

    # ------------------------------------------------------------------ helpers
    @property
    def rank(self) -> int:
        return self._local.rank

    def _group(self, group) -> Group:
        return self.world if group is None or group is dist.group.WORLD else group

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (handing the turn to the other ranks) until ready(); TimeoutError(what) when it cannot come."""
        me = self.rank
        with self._cond:
            if ready():
                return
            self._waiting[me] = (what, ready)
            self._detect_deadlock()
        self._turn.release()
        try:
            with self._cond:
                came = self._cond.wait_for(lambda: ready() or me in self._stuck, timeout=self.timeout) and ready()
                del self._waiting[me]
                self._stuck.discard(me)
        finally:
            self._turn.acquire()
        if not came:
            raise RankStuck(what)

    def _detect_deadlock(self) -> None:
        """(holding _cond) When no rank can run (each is done or waits for what has not come), fail every wait."""
        alive = [r for r in range(self.size) if r not in self._done]
        if all(r in self._waiting for r in alive) and not any(ready() for _, ready in self._waiting.values()):
            self._stuck.update(self._waiting)
            self._cond.notify_all()

    # ------------------------------------------------------------------ point to point
    def _send(self, tensor, dst, tag):
        if not 0 <= dst < self.size or dst == self.rank:
            raise ValueError(f"rank {self.rank} sends to rank {dst} in a world of {self.size}")
        with self._cond:
            self._mail.setdefault((self.rank, dst, tag), deque()).append(tensor.detach().clone())
            self._cond.notify_all()
        return _Request()

    def _recv(self, tensor, src, tag):
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"rank {self.rank} receives from rank {src} in a world of {self.size}")
        key, me = (src, self.rank, tag), self.rank

        def wait():
            self._wait_for(lambda: bool(self._mail.get(key)), f"irecv from rank {src} (tag {tag}): never sent")
            with self._cond:
                message = self._mail[key].popleft()
            if message.shape != tensor.shape or message.dtype != tensor.dtype:
                raise RuntimeError(f"rank {me} receives a {tuple(tensor.shape)} {tensor.dtype} buffer from rank {src}, "
                                   f"which sent {tuple(message.shape)} {message.dtype}")
            with torch.no_grad():
                tensor.copy_(message)

        return _Request(wait)

    # ------------------------------------------------------------------ collectives
    def _exchange(self, group: Group, contribution, what: str) -> dict:
        """Every rank of `group` deposits its contribution; returns them all, {group rank: contribution}."""
        ranks = tuple(group.ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} calls {what} on a group of ranks {list(ranks)}, which it is not in")
        key = (getattr(group, "uid", 0), ranks)
        with self._cond:
            n = self._calls.get((self.rank, *key), 0)
            self._calls[(self.rank, *key)] = n + 1
            slot = self._slots.setdefault((*key, n), {})
            slot[ranks.index(self.rank)] = contribution
            self._cond.notify_all()
        self._wait_for(lambda: len(slot) == len(ranks), f"{what} on ranks {list(ranks)}: not every rank joined")
        return slot

    def namespace(self) -> dict:
        world = self

        def get_rank(group=None):
            group = world._group(group)
            return group.ranks.index(world.rank) if world.rank in group.ranks else -1

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            return world._send(tensor, dst if dst is not None else world._group(group).ranks[group_dst], tag)

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            return world._recv(tensor, src if src is not None else world._group(group).ranks[group_src], tag)

        def send(tensor, dst=None, group=None, tag=0, group_dst=None):
            isend(tensor, dst, group, tag, group_dst).wait()

        def recv(tensor, src=None, group=None, tag=0, group_src=None):
            irecv(tensor, src, group, tag, group_src).wait()

        def batch_isend_irecv(ops):
            sends = [o for o in ops if o.op in (isend, dist.isend)]  # sends first: a batch never waits on itself
            requests = {id(o): world._send(o.tensor, o.peer, o.tag) for o in sends}
            requests.update({id(o): world._recv(o.tensor, o.peer, o.tag) for o in ops if id(o) not in requests})
            return [requests[id(o)] for o in ops]

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            world.log.append((world.rank, "all_gather", dict(size=len(tensor_list))))
            got = world._exchange(world._group(group), tensor.detach().clone(), "all_gather")
            with torch.no_grad():
                for i, t in enumerate(tensor_list):
                    t.copy_(got[i])
            return _Request() if async_op else None

        def all_gather_object(object_list, obj, group=None):
            got = world._exchange(world._group(group), copy.deepcopy(obj), "all_gather_object")
            for i in range(len(object_list)):
                object_list[i] = copy.deepcopy(got[i])

        def all_reduce(tensor, op=None, group=None, async_op=False):
            got = world._exchange(world._group(group), tensor.detach().clone(), "all_reduce")
            with torch.no_grad():
                tensor.copy_(_reduce(torch.stack([got[i] for i in sorted(got)]), op))
            return _Request() if async_op else None

        def all_gather_single(output, input, group=None, async_op=False):
            world.log.append((world.rank, "all_gather_single", dict(numel=input.numel())))
            n = len(world._group(group).ranks)
            if tuple(output.shape) not in ((n * input.shape[0], *input.shape[1:]), (n, *input.shape)):
                chunk = tuple(output.chunk(n)[0].shape) if output.dim() and output.shape[0] >= n else tuple(output.shape)
                raise RuntimeError(f"ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected "
                                   f"{tuple(input.shape)}, got {chunk})")  # as gloo says it: the ranks' inputs, stacked
                # or one after the other along dim 0, are the only output shapes
            got = world._exchange(world._group(group), input.detach().clone(), "all_gather_single")
            with torch.no_grad():
                output.copy_(torch.cat([got[i].reshape(-1, *input.shape[1:]) for i in sorted(got)]).view_as(output))
            return _Request() if async_op else None

        def reduce_scatter_single(output, input, op=None, group=None, async_op=False):
            group = world._group(group)
            world.log.append((world.rank, "reduce_scatter_single", dict(numel=input.numel())))
            got = world._exchange(group, input.detach().clone(), "reduce_scatter_single")
            total = _reduce(torch.stack([got[i] for i in sorted(got)]), op)
            with torch.no_grad():
                output.copy_(total.chunk(len(group.ranks))[group.ranks.index(world.rank)].view_as(output))
            return _Request() if async_op else None

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            group = world._group(group)
            n, me = len(group.ranks), group.ranks.index(world.rank)
            ins = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
            outs = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // n] * n
            world.log.append((world.rank, "all_to_all_single", dict(output_split_sizes=outs, input_split_sizes=ins)))
            got = world._exchange(group, (list(torch.split(input.detach(), ins)), outs), "all_to_all_single")
            pieces = []
            for src in range(n):
                piece, expected = got[src][0][me], outs[src]
                if piece.shape[0] != expected:
                    raise RuntimeError(f"all_to_all_single: rank {group.ranks[me]} expects {expected} rows from rank "
                                       f"{group.ranks[src]}, which sends {piece.shape[0]} (output_split_sizes of one "
                                       "rank must equal the input_split_sizes the others send it)")
                pieces.append(piece)
            with torch.no_grad():
                output.copy_(torch.cat(pieces))
            return _Request() if async_op else None

        def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
            group = world._group(group)
            root = group.ranks.index(src) if src is not None else group_src
            got = world._exchange(group, tensor.detach().clone(), "broadcast")
            with torch.no_grad():
                tensor.copy_(got[root])
            return _Request() if async_op else None

        def barrier(group=None, async_op=False, device_ids=None):
            world._exchange(world._group(group), None, "barrier")
            return _Request() if async_op else None

        def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
            with world._cond:
                uid = world._groups.get(world.rank, 0) + 1
                world._groups[world.rank] = uid
            return Group(sorted(ranks) if ranks is not None else world.world.ranks, uid)

        return dict(
            get_rank=get_rank, get_world_size=lambda group=None: len(world._group(group).ranks),
            get_process_group_ranks=lambda group: list(world._group(group).ranks),
            get_global_rank=lambda group, group_rank: world._group(group).ranks[group_rank],
            get_group_rank=lambda group, global_rank: world._group(group).ranks.index(global_rank),
            get_backend=lambda group=None: "gloo", is_initialized=lambda: True, is_available=lambda: True,
            isend=isend, irecv=irecv, send=send, recv=recv, P2POp=_P2POp, batch_isend_irecv=batch_isend_irecv,
            all_gather=all_gather, all_gather_object=all_gather_object, all_reduce=all_reduce, broadcast=broadcast, all_to_all_single=all_to_all_single,
            barrier=barrier, all_gather_single=all_gather_single, all_gather_into_tensor=all_gather_single,
            reduce_scatter_single=reduce_scatter_single, reduce_scatter_tensor=reduce_scatter_single,
            new_group=new_group,
        )

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def installed(self):
        """torch.distributed's functions swapped for this world's, restored afterwards."""
        missing = object()
        saved = {name: getattr(dist, name, missing) for name in self.namespace()}
        try:
            for name, value in self.namespace().items():
                setattr(dist, name, value)
            yield self
        finally:
            for name, value in saved.items():
                if value is missing:
                    delattr(dist, name)
                else:
                    setattr(dist, name, value)

    def run(self, fn: Callable[[int, Group], object]) -> dict[int, object]:
        """fn(rank, world group) on every rank, each in its thread; {rank: what it returned}. Raises the first
        rank's exception (with `.rank` set; EndlessLoop for a rank stopped past its CPU limit), else WorldStuck
        when a rank waited for what cannot come."""
        results, errors, stuck = {}, {}, {}

        def body(rank):
            self._local.rank = rank
            self._turn.acquire()
            try:
                results[rank] = fn(rank, self.world)
            except TimeoutError as e:
                stuck[rank] = str(e)
            except BaseException as e:  # noqa: BLE001  (handed to the caller below)
                errors[rank] = e
            finally:
                with self._cond:
                    self._done.add(rank)
                    self._detect_deadlock()  # the others may wait for this rank: they fail now
                self._turn.release()

        with self.installed():
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
            for t in threads:
                t.start()
            try:
                self._watch(threads, stuck)
            except BaseException:  # the test was interrupted (pytest-timeout, the grader's CPU limit, Ctrl-C)
                for t in threads:
                    _stop(t, RankStuck, "the test was interrupted")
                for t in threads:
                    t.join(5)
                raise
        if errors:
            rank = min(errors, key=lambda r: (isinstance(errors[r], RankStuck), r))  # an interrupted rank: last
            errors[rank].rank = rank
            raise errors[rank]
        if stuck:
            raise WorldStuck(stuck)
        return results

    def _watch(self, threads: list[threading.Thread], stuck: dict[int, str]) -> None:
        """Until every rank is done. A rank past its CPU limit is stopped with EndlessLoop at its line (again and
        again, so that an `except Exception` cannot swallow it): cpu_limit, or half the grader's limit while
        grading (megalab/lab/cpu_guard.py: the grader's counts the whole process, so this one says it first)."""
        from megalab.lab.cpu_guard import EndlessLoop, from_env

        limit = min(self.cpu_limit, from_env() / 2) if from_env() else self.cpu_limit
        clocks, said = {}, {}
        for rank, t in enumerate(threads):
            with contextlib.suppress(AttributeError, OSError):  # per-thread CPU clocks: Linux, macOS
                clocks[rank] = time.pthread_getcpuclockid(t.ident)
        while any(t.is_alive() for t in threads):
            for rank, t in enumerate(threads):
                t.join(0.2)
                if not t.is_alive() or rank not in clocks:
                    continue
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    cpu = time.clock_gettime(clocks[rank])
                    if cpu > limit:
                        said.setdefault(rank, f"rank {rank} still computing after {limit:g} s of CPU time at "
                                              f"{_line(t)}: an endless loop? (a while loop whose condition never "
                                              "changes, or a counter never advanced)")
                        _stop(t, EndlessLoop, said[rank])


def _line(thread: threading.Thread) -> str:
    """The innermost line of megalab's code (else the innermost line) the thread is running now."""
    frame = first = sys._current_frames().get(thread.ident)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/megalab/" in path:
            return f"{path[path.rindex('/megalab/') + 1:]}:{frame.f_lineno} (in {frame.f_code.co_name})"
        frame = frame.f_back
    return f"{first.f_code.co_filename}:{first.f_lineno}" if first is not None else "?"


def _stop(thread: threading.Thread, kind: type[BaseException], why: str) -> None:
    """Raise kind(why) in `thread` at its next Python line (a rank thread cannot be killed otherwise)."""
    if thread.is_alive():
        exc = type(kind.__name__, (kind,), {"__init__": lambda self: kind.__init__(self, why),
                                            "__module__": kind.__module__})
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


_OPS = {"SUM": lambda t: t.sum(0), "AVG": lambda t: t.mean(0), "MAX": lambda t: t.amax(0), "MIN": lambda t: t.amin(0),
        "PRODUCT": lambda t: t.prod(0)}


def _reduce(stacked: torch.Tensor, op) -> torch.Tensor:
    """The ranks' contributions [ranks, ...] reduced with torch.distributed's ReduceOp `op` (None: SUM)."""
    name = "SUM" if op is None else next((n for n in _OPS if op == getattr(dist.ReduceOp, n)), None)
    if name is None:
        raise NotImplementedError(f"the threaded world has no all-reduce op {op}")
    return _OPS[name](stacked)


def run(size: int, fn: Callable[[int, Group], object], timeout: float | None = None) -> dict[int, object]:
    """World(size, timeout).run(fn)."""
    return World(size, timeout).run(fn)
