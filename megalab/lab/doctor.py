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
        ("FlashAttention in Triton", "does not run: no triton (Linux wheels only); its exercise runs in plain PyTorch"
         if f["triton"] == "not installed" else "compiled for the GPU" if n else f"{cpu}: TRITON_INTERPRET=1, small sizes"),
        ("flash-attn library", f"flash-attn {f['flash_attn']}" if f["flash_attn_ok"] else f"{cpu}: PyTorch SDPA"),
        ("sequence packing (cu_seqlens)", "flash_attn_varlen_func" if n and f["flash_attn_ok"]
         else "PyTorch SDPA with the document-causal mask"),
    ]


def platform_limits(system: str | None = None, machine: str | None = None, release: str | None = None,
                    environ: dict | None = None, hostname: str | None = None,
                    resolve_timeout: float = 3.0) -> list[tuple[str, str]]:
    """Rows naming this platform (Linux, WSL2, macOS on Apple silicon or Intel) and what will not run on it, and
    whether the hostname resolves (a Mac's often does not: single-machine runs do not need it)."""
    import socket

    from megalab.kernels import triton_status
    from megalab.lab import procs

    system = system or platform.system()
    machine = machine or platform.machine()
    release = release if release is not None else platform.release()
    environ = os.environ if environ is None else environ
    if system == "Darwin":
        chip = "Apple silicon" if machine in ("arm64", "aarch64") else "Intel"
        rows = [("platform", f"macOS on {chip} ({machine}): every %%torchrun chapter runs on gloo (CPU); processes "
                             "are read through psutil, ranks watch their launcher themselves"),
                ("  not here", "the Triton kernels of 06 · 03 (Triton has no macOS wheels; its online-softmax exercise "
                               "runs in plain PyTorch), flash-attn, NCCL and every GPU check (no CUDA on a Mac; the "
                               "course does not use Apple's MPS), FP8 tensor cores (FP8 is emulated on CPU)")]
    elif system == "Linux" and ("microsoft" in release.lower() or "WSL_DISTRO_NAME" in environ):
        rows = [("platform", f"Windows through WSL2 ({machine}, Linux {release}): the whole course runs, as on Linux; "
                             "an NVIDIA GPU needs only its Windows driver (CUDA on WSL)"),
                ("  keep in mind", "keep the course in the Linux home (~/), not under /mnt/c: files there are many "
                                   "times slower; open JupyterLab's URL in a Windows browser")]
    elif system == "Linux":
        rows = [("platform", f"Linux ({machine}): the whole course runs (gloo on CPU; NCCL on CUDA GPUs)")]
    elif system == "Windows":
        rows = [("platform", "Windows itself: the course does not run here; use WSL2 (README, \"Windows (WSL2)\")")]
    else:
        rows = [("platform", f"{system} ({machine}): not tested; Linux, macOS and WSL2 are")]
    ok, why = triton_status()
    if not ok and system != "Darwin":
        rows.append(("  triton", why))
    name = hostname or socket.gethostname()
    address = procs.resolve(name, resolve_timeout)
    if address:
        rows.append(("hostname", f"{name} resolves to {address}"))
    else:
        rows.append(("hostname", f"{name} does not resolve (within {resolve_timeout:g} s). Runs on this machine do not "
                                 "need it: their ranks meet on 127.0.0.1. Runs across machines do: give it an address "
                                 f"(a line `127.0.0.1 {name}` in /etc/hosts for this machine alone, its LAN address for "
                                 "several)"))
    return rows


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
    limits = platform_limits()  # this platform and what will not run on it
    lw = max(len(k) for k, _ in limits)
    lines += ["", "This platform:", *(f"  {k:<{lw}}  {v}" for k, v in limits)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- megalab doctor --slurm

_SLURM_PROBE = """\
import json, os, shutil, socket, subprocess, sys
run_dir, names = sys.argv[1], sys.argv[2:]
node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
unresolved = []
for name in names:
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        unresolved.append(name)
gpus = 0
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    gpus = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
if visible is not None:
    gpus = min(gpus, len([d for d in visible.split(",") if d.strip()]))
report = {"node": node, "sees_marker": os.path.exists(os.path.join(run_dir, "marker")), "unresolved": unresolved,
          "gpus": gpus, "probe_env": os.environ.get("MEGALAB_DOCTOR_PROBE")}
with open(os.path.join(run_dir, f"probe-{node}.json"), "w") as f:
    json.dump(report, f)
"""


def slurm_report(cwd: Path | None = None, timeout: float = 120.0) -> tuple[str, bool]:
    """`megalab doctor --slurm`: what a `%%torchrun --slurm` cell needs from the allocation it runs in, checked
    the way megalab launches (one srun step, one task per node): srun's version, the export setting, node names
    that resolve on every node, a run folder every node sees, GPUs per node. (text, True when all is well)."""
    import json
    import shutil
    import socket
    import subprocess
    import tempfile

    from megalab.lab.launch import LaunchError, slurm_cpus_per_node, slurm_nodes

    rows: list[tuple[str, str]] = []
    problems: list[str] = []

    def result() -> tuple[str, bool]:
        width = max(len(k) for k, _ in rows)
        lines = ["megalab doctor --slurm", "=" * 22, *(f"{k:<{width}}  {v}" for k, v in rows)]
        lines += ["", "Problems:", *(f"  - {p}" for p in problems)] if problems else ["", "All checks passed."]
        return "\n".join(lines), not problems

    srun = shutil.which("srun")
    if not srun:
        rows.append(("srun", "not found"))
        problems.append("no srun on PATH: run this on a login or compute node of the cluster")
        return result()
    version = subprocess.run([srun, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    rows.append(("srun", version or "(no version)"))
    major_minor = tuple(int(x) for x in version.split()[-1].split(".")[:2]) if version.split() else (0, 0)
    if major_minor < (20, 11):
        problems.append(f"{version}: megalab's srun uses --overlap, new in Slurm 20.11")
    export = os.environ.get("SLURM_EXPORT_ENV")
    rows.append(("export setting", f"SLURM_EXPORT_ENV={export}" if export else "SLURM_EXPORT_ENV unset (srun passes the "
                                                                               "environment on: ALL)"))
    if export and "ALL" not in export.upper().split(","):
        problems.append(f"SLURM_EXPORT_ENV={export}: srun passes on {'no' if export.upper() == 'NONE' else 'only part of the'}"
                        " environment (a job submitted with --export=NONE, batchspawner's default, sets this). "
                        "megalab's own srun asks for --export=ALL, but other srun commands (grading through srun) "
                        "lose PYTHONPATH: `export SLURM_EXPORT_ENV=ALL` in the job script")
    try:
        nodes = slurm_nodes()
    except (LaunchError, OSError, subprocess.SubprocessError) as exc:
        rows.append(("allocation", "none"))
        problems.append(f"{exc}: the other checks need an allocation (`salloc -N2`, or run it in the JupyterLab job)")
        return result()
    rows.append(("allocation", f"job {os.environ['SLURM_JOB_ID']}, {len(nodes)} node{'s' if len(nodes) != 1 else ''}: "
                               f"{', '.join(nodes)}; {slurm_cpus_per_node()} CPUs per node"))
    here = socket.gethostname()
    unresolved_here = []
    for name in nodes:
        try:
            socket.getaddrinfo(name, None)
        except OSError:
            unresolved_here.append(name)

    base = Path(cwd or Path.cwd()).resolve() / ".megalab" / "runs"
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="megalab-doctor-", dir=base))
    try:
        (run_dir / "marker").write_text("megalab doctor")
        cmd = [srun, f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1", "--overlap",
               "--cpus-per-task=1", "--export=ALL", "--job-name=megalab-doctor", sys.executable, "-c", _SLURM_PROBE,
               str(run_dir), *nodes, here]
        env = {**os.environ, "MEGALAB_DOCTOR_PROBE": "1"}
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=run_dir.parent)
            failed = out.returncode != 0 and (out.stderr.strip() or f"exit code {out.returncode}")
        except subprocess.TimeoutExpired:
            failed = f"no answer within {timeout:g} s"
        reports = {}
        for path in run_dir.glob("probe-*.json"):
            report = json.loads(path.read_text())
            reports[report["node"]] = report
        if failed:
            problems.append(f"srun could not run a step on every node: {str(failed)[:500]}")
        unresolved = {name: [r["node"] for r in reports.values() if name in r["unresolved"]] for name in [*nodes, here]}
        if unresolved_here:
            unresolved.update({n: [*unresolved.get(n, []), here] for n in unresolved_here})
        bad = {n: w for n, w in unresolved.items() if w}
        rows.append(("node names resolve", "ok" if not bad and reports else
                     "; ".join(f"{n} not on {', '.join(w)}" for n, w in bad.items()) or "unknown (no node answered)"))
        if bad:
            problems.append("node names that do not resolve on every node (the ranks meet at the first node or at "
                            f"this one, {here}): {', '.join(bad)}; ask the admins (DNS or /etc/hosts)")
        unseen = [n for n in nodes if n not in reports]
        blind = [r["node"] for r in reports.values() if not r["sees_marker"]]
        shared = not unseen and not blind
        rows.append(("shared run folder", f"ok ({base})" if shared else
                     f"NOT shared: {base} " + ", ".join(filter(None, [
                         f"no files from {', '.join(unseen)}" if unseen else "",
                         f"not seen by {', '.join(blind)}" if blind else ""]))))
        if not shared:
            problems.append(f"{base} is not on a filesystem every node shares: run the notebook from a shared folder "
                            "(home or project space, not /tmp)")
        lost = [r["node"] for r in reports.values() if r["probe_env"] != "1"]
        if lost:
            problems.append(f"megalab's srun (--export=ALL) did not pass the environment on to {', '.join(lost)}: "
                            "a site setting overrides it; ask the admins")
        gpus = {r["node"]: r["gpus"] for r in reports.values()}
        counts = sorted(set(gpus.values()))
        rows.append(("GPUs per node", (f"{counts[0]}" if len(counts) == 1 else "uneven: " + ", ".join(
            f"{n}: {g}" for n, g in sorted(gpus.items()))) + (" (gloo on CPU: %%torchrun --slurm -n CPU_RANKS)"
                                                              if counts == [0] else " (%%torchrun --slurm -n GPUS)")
                     if gpus else "unknown"))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result()
