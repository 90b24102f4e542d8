"""`make gpu-test`: the GPU-marked tests and every notebook's cells on CUDA, compared with the CPU outputs.

    python -m megalab.lab.gpu_check               on a GPU machine: run it all, print the table and the
                                                  course/INSTRUCTORS.md "tested on" row to paste
    python -m megalab.lab.gpu_check --plan 8      on any machine: which backend every %%torchrun cell would get
                                                  on a node with 8 GPUs (nothing is run)
    python -m megalab.lab.gpu_check --cpu-rehearsal --notebook NB   the same machinery on the CPU (no GPU claims)

The notebooks run without Jupyter (megalab/lab/nbexec.py): every cell in order, its output compared with the
committed (CPU) output -- a check line's verdict must be the committed one, numbers within the cell's tolerance.
Several notebooks run at once (--workers), each within its own time budget and the whole within --budget;
what the budget cuts off is reported as not run, never as passed.

A `%%torchrun -n N` cell runs on NCCL when the node has at least N GPUs (one per rank; the launcher's own
rule). With fewer GPUs every rank still computes on a GPU (MEGALAB_DEVICE=cuda: the GPUs are shared round
robin, megalab.lab.dist.device) and the ranks talk over gloo, which runs the collectives on CUDA tensors
(GLOO_CUDA_COLLECTIVES) but has no point-to-point for them. Point-to-point is then staged through host memory
(megalab.lab.dist: a CUDA tensor's send goes out from a CPU copy, a receive lands in a CPU buffer and is copied
to the GPU at wait()); `--no-host-p2p` turns that off, and such cells are then reported "needs N GPUs (p2p)".
The plan finds p2p in a cell itself and in the library code a cell calls (P2P_CALLS, followed through megalab).

Without CUDA it says so: "no CUDA GPU" (exit 0: nothing was run, nothing is claimed), or, when an NVIDIA driver
is there but this torch cannot use it (a CPU build, or a CUDA build newer than the driver), "CUDA present but
unusable" with what to do (exit 2).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# gloo on CUDA tensors (ProcessGroupGloo's CUDA work classes): every collective; not send/recv.
GLOO_CUDA_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp")  # gloo has none of them on CUDA
DIST_NAMES = ("dist", "torch.distributed")
TRITON_MIN_CAPABILITY = (8, 0)  # Triton 3's NVIDIA targets: Ampere and newer
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores (torch._scaled_mm): Ada and Hopper
BUDGET_S = 420  # the whole run (tests and notebooks, several at once): the lent machine's 8 minutes, start-up included
NOTEBOOK_BUDGET_S = 150  # one notebook (the longest takes 90 s on 2 CPU cores)
TESTS_BUDGET_S = 240


@dataclass(frozen=True)
class CellPlan:
    index: int  # the cell's index in the notebook
    ranks: int
    backend: str  # "nccl", "gloo on CUDA", "gloo on CUDA, p2p via host", "gloo on CPU", "needs N GPUs (p2p)"
    p2p: tuple[str, ...] = ()  # the p2p calls it makes, itself or through megalab (names)


@dataclass
class Row:
    notebook: str
    ranks: str
    backend: str
    result: str
    seconds: float | None = None
    cells: list = field(default_factory=list)


# --------------------------------------------------------------------------- the plan


def torchrun_cells(notebook: Path) -> list[tuple[int, str, str]]:
    """(cell index, the %%torchrun line, the cell body) of every %%torchrun cell."""
    out = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and source.startswith("%%torchrun"):
            magic, _, body = source.partition("\n")
            out.append((i, magic, body))
    return out


def cell_ranks(magic: str) -> tuple[int, str]:
    """(ranks per node, requested backend) from a `%%torchrun -n 4 --backend auto ...` line."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    args, _ = parser.parse_known_args(shlex.split(magic)[1:])
    return args.nproc_per_node, args.backend


def _parse(source: str) -> ast.AST | None:
    lines = ["pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _dotted(node: ast.AST) -> str | None:
    """'torch.distributed' for that attribute chain, None for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return owner and f"{owner}.{node.attr}"
    return None


def _references(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(torch.distributed names it uses, other names it uses: bare names and attribute names)."""
    dist_names, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            (dist_names if _dotted(node.value) in DIST_NAMES else names).add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return dist_names, names


def collectives_in(body: str) -> set[str]:
    """The torch.distributed functions a cell uses itself (dist.X / torch.distributed.X)."""
    tree = _parse(body)
    return _references(tree)[0] if tree is not None else set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str) -> dict[str, str]:
    """Local name -> the megalab module or object it stands for (import x.y as z, from x import y)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megalab"):
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "megalab"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from .y import z
                package = module.split(".")[: len(module.split(".")) - node.level + (1 if module.endswith("__init__") else 0)]
                base = ".".join([*package, *([base] if base else [])])
            if base.startswith("megalab"):
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _resolved(node: ast.AST, module: str, imports: dict[str, str], local: set[str], cls: str | None) -> set[str]:
    """The megalab objects (qualified names) a function or class body refers to, where a reader can tell which."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            if sub.id in imports:
                out.add(imports[sub.id])
            elif sub.id in local:
                out.add(f"{module}.{sub.id}")
        elif isinstance(sub, ast.Attribute):
            owner = _dotted(sub.value)
            if owner is None:
                continue
            if owner in imports:
                out.add(f"{imports[owner]}.{sub.attr}")
            elif owner == "self" and cls:
                out.add(f"{module}.{cls}.{sub.attr}")
            elif owner.startswith("megalab."):
                out.add(f"{owner}.{sub.attr}")
    return out


def _p2p_calls(node: ast.AST) -> set[str]:
    """The torch.distributed p2p functions `node` calls (dist.isend(...), dist.P2POp(...)): not ones it only names,
    as a tracer that wraps them does."""
    return {sub.func.attr for sub in ast.walk(node) if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in P2P_CALLS and _dotted(sub.func.value) in DIST_NAMES}


@functools.cache
def library_p2p(root: Path = ROOT) -> frozenset[str]:
    """Qualified names of megalab's functions and classes that reach point-to-point (P2P_CALLS on torch.distributed),
    directly or through the megalab functions and classes they name (a class reaches what its methods reach)."""
    uses: dict[str, set[str]] = {}
    direct: set[str] = set()
    for path in sorted((root / "megalab").rglob("*.py")):
        tree = _parse(path.read_text())
        if tree is None:
            continue
        module = _module_name(path, root)
        imports = _imports(tree, module + (".__init__" if path.name == "__init__.py" else ""))
        local = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        local |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for top in tree.body:
            if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(top, ast.Assign):  # forward_backward = some_function: an alias
                    for t in top.targets:
                        if isinstance(t, ast.Name):
                            uses.setdefault(f"{module}.{t.id}", set()).update(_resolved(top.value, module, imports, local, None))
                continue
            cls = top.name if isinstance(top, ast.ClassDef) else None
            name = f"{module}.{top.name}"
            uses.setdefault(name, set()).update(_resolved(top, module, imports, local, cls) - {name})
            if _p2p_calls(top):
                direct.add(name)
            if cls:
                for item in top.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        uses.setdefault(f"{name}.{item.name}", set()).add(name)  # a method: what its class reaches
    reach = set(direct)
    while True:
        more = {name for name, used in uses.items() if name not in reach and used & reach}
        if not more:
            return frozenset(reach)
        reach |= more


def p2p_in(body: str, root: Path = ROOT) -> tuple[str, ...]:
    """The p2p a cell makes: its own torch.distributed p2p calls, and the megalab functions it names that reach p2p."""
    tree = _parse(body)
    if tree is None:
        return ()
    own = _references(tree)[0] & set(P2P_CALLS)
    via = {ref.removeprefix("megalab.") for ref in _resolved(tree, "__cell__", _imports(tree, "__cell__"), set(), None)
           if ref in library_p2p(root)}
    return tuple(sorted(own)) + tuple(sorted(via))


def plan_cell(ranks: int, backend: str, n_gpus: int, p2p: tuple[str, ...], host_p2p: bool = True) -> str:
    """The backend a cell gets on a node with n_gpus GPUs (or why it cannot run there)."""
    if n_gpus == 0:
        return "gloo on CPU"
    if backend != "gloo" and ranks <= n_gpus:
        return "nccl"
    if backend == "nccl":
        return f"needs {ranks} GPUs (--backend nccl)"
    if not p2p:
        return "gloo on CUDA"
    return "gloo on CUDA, p2p via host" if host_p2p else f"needs {ranks} GPUs (p2p)"


def plan_notebook(notebook: Path, n_gpus: int, host_p2p: bool = True, root: Path = ROOT) -> list[CellPlan]:
    plans = []
    for index, magic, body in torchrun_cells(notebook):
        ranks, backend = cell_ranks(magic)
        p2p = p2p_in(body, root)
        plans.append(CellPlan(index, ranks, plan_cell(ranks, backend, n_gpus, p2p, host_p2p), p2p))
    return plans


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "course").glob("*/*.ipynb"))


def _name(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root / "course")) if path.is_relative_to(root / "course") else path.name


def plan_rows(paths: list[Path], n_gpus: int, root: Path = ROOT, host_p2p: bool = True) -> list[Row]:
    """One row per notebook: its ranks, the backends its cells get on n_gpus GPUs, the p2p it reaches."""
    rows = []
    for path in paths:
        cells = plan_notebook(path, n_gpus, host_p2p, root)
        if not cells:
            rows.append(Row(_name(path, root), "1", "one process", "planned"))  # its cells choose their device
            continue
        backends = sorted({c.backend for c in cells})
        p2p = sorted({f"cell {c.index}: {', '.join(c.p2p)}" for c in cells if c.p2p and c.backend != "nccl"})
        note = ("p2p in " + "; ".join(p2p)) if p2p else "planned"
        rows.append(Row(_name(path, root), ",".join(str(r) for r in sorted({c.ranks for c in cells})),
                        " + ".join(backends), note))
    return rows


def format_table(rows: list[Row], markdown: bool = False) -> str:
    header = ("notebook", "ranks", "backend", "result", "seconds")
    body = [(r.notebook, r.ranks, r.backend, r.result, "" if r.seconds is None else f"{r.seconds:.0f}") for r in rows]
    if markdown:
        cells = lambda row: "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"  # noqa: E731
        return "\n".join([cells(header), "|---|---:|---|---|---:|", *map(cells, body)])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


# --------------------------------------------------------------------------- the machine


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version when one is installed (/proc/driver/nvidia/version, else nvidia-smi), else None."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module(?: for \w+)?\s+([\d.]+)", text)
        return match.group(1) if match else text.split("\n", 1)[0].strip()
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    return None


def cuda_state() -> tuple[str, str]:
    """("ok" | "none" | "unusable", a line saying so and what to do)."""
    import torch

    if torch.cuda.is_available():
        return "ok", ""
    driver = nvidia_driver()
    if driver is None:
        return "none", (f"this machine has no CUDA GPU (torch {torch.__version__}, CUDA build: "
                        f"{torch.version.cuda or 'none'}), so nothing was run and nothing is claimed")
    if torch.version.cuda is None:
        return "unusable", (f"CUDA present but unusable: NVIDIA driver {driver} is installed, but torch "
                            f"{torch.__version__} is a CPU build: install a CUDA build of torch "
                            "(`make setup` picks one that matches the driver) and run this again")
    try:
        torch.cuda.init()
        why = "torch.cuda.is_available() is False"
    except Exception as exc:  # noqa: BLE001  (torch says why: driver too old, no device visible, ...)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return "unusable", (f"CUDA present but unusable (driver {driver} too old for this wheel, or no device visible to "
                        f"it): torch {torch.__version__} is built for CUDA {torch.version.cuda} ({why}). Install the "
                        "torch build for your driver's CUDA version (`nvidia-smi` shows it), or update the driver")


def capability_notes(capability: tuple[int, int], name: str) -> list[str]:
    """One line per check this GPU is too old for, saying what happens and what to use instead."""
    cc = f"{capability[0]}.{capability[1]}"
    notes = []
    if capability < TRITON_MIN_CAPABILITY:
        notes.append(f"{name} (compute capability {cc}) is too old for Triton 3 (needs 8.0+, Ampere or newer): "
                     "the Triton kernel checks fail here for that reason; run on an A100, H100 or newer")
    if capability < FP8_MIN_CAPABILITY:
        notes.append(f"{name} (compute capability {cc}) has no FP8 tensor cores (needs 8.9+, Ada or Hopper): "
                     "FP8 runs emulated and the tensor-core FP8 tests are skipped, not passed")
    return notes


# --------------------------------------------------------------------------- running


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that hold gpu-marked tests (collecting only these keeps the run's imports small)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def _env(gpu: bool, host_p2p: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    if gpu:
        env["MEGALAB_DEVICE"] = "cuda"
    if not host_p2p:
        env["MEGALAB_HOST_P2P"] = "0"
    return env


def run_tests(deadline: float, gpu: bool) -> Row:
    """The gpu-marked tests in one pytest process: passed only if some ran and none failed; skips are named."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu",
           *gpu_test_files()]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=_env(False, True), capture_output=True, text=True,
                              timeout=max(deadline - time.time(), 1))
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or ""), None
    seconds = time.perf_counter() - start
    summary = next((ln.strip("= ") for ln in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    skips = [ln.split(": ", 1)[-1] for ln in out.splitlines() if ln.startswith("SKIPPED")]
    if code is None:
        result = f"not finished: stopped at the budget ({summary or 'no summary'})"
    elif code == 0 and "passed" in summary:
        result = f"passed: {summary}" + (f" (skipped: {'; '.join(sorted(set(skips)))})" if skips else "")
    elif code == 0:
        result = f"not run: {summary}" + (f" ({'; '.join(sorted(set(skips)))})" if skips else "")
    else:
        failed = [ln.split(" - ")[0].removeprefix("FAILED ") for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        result = f"FAILED: {summary or out.strip().splitlines()[-1:]}" + (f": {', '.join(failed[:6])}" if failed else "")
    return Row(f"tests (-m gpu, {len(gpu_test_files())} files)", "1", "cuda" if gpu else "cpu", result, seconds,
               cells=[out[-6000:]])


def run_notebook(path: Path, deadline: float, n_gpus: int, gpu: bool, host_p2p: bool, workdir: Path) -> Row:
    """One notebook in its own process (megalab.lab.nbexec), stopped at `deadline`."""
    [row] = plan_rows([path], n_gpus, host_p2p=host_p2p)
    report = workdir / (_name(path).replace("/", "__") + ".json")
    cmd = [sys.executable, "-m", "megalab.lab.nbexec", str(path), "--json", str(report), "--deadline", str(deadline),
           "--gpus", str(n_gpus), *([] if host_p2p else ["--no-host-p2p"])]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=_env(gpu, host_p2p), capture_output=True, text=True,
                              timeout=max(deadline - time.time(), 1) + 30)
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        tail = ["the executor did not stop at its deadline and was killed"]
    row.seconds = time.perf_counter() - start
    try:
        result = json.loads(report.read_text())
    except (OSError, ValueError):
        row.result = f"FAILED: the executor stopped before reporting ({' | '.join(tail)[:300]})"
        return row
    row.cells = result["cells"]
    ran = sum(c["status"] != "not run" for c in result["cells"])
    if result["status"] == "passed":
        row.result = f"passed ({ran} cells)"
    elif result["status"] == "partial":
        row.result = f"partial: {ran}/{len(result['cells'])} cells ran, {result['message']}"
    elif result["status"] == "running":
        row.result = f"FAILED: the executor died during the run ({' | '.join(tail)[:300]})"
    else:
        row.result = f"FAILED: {result['message']}"
    return row


def tested_on_row(gpu: str, torch_version: str, nccl: str, what: str, date: str | None = None) -> str:
    """The course/INSTRUCTORS.md "tested on" row for a real run."""
    date = date or datetime.date.today().isoformat()
    return f"| {date} | {gpu} | torch {torch_version} | NCCL {nccl} | {what} |"


def _short(notebook: str) -> str:
    """'03_parallelism/06_pipeline_parallel.ipynb' -> '03·06'."""
    chapter, _, name = notebook.partition("/")
    return f"{chapter[:2]}·{name[:2]}" if name else notebook


def _longest_first(paths: list[Path]) -> list[Path]:
    def recorded(path: Path) -> float:
        return json.loads(path.read_text()).get("metadata", {}).get("megalab", {}).get("run_seconds", 0.0)

    return sorted(paths, key=recorded, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=int, metavar="GPUS", help="print the plan for a node with GPUS GPUs; run nothing")
    parser.add_argument("--notebook", action="append", type=Path, help="only these notebooks (default: all)")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    parser.add_argument("--no-host-p2p", action="store_true", help="no host-staged p2p: such cells need one GPU per rank")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run (default %(default)s)")
    parser.add_argument("--notebook-budget", type=float, default=NOTEBOOK_BUDGET_S, help="seconds per notebook")
    parser.add_argument("--workers", type=int, default=None, help="notebooks run at once (default: cores / 4, 1..4)")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="write gpu_check.md and gpu_check.json here (default: $OUT when set)")
    parser.add_argument("--require-gpu", action="store_true", help="no usable CUDA GPU is an error (exit 2)")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the same machinery on the CPU (no GPU claims): for rehearsing the device check")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebook] if args.notebook else notebooks()
    host_p2p = not args.no_host_p2p

    if args.plan is not None:
        print(f"Plan for a node with {args.plan} GPU(s) (nothing run; gloo runs "
              f"{', '.join(GLOO_CUDA_COLLECTIVES)} on CUDA tensors, and no p2p):\n"
              f"{format_table(plan_rows(paths, args.plan, host_p2p=host_p2p))}")
        return 0

    import torch

    state, line = cuda_state()
    if args.cpu_rehearsal:
        gpu, n_gpus, machine = False, 0, "CPU rehearsal (no GPU claims)"
    elif state != "ok":
        print(f"make gpu-test: {line}.")
        if state == "none":
            print("Run it on a GPU node; to see which backend each notebook's cells would get there:\n"
                  "    python -m megalab.lab.gpu_check --plan 8")
        return 2 if state == "unusable" or args.require_gpu else 0
    else:
        gpu, n_gpus = True, torch.cuda.device_count()
        machine = f"{n_gpus} x {torch.cuda.get_device_name(0)}"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpu and torch.distributed.is_nccl_available() else "none"
    notes = capability_notes(torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)) if gpu else []
    print(f"make gpu-test on {machine}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")
    for note in notes:
        print(f"note: {note}")
    print(f"gloo on CUDA (cells with more ranks than GPUs): {', '.join(GLOO_CUDA_COLLECTIVES)}; p2p "
          f"{'staged through host memory' if host_p2p else 'not available (such cells are skipped)'}\n", flush=True)

    start = time.time()
    deadline = start + args.budget
    workers = args.workers or max(1, min(4, (os.cpu_count() or 1) // 4))
    workdir = Path(tempfile.mkdtemp(prefix="megalab-gpu-check-"))
    rows: list[Row] = []

    def job(item):
        if item == "tests":
            return run_tests(min(deadline, time.time() + TESTS_BUDGET_S), gpu)
        left = deadline - time.time()
        if left < 20:
            [row] = plan_rows([item], n_gpus, host_p2p=host_p2p)
            row.result = "not run: the run's time budget was spent before it started"
            return row
        return run_notebook(item, min(deadline, time.time() + args.notebook_budget), n_gpus, gpu, host_p2p, workdir)

    jobs = ([] if args.no_tests else ["tests"]) + _longest_first(paths)
    with ThreadPoolExecutor(workers) as pool:
        for row in pool.map(job, jobs):
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
            if args.out:  # as it goes: a run stopped from outside still leaves what finished
                _write_results(Path(args.out), machine, torch, nccl, notes, rows, "(not finished)", time.time() - start)
    shutil.rmtree(workdir, ignore_errors=True)
    order = {_name(p): i for i, p in enumerate(paths)}
    rows.sort(key=lambda r: order.get(r.notebook, -1))
    nb_rows = [r for r in rows if r.notebook in order]
    test_rows = [r for r in rows if r.notebook not in order]
    passed = sum(r.result.startswith("passed") for r in nb_rows)
    tests_text = (test_rows[0].result.split(" (skipped")[0] if test_rows else "skipped")
    not_passed = [_short(r.notebook) for r in nb_rows if not r.result.startswith("passed")]
    what = (f"make gpu-test: gpu tests {tests_text}; {passed}/{len(nb_rows)} notebooks passed"
            + (f" (not: {', '.join(not_passed)})" if not_passed else ""))
    row_line = tested_on_row(machine, torch.__version__, nccl, what)
    print("\nAll:\n" + format_table(rows))
    print(f"\nRow for course/INSTRUCTORS.md (\"Tested on\"):\n{row_line}\n({time.time() - start:.0f} s)")
    if args.out:
        _write_results(Path(args.out), machine, torch, nccl, notes, rows, row_line, time.time() - start)
    tests_ok = not test_rows or test_rows[0].result.startswith("passed") or (
        args.cpu_rehearsal and test_rows[0].result.startswith("not run"))
    return 0 if passed == len(nb_rows) and tests_ok else 1


def _write_results(out: Path, machine: str, torch, nccl: str, notes: list[str], rows: list[Row], row_line: str,
                   seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    for r in rows:
        if r.notebook.startswith("tests"):
            if not r.result.startswith(("passed", "not run")):
                failures.append(f"- {r.notebook}: {r.result}")
            continue
        failures += [f"- {r.notebook} cell {c['index']}: {c['message']}" for c in r.cells if c.get("status") == "failed"]
        if r.result.startswith("FAILED") and not any(c.get("status") == "failed" for c in r.cells):
            failures.append(f"- {r.notebook}: {r.result}")
    md = [f"# make gpu-test on {machine}", "",
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; {seconds:.0f} s", "",
          *[f"- note: {n}" for n in notes], "", format_table(rows, markdown=True), "",
          "## Failures", "", *(failures or ["none"]), "",
          "## Row for course/INSTRUCTORS.md", "", row_line, ""]
    tests = next((r for r in rows if r.notebook.startswith("tests")), None)
    if tests and tests.cells:
        md += ["## gpu-marked tests (pytest output, end)", "", "```", tests.cells[0][-4000:], "```", ""]
    (out / "gpu_check.md").write_text("\n".join(md))
    (out / "gpu_check.json").write_text(json.dumps({
        "machine": machine, "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "notes": notes,
        "seconds": round(seconds, 1), "row": row_line, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
