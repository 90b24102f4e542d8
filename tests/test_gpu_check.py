"""`make gpu-test` (megalab/lab/gpu_check.py): honest on CPU, and the plan/table logic, without a GPU."""

import json
import subprocess

import pytest
import torch

from megalab.lab import gpu_check
from megalab.lab.gpu_check import ROOT, cell_ranks, collectives_in, plan_notebook, plan_rows


def _notebook(tmp_path, *cells):
    nb = {"cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": [], "execution_count": None}
                    for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_on_a_cpu_machine_it_says_so_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran something on a CPU machine"))
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "nothing was run" in out and "--plan" in out


def test_cell_ranks_and_collectives():
    assert cell_ranks("%%torchrun -n 4 --ranks 0") == (4, "auto")
    assert cell_ranks("%%torchrun --nproc-per-node 8 --backend gloo") == (8, "gloo")
    assert cell_ranks("%%torchrun") == (1, "auto")
    body = "x = 1\nops = [dist.P2POp(dist.isend, t, 1)]\ndist.batch_isend_irecv(ops)\ntorch.distributed.all_reduce(t)"
    assert collectives_in(body) == {"P2POp", "isend", "batch_isend_irecv", "all_reduce"}


def test_plan_gives_nccl_where_the_ranks_fit_and_names_what_gloo_lacks_on_cuda(tmp_path):
    path = _notebook(tmp_path, "%%torchrun -n 2\ndist.all_reduce(t)\n", "%%torchrun -n 4\ndist.send(t, 1)\n",
                     "print('not a rank cell')")
    assert [(c.index, c.ranks, c.backend, c.unsupported) for c in plan_notebook(path, 8)] == [
        (0, 2, "nccl", ()), (1, 4, "nccl", ())]
    assert [(c.backend, c.unsupported) for c in plan_notebook(path, 2)] == [("nccl", ()), ("gloo on CUDA", ("send",))]
    assert {c.backend for c in plan_notebook(path, 0)} == {"gloo on CPU"}
    [row] = plan_rows([path], 2, root=tmp_path)
    assert (row.ranks, row.backend, row.result) == ("2,4", "gloo on CUDA + nccl", "gloo/CUDA lacks send")


def test_every_course_notebook_has_a_plan_row():
    paths = gpu_check.notebooks()
    rows = plan_rows(paths, 8)
    assert len(rows) == len(paths) > 30
    collectives = next(r for r in rows if r.notebook == "01_foundations/02_collectives.ipynb")
    assert collectives.backend == "nccl"
    on_one_gpu = next(r for r in plan_rows(paths, 1) if r.notebook == "01_foundations/02_collectives.ipynb")
    assert on_one_gpu.backend == "gloo on CUDA" and "send" in on_one_gpu.result
    assert "notebook" in gpu_check.format_table(rows).splitlines()[0]


def test_gpu_path_prints_a_table_per_notebook_and_the_instructors_row(monkeypatch, capsys, tmp_path):
    """The run itself, with the GPU and the pytest runs faked: the table logic and the row to paste."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw["env"]["MEGALAB_DEVICE"]))
        return subprocess.CompletedProcess(cmd, 0 if "--nbval-lax" in cmd else 1, "1 failed in 3.0s\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = _notebook(tmp_path, "%%torchrun -n 4\ndist.all_reduce(t)\n")
    assert gpu_check.main(["--notebook", str(path)]) == 1  # the gpu tests "failed"
    out = capsys.readouterr().out
    assert "tests (-m gpu)" in out and "FAILED: 1 failed in 3.0s" in out
    assert "nb.ipynb" in out and "gloo on CUDA" in out and "passed" in out
    assert "| 2 x NVIDIA H100 80GB HBM3 | torch " in out and "1/1 notebooks passed" in out
    assert [c[1] for c in calls] == ["cuda", "cuda"] and "-m" in calls[0][0] and "gpu" in calls[0][0]


def test_megalab_device_cuda_without_a_gpu_says_what_to_do(monkeypatch):
    from megalab.lab import dist as mdist

    monkeypatch.setenv("MEGALAB_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="unset MEGALAB_DEVICE"):
        mdist.device()


def test_makefile_has_the_target():
    text = (ROOT / "Makefile").read_text()
    assert "gpu-test:" in text and "megalab.lab.gpu_check" in text


def test_instructors_tested_on_table_holds_only_real_runs():
    """The table starts empty ("No GPU run yet"); any row in it has the shape make gpu-test prints."""
    import re

    text = (ROOT / "course" / "INSTRUCTORS.md").read_text()
    section = text.split("### Tested on", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert lines[:2] == ["| date | GPU | torch | NCCL | what ran |", "|---|---|---|---|---|"]
    rows = lines[2:]
    row_shape = re.compile(r"^\| \d{4}-\d\d-\d\d \| .+ \| torch \S+ \| NCCL \S+ \| make gpu-test: .+ \|$")
    assert all(row_shape.match(r) for r in rows), rows
    assert rows or "No GPU run yet" in section
    assert row_shape.match(gpu_check.tested_on_row("1 x H100", "2.13.0", "2.27.5", "make gpu-test: 34/34 notebooks passed"))
