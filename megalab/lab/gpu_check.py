"""`make gpu-test`: the GPU-marked tests and every notebook's cells on CUDA, with a table per notebook.

    python -m megalab.lab.gpu_check               on a GPU machine: run it all, print the tables and the
                                                  course/INSTRUCTORS.md "tested on" row to paste
    python -m megalab.lab.gpu_check --plan 8      on any machine: which backend every %%torchrun cell would get
                                                  on a node with 8 GPUs (nothing is run)

A `%%torchrun -n N` cell runs on NCCL when the node has at least N GPUs (one per rank; the launcher's own
rule). With fewer GPUs every rank still computes on a GPU (MEGALAB_DEVICE=cuda: the GPUs are shared round
robin, megalab.lab.dist.device) and the ranks talk over gloo, which moves CUDA tensors through host memory --
but only for the collectives PyTorch's backend table lists for gloo on GPU: broadcast and all_reduce. A cell
that calls another one (GLOO_CUDA_UNSUPPORTED) is marked in the plan; if it fails, that is why.

On a machine without CUDA it says so and exits 0: nothing is run, nothing is pretended.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# PyTorch's backend table (torch.distributed docs, "Backends"): gloo on GPU tensors runs broadcast and all_reduce.
GLOO_CUDA_SUPPORTED = ("broadcast", "all_reduce")
GLOO_CUDA_UNSUPPORTED = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "reduce", "all_gather",
                         "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce_scatter",
                         "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single")
NBVAL_TIMEOUT_S = 900  # one notebook


@dataclass(frozen=True)
class CellPlan:
    index: int  # the cell's index in the notebook
    ranks: int
    backend: str  # "nccl", "gloo on CUDA", "gloo on CPU"
    unsupported: tuple[str, ...] = ()  # collectives the cell calls that gloo lacks on CUDA


@dataclass
class Row:
    notebook: str
    ranks: str
    backend: str
    result: str
    seconds: float | None = None


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


def collectives_in(body: str) -> set[str]:
    """The torch.distributed collectives a cell calls itself (dist.X / torch.distributed.X)."""
    lines = ["pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in body.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                names.add(node.func.attr)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("dist", "torch.distributed") \
                and node.attr in GLOO_CUDA_UNSUPPORTED:  # dist.isend passed to dist.P2POp
            names.add(node.attr)
    return names


def plan_cell(ranks: int, backend: str, n_gpus: int, collectives: set[str]) -> tuple[str, tuple[str, ...]]:
    if n_gpus == 0:
        return "gloo on CPU", ()
    if backend != "gloo" and ranks <= n_gpus:
        return "nccl", ()
    return "gloo on CUDA", tuple(sorted(collectives & set(GLOO_CUDA_UNSUPPORTED)))


def plan_notebook(notebook: Path, n_gpus: int) -> list[CellPlan]:
    plans = []
    for index, magic, body in torchrun_cells(notebook):
        ranks, backend = cell_ranks(magic)
        chosen, unsupported = plan_cell(ranks, backend, n_gpus, collectives_in(body))
        plans.append(CellPlan(index, ranks, chosen, unsupported))
    return plans


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "course").glob("*/*.ipynb"))


def plan_rows(paths: list[Path], n_gpus: int, root: Path = ROOT) -> list[Row]:
    """One row per notebook: its ranks, the backends its cells get on n_gpus GPUs, what gloo lacks there."""
    rows = []
    for path in paths:
        cells = plan_notebook(path, n_gpus)
        name = str(path.relative_to(root / "course")) if path.is_relative_to(root / "course") else path.name
        if not cells:
            rows.append(Row(name, "1", "one process", "planned"))  # its cells choose their device
            continue
        backends = sorted({c.backend for c in cells})
        lacking = sorted({op for c in cells for op in c.unsupported})
        note = f"gloo/CUDA lacks {', '.join(lacking)}" if lacking else "planned"
        rows.append(Row(name, ",".join(str(r) for r in sorted({c.ranks for c in cells})), " + ".join(backends), note))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("notebook", "ranks", "backend", "result", "seconds")
    body = [(r.notebook, r.ranks, r.backend, r.result, "" if r.seconds is None else f"{r.seconds:.0f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def _pytest(args: list[str], timeout: float) -> tuple[str, float]:
    """Run pytest in a fresh process on the GPUs; ("passed" or the failure summary, seconds)."""
    env = {**os.environ, "MEGALAB_DEVICE": "cuda",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout:.0f} s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ("passed" if done.returncode == 0 else f"FAILED: {last}"), seconds


def tested_on_row(gpu: str, torch_version: str, nccl: str, what: str, date: str | None = None) -> str:
    """The course/INSTRUCTORS.md "tested on" row for a real run."""
    date = date or datetime.date.today().isoformat()
    return f"| {date} | {gpu} | torch {torch_version} | NCCL {nccl} | {what} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=int, metavar="GPUS", help="print the plan for a node with GPUS GPUs; run nothing")
    parser.add_argument("--notebook", action="append", type=Path, help="only these notebooks (default: all)")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    args = parser.parse_args(argv)
    paths = args.notebook or notebooks()

    if args.plan is not None:
        print(f"Plan for a node with {args.plan} GPU(s) (nothing run):\n{format_table(plan_rows(paths, args.plan))}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print(f"make gpu-test: this machine has no CUDA GPU (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'none'}), so nothing was run and nothing is claimed.\n"
              "Run it on a GPU node; to see which backend each notebook's cells would get there:\n"
              "    python -m megalab.lab.gpu_check --plan 8")
        return 0

    n_gpus = torch.cuda.device_count()
    gpu = f"{n_gpus} x {torch.cuda.get_device_name(0)}"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    print(f"make gpu-test on {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")
    print(f"gloo on CUDA (cells with more ranks than GPUs) runs {', '.join(GLOO_CUDA_SUPPORTED)} only\n", flush=True)
    failed = 0
    if not args.no_tests:
        result, seconds = _pytest(["-m", "gpu", "tests", "-o", "addopts="], NBVAL_TIMEOUT_S)
        failed += result != "passed"
        print(format_table([Row("tests (-m gpu)", "-", "cuda", result, seconds)]) + "\n", flush=True)
    rows = plan_rows(paths, n_gpus)
    for row, path in zip(rows, paths):
        row.result, row.seconds = _pytest(["--nbval-lax", str(path), "-p", "no:xdist", "-o", "addopts=",
                                           "--nbval-current-env", f"--nbval-sanitize-with={ROOT / 'course/sanitize.cfg'}"],
                                          NBVAL_TIMEOUT_S)
        failed += row.result != "passed"
        print(format_table([row]), flush=True)  # one table per notebook, as it finishes
        print(flush=True)
    print("All notebooks:\n" + format_table(rows))
    passed = sum(r.result == "passed" for r in rows)
    what = f"make gpu-test: gpu tests {'run' if not args.no_tests else 'skipped'}, {passed}/{len(rows)} notebooks passed"
    print("\nRow for course/INSTRUCTORS.md (\"Tested on\"):\n" + tested_on_row(gpu, torch.__version__, nccl, what))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
