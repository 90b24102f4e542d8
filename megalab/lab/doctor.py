"""`megalab doctor`: what this machine has, and which parts of the course run fully on it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _auto_attention(gpu: bool, dtype_name: str = "bfloat16") -> tuple[str, str]:
    """What attention_backend="auto" runs for a model in `dtype_name` on this machine, and why (megalab/kernels)."""
    import torch

    from megalab.kernels import explain_attention_backend

    return explain_attention_backend("auto", torch.device("cuda" if gpu else "cpu"), getattr(torch, dtype_name),
                                     head_dim=64)


def cuda_driver_line() -> str:
    """The NVIDIA driver against what this torch build needs: a CUDA build on a driver too old for it has CUDA
    silently unavailable (every cell falls back to the CPU)."""
    import torch

    from megalab.lab import torch_build

    driver, cuda = torch_build.driver_version(), torch.version.cuda
    reinstall = "rm -rf .venv && make setup (it picks a build the driver runs; TORCH_INDEX_URL=... to choose one)"
    if not cuda:
        return f"{driver}, but torch is a CPU build: the GPUs are unused; {reinstall}" if driver \
            else "none (CPU build of torch)"
    needed = torch_build.driver_needed(cuda)
    if driver is None:
        return (f"none: no NVIDIA driver, so this CUDA {cuda} build of torch runs on the CPU "
                f"(the smaller CPU build: rm -rf .venv && TORCH_INDEX_URL={torch_build.CPU_INDEX} make setup)")
    if needed and torch_build.driver_major(driver) < needed:
        return (f"{driver}, older than this torch's CUDA {cuda} needs (R{needed}+): CUDA is unavailable and every "
                f"cell runs on the CPU. Update the driver, or reinstall torch for it: {reinstall}")
    if not torch.cuda.is_available():
        return (f"{driver} runs CUDA {cuda}, but torch sees no GPU: check CUDA_VISIBLE_DEVICES, or the container's "
                "access to the GPUs")
    return f"{driver} (runs CUDA {cuda}: R{needed}+)" if needed else f"{driver} (CUDA {cuda})"


def facts() -> dict:
    import torch
    import torch.distributed as dist

    from megalab.kernels import flash_attn_status
    from megalab.transformer_engine.fp8 import fp8_path

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "capability": (p.major, p.minor), "memory_gib": p.total_memory / 2**30})
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus and dist.is_nccl_available() else None
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "gpus": gpus,
        "nccl": nccl,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "fp8_tensor_cores": any(fp8_path(f"cuda:{i}") == "tensor cores" for i in range(len(gpus))),
        "flash_attn": _version("flash-attn") if importlib.util.find_spec("flash_attn") else None,
        "triton": _version("triton"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1" or not gpus,
        "flash_attn_ok": flash_attn_status()[0],
        "flash_attn_status": flash_attn_status()[1],
        "attention_auto": _auto_attention(bool(gpus))[0],
        "attention_auto_reason": _auto_attention(bool(gpus))[1],
        "attention_auto_fp32": _auto_attention(bool(gpus), "float32"),
        "jupyterlab": _version("jupyterlab"),
        "nbval": _version("nbval"),
        "ipywidgets": _version("ipywidgets"),
        "ipykernel": _version("ipykernel"),
    }


def _course_parts(f: dict) -> list[tuple[str, str]]:
    n = len(f["gpus"])
    cpu = "CPU fallback"
    return [
        ("%%torchrun, multi-rank runs", f"NCCL on up to {n} GPUs per node" if n else "gloo on CPU (full course)"),
        ("collectives, DP, TP, PP, CP, EP", "NCCL" if n else "gloo on CPU (full)"),
        ("FP8 matmul (torch._scaled_mm)", "megalab.transformer_engine.fp8 path: tensor cores" if f["fp8_tensor_cores"]
         else "megalab.transformer_engine.fp8 path: emulated (real fp8 rounding, not fp8 speed)"),
        ("FlashAttention in Triton", "compiled for the GPU" if n and f["triton"] != "not installed" else f"{cpu}: TRITON_INTERPRET=1, small sizes"),
        ("flash-attn library", f"flash-attn {f['flash_attn']}" if f["flash_attn_ok"] else f"{cpu}: PyTorch SDPA"),
        ("sequence packing (cu_seqlens)", "flash_attn_varlen_func" if n and f["flash_attn_ok"]
         else "PyTorch SDPA with the document-causal mask"),
    ]


def which_megalab(cwd: Path | None = None) -> list[tuple[str, str]]:
    """Rows saying which megalab this Python imports and which tree the current folder belongs to."""
    import megalab
    from megalab import _tree_of
    from megalab.lab.workspace import open_workspace, progress

    imported = Path(megalab.__file__).resolve().parent.parent
    here = _tree_of((cwd or Path.cwd()).resolve())
    if here is None:
        return [("megalab", f"{megalab.__version__} from {imported / 'megalab'}"),
                ("this folder", "not inside the course (no megalab/ here or above)")]
    ws = open_workspace(here)
    done, total = progress(here)
    kind = f"a workspace made from {ws.source}" if ws else "the reference (every exercise solved)" if done == total \
        else "a student tree"
    where = "this folder's tree" if here == imported else str(imported / "megalab")
    rows = [("megalab", f"{megalab.__version__} from {where}: {kind}, {done} of {total} exercises implemented")]
    if here != imported:
        rows.append(("  WARNING", f"Python imports megalab from {imported}, not from {here}: start JupyterLab with "
                                  f"`make lab` in {here} (or set PYTHONPATH={here})"))
    return rows


def report() -> str:
    f = facts()
    rows = [
        *which_megalab(),
        ("Python", f"{f['python']} ({sys.executable})"),
        ("Platform", f["platform"]),
        ("torch", f"{f['torch']} (CUDA build: {f['cuda_build'] or 'none, CPU-only'})"),
        ("CUDA driver", cuda_driver_line()),
        ("GPUs", str(len(f["gpus"])) if f["gpus"] else "none"),
        *[(f"  cuda:{i}", f"{g['name']}, sm_{g['capability'][0]}{g['capability'][1]}, {g['memory_gib']:.0f} GiB") for i, g in enumerate(f["gpus"])],
        ("NCCL", f["nccl"] or "not available (no GPU)"),
        ("gloo", "available" if f["gloo"] else "MISSING"),
        ("FP8 (Ada/Hopper+)", "yes" if f["fp8_tensor_cores"] else "no"),
        ("flash-attn", f["flash_attn_status"]),
        ("triton", f"{f['triton']}" + (" (interpreter mode: TRITON_INTERPRET=1)" if f["triton_interpret"] else "")),
        ("attention (auto)", {"flash_attn": "flash-attn", "triton": "Triton FlashAttention kernels (megalab/kernels)",
                              "sdpa": "PyTorch SDPA"}[f["attention_auto"]] + f" for bf16: {f['attention_auto_reason']}"),
        ("attention (auto, fp32)", f"{f['attention_auto_fp32'][0]}: {f['attention_auto_fp32'][1]}"),
        ("jupyterlab", f["jupyterlab"]),
        ("nbval", f["nbval"]),
        ("ipywidgets", f["ipywidgets"]),
        ("ipykernel", f["ipykernel"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["megalab doctor", "=" * 14, *(f"{k:<{width}}  {v}" for k, v in rows), "", "Course parts on this machine:"]
    parts = _course_parts(f)
    pw = max(len(k) for k, _ in parts)
    lines += [f"  {k:<{pw}}  {v}" for k, v in parts]
    return "\n".join(lines)
