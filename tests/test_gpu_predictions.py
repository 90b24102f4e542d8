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


# ------------------------------------------------------------------ 03·10: losses near 4.1, compared across layouts
def test_reduction_tolerance_is_relative_and_knows_tf32(monkeypatch):
    from megalab.lab.checks import close, reduction_tolerance

    loss = torch.tensor(4.18066, dtype=torch.float32)
    reordered = loss + 3 * torch.finfo(torch.float32).eps * 4  # 3 ulps at 4.18: another order of the same sums
    assert abs(reordered.item() - loss.item()) > 1e-6  # the old absolute 1e-6 called this a mismatch
    rtol, atol = reduction_tolerance(torch.float32, "cpu")
    assert close(reordered, loss, "the loss", rtol=rtol, atol=atol)
    assert not close(loss * (1 + 1e-3), loss, "the loss", rtol=rtol, atol=atol)  # a real difference still shows
    assert reduction_tolerance(torch.float32, torch.device("cuda", 0)) == (rtol, atol)  # IEEE fp32: PyTorch's default
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # what allow_tf32 = True sets
    rtol32, atol32 = reduction_tolerance(torch.float32, torch.device("cuda", 0))
    assert close(loss * (1 + 1e-3), loss, "the loss", rtol=rtol32, atol=atol32)  # TF32 matmuls: ~1e-3 relative
    assert reduction_tolerance(torch.float32, "cpu") == (rtol, atol)  # TF32 is a CUDA setting
    assert reduction_tolerance(torch.bfloat16, "cpu")[0] > rtol32
    cell = next(src for path, _, src in _code_cells("course/03_parallelism/10_*.ipynb") if "reference_loss" in src)
    assert "reduction_tolerance(" in cell and "< 1e-6}\"" not in cell.split("weights equal")[0]


# ------------------------------------------------------------------ 03·04: what autograd keeps depends on the device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_norm_statistics_and_dropout_masks_are_measured_not_assumed(dtype):
    """03·04's memory equality counts LayerNorm statistics and dropout masks at the sizes the device keeps
    (CUDA: fp32 statistics, bool masks; the CPU: the input's dtype). A fixed 2 bytes is wrong for fp32 here."""
    from megalab.extras.profiling import SavedTensorsMeter, saved_dropout_mask_bytes, saved_layernorm_stat_bytes

    tokens, h = 6, 32
    x = torch.randn(tokens, h, dtype=dtype, requires_grad=True)
    norm = torch.nn.LayerNorm(h, dtype=dtype)
    with SavedTensorsMeter(exclude=norm.parameters()) as meter:
        torch.nn.functional.dropout(norm(x), 0.1, training=True)
    expected = tokens * h * dtype.itemsize + 2 * tokens * saved_layernorm_stat_bytes(dtype, "cpu") \
        + tokens * h * saved_dropout_mask_bytes(dtype, "cpu")  # the input, mean and rstd, the mask
    assert meter.bytes == expected
    assert saved_layernorm_stat_bytes(dtype, "cpu") == dtype.itemsize  # the CPU kernel: the input's dtype
    cell = next(src for _, _, src in _code_cells("course/03_parallelism/04_*.ipynb") if "CPU extras" in src)
    assert "saved_layernorm_stat_bytes(" in cell and "saved_dropout_mask_bytes(" in cell


# ------------------------------------------------------------------ 06·04: DDP overlap, read from the GPU's kernels
def _x(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_ddp_overlap_reads_kernels_on_a_gpu_trace():
    """On a GPU the CPU ops only launch: here the all_reduce op and the backward ops overlap on the CPU, while
    the NCCL kernel runs after every compute kernel (serial) -- and the other way round. The kernels decide."""
    from megalab.extras.profiling import ddp_overlap, ddp_spans, overlap_from_trace

    cpu = [_x("MmBackward0", 0, 10), _x("nccl:all_reduce", 5, 2), _x("MmBackward0", 12, 10)]
    serial = cpu + [_x("sm90_xmma_gemm_f32", 3, 30, "kernel"), _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 8, "kernel")]
    by_name = overlap_from_trace(serial, comm=lambda n: "all_reduce" in n, compute=lambda n: n.endswith("Backward0"))
    assert by_name["overlap_ms"] > 0  # what the CPU spans say
    assert ddp_overlap(serial) == dict(comm_ms=0.008, compute_ms=0.03, overlap_ms=0.0, overlap_share=0.0)
    overlapped = [_x("MmBackward0", 0, 3), _x("nccl:all_reduce", 4, 1),
                  _x("sm90_xmma_gemm_f32", 3, 30, "kernel"), _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 10, "kernel")]
    assert ddp_overlap(overlapped)["overlap_ms"] == pytest.approx(0.010)  # the kernels ran together
    comm, compute = ddp_spans(overlapped)
    assert [e["name"] for e in comm] == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL"] and len(compute) == 1
    # a CPU trace (no kernels): gloo's all_reduce events vs the backward ops, as before
    assert ddp_overlap(cpu) == overlap_from_trace(cpu, comm=lambda n: "all_reduce" in n, compute=lambda n: n.endswith("Backward0"))


# ------------------------------------------------------------------ predicted vs measured: a CPU calibration
def _calibration():
    from megalab.extras.calibrate import Calibration, Link

    return Calibration(2, {1: (1e-5, 1e10), 2: (1e-5, 2e10)}, {2: Link(1e-4, 1e-9, 2), 4: Link(2e-4, 2e-9, 4)},
                       elementwise=1e-9)


def test_a_cpu_calibration_is_not_compared_with_gpu_runs(monkeypatch, capsys):
    from megalab.extras import calibrate

    monkeypatch.setattr(calibrate, "load", _calibration)
    monkeypatch.delenv("MEGALAB_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = calibrate.calibration()
    assert capsys.readouterr().out == "" and calibrate.predict_all_reduce(cpu, 2, 2**20) > 0  # a laptop: compared
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the runs compute on a GPU
    gpu = calibrate.calibration()
    assert "compare a CPU model with a GPU run" in capsys.readouterr().out
    assert gpu == cpu and gpu.runs_on == "cuda"
    assert calibrate.predict_all_reduce(gpu, 2, 2**20) != calibrate.predict_all_reduce(gpu, 2, 2**20)  # nan
    ddp = calibrate.predict_ddp_step(gpu, layers=2, width=8, batch=4, ranks=2, bucket_size=100)
    assert all(v != v for k, v in ddp.items() if k != "messages") and ddp["messages"] > 0
    pipe = calibrate.predict_pipeline(gpu, 4, 8, forward_s=0.02, backward_s=0.04)  # its sleeps are not calibrated
    assert pipe["busy"] == calibrate.predict_pipeline(cpu, 4, 8, forward_s=0.02, backward_s=0.04)["busy"] > 0
    assert pipe["total"] != pipe["total"]


# ------------------------------------------------------------------ 01·01: the deadlock demo on a non-blocking backend
class _NcclLikeWork:
    """NCCL's work.wait(): orders the current CUDA stream after the operation and returns at once."""

    def __init__(self, events):
        self.events = events

    def wait(self):
        self.events.append("work.wait returned")


def test_wait_blocks_the_cpu_on_a_backend_whose_wait_does_not(monkeypatch):
    from megalab.extras import comm

    events = []

    class Stream:
        def synchronize(self):
            events.append("stream synchronized")  # where a real deadlock would block the CPU: the demo's stuck line

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: events.append(("stream of", device)) or Stream())
    comm.wait(_NcclLikeWork(events), torch.device("cuda", 0))
    assert events == ["work.wait returned", ("stream of", torch.device("cuda", 0)), "stream synchronized"]
    events.clear()
    comm.wait(_NcclLikeWork(events), "cpu")  # gloo: its wait() already blocks
    assert events == ["work.wait returned"]
    demo = next(src for _, _, src in _code_cells("course/01_foundations/01_*.ipynb") if "nobody sends" in src)
    assert "comm.wait(" in demo and "dist.recv(" not in demo  # a bare recv returns at once on NCCL


# ------------------------------------------------------------------ 05·03, 07·01: checkpoints of a multi-node run
def _on_node(monkeypatch, tmp_path, node: str) -> None:
    """This process as a rank on `node`: its own private temp dir, in a launch of 2 nodes x 2 ranks."""
    import tempfile

    private = tmp_path / node / "tmp"
    private.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.delenv("MEGALAB_SCRATCH", raising=False)


@pytest.mark.parametrize("shared_env", [True, False], ids=["MEGALAB_SHARED_DIR", "the course tree"])
def test_two_nodes_write_one_checkpoint_folder(monkeypatch, tmp_path, shared_env):
    from megalab.lab import dist as mdist

    shared = tmp_path / ("shared" if shared_env else "tree/.megalab/shared")
    if shared_env:
        monkeypatch.setenv("MEGALAB_SHARED_DIR", str(shared))
    else:
        monkeypatch.delenv("MEGALAB_SHARED_DIR", raising=False)
        monkeypatch.setattr(mdist, "_tree_root", lambda: tmp_path / "tree")  # the course runs from a shared filesystem
    folders = {}
    for node, rank in (("node-a", 0), ("node-b", 2)):
        _on_node(monkeypatch, tmp_path, node)
        folders[node] = mdist.scratch_dir("crashed")
        (folders[node] / f"__{rank}_0.distcp").write_text(node)  # this node's shard
    assert folders["node-a"] == folders["node-b"] and folders["node-a"].is_relative_to(shared), folders
    assert sorted(p.name for p in folders["node-a"].iterdir()) == ["__0_0.distcp", "__2_0.distcp"]
    assert mdist.cache_dir("x").is_relative_to(shared)  # project 1's model for project 4 too


def test_a_node_local_scratch_folder_in_a_multi_node_run_is_refused(monkeypatch, tmp_path):
    from megalab.lab import dist as mdist

    monkeypatch.delenv("MEGALAB_SHARED_DIR", raising=False)
    monkeypatch.setattr(mdist, "_tree_root", lambda: tmp_path / "tree")
    _on_node(monkeypatch, tmp_path, "node-a")
    private = tmp_path / "node-a" / "tmp"  # this node's temp dir (_on_node)
    monkeypatch.setenv("MEGALAB_SCRATCH", str(private / "megalab-u-1234" / "run-1-x"))  # made by a kernel off the nodes
    with pytest.raises(RuntimeError, match="MEGALAB_SHARED_DIR"):
        mdist.scratch_dir("crashed")
    monkeypatch.setenv("WORLD_SIZE", "2")  # one node: its temp dir is right
    assert mdist.scratch_dir("crashed").is_relative_to(private)
