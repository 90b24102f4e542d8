"""Where a training step spends its time: profiler traces, and communication/computation overlap.

    profile_step(step)  ──> torch.profiler trace ──> Chrome trace file (chrome://tracing, Perfetto)
                                                 └─> top_ops(): the ops that cost the most, as rows

Sequence packing, the other speed-up of chapter 06 · 04, lives in megalab/core/packed_seq_params.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


def device_time(device: torch.device | str) -> float:
    """time.perf_counter() once `device` has finished the work queued on it: CUDA kernels run asynchronously, so
    a clock read right after a launch would time the launch, not the kernel. Read it before and after:

        start = device_time(dev); step(); seconds = device_time(dev) - start
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def profile_step(step: Callable[[], None], steps: int = 2, warmup: int = 1,
                 trace_path: str | Path | None = None, device: torch.device | str | None = None) -> profile:
    """Run `step` warmup + steps times under torch.profiler, record the last `steps`.

    device: where the step computes; CUDA kernels are recorded only for a CUDA device (default: CUDA
    when present). With trace_path, also writes the Chrome trace JSON there. Returns the profiler (see top_ops).
    """
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                 record_shapes=True, profile_memory=True) as prof:
        for _ in range(warmup + steps):
            step()
            prof.step()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return prof


def top_ops(prof: profile, n: int = 8) -> list[dict]:
    """The n ops with the most self time (time in the op itself, not in ops it calls): name, calls, ms, share.

    Device (GPU kernel) time when the profile recorded any, else CPU time: a CPU model on a GPU machine
    is timed by its CPU ops, not by zeros."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    device = any(e.self_device_time_total > 0 for e in events)
    self_us = (lambda e: e.self_device_time_total) if device else (lambda e: e.self_cpu_time_total)
    total = sum(self_us(e) for e in events) or 1.0
    events.sort(key=self_us, reverse=True)
    return [dict(name=e.key, calls=e.count, self_ms=self_us(e) / 1e3, share=self_us(e) / total) for e in events[:n]]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_from_trace(events: list[dict], comm: Callable[[str], bool], compute: Callable[[str], bool]) -> dict:
    """Milliseconds of communication, and how many of them ran while computation ran, from Chrome trace events.

    comm/compute select events (complete events, "ph": "X") by name; each set is merged into disjoint
    intervals first, so nested or repeated events count once.
    """
    complete = [e for e in events if e.get("ph") == "X"]
    return _overlap([e for e in complete if comm(e["name"])], [e for e in complete if compute(e["name"])])


def _overlap(comm: list[dict], compute: list[dict]) -> dict:
    def spans(chosen):
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in chosen])

    comm_spans, compute_spans = spans(comm), spans(compute)
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm_spans for c, d in compute_spans)
    comm_us = sum(b - a for a, b in comm_spans)
    return dict(comm_ms=comm_us / 1e3, compute_ms=sum(b - a for a, b in compute_spans) / 1e3,
                overlap_ms=overlap / 1e3, overlap_share=overlap / comm_us if comm_us else 0.0)


def _is_kernel(event: dict) -> bool:
    return event.get("ph") == "X" and event.get("cat") == "kernel"


def ddp_spans(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(communication, computation) events of a DDP step's Chrome trace, where they really run.

    On a GPU (the trace has "kernel" events) the device's kernels: NCCL's kernels vs every other kernel. The
    CPU-side ops there only launch work and return: a bucket's all_reduce op ends long before its kernel does,
    so CPU spans would show neither the overlap nor its absence. On the CPU: gloo's all_reduce events (its own
    thread) vs the main thread's backward ops (...Backward0)."""
    kernels = [e for e in events if _is_kernel(e)]
    if kernels:
        nccl = [e for e in kernels if "nccl" in e["name"].lower()]
        return nccl, [e for e in kernels if "nccl" not in e["name"].lower()]
    complete = [e for e in events if e.get("ph") == "X"]
    return ([e for e in complete if "all_reduce" in e["name"] or "allreduce" in e["name"]],
            [e for e in complete if e["name"].endswith("Backward0")])


def ddp_overlap(events: list[dict]) -> dict:
    """overlap_from_trace of a DDP step's communication vs its computation (ddp_spans: kernels on a GPU)."""
    return _overlap(*ddp_spans(events))


def profile_ddp_step(trace_dir: str, width: int = 256, layers: int = 6) -> dict[str, dict]:
    """On every rank of a torchrun launch: profile one DDP step of an MLP stack with and without
    overlap_grad_reduce, write the Chrome traces to trace_dir/ddp_{overlapped,serial}_rank{r}.json, and
    return ddp_overlap (bucket all-reduces vs backward: kernels on a GPU) for each ("overlapped", "serial")."""
    import json

    import torch.distributed as dist
    from torch import nn

    from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megalab.lab import dist as mdist

    rank, _ = mdist.init()
    dev = mdist.device()
    x = torch.randn(512, width, generator=torch.Generator().manual_seed(rank)).to(dev)
    results = {}
    for name, overlap in (("overlapped", True), ("serial", False)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(dev)
        ddp = DistributedDataParallel(model, bucket_size=width * width + width, overlap_grad_reduce=overlap)

        def step(ddp=ddp):
            ddp.zero_grad_buffer()
            ddp(x).square().mean().backward()
            ddp.finish_grad_sync()

        path = Path(trace_dir) / f"ddp_{name}_rank{rank}.json"
        profile_step(step, steps=1, warmup=1, trace_path=path, device=dev)
        events = json.loads(path.read_text())["traceEvents"]
        results[name] = ddp_overlap(events)
    dist.barrier()
    return results


class SavedTensorsMeter:
    """Bytes autograd keeps for backward inside a `with` block, each storage counted once.

        with SavedTensorsMeter(exclude=model.parameters()) as meter:
            loss = model(x).sum()
        meter.bytes

    Parameters (and views of them, like weight.t()) are excluded: they exist anyway.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._storages: dict[int, int] = {}  # storage address -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_layernorm_stat_bytes(dtype: torch.dtype, device: torch.device | str) -> int:
    """Bytes of one statistic (mean or rstd) per token that a LayerNorm on `dtype` inputs keeps for backward on
    `device`, measured: CUDA's kernel keeps them in fp32 (4 bytes), the CPU's in the input's dtype (2 for bf16)."""
    x = torch.zeros(2, 16, dtype=dtype, device=device, requires_grad=True)  # [tokens, h]
    norm = torch.nn.LayerNorm(16, dtype=dtype, device=device)
    with SavedTensorsMeter(exclude=[x, *norm.parameters()]) as meter:
        norm(x)
    return meter.bytes // (2 * x.shape[0])  # mean and rstd, one of each per token


def saved_dropout_mask_bytes(dtype: torch.dtype, device: torch.device | str) -> int:
    """Bytes per element of the mask dropout on `dtype` inputs keeps for backward on `device`, measured: CUDA's
    fused kernel keeps a bool mask (1 byte), the CPU path the scaled noise in the input's dtype (2 for bf16)."""
    x = torch.ones(64, dtype=dtype, device=device, requires_grad=True)
    with SavedTensorsMeter(exclude=[x]) as meter:
        torch.nn.functional.dropout(x, 0.5, training=True)
    return meter.bytes // x.numel()
