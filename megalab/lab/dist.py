"""Small helpers for code running inside a rank: start torch.distributed, share work, report back.

Every rank started by torchrun finds its identity in environment variables:

    RANK        this process's index among all processes          0 .. WORLD_SIZE-1
    WORLD_SIZE  how many processes take part
    LOCAL_RANK  its index on this node (which GPU it should use)   0 .. nproc_per_node-1
    MASTER_ADDR / MASTER_PORT   where the rendezvous store listens

`init()` reads them (through torch.distributed) and picks the backend the launcher chose.
"""

from __future__ import annotations

import os
import pickle
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def alias_new_collectives() -> None:
    """torch < 2.12 (the lent GPU machine has 2.11) names all_gather_single and reduce_scatter_single, which the
    course uses, all_gather_into_tensor and reduce_scatter_tensor (the same signatures): give it the new names."""
    for new, old in (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")):
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))


alias_new_collectives()  # every rank imports this module (init) before it calls a collective


def init(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """init_process_group with the backend the launcher picked; returns (rank, world_size).

    NCCL ranks also get their GPU (cuda:LOCAL_RANK); so do gloo ranks under MEGALAB_DEVICE=cuda (see device()).
    Safe to call twice.
    """
    backend = backend or os.environ.get("MEGALAB_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if backend == "nccl":
            torch.cuda.set_device(local_rank())
            kwargs["device_id"] = torch.device("cuda", local_rank())
        elif os.environ.get("MEGALAB_DEVICE") == "cuda":
            torch.cuda.set_device(_shared_gpu())
        dist.init_process_group(backend, **kwargs)
        if backend == "gloo" and os.environ.get("MEGALAB_DEVICE") == "cuda" and os.environ.get("MEGALAB_HOST_P2P") != "0":
            stage_p2p_through_host()
    return dist.get_rank(), dist.get_world_size()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU.

    MEGALAB_DEVICE=cuda (set by `make gpu-test` when a cell has more ranks than there are GPUs): gloo ranks
    compute on the GPUs too, sharing them round robin; gloo then moves tensors through host memory for the
    collectives it supports on CUDA (megalab/lab/gpu_check.py lists them)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    if os.environ.get("MEGALAB_DEVICE") == "cuda":
        return torch.device("cuda", _shared_gpu())
    return torch.device("cpu")


def _shared_gpu() -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("MEGALAB_DEVICE=cuda, but this machine has no CUDA GPU: unset MEGALAB_DEVICE "
                           "(ranks then compute on the CPU with gloo)")
    return local_rank() % torch.cuda.device_count()


class _HostWork:
    """An irecv into a CPU buffer: wait() copies the buffer into the CUDA tensor it stands for."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self._work, self._host, self._target = work, host, target

    def wait(self, *args, **kwargs) -> bool:
        self._work.wait(*args, **kwargs)
        self._target.copy_(self._host)
        return True

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def stage_p2p_through_host() -> None:
    """gloo has collectives for CUDA tensors but no send/recv: from here on, p2p of a CUDA tensor on a gloo group
    sends a CPU copy and receives into a CPU buffer, copied to the GPU when the receive completes (at wait() for
    irecv). Installed by init() when gloo ranks compute on GPUs (MEGALAB_DEVICE=cuda: `make gpu-test` with more
    ranks than GPUs; MEGALAB_HOST_P2P=0 leaves p2p as torch has it). Works through batch_isend_irecv and P2POp,
    which look the functions up in torch.distributed at call time. Other backends and CPU tensors are untouched."""
    from torch.distributed import distributed_c10d as c10d

    def staged(op, receive: bool):
        def p2p(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if not tensor.is_cuda or dist.get_backend(group) != "gloo":
                return op(tensor, *args, **kwargs)
            if not receive:
                return op(tensor.detach().cpu(), *args, **kwargs)
            host = torch.empty_like(tensor, device="cpu")
            done = op(host, *args, **kwargs)
            if hasattr(done, "wait"):  # irecv: the copy waits for the data
                return _HostWork(done, host, tensor)
            tensor.copy_(host)  # recv has returned: the data is there
            return done

        p2p.megalab_staged = op
        return p2p

    for name, receive in (("send", False), ("isend", False), ("recv", True), ("irecv", True)):
        if not hasattr(getattr(c10d, name), "megalab_staged"):
            wrapped = staged(getattr(c10d, name), receive)
            setattr(c10d, name, wrapped)  # P2POp and batch_isend_irecv compare ops with these
            setattr(dist, name, wrapped)


def to_cpu(value: Any) -> Any:
    """value with every tensor in it (through dicts, lists, tuples) detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value


def publish(name: str, value: Any) -> None:
    """Hand a picklable value back to the notebook: after the cell, `name` holds {rank: value}.

    Tensors (also inside dicts, lists, tuples) arrive detached on the CPU: ranks' GPUs are not the notebook's."""
    if not name.isidentifier():
        raise ValueError(f"publish name must be a Python identifier (it becomes a notebook variable), got {name!r}")
    run_dir = os.environ.get("MEGALAB_RUN_DIR")
    if run_dir is None:
        warnings.warn("megalab.lab.dist.publish only works under megalab.lab.launch / %%torchrun; value dropped", stacklevel=2)
        return
    rank = int(os.environ.get("RANK", "0"))
    value = to_cpu(value)
    path = Path(run_dir) / "publish" / f"{name}.rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    tmp.rename(path)


SCRATCH_ENV = "MEGALAB_SCRATCH"
SHARED_ENV = "MEGALAB_SHARED_DIR"  # a folder every node sees: multi-node runs keep their scratch and cache there


def _tree_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _multi_node() -> bool:
    """A rank of a launch over several nodes, or a process in a Slurm allocation of several nodes (a notebook's
    kernel whose `%%torchrun --slurm` ranks span them)."""
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(world) > int(local):
        return True
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return nodes.isdigit() and int(nodes) > 1


def _shared_base() -> Path | None:
    """Where scratch and cache folders go instead of the temp dir: MEGALAB_SHARED_DIR, else in a multi-node run
    this course tree's .megalab/shared (the course runs from a shared filesystem there). Each node has its own
    temp dir: a checkpoint's shards written there would be split across the nodes."""
    if os.environ.get(SHARED_ENV):
        return Path(os.environ[SHARED_ENV])
    return _tree_root() / ".megalab" / "shared" if _multi_node() else None


def _user_temp_root() -> Path:
    """This user's and this tree's folder in the temp dir, or in the shared folder of a multi-node run
    (_shared_base); under make test's pytest-xdist, this worker's."""
    import getpass
    import hashlib
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = str(os.getuid())
    key = str(_tree_root()) + os.environ.get("PYTEST_XDIST_WORKER", "")
    base = _shared_base() or Path(tempfile.gettempdir())
    return base / f"megalab-{user}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _check_shared(root: str) -> None:
    """A multi-node rank given a scratch folder in its node's own temp dir (a kernel started outside the
    allocation made it there): refuse, in words, rather than split the run's files across the nodes."""
    import tempfile

    path, shared = Path(root).resolve(), _shared_base()
    if _multi_node() and shared is not None and path.is_relative_to(Path(tempfile.gettempdir()).resolve()) \
            and not path.is_relative_to(shared.resolve()):
        raise RuntimeError(f"this run spans several nodes, but its scratch folder {root} is in this node's own temp "
                           f"dir, which the other nodes do not see (checkpoint shards would be split across them): "
                           f"set {SHARED_ENV} to a folder on the shared filesystem before starting JupyterLab (or "
                           f"start it inside the multi-node allocation, where {shared} is used)")


def scratch_root() -> Path:
    """This run's own folder in the temp dir, made on first use and removed when the process that made it exits.

    A run is a notebook's kernel (its %%torchrun ranks inherit the folder through MEGALAB_SCRATCH), a script, or
    one launch of ranks started without one. So two runs at once, two learners on one node, or make test's
    workers never see, let alone delete, each other's files. In a multi-node run it is on the shared folder
    every node sees (_shared_base: MEGALAB_SHARED_DIR, or the course tree's .megalab/shared), never a node's /tmp.
    """
    import atexit
    import shutil
    import tempfile

    root = os.environ.get(SCRATCH_ENV)
    if root is not None:
        _check_shared(root)
    if root is None and "TORCHELASTIC_RUN_ID" in os.environ:  # ranks whose parent made none: one per launch
        root = str(_user_temp_root() / f"launch-{os.environ['TORCHELASTIC_RUN_ID']}")
    if root is None:
        base = _user_temp_root()
        base.mkdir(parents=True, exist_ok=True)
        if _shared_base() is None:  # on a shared folder another node's live run looks abandoned here
            _remove_abandoned_runs(base)
        root = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base)
        os.environ[SCRATCH_ENV] = root
        atexit.register(shutil.rmtree, root, True)
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(root)


def _remove_abandoned_runs(base: Path) -> None:
    """Folders of runs whose process is gone without cleaning up (a killed kernel)."""
    import shutil
    import time

    from megalab.lab.procs import pid_exists

    for folder in base.glob("run-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    for folder in base.glob("launch-*"):  # a launch's ranks cannot tell when the last of them is done: a day later
        if time.time() - folder.stat().st_mtime > 86400:
            shutil.rmtree(folder, ignore_errors=True)


def scratch_dir(name: str) -> Path:
    """`name` inside this run's own folder (scratch_root), created: checkpoints and crash demos that a notebook's
    cells and ranks share, gone when the run ends."""
    path = scratch_root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(name: str) -> Path:
    """A folder that outlives runs, this user's and this tree's (preprocessed data, project 1's trained model for
    project 4). Write into it only with publish_dir, so a reader never sees half a result. Not created here."""
    return _user_temp_root() / "cache" / name


def publish_dir(built: Path, final: Path) -> Path:
    """Move a fully written folder `built` to `final` (same file system), replacing what was there: a reader finds
    a whole folder (old or new) or, for the instant between two renames, none; never a half-written one."""
    import shutil
    import uuid

    final.parent.mkdir(parents=True, exist_ok=True)
    old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists():
        os.rename(final, old)
    os.rename(built, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def shard_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `length` items, sizes differing by at most 1.

    The first `length % world_size` ranks get one extra item: 10 items on 4 ranks -> 3, 3, 2, 2.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    # EXERCISE dist.shard_bounds: balanced contiguous split (first length % world_size ranks get one more)
    ### BEGIN SOLUTION
    # HINT 1: The shards tile [0, length) without gaps: rank r's shard starts where rank r-1's stops. Every rank
    #         gets length // world_size items, and the FIRST length % world_size ranks get one item more.
    # HINT 2: divmod gives the base size and the remainder. Rank r starts after r base-sized shards plus one extra
    #         item for each earlier rank that got one (how many of ranks 0..r-1 are below the remainder?); its stop
    #         adds its own size (base, plus one if r itself is below the remainder).
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop
    ### END SOLUTION
