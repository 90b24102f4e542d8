import os

import pytest


def _threads_per_worker(workers: int | None = None) -> int:
    """Cores per pytest worker: `make test` runs 2 workers on 2 cores, and two processes with 2 OpenMP threads
    each spin on each other's cores (a tiny model's training step took 4x the CPU time with 2 threads as with 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(workers or os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# Set before torch loads here, and inherited by what the tests start: notebook kernels, graders, launches
# (their ranks already get cores // ranks). The xdist controller sets it again for its workers in
# pytest_configure (they inherit its environment, and it has no PYTEST_XDIST_WORKER_COUNT).
_USER_OMP = "OMP_NUM_THREADS" in os.environ
os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker()))

import torch  # noqa: E402

# Triton's interpreter mode is fixed when triton is first imported, and some torch modules import
# it (torch.utils.flop_counter, used by test_model, does): choose it before any test module loads,
# as megalab.kernels would, so the kernel tests run interpreted on CPU whatever ran before them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The longest files, longest first (CI's junit report, 2026-11-27: seconds on a 2-core machine), so the two workers
# of `make test` (--dist loadfile --no-loadscope-reorder hands out files in this order) finish together instead of
# one worker running a long file alone at the end.
LONGEST_FIRST = (
    "tests/test_exercises.py",  # 220: the student workspace's run of every exercise test
    "tests/test_benchmarks.py",  # 199: every benchmark's --quick smoke
    "tests/test_launch.py",  # 196
    "tests/test_learner.py",  # 163
    "tests/test_browser.py",  # 160
    "tests/test_slurm.py",  # 118
    "course/03_parallelism/09_moe_and_expert_parallel.ipynb",  # 99
    "course/01_foundations/02_collectives.ipynb",  # 87
)


def pytest_configure(config):
    """Under xdist (`-n N`), this is the controller: its N workers start after this, with its environment."""
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 0 and not _USER_OMP and "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(_threads_per_worker(workers))


def pytest_collection_modifyitems(config, items):
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# the megatron-core oracle's fixtures (tests/megatron_oracle.py): parity tests fail, never skip, without it
from tests.megatron_oracle import mcore, mcore_installed  # noqa: E402, F401


def _linux_path_taken(*args, **kwargs):
    raise AssertionError("the /proc fast path ran with the Linux-only facilities switched off")


@pytest.fixture(params=["linux", "portable"])
def facilities(request, monkeypatch):
    """Run a launcher test twice: with Linux's /proc, prctl and sched_getaffinity, and without them, the path
    macOS takes (megalab/lab/procs.py): MEGALAB_PORTABLE=1 for the launcher and, through the environment, its
    ranks; in this process sched_getaffinity is gone and the /proc scan fails if anything still takes it."""
    if request.param == "portable":
        from megalab.lab import procs

        monkeypatch.setenv(procs.PORTABLE_ENV, "1")
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(procs, "_processes_proc", _linux_path_taken)
    return request.param
