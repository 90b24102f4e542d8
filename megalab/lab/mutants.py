"""Mutation testing of the course's own checks: every named mistake must be failed AND named by grading.

    python -m megalab.lab.mutants                          every mistake in tests/mistakes/
    python -m megalab.lab.mutants --exercise tp.row_forward
    python -m megalab.lab.mutants --file tests/mistakes/ch03_dp_tp.py --json results.json

A mistake (tests/mistakes/__init__.py) is a typical wrong body for one exercise region. For each one the
runner puts that body in the region, runs the exercise's tests the way `megalab grade` does (those marked
`@pytest.mark.exercise(ID)`, in file order, stopping at the first failure) and reads the grader's one-line
verdict (grading.failure_line). The verdict must fail and contain the mistake's `says`:

    caught + named       failed, and the verdict names the mistake
    caught, not named    failed, but the verdict only says "wrong" (the test needs a diagnosis)
    NOT CAUGHT           every test passed (or was skipped): the check cannot tell this mistake from a solution

How the body gets in, fast: the function that holds the region is compiled again with the mutated region
and its `__code__` swapped in the live process (every reference to it sees the mutant), and in every rank
that megalab.lab.launch starts (the env var MEGALAB_MUTANT, read by megalab.lab.worker). A mistake marked
`fresh` (a Triton kernel, code a separate process runs) instead runs in a fresh process on a copy of the
tree with the file patched on disk.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import linecache
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "MEGALAB_MUTANT"
MISTAKES_DIR = "tests/mistakes"
TEST_TIMEOUT = 120  # seconds per test: a hanging mutant fails (the tests' own launches time out sooner)


class CannotSwap(RuntimeError):
    """The function around a region cannot be swapped in a live process (run the mistake `fresh`)."""


@dataclass
class Result:
    exercise: str
    name: str
    says: str
    status: str  # "caught + named" | "caught, not named" | "NOT CAUGHT" | "error"
    seconds: float
    verdict: str  # the grader's one-line verdict (the first failure), or why it could not run

    @property
    def ok(self) -> bool:
        return self.status == "caught + named"


# --------------------------------------------------------------------------- the mistakes


def load_mistakes(root: Path, files: list[str] | None = None) -> list:
    """Every Mistake in tests/mistakes/*.py (or in `files`), in file order."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    paths = [root / f for f in files] if files else sorted((root / MISTAKES_DIR).glob("[!_]*.py"))
    found = []
    for path in paths:
        spec = importlib.util.spec_from_file_location(f"_megalab_mistakes_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += list(getattr(module, "MISTAKES", []))
    return found


def mutated_source(text: str, ex, code: str) -> str:
    """`text` (the module holding `ex`) with the region's body replaced by `code`, at the region's indent."""
    begin, end = ex.solution
    lines = text.splitlines(keepends=True)
    body = [ex.indent + line if line.strip() else "\n" for line in textwrap.dedent(code).strip("\n").splitlines(True)]
    body = [line if line.endswith("\n") else line + "\n" for line in body]
    return "".join(lines[:begin] + body + lines[end + 1 :])


# --------------------------------------------------------------------------- swapping a function's code


def _module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _holder(module, qualname: str):
    """(function object, its qualname) of the outermost function on the path `qualname` inside `module`."""
    obj, parts = module, qualname.split(".")
    for i, part in enumerate(parts):
        owner = obj
        obj = inspect.getattr_static(owner, part, None)
        if obj is None:
            raise CannotSwap(f"{module.__name__}.{'.'.join(parts[: i + 1])} is not reachable")
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        while hasattr(obj, "__wrapped__") and not hasattr(obj, "__code__"):  # functools.lru_cache, wraps
            obj = obj.__wrapped__
        if inspect.isfunction(obj):
            while hasattr(obj, "__wrapped__") and inspect.isfunction(obj.__wrapped__):
                obj = obj.__wrapped__
            return obj, ".".join(parts[: i + 1])
        if not inspect.isclass(obj):
            raise CannotSwap(f"{module.__name__}.{'.'.join(parts[: i + 1])} is a {type(obj).__name__}, "
                             "not a plain function (mark the mistake fresh=True)")
    raise CannotSwap(f"no function at {qualname}")


def _find_code(code, qualname: str):
    if getattr(code, "co_qualname", None) == qualname:
        return code
    for const in code.co_consts:
        if inspect.iscode(const):
            found = _find_code(const, qualname)
            if found is not None:
                return found
    return None


def swap(root: Path, rel: str, line: int, source: str):
    """Swap the code of the function around 1-based `line` of module `rel` for its code in `source`;
    returns a callable that undoes it."""
    from megalab.lab.workspace import enclosing_function, parse_module

    qualname = enclosing_function(parse_module(source, rel), line)
    if qualname is None:
        raise CannotSwap(f"{rel}:{line} is not inside a function")
    module = importlib.import_module(_module_name(rel))
    func, outer = _holder(module, qualname)
    filename = func.__code__.co_filename
    new = _find_code(compile(source, filename, "exec"), func.__code__.co_qualname)
    if new is None or len(new.co_freevars) != len(func.__code__.co_freevars):
        raise CannotSwap(f"cannot rebuild {outer} of {rel} from the mutated source")
    old, old_lines = func.__code__, linecache.cache.get(filename)
    func.__code__ = new
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show the mutant
    clear = [getattr(o, "cache_clear") for o in vars(module).values() if callable(getattr(o, "cache_clear", None))]
    for c in clear:
        c()

    def undo():
        func.__code__ = old
        if old_lines is None:
            linecache.cache.pop(filename, None)
        else:
            linecache.cache[filename] = old_lines
        for c in clear:
            c()

    return undo


def apply_from_env() -> None:
    """In a rank: swap in the mutant that MEGALAB_MUTANT names (a JSON file), if any."""
    path = os.environ.get(ENV)
    if path:
        spec = json.loads(Path(path).read_text())
        swap(Path(spec["root"]), spec["path"], spec["line"], spec["source"])


# --------------------------------------------------------------------------- running an exercise's tests


class _FirstFailure:
    """A pytest plugin: the grader's verdict line of the first failure, and whether anything ran."""

    def __init__(self):
        self.verdict: str | None = None
        self.passed = 0

    def pytest_runtest_logreport(self, report):
        from megalab.lab.grading import failure_line

        if report.failed and self.verdict is None:
            self.verdict = failure_line(report.longreprtext) or f"{report.nodeid} failed"
        elif report.passed and report.when == "call":
            self.passed += 1

    def pytest_collectreport(self, report):
        from megalab.lab.grading import failure_line

        if report.failed and self.verdict is None:
            self.verdict = failure_line(report.longreprtext) or "collection failed"


def run_tests(root: Path, ex) -> tuple[str | None, int]:
    """(the first failure's verdict or None, tests passed) for `ex`'s tests, stopping at the first failure."""
    import pytest

    plugin = _FirstFailure()
    args = [*ex.tests, "-x", "-p", "no:terminal", "-p", "no:cacheprovider", "-p", "no:nbval", "-o", "addopts=", "-p", "no:xdist",
            f"--timeout={TEST_TIMEOUT}", "--rootdir", str(root), "-W", "ignore"]
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code = pytest.main(args, plugins=[plugin])
    finally:
        os.chdir(cwd)
    if code in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise CannotSwap(f"pytest could not run the tests of {ex.id} ({code.name}): {' '.join(ex.tests)}")
    return plugin.verdict, plugin.passed


def _verdict(m, verdict: str | None, passed: int, seconds: float) -> Result:
    if verdict is None:
        status, verdict = "NOT CAUGHT", f"{passed} test(s) passed" if passed else "every test was skipped"
    elif m.says.lower() in verdict.lower():
        status = "caught + named"
    else:
        status = "caught, not named"
    return Result(m.exercise, m.name, m.says, status, round(seconds, 2), verdict)


def run_live(root: Path, registry, m) -> Result:
    """One mistake in this process: swap it in, run the tests, swap it out."""
    ex = registry.exercises[m.exercise]
    source = mutated_source((root / ex.path).read_text(encoding="utf-8"), ex, m.code)
    start = time.perf_counter()
    undo = swap(root, ex.path, ex.line, source)
    fd, spec = tempfile.mkstemp(prefix="megalab-mutant-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"root": str(root), "path": ex.path, "line": ex.line, "source": source}, f)
    os.environ[ENV] = spec
    try:
        verdict, passed = run_tests(root, ex)
    finally:
        os.environ.pop(ENV, None)
        os.unlink(spec)
        undo()
    return _verdict(m, verdict, passed, time.perf_counter() - start)


def run_fresh(root: Path, registry, m) -> Result:
    """One mistake in a fresh process, on a copy of the tree with the region patched on disk."""
    ex = registry.exercises[m.exercise]
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="megalab-mutant-"))
    try:
        for folder in ("megalab", "tests"):
            shutil.copytree(root / folder, tmp / folder, ignore=shutil.ignore_patterns("__pycache__"))
        for entry in root.iterdir():
            if not (tmp / entry.name).exists() and entry.name not in (".git", ".venv"):
                os.symlink(entry, tmp / entry.name)
        (tmp / ex.path).write_text(mutated_source((root / ex.path).read_text(encoding="utf-8"), ex, m.code))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
        env.pop(ENV, None)
        code = ("import json, sys; from pathlib import Path; from megalab.lab.exercises import load; "
                "from megalab.lab.mutants import run_tests; root = Path.cwd(); "
                f"print('\\n' + json.dumps(run_tests(root, load(root).exercises[{m.exercise!r}])))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=TEST_TIMEOUT * (len(ex.tests) + 1))
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        try:
            verdict, passed = json.loads(last)
        except ValueError:
            return Result(m.exercise, m.name, m.says, "error", round(time.perf_counter() - start, 2),
                          (proc.stderr or proc.stdout).strip().splitlines()[-1:][0] if (proc.stderr or proc.stdout)
                          else "the fresh run printed nothing")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _verdict(m, verdict, passed, time.perf_counter() - start)


def run(root: Path, mistakes: list) -> list[Result]:
    from megalab.lab.exercises import load

    registry = load(root)
    results = []
    for m in mistakes:
        if m.exercise not in registry.exercises or registry.exercises[m.exercise].solution is None:
            results.append(Result(m.exercise, m.name, m.says, "error", 0.0,
                                  f"no exercise {m.exercise} with a solution region in {root}"))
            continue
        try:
            result = run_fresh(root, registry, m) if m.fresh else run_live(root, registry, m)
        except CannotSwap as exc:
            result = Result(m.exercise, m.name, m.says, "error", 0.0, f"{exc}")
        results.append(result)
        print(_row(result), flush=True)
    return results


def _row(r: Result) -> str:
    return f"{r.exercise:34.34} {r.name[:44]:44} {r.status:18} {r.seconds:6.1f}s  {r.verdict[:150]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megalab.lab.mutants", description=__doc__.split("\n")[0])
    p.add_argument("--exercise", action="append", help="only this exercise's mistakes (repeatable)")
    p.add_argument("--file", action="append", help=f"only the mistakes in this file under {MISTAKES_DIR}/")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    from megalab.lab.exercises import find_root

    root = find_root(".")
    mistakes = load_mistakes(root, args.file)
    if args.exercise:
        mistakes = [m for m in mistakes if m.exercise in args.exercise]
    print(f"{'exercise':34} {'mistake':44} {'verdict':18} {'time':>7}  the grader's line")
    results = run(root, mistakes)
    named = sum(r.ok for r in results)
    print(f"\n{named} of {len(results)} mistakes caught and named"
          + ("" if named == len(results) else f"; {len(results) - named} not: see above"))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if named == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
