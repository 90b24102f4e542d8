"""Run a notebook's code cells without Jupyter, and compare what they print with the committed outputs.

    python -m megalab.lab.nbexec NOTEBOOK --json RESULT.json [--deadline EPOCH_SECONDS] [--gpus N]

`make gpu-test` (megalab/lab/gpu_check.py) runs every notebook this way on a GPU machine, which may have no
JupyterLab, nbclient or ipykernel. The cells run in order in one namespace, in the notebook's folder, like a
kernel's "Run All"; the course's magics are handled here: `%load_ext megalab` (the banner), `%%torchrun` (megalab's
launcher, as the cell magic calls it: megalab/lab/magic.py), `%progress`, `%grade`, `%hint`. What a cell prints
(stdout, and the value of its last expression) is compared with the output stored in the notebook:

- both sides go through course/sanitize.cfg (as nbval does), and a tensor's `, device='cuda:0'` is dropped;
- every line must read the same with its numbers taken out: so a check line's verdict (`True`/`False`) must be
  the committed one -- a check that printed True on CPU and prints False here fails;
- each number must equal the committed one within `atol + rtol * |committed| + one unit of its last printed
  digit`: rtol 1e-3 and atol 0 unless the cell says otherwise in a comment, `# GPU_RTOL: 1e-2` / `# GPU_ATOL: 1e-6`;
- a `# NBVAL_IGNORE_OUTPUT` cell (timings, hardware) is not compared number by number, but each committed line
  that holds a verdict must be there with the same verdict, and no new `False` may appear;
- a `# NBVAL_RAISES_EXCEPTION` cell (or one tagged raises-exception) must raise the committed exception type;
  any other exception fails the notebook at that cell, and the cells after it are reported as not run.

The result (RESULT.json) is rewritten after every cell, so a notebook stopped at its deadline still says what ran.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import contextlib
import io
import json
import math
import os
import re
import shlex
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RTOL = 1e-3
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\d.])")
VERDICT = re.compile(r"\b(True|False)\b")
TOLERANCE_TAG = re.compile(r"#\s*GPU_(RTOL|ATOL):\s*([0-9.eE+-]+)")
DEVICE_SPELLINGS = [(re.compile(r", device='cuda:\d+'"), "")]  # a tensor's repr on a GPU; the CPU's shows none
FIGURE = re.compile(r"^<Figure size \d+x\d+ with \d+ Axes>$")


class BudgetExceeded(Exception):
    """The notebook's time is up (its --deadline)."""


@dataclass
class CellResult:
    index: int
    status: str  # "passed", "failed" or "not run"
    seconds: float = 0.0
    message: str = ""


@dataclass
class NotebookResult:
    notebook: str
    status: str = "running"  # "passed", "failed", "partial" (stopped by the budget or a cell it cannot run)
    message: str = ""
    seconds: float = 0.0
    cells: list[CellResult] = field(default_factory=list)


# --------------------------------------------------------------------------- comparing outputs


def sanitizers(path: Path = ROOT / "course" / "sanitize.cfg") -> list[tuple[re.Pattern, str]]:
    """course/sanitize.cfg's regex/replace pairs (what nbval applies before comparing)."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(path)
    return [(re.compile(config[s]["regex"]), config[s]["replace"]) for s in config.sections()]


def sanitize(text: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, replacement in [*rules, *DEVICE_SPELLINGS]:
        text = pattern.sub(replacement, text)
    return text


def committed_text(cell: dict) -> tuple[str, str | None]:
    """(what the cell printed, the exception type it raised or None), from its stored outputs."""
    parts, error = [], None
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") == "stdout":
            parts.append(_text(out.get("text", "")))
        elif kind in ("execute_result", "display_data"):
            shown = _text(out.get("data", {}).get("text/plain", ""))
            if shown and not FIGURE.match(shown.strip()):
                parts.append(shown if shown.endswith("\n") else shown + "\n")
        elif kind == "error":
            error = out.get("ename")
    return "".join(parts), error


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def tolerance(source: str) -> tuple[float, float]:
    """(rtol, atol) for a cell: the defaults, or what its `# GPU_RTOL:` / `# GPU_ATOL:` comments say."""
    rtol, atol = DEFAULT_RTOL, 0.0
    for name, value in TOLERANCE_TAG.findall(source):
        if name == "RTOL":
            rtol = float(value)
        else:
            atol = float(value)
    return rtol, atol


def _unit(number: str) -> float:
    """One unit of the last printed digit: 0.01 for '4.86', 1e-7 for '1.5e-06', 1 for '42'."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.split(".", 1)[1]) if "." in mantissa else 0
    return 10.0 ** (int(exponent or 0) - decimals)


def _skeleton(line: str) -> str:
    return NUMBER.sub("#", line.rstrip())


def compare(expected: str, actual: str, source: str, rules: list[tuple[re.Pattern, str]]) -> str | None:
    """None when `actual` (this run's output) matches `expected` (the committed one), else the first difference."""
    expected, actual = sanitize(expected, rules), sanitize(actual, rules)
    if "NBVAL_IGNORE_OUTPUT" in source:
        return _compare_verdicts(expected.splitlines(), actual.splitlines())
    rtol, atol = tolerance(source)
    want, got = expected.rstrip("\n").splitlines(), actual.rstrip("\n").splitlines()
    for number, (w, g) in enumerate(zip(want, got), 1):
        if _skeleton(w) != _skeleton(g):
            return f"line {number} reads {g.strip()!r}, committed {w.strip()!r}"
        for a, e in zip(NUMBER.findall(g), NUMBER.findall(w)):
            allowed = atol + rtol * abs(float(e)) + _unit(e)
            if not abs(float(a) - float(e)) <= allowed:  # NaN fails
                return (f"line {number}: {a} where the CPU run printed {e} (allowed {allowed:.3g}; "
                        f"rtol {rtol:g}): {g.strip()!r}")
    if len(want) != len(got):
        extra = got[len(want)] if len(got) > len(want) else want[len(got)]
        which = "an extra line" if len(got) > len(want) else "a missing line"
        return f"{len(got)} lines, committed {len(want)} ({which}: {extra.strip()!r})"
    return None


def _compare_verdicts(want: list[str], got: list[str]) -> str | None:
    """For NBVAL_IGNORE_OUTPUT cells: every committed verdict line is there with its verdict, and no new False."""
    label = lambda line: VERDICT.sub("?", _skeleton(line))  # noqa: E731
    position = 0
    for w in want:
        if not VERDICT.search(w):
            continue
        found = next((i for i in range(position, len(got)) if label(got[i]) == label(w)), None)
        if found is None:
            return f"the check line {w.strip()!r} is missing"
        if VERDICT.findall(got[found]) != VERDICT.findall(w):
            return f"verdict changed: {got[found].strip()!r}, committed {w.strip()!r}"
        position = found + 1
    committed = {label(w) for w in want}
    for g in got:
        if "False" in VERDICT.findall(g) and label(g) not in committed:
            return f"a new failing check line: {g.strip()!r}"
    return None


# --------------------------------------------------------------------------- running cells


def torchrun_parser() -> argparse.ArgumentParser:
    """The `%%torchrun` options (megalab/lab/magic.py's, without IPython)."""
    from megalab.lab import launch

    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False, exit_on_error=False)
    p.add_argument("-n", "--nproc-per-node", type=int, default=1)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=launch.DEFAULT_TIMEOUT)
    p.add_argument("--hard-timeout", type=float, default=None)
    p.add_argument("--ranks", default="all")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--slurm", action="store_true")
    return p


class Executor:
    """One notebook's namespace; `run(source)` runs a cell and returns what it printed."""

    def __init__(self, deadline: float | None = None):
        self.namespace: dict = {"__name__": "__main__"}
        self.deadline = deadline

    def remaining(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.time()

    def run(self, source: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if source.startswith("%%"):
                magic, _, body = source.partition("\n")
                name, _, line = magic[2:].partition(" ")
                if name != "torchrun":
                    raise RuntimeError(f"the cell magic %%{name} is not one of the course's (%%torchrun)")
                self._torchrun(line, body)
            else:
                self._python(source)
        return out.getvalue()

    def _python(self, source: str) -> None:
        lines = []
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith("%") and line == line.lstrip():
                name, _, args = stripped[1:].partition(" ")
                line = f"__megalab_magic__({name!r}, {args!r})"
            elif stripped.startswith("!") and line == line.lstrip():
                raise RuntimeError(f"shell escapes are not run here: {stripped[:60]!r}")
            lines.append(line)
        self.namespace["__megalab_magic__"] = self._line_magic
        tree = ast.parse("\n".join(lines), filename="<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), self.namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.namespace)
            if value is not None and not source.rstrip().endswith(";"):
                print(_pretty(value))

    def _line_magic(self, name: str, line: str) -> None:
        import megalab

        if name == "load_ext":
            if line.strip() != "megalab":
                raise RuntimeError(f"%load_ext {line}: only megalab's extension is known here")
            from megalab.lab.dist import scratch_root

            scratch_root()
            print(megalab.banner(megalab._tree_of(Path.cwd()) or ROOT))
        elif name in ("progress", "grade", "hint"):
            getattr(megalab, f"{name}_magic")(line)
        else:
            raise RuntimeError(f"the line magic %{name} is not one of the course's")

    def _torchrun(self, line: str, body: str) -> None:
        from megalab.lab import launch

        args = torchrun_parser().parse_args(shlex.split(line))
        left = self.remaining()
        if left <= 5:
            raise BudgetExceeded("no time left for this %%torchrun cell")
        timeout = min(args.timeout, left)
        hard = min(args.hard_timeout or launch.HARD_TIMEOUT_FACTOR * args.timeout, left)
        result = launch.run("\n" + body, args.nproc_per_node, backend=args.backend, timeout=timeout,
                            hard_timeout=max(hard, timeout), ranks=args.ranks, nnodes=args.nnodes,
                            node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, slurm=args.slurm)
        sys.stdout.write(result.text("stdout"))
        err = result.text("stderr")
        if err:
            sys.stderr.write(err)
        self.namespace.update(result.results)


def _pretty(value) -> str:
    """The text/plain a kernel shows for a cell's last value (IPython's pretty printer where installed)."""
    try:
        from IPython.lib.pretty import pretty
    except ImportError:
        return repr(value)
    return pretty(value)


def _raises_expected(cell: dict, source: str) -> bool:
    tags = set(cell.get("metadata", {}).get("tags", []))
    return "NBVAL_RAISES_EXCEPTION" in source or bool(tags & {"raises-exception", "nbval-raises-exception"})


def _on_alarm(signum, frame):
    raise BudgetExceeded("the notebook's time budget ran out in this cell")


def run_notebook(path: Path, deadline: float | None = None, stop_cells: dict[int, str] | None = None,
                 report: Path | None = None) -> NotebookResult:
    """Run every code cell of `path` in order and compare each one's output with the committed one.

    stop_cells: cell index -> why it cannot run here (from the plan, e.g. "needs 8 GPUs (p2p)"): the run stops
    there, that cell and the rest reported as not run. `report` is rewritten (JSON) after every cell."""
    nb = json.loads(path.read_text())
    name = str(path.relative_to(ROOT / "course")) if path.is_relative_to(ROOT / "course") else path.name
    result = NotebookResult(name)
    rules = sanitizers()
    executor = Executor(deadline)
    start = time.perf_counter()
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    save = lambda: report and _write_json(report, asdict(result))  # noqa: E731
    old_cwd = os.getcwd()
    os.chdir(path.parent)
    if deadline is not None:
        signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for n, (index, cell) in enumerate(code):
            source = _text(cell["source"])
            why_not = (stop_cells or {}).get(index)
            if why_not is None and executor.remaining() <= 0:
                why_not = "the notebook's time budget ran out"
            if why_not is not None:
                result.cells += [CellResult(i, "not run", message=why_not) for i, _ in code[n:]]
                result.status, result.message = "partial", f"stopped at cell {index}: {why_not}"
                break
            cell_start = time.perf_counter()
            if deadline is not None:
                signal.setitimer(signal.ITIMER_REAL, max(executor.remaining(), 0.01))
            error = None
            try:
                printed = executor.run(source)
            except BudgetExceeded as exc:
                printed, error = "", exc
            except Exception as exc:  # noqa: BLE001  (a cell's failure is the finding)
                printed, error = "", exc
            finally:
                if deadline is not None:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            seconds = time.perf_counter() - cell_start
            expected, expected_error = committed_text(cell)
            if isinstance(error, BudgetExceeded):
                result.cells += [CellResult(index, "not run", seconds, str(error))]
                result.cells += [CellResult(i, "not run", message="after the budget ran out") for i, _ in code[n + 1:]]
                result.status, result.message = "partial", f"stopped at cell {index}: {error}"
                break
            message = None
            if error is not None and not _raises_expected(cell, source):
                message = f"raised {_summary(error)}"
            elif error is None and _raises_expected(cell, source):
                message = f"was to raise {expected_error or 'an exception'}, and raised none"
            elif error is not None and expected_error and type(error).__name__ != expected_error:
                message = f"raised {_summary(error)}, committed {expected_error}"
            if message is None and error is None:
                message = compare(expected, printed, source, rules)
            result.cells.append(CellResult(index, "failed" if message else "passed", seconds, message or ""))
            save()
            if message:
                result.cells += [CellResult(i, "not run", message=f"after cell {index} failed") for i, _ in code[n + 1:]]
                result.status, result.message = "failed", f"cell {index} {message}"
                break
        else:
            result.status = "passed"
    finally:
        os.chdir(old_cwd)
        result.seconds = time.perf_counter() - start
        save()
    return result


def _summary(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == "<cell>"]
    where = f" at line {frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}{where}: {text[0][:300] if text else ''}"


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalab.lab.nbexec", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--json", type=Path, help="write the result here (rewritten after every cell)")
    parser.add_argument("--deadline", type=float, help="stop by this time (seconds since the epoch)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs the plan assumes (cells it cannot run stop the run)")
    parser.add_argument("--no-host-p2p", action="store_true", help="do not stage gloo p2p of CUDA tensors via host")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    from megalab.lab.gpu_check import plan_notebook

    path = args.notebook.resolve()
    stops = {c.index: c.backend for c in plan_notebook(path, args.gpus, host_p2p=not args.no_host_p2p)
             if c.backend.startswith("needs")}
    result = run_notebook(path, args.deadline, stops, args.json)
    print(f"{result.notebook}: {result.status}{' -- ' + result.message if result.message else ''} "
          f"({result.seconds:.0f} s)")
    return 0 if result.status == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
