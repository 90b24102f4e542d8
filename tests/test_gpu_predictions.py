"""What would be wrong on a GPU, checked on the CPU (issue 36): each test fakes the GPU side (a CUDA device that
records synchronisations, a kernel trace, two nodes with their own temp dirs, a driver version) and would fail
on the code before the fix."""

import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _code_cells(pattern: str = "course/0*/*.ipynb"):
    for path in sorted(ROOT.glob(pattern)):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield path.relative_to(ROOT), i, "".join(cell["source"])


# ------------------------------------------------------------------ timing GPU work (03·05, 03·08, 03·09)
def test_device_time_waits_for_the_gpu_before_reading_the_clock(monkeypatch):
    from megalab.extras import profiling

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", torch.device(device))))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: events.append("clock") or 1.5)
    assert profiling.device_time(torch.device("cuda", 1)) == 1.5
    assert events == [("sync", torch.device("cuda", 1)), "clock"]  # the queued kernels first, then the clock
    events.clear()
    assert profiling.device_time("cpu") == 1.5 and events == ["clock"]  # the CPU has nothing queued


def test_cells_that_time_device_work_synchronise():
    """A %%torchrun cell that computes on mdist.device() and reads time.perf_counter() times only the kernel
    launches on a GPU unless it synchronises (device_time, torch.cuda.synchronize, or reading a value back)."""
    unsynced = [f"{path} cell {i}" for path, i, src in _code_cells()
                if src.startswith("%%torchrun") and "mdist.device()" in src and "perf_counter" in src
                and not re.search(r"device_time\(|cuda\.synchronize\b|float\(x\[0\]\)", src)]
    assert not unsynced, unsynced
