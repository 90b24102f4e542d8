import os

import pytest
import torch

# Triton's interpreter mode is fixed when triton is first imported, and some torch modules import
# it (torch.utils.flop_counter, used by test_model, does): choose it before any test module loads,
# as megalab.kernels would, so the kernel tests run interpreted on CPU whatever ran before them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


LONGEST_FIRST = ("tests/test_learner.py", "tests/test_launch.py", "tests/test_hybrid.py")  # a minute or more each:
# started first, so the two pytest workers of `make test` (--dist loadfile --no-loadscope-reorder hands out files in
# this order) finish together instead of one worker running a long file alone at the end. (The mistakes sweeps were
# the longest, minutes each, until the first checks they run moved from 2-process launches to threaded worlds.)


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
