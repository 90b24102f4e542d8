"""`make gpu-test` (megalab/lab/gpu_check.py, megalab/lab/nbexec.py) without a GPU: honest on CPU, the plan, the
comparison with the committed outputs, the notebook executor, and the host-staged p2p for gloo on CUDA."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from megalab.lab import gpu_check, nbexec
from megalab.lab.gpu_check import ROOT, cell_ranks, collectives_in, plan_notebook, plan_rows


def _notebook(tmp_path, *cells, name="nb.ipynb"):
    """A notebook of code cells; a cell is its source, or (source, committed stdout)."""
    cells = [c if isinstance(c, tuple) else (c, None) for c in cells]
    nb = {"cells": [{"cell_type": "code", "source": src, "metadata": {}, "execution_count": None,
                     "outputs": [] if out is None else [{"output_type": "stream", "name": "stdout", "text": out}]}
                    for src, out in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / name
    path.write_text(json.dumps(nb))
    return path


# --------------------------------------------------------------------------- no GPU, or an unusable one
def test_on_a_cpu_machine_it_says_so_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "nvidia_driver", lambda: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran something on a CPU machine"))
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "nothing was run" in out and "--plan" in out
    assert gpu_check.main(["--require-gpu"]) == 2  # the device check: no GPU there is an error


def test_a_driver_that_torch_cannot_use_is_not_called_no_gpu(monkeypatch, capsys):
    """torch.cuda.is_available() False with an NVIDIA driver present: a CUDA build newer than the driver."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "nvidia_driver", lambda: "535.104.05")
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12020).")

    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran something"))
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out
    assert "CUDA present but unusable" in out and "535.104.05" in out and "too old" in out and "no CUDA GPU" not in out
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch on a GPU machine
    assert gpu_check.main([]) == 2 and "is a CPU build" in capsys.readouterr().out


def test_nvidia_driver_reads_proc(monkeypatch, tmp_path):
    real = Path.read_text
    text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 2 2025\nGCC version: gcc 12\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if str(self) == "/proc/driver/nvidia/version"
                        else real(self, *a, **k))
    assert gpu_check.nvidia_driver() == "580.159.04"


def test_capability_notes_name_what_an_old_gpu_cannot_run():
    assert gpu_check.capability_notes((9, 0), "H100") == []
    [fp8] = gpu_check.capability_notes((8, 0), "A100")
    assert "FP8" in fp8 and "8.9" in fp8 and "skipped, not passed" in fp8
    triton, _ = gpu_check.capability_notes((7, 0), "V100")
    assert "Triton" in triton and "8.0" in triton


# --------------------------------------------------------------------------- the plan
def test_cell_ranks_and_collectives():
    assert cell_ranks("%%torchrun -n 4 --ranks 0") == (4, "auto")
    assert cell_ranks("%%torchrun --nproc-per-node 8 --backend gloo") == (8, "gloo")
    assert cell_ranks("%%torchrun") == (1, "auto")
    body = "x = 1\nops = [dist.P2POp(dist.isend, t, 1)]\ndist.batch_isend_irecv(ops)\ntorch.distributed.all_reduce(t)"
    assert collectives_in(body) == {"P2POp", "isend", "batch_isend_irecv", "all_reduce"}


def test_gloo_on_cuda_lacks_only_p2p():
    assert set(gpu_check.GLOO_CUDA_COLLECTIVES) >= {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                                     "all_to_all", "gather", "scatter"}
    assert not set(gpu_check.GLOO_CUDA_COLLECTIVES) & set(gpu_check.P2P_CALLS)


def test_plan_shares_the_gpu_stages_p2p_or_says_it_needs_gpus(tmp_path):
    path = _notebook(tmp_path, "%%torchrun -n 2\ndist.all_gather(out, t)\n", "%%torchrun -n 4\ndist.send(t, 1)\n",
                     "%%torchrun -n 2 --backend nccl\ndist.all_reduce(t)\n", "print('not a rank cell')")
    assert [(c.index, c.backend) for c in plan_notebook(path, 8)] == [(0, "nccl"), (1, "nccl"), (2, "nccl")]
    assert [(c.backend, c.p2p) for c in plan_notebook(path, 1)] == [
        ("gloo on CUDA", ()), ("gloo on CUDA, p2p via host", ("send",)), ("needs 2 GPUs (--backend nccl)", ())]
    assert plan_notebook(path, 1, host_p2p=False)[1].backend == "needs 4 GPUs (p2p)"
    assert {c.backend for c in plan_notebook(path, 0)} == {"gloo on CPU"}
    [row] = plan_rows([path], 1, root=tmp_path)
    assert row.ranks == "2,4" and row.result == "p2p in cell 1: send"


def test_p2p_through_library_code_is_found(tmp_path):
    """The pipeline's p2p lives in megalab.core.pipeline_parallel: a cell that only calls a schedule reaches it."""
    reach = gpu_check.library_p2p()
    assert "megalab.core.pipeline_parallel.p2p_communication.send_forward" in reach
    assert "megalab.core.pipeline_parallel.schedules.forward_backward_pipelining" in reach
    assert "megalab.extras.comm_tracer.CollectiveTracer" not in reach  # it wraps p2p, it does not call it
    body = "from megalab.core.pipeline_parallel import schedules as pp\npp.forward_backward_pipelining(x)\n"
    assert gpu_check.p2p_in(body) == ("core.pipeline_parallel.schedules.forward_backward_pipelining",)
    assert gpu_check.p2p_in("from megalab.core import parallel_state as ps\nps.initialize_model_parallel(2)\n") == ()


def test_the_course_plan_on_one_gpu():
    """On one GPU every multi-rank cell shares it; these notebooks' cells reach p2p, the nine through library code."""
    rows = {f"{r.notebook[:2]}·{r.notebook.split('/')[1][:2]}": r for r in plan_rows(gpu_check.notebooks(), 1)}
    staged = {k for k, r in rows.items() if "p2p via host" in r.backend}
    assert staged == {"01·01", "01·02", "01·03", "03·06", "03·07", "03·08", "03·10", "05·02", "05·03", "07·01", "07·05"}
    assert "nccl" not in " ".join(r.backend for r in rows.values())
    assert rows["03·09"].backend == "gloo on CUDA"  # all-to-all: gloo has it on CUDA
    on_8 = {f"{r.notebook[:2]}·{r.notebook.split('/')[1][:2]}": r.backend for r in plan_rows(gpu_check.notebooks(), 8)}
    assert on_8.pop("07·06") == "gloo on CUDA"  # the refit is on gloo by design (Megatron's gloo copy service)
    assert set(on_8.values()) <= {"nccl", "one process"}


# --------------------------------------------------------------------------- comparing with the committed outputs
RULES = nbexec.sanitizers()


def test_compare_verdicts_and_numbers():
    cpu = "loss 4.861 -> 0.821   same curve: True\n[rank 1] 12 tokens\n"
    assert nbexec.compare(cpu, cpu, "", RULES) is None
    assert nbexec.compare(cpu, "loss 4.862 -> 0.8214   same curve: True\n[rank 1] 12 tokens\n", "", RULES) is None
    why = nbexec.compare(cpu, "loss 4.861 -> 0.821   same curve: False (max diff 0.3)\n[rank 1] 12 tokens\n", "", RULES)
    assert "line 1" in why and "False" in why
    why = nbexec.compare(cpu, "loss 4.95 -> 0.821   same curve: True\n[rank 1] 12 tokens\n", "", RULES)
    assert "4.95 where the CPU run printed 4.861" in why
    assert nbexec.compare(cpu, "loss 4.95 -> 0.821   same curve: True\n[rank 1] 12 tokens\n", "# GPU_RTOL: 0.05", RULES) is None
    assert "missing line" in nbexec.compare(cpu, "loss 4.861 -> 0.821   same curve: True\n", "", RULES)
    assert "nan" in nbexec.compare("x 1.0\n", "x nan\n", "", RULES) or nbexec.compare("x 1.0\n", "x nan\n", "", RULES)
    assert nbexec.compare("tensor([1., 2.])\n", "tensor([1., 2.], device='cuda:0')\n", "", RULES) is None
    assert nbexec.compare("took 3.2 s\n", "took 0.4 s\n", "", RULES) is None  # sanitize.cfg's durations


def test_ignored_output_cells_still_keep_their_verdicts():
    src = "# NBVAL_IGNORE_OUTPUT"
    cpu = "measured 12.3 ms\npredicted within 2x: True\nshipped bug caught: False\n"
    assert nbexec.compare(cpu, "measured 0.4 ms\npredicted within 2x: True\nshipped bug caught: False\n", src, RULES) is None
    assert "verdict changed" in nbexec.compare(cpu, "measured 1 ms\npredicted within 2x: False\nshipped bug caught: False\n",
                                               src, RULES)
    assert "missing" in nbexec.compare(cpu, "measured 0.4 ms\n", src, RULES)
    assert "new failing" in nbexec.compare("a\n", "a\nextra check: False\n", src, RULES)


def test_tolerance_tags_and_units():
    assert nbexec.tolerance("x = 1\n# GPU_RTOL: 1e-2\n# GPU_ATOL: 1e-6") == (1e-2, 1e-6)
    assert nbexec.tolerance("x = 1") == (nbexec.DEFAULT_RTOL, 0.0)
    assert nbexec._unit("4.86") == pytest.approx(0.01) and nbexec._unit("1.5e-06") == pytest.approx(1e-7)
    assert nbexec._unit("42") == 1


# --------------------------------------------------------------------------- the executor
def test_executor_runs_cells_in_one_namespace_with_magics(tmp_path):
    path = _notebook(
        tmp_path,
        ("%load_ext megalab", "megalab 0.1.0 · the reference implementation · every exercise solved\n"),
        ("x = 6 * 7\nprint('x is', x)\nx", "x is 42\n42\n"),
        ("x / 4;", None),
        ("%%torchrun -n 1\nfrom megalab.lab import dist as mdist\nrank, world = mdist.init()\n"
         "mdist.publish('r', rank * x_rank)\nprint(f'rank {rank} of {world}')",
         None),
    )
    nb = json.loads(path.read_text())
    nb["cells"][3]["source"] = nb["cells"][3]["source"].replace("x_rank", "10")
    nb["cells"][3]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "rank 0 of 1\n"}]
    nb["cells"].append({"cell_type": "code", "source": "print(r)", "metadata": {}, "execution_count": None,
                        "outputs": [{"output_type": "stream", "name": "stdout", "text": "{0: 0}\n"}]})
    path.write_text(json.dumps(nb))
    report = tmp_path / "r.json"
    result = nbexec.run_notebook(path, report=report)
    assert result.status == "passed", result
    assert [c.status for c in result.cells] == ["passed"] * 5
    assert json.loads(report.read_text())["status"] == "passed"


def test_executor_fails_a_changed_verdict_and_reports_the_rest_as_not_run(tmp_path):
    path = _notebook(tmp_path, ("print('check: True')", "check: True\n"), ("print('check:', 1 == 2)", "check: True\n"),
                     ("print('later')", "later\n"))
    result = nbexec.run_notebook(path)
    assert result.status == "failed" and "cell 1" in result.message and "False" in result.message
    assert [c.status for c in result.cells] == ["passed", "failed", "not run"]


def test_executor_exceptions_budget_and_plan_stops(tmp_path):
    raising = _notebook(tmp_path, "# NBVAL_RAISES_EXCEPTION\n1 / 0", "undefined_name", name="a.ipynb")
    nb = json.loads(raising.read_text())
    nb["cells"][0]["outputs"] = [{"output_type": "error", "ename": "ZeroDivisionError", "evalue": "", "traceback": []}]
    raising.write_text(json.dumps(nb))
    result = nbexec.run_notebook(raising)
    assert [c.status for c in result.cells] == ["passed", "failed"] and "NameError at line 1" in result.message
    slow = _notebook(tmp_path, "import time\ntime.sleep(30)", "print(1)", name="b.ipynb")
    import time
    result = nbexec.run_notebook(slow, deadline=time.time() + 1)
    assert result.status == "partial" and [c.status for c in result.cells] == ["not run", "not run"]
    result = nbexec.run_notebook(slow, stop_cells={0: "needs 4 GPUs (p2p)"})
    assert result.status == "partial" and "needs 4 GPUs (p2p)" in result.message


def test_torchrun_options_match_the_cell_magic():
    """nbexec parses %%torchrun itself (no IPython on the GPU machine): every option magic.py declares."""
    import ast

    tree = ast.parse((ROOT / "megalab" / "lab" / "magic.py").read_text())
    flags = {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "argument"
             for a in n.args if isinstance(a, ast.Constant) and a.value.startswith("--")}
    known = {f for a in nbexec.torchrun_parser()._actions for f in a.option_strings}
    assert flags and flags <= known


# --------------------------------------------------------------------------- host-staged p2p (gloo on CUDA)
def test_host_staged_p2p_moves_cuda_tensors_through_cpu_copies(monkeypatch):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megalab.lab import dist as mdist

    class OnGpu(torch.Tensor):  # stands for a CUDA tensor on this CPU machine
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def is_cuda(self):
            return True

    got = []

    class Work:
        def __init__(self, buffer):
            self.buffer = buffer

        def wait(self):
            self.buffer.fill_(7.0)
            return True

    def isend(t, dst=None, group=None, tag=0, **kw):
        got.append(t)

    def irecv(t, src=None, group=None, tag=0, **kw):
        got.append(t)
        return Work(t)

    def recv(t, src=None, group=None, tag=0, **kw):
        got.append(t)
        t.fill_(3.0)
        return 0

    for name, fn in (("isend", isend), ("send", isend), ("irecv", irecv), ("recv", recv)):
        monkeypatch.setattr(c10d, name, fn)
        monkeypatch.setattr(dist, name, fn)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    mdist.stage_p2p_through_host()
    gpu = torch.arange(3.0).as_subclass(OnGpu)
    dist.isend(gpu, 1)
    assert type(got[-1]) is torch.Tensor and got[-1] is not gpu and got[-1].tolist() == [0.0, 1.0, 2.0]
    target = torch.zeros(3).as_subclass(OnGpu)
    work = dist.irecv(target, 0)
    assert got[-1] is not target and target.tolist() == [0.0, 0.0, 0.0]  # not before wait()
    assert work.wait() and target.tolist() == [7.0] * 3
    assert dist.recv(target, 0) == 0 and target.tolist() == [3.0] * 3
    cpu = torch.ones(2)
    dist.isend(cpu, 1)
    assert got[-1] is cpu  # CPU tensors go as they are
    c10d._check_op(dist.isend)  # P2POp's check accepts the staged functions (it compares with c10d's own names)
    mdist.stage_p2p_through_host()  # twice: no double wrapping
    assert c10d.isend.megalab_staged is isend


def test_torch_2_11_gets_the_collectives_names_the_course_uses(monkeypatch):
    """The lent GPU machine's torch 2.11 has all_gather_into_tensor / reduce_scatter_tensor only."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    mdist.alias_new_collectives()
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor


def test_gpu_run_writes_the_table_the_failures_and_the_row(monkeypatch, tmp_path, capsys):
    """main on a (faked) GPU: the jobs' rows become the table, gpu_check.md / .json under --out, and the row to paste."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    good = _notebook(tmp_path, "print(1)", name="good.ipynb")
    bad = _notebook(tmp_path, "print(2)", name="bad.ipynb")
    seen = []

    def fake_notebook(path, deadline, n_gpus, gpu, host_p2p, workdir):
        seen.append((path.name, n_gpus, gpu, host_p2p))
        ok = path.name == "good.ipynb"
        cells = [{"index": 0, "status": "passed" if ok else "failed", "message": "" if ok else "line 1 reads '3'"}]
        return gpu_check.Row(path.name, "1", "one process", "passed (1 cells)" if ok else "FAILED: cell 0 line 1", 1.0, cells)

    monkeypatch.setattr(gpu_check, "run_notebook", fake_notebook)
    monkeypatch.setattr(gpu_check, "run_tests", lambda deadline, gpu: gpu_check.Row("tests (-m gpu, 6 files)", "1", "cuda",
                                                                                     "passed: 17 passed in 9s", 9.0))
    out = tmp_path / "out"
    assert gpu_check.main(["--notebook", str(good), "--notebook", str(bad), "--out", str(out), "--workers", "2"]) == 1
    assert sorted(seen) == [("bad.ipynb", 1, True, True), ("good.ipynb", 1, True, True)]
    md = (out / "gpu_check.md").read_text()
    assert "| good.ipynb | 1 | one process | passed (1 cells) |" in md and "- bad.ipynb cell 0: line 1 reads '3'" in md
    row = json.loads((out / "gpu_check.json").read_text())["row"]
    assert row.endswith("| torch " + torch.__version__ + " | NCCL none | make gpu-test: gpu tests passed: 17 passed in "
                        "9s; 1/2 notebooks passed (not: bad.ipynb) |") and "1 x NVIDIA H100 80GB HBM3" in row
    assert row in capsys.readouterr().out


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
