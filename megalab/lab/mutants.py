"""Mutation testing of the course's own checks: every named mistake must be failed AND named by grading.

    python -m megalab.lab.mutants                          every mistake in tests/mistakes/
    python -m megalab.lab.mutants --exercise tp.row_forward
    python -m megalab.lab.mutants --file tests/mistakes/ch03_dp_tp.py --json results.json

A mistake (tests/mistakes/__init__.py) is a typical wrong body for one exercise region. For each one the
runner puts that body in the region, runs the exercise's tests the way `megalab grade ID` does (those marked
`@pytest.mark.exercise(ID)` but not `integration`, in file order, stopping at the first failure) and reads the
grader's one-line verdict (grading.failure_line). All of them run in ONE pytest session (collected once; every fixture torn
down between two mistakes), so a mistake costs what its failing test costs. The verdict must fail and contain the mistake's `says`:

    caught + named       failed, and the verdict names the mistake
    caught, not named    failed, but the verdict only says "wrong" (the test needs a diagnosis)
    NOT CAUGHT           every test passed (or was skipped): the check cannot tell this mistake from a solution

How the body gets in, fast (megalab/lab/mutate.py): the function that holds the region is compiled again with the mutated region
and its `__code__` swapped in the live process (every reference to it sees the mutant), and in every rank
that megalab.lab.launch starts (the env var MEGALAB_MUTANT, read by megalab.lab.worker). A mistake marked
`fresh` (a Triton kernel, code a separate process runs) instead runs in a fresh process on a copy of the
tree with the file patched on disk.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megalab.lab.mutate import ENV, CannotSwap, mutated_source, swap

MISTAKES_DIR = "tests/mistakes"
TEST_TIMEOUT = 120  # seconds per test: a hanging mutant fails (the tests' own launches time out sooner)


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


# --------------------------------------------------------------------------- running an exercise's tests


def _pytest_args(root: Path, nodes: list[str]) -> list[str]:
    return [*dict.fromkeys(nodes), "-p", "no:terminal", "-p", "no:cacheprovider", "-p", "no:nbval", "-o", "addopts=",
            "-p", "no:xdist", f"--timeout={TEST_TIMEOUT}", "--rootdir", str(root), "-W", "ignore"]


class _Sweep:
    """A pytest plugin that, in ONE session (collected once), runs each job's tests in file order and stops
    at its first failure, like `megalab grade` does. A job is (exercise, setup) where setup() swaps a mistake
    in and returns its undo; each job ends with every fixture torn down, so no value outlives its mutant."""

    def __init__(self, jobs: list, on_result=None):
        self.jobs, self.outcomes, self.on_result = jobs, [], on_result
        self._verdict, self._passed = None, 0

    def pytest_runtest_logreport(self, report):
        from megalab.lab.grading import failure_line

        if report.failed and self._verdict is None:
            self._verdict = failure_line(report.longreprtext) or f"{report.nodeid} failed"
        elif report.passed and report.when == "call":
            self._passed += 1

    def pytest_runtestloop(self, session):
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            return None  # a collection error: pytest reports it
        by_node: dict[str, list] = {}
        for item in session.items:
            by_node.setdefault(item.nodeid.split("[")[0], []).append(item)
        for ex, setup in self.jobs:
            items = [item for node in ex.tests for item in by_node.get(node, [])]
            self._verdict, self._passed = None, 0
            undo = setup()
            try:
                for i, item in enumerate(items):
                    nxt = items[i + 1] if i + 1 < len(items) else None
                    item.ihook.pytest_runtest_protocol(item=item, nextitem=nxt)
                    if self._verdict is not None:
                        session._setupstate.teardown_exact(None)
                        break
            finally:
                undo()
            self.outcomes.append((self._verdict, self._passed, len(items)))
            if self.on_result:
                self.on_result(len(self.outcomes) - 1, *self.outcomes[-1])
        return True


def run_tests(root: Path, jobs: list, on_result=None) -> list[tuple[str | None, int, int]]:
    """[(the first failure's verdict or None, tests passed, tests selected)] for each (exercise, setup) job;
    on_result(index, verdict, passed, selected) is called as each one ends."""
    import pytest

    plugin = _Sweep(jobs, on_result)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        code = pytest.main(_pytest_args(root, [node for ex, _ in jobs for node in ex.tests]), plugins=[plugin])
    finally:
        os.chdir(cwd)
    if len(plugin.outcomes) != len(jobs):
        raise CannotSwap(f"pytest could not run the tests ({code!r}): "
                         f"{' '.join(dict.fromkeys(n for ex, _ in jobs for n in ex.tests))}")
    return plugin.outcomes


def _verdict(m, verdict: str | None, passed: int, selected: int, seconds: float) -> Result:
    if verdict is None:
        status = "NOT CAUGHT"
        verdict = (f"{passed} test(s) passed" if passed else
                   "every test was skipped" if selected else "no test of this exercise was collected")
    elif m.says.lower() in verdict.lower():
        status = "caught + named"
    else:
        status = "caught, not named"
    return Result(m.exercise, m.name, m.says, status, round(seconds, 2), verdict)


def _live_setup(root: Path, ex, source: str, clock: list):
    """Swap the mutant in here and in every rank launched from here; returns its undo."""

    def setup():
        clock.append(time.perf_counter())
        undo = swap(root, ex.path, ex.line, source)
        fd, spec = tempfile.mkstemp(prefix="megalab-mutant-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"root": str(root), "path": ex.path, "line": ex.line, "source": source}, f)
        os.environ[ENV] = spec

        def done():
            os.environ.pop(ENV, None)
            os.unlink(spec)
            undo()
            clock.append(time.perf_counter())

        return done

    return setup


def run_live(root: Path, registry, mistakes: list, echo: bool = True) -> list[Result]:
    """Mistakes in this process, one pytest session for all: each swapped in, its tests run, swapped out."""
    jobs, clocks = [], []
    for m in mistakes:
        ex = registry.exercises[m.exercise]
        source = mutated_source((root / ex.path).read_text(encoding="utf-8"), ex, m.code)
        clocks.append([])
        jobs.append((ex, _live_setup(root, ex, source, clocks[-1])))
    results = []

    def said(i, verdict, passed, selected):
        c = clocks[i]
        results.append(_verdict(mistakes[i], verdict, passed, selected, (c[1] - c[0]) if len(c) == 2 else 0.0))
        if echo:
            print(_row(results[-1]), flush=True)

    run_tests(root, jobs, said)
    return results


def _tree_copy(root: Path, prefix: str) -> Path:
    """A private copy of the tree's megalab/ and tests/ (to patch on disk), the rest linked; the caller removes it."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    for folder in ("megalab", "tests"):
        shutil.copytree(root / folder, tmp / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for entry in root.iterdir():
        if not (tmp / entry.name).exists() and entry.name not in (".git", ".venv"):
            os.symlink(entry, tmp / entry.name)
    return tmp


def run_fresh(root: Path, registry, m) -> Result:
    """One mistake in a fresh process, on a copy of the tree with the region patched on disk."""
    ex = registry.exercises[m.exercise]
    start = time.perf_counter()
    tmp = _tree_copy(root, "megalab-mutant-")
    try:
        (tmp / ex.path).write_text(mutated_source((root / ex.path).read_text(encoding="utf-8"), ex, m.code))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
        env.pop(ENV, None)
        code = ("import json; from pathlib import Path; from megalab.lab.exercises import load; "
                "from megalab.lab.mutants import run_tests; root = Path.cwd(); "
                f"ex = load(root).exercises[{m.exercise!r}]; ex.tests = ex.verdict_tests; "
                "print('\\n' + json.dumps(run_tests(root, [(ex, lambda: (lambda: None))])[0]))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=TEST_TIMEOUT * (len(ex.tests) + 1))
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        try:
            verdict, passed, selected = json.loads(last)
        except ValueError:
            said = (proc.stderr or proc.stdout).strip().splitlines()
            return Result(m.exercise, m.name, m.says, "error", round(time.perf_counter() - start, 2),
                          said[-1] if said else "the fresh run printed nothing")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _verdict(m, verdict, passed, selected, time.perf_counter() - start)


def run(root: Path, mistakes: list, first_test_only: bool = False, echo: bool = True) -> list[Result]:
    """Every mistake's result, in the order given (the live ones share one pytest session). first_test_only:
    each exercise's first test alone (its focused "first check", what names a mistake)."""
    from dataclasses import replace

    from megalab.lab.exercises import load

    registry = load(root)  # the tests of `megalab grade ID`: its verdict_tests (not the integration ones)
    registry.exercises.update({k: replace(ex, tests=ex.verdict_tests[: 1 if first_test_only else None])
                               for k, ex in registry.exercises.items()})
    results: dict[int, Result] = {}
    live = []
    for i, m in enumerate(mistakes):
        if m.exercise not in registry.exercises or registry.exercises[m.exercise].solution is None:
            results[i] = Result(m.exercise, m.name, m.says, "error", 0.0,
                                f"no exercise {m.exercise} with a solution region in {root}")
        elif m.fresh:
            results[i] = run_fresh(root, registry, m)
            if echo:
                print(_row(results[i]), flush=True)
        else:
            live.append(i)
    swappable = []
    for i in live:  # a function that cannot be swapped is said now, not after the whole session
        ex = registry.exercises[mistakes[i].exercise]
        try:
            undo = swap(root, ex.path, ex.line, mutated_source((root / ex.path).read_text(encoding="utf-8"), ex,
                                                               mistakes[i].code))
            undo()
            swappable.append(i)
        except (CannotSwap, SyntaxError) as exc:
            results[i] = Result(mistakes[i].exercise, mistakes[i].name, mistakes[i].says, "error", 0.0, str(exc))
            print(_row(results[i]), flush=True)
    if swappable:
        try:
            for i, r in zip(swappable, run_live(root, registry, [mistakes[i] for i in swappable], echo)):
                results[i] = r
        except CannotSwap as exc:
            for i in swappable:
                results[i] = Result(mistakes[i].exercise, mistakes[i].name, mistakes[i].says, "error", 0.0, str(exc))
    return [results[i] for i in range(len(mistakes))]


def check_solutions(root: Path, solutions: list, first_test_only: bool = False) -> list[Result]:
    """Solutions written by someone else from the course's text alone (tests/blind/): each swapped in like a
    mistake, and it must pass; a Result's status is "passed" or "FAILED" (with the grader's verdict)."""
    from types import SimpleNamespace

    as_mistakes = [SimpleNamespace(exercise=s["exercise"], name=s.get("name", "blind solution"), says="",
                                   code=s["code"], fresh=s.get("fresh", False)) for s in solutions]
    results = run(root, as_mistakes, first_test_only, echo=False)
    for r in results:
        r.status = "passed" if r.status == "NOT CAUGHT" and r.verdict.endswith("test(s) passed") else "FAILED"
    return results


def check_solutions_together(root: Path, solutions: list, first_test_only: bool = True) -> list[Result]:
    """Every solution written into ONE copy of the tree (a learner's finished workspace), then each exercise's tests
    (its first, focused test with first_test_only) in one pytest run: one launch per test module for all of
    them. A Result per solution: "passed", or "FAILED" with the first failing test's line."""
    import xml.etree.ElementTree as ET

    from megalab.lab.exercises import load
    from megalab.lab.grading import failure_line

    registry = load(root)
    start = time.perf_counter()
    tmp = _tree_copy(root, "megalab-blind-")
    try:
        by_file: dict[str, list] = {}
        for s in solutions:
            ex = registry.exercises[s["exercise"]]
            by_file.setdefault(ex.path, []).append((ex, s["code"]))
        for rel, items in by_file.items():  # bottom-up: the regions above keep their line numbers
            text = (tmp / rel).read_text(encoding="utf-8")
            for ex, code in sorted(items, key=lambda item: -item[0].solution[0]):
                text = mutated_source(text, ex, code)
            (tmp / rel).write_text(text, encoding="utf-8")
        nodes = {s["exercise"]: registry.exercises[s["exercise"]].tests[: 1 if first_test_only else None]
                 for s in solutions}
        report = tmp / "report.xml"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))}
        env.pop(ENV, None)
        proc = subprocess.run([sys.executable, "-m", "pytest", *dict.fromkeys(n for ns in nodes.values() for n in ns),
                               "-q", "-p", "no:cacheprovider", "-p", "no:nbval", "-p", "no:xdist", "-o", "addopts=",
                               f"--timeout={TEST_TIMEOUT}", f"--junitxml={report}"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        if not report.exists():
            raise CannotSwap(f"pytest did not run the solutions' tests:\n{(proc.stdout + proc.stderr)[-3000:]}")
        failed: dict[str, str] = {}
        ran: dict[str, int] = {}
        for case in ET.parse(report).getroot().iter("testcase") if report.exists() else []:
            parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
            cut = next((i for i in range(len(parts), 0, -1) if (tmp / Path(*parts[:i])).with_suffix(".py").is_file()),
                       len(parts))
            node = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "").split("[")[0]])
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            ran[node] = ran.get(node, 0) + 1
            if problem is not None and node not in failed:
                failed[node] = failure_line(problem.text or problem.get("message", "")) or "failed"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = round(time.perf_counter() - start, 2)
    results = []
    for s in solutions:
        mine = nodes[s["exercise"]]
        bad = next((failed[n] for n in mine if n in failed), None)
        count = sum(ran.get(n, 0) for n in mine)
        status = "passed" if bad is None and count else "FAILED"
        results.append(Result(s["exercise"], s.get("name", "blind solution"), "", status, seconds,
                              bad or (f"{count} test(s) passed" if count else "no test ran")))
    return results


def _row(r: Result) -> str:
    return f"{r.exercise:34.34} {r.name[:44]:44} {r.status:18} {r.seconds:6.1f}s  {r.verdict[:150]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megalab.lab.mutants", description=__doc__.split("\n")[0])
    p.add_argument("--exercise", action="append", help="only this exercise's mistakes (repeatable)")
    p.add_argument("--file", action="append", help=f"only the mistakes in this file under {MISTAKES_DIR}/")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--solutions", action="append", help="a file of SOLUTIONS written from the course's text alone "
                   "(tests/blind/): each must pass")
    p.add_argument("--wrong", action="append", help="a file of WRONG answers written blind (tests/independent/): "
                   "each must fail; says whether its verdict contains the entry's `says` (the behaviour, named)")
    p.add_argument("--first-test-only", action="store_true", help="each exercise's first test only")
    p.add_argument("--together", action="store_true", help="every solution in one copy of the tree, one pytest run "
                   "(a finished workspace; one launch per test module)")
    args = p.parse_args(argv)
    from megalab.lab.exercises import find_root

    root = find_root(".")
    if args.wrong:
        return _main_wrong(root, args)
    if args.solutions:
        return _main_solutions(root, args)
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


def _load_lists(root: Path, files: list[str], name: str) -> list[dict]:
    """Every dict in the `name` lists of `files`, in file order."""
    found = []
    for rel in files:
        spec = importlib.util.spec_from_file_location(f"_megalab_{name.lower()}_{Path(rel).stem}", root / rel)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += list(getattr(module, name))
    return found


def load_solutions(root: Path, files: list[str]) -> list[dict]:
    """Every dict in the SOLUTIONS lists of `files` (tests/blind/*.py): exercise, code, and how it was written."""
    return _load_lists(root, files, "SOLUTIONS")


def load_wrong(root: Path, files: list[str]) -> list[dict]:
    """Every dict in the WRONG lists of `files` (tests/independent/*.py): exercise, name, code, and what a verdict
    that names it says (`says`, set once a verdict was judged to name it; absent while it does not)."""
    return _load_lists(root, files, "WRONG")


def check_wrong(root: Path, wrong: list, echo: bool = True) -> list[Result]:
    """Wrong answers written blind, graded like named mistakes: "NOT CAUGHT", "caught + named" (the verdict
    contains the entry's `says`) or "caught, not named"."""
    from types import SimpleNamespace

    as_mistakes = [SimpleNamespace(exercise=w["exercise"], name=w["name"], says=w.get("says") or "\0",
                                   code=w["code"], fresh=w.get("fresh", False)) for w in wrong]
    results = run(root, as_mistakes, echo=echo)
    for r in results:
        r.says = "" if r.says == "\0" else r.says
    return results


def _main_wrong(root: Path, args) -> int:
    wrong = load_wrong(root, args.wrong)
    if args.exercise:
        wrong = [w for w in wrong if w["exercise"] in args.exercise]
    print(f"{'exercise':34} {'wrong answer':44} {'verdict':18} {'time':>7}  the grader's line")
    results = check_wrong(root, wrong)
    caught = sum(r.status != "NOT CAUGHT" and r.status != "error" for r in results)
    named = sum(r.ok for r in results)
    print(f"\n{caught} of {len(results)} wrong answers fail; {named} named")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "half": w.get("half"), "expect": w.get("expect")}
                                               for r, w in zip(results, wrong)], indent=1))
    return 0 if caught == len(results) else 1


def _main_solutions(root: Path, args) -> int:
    solutions = load_solutions(root, args.solutions)
    if args.exercise:
        solutions = [s for s in solutions if s["exercise"] in args.exercise]
    print(f"{'exercise':34} {'solution':44} {'verdict':18} {'time':>7}  the grader's line")
    if args.together:
        results = check_solutions_together(root, solutions, args.first_test_only)
    else:
        results = check_solutions(root, solutions, args.first_test_only)
    for r in results:
        print(_row(r), flush=True)
    passed = sum(r.status == "passed" for r in results)
    print(f"\n{passed} of {len(results)} solutions pass" + ("" if passed == len(results) else "; see above"))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
