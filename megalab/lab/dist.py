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


def scratch_dir(name: str) -> Path:
    """A folder for files that notebooks, their ranks and later notebooks share (checkpoints, curves):
    under the temp dir, but this user's and this tree's own, so two learners on one machine (or two
    workspaces) never collide; under `make test`'s parallel workers (pytest-xdist), each worker's own
    too. Not created here."""
    import getpass
    import hashlib
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = str(os.getuid())
    key = str(Path(__file__).resolve().parents[2]) + os.environ.get("PYTEST_XDIST_WORKER", "")
    return Path(tempfile.gettempdir()) / f"megalab-{user}-{hashlib.sha256(key.encode()).hexdigest()[:8]}" / name


def shard_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `length` items, sizes differing by at most 1.

    The first `length % world_size` ranks get one extra item: 10 items on 4 ranks -> 3, 3, 2, 2.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    # EXERCISE dist.shard_bounds: balanced contiguous split (first length % world_size ranks get one more)
    ### BEGIN SOLUTION
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop
    ### END SOLUTION
