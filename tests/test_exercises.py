"""Exercises from one source (megalab/lab/exercises.py, megalab/lab/grading.py, `megalab student|grade`).

The real tree: its registry is consistent; its student workspace differs only in the regions;
the reference passes every exercise test; the student workspace fails each one with the
exercise's NotImplementedError; pasting one solution back turns exactly that exercise green.
Synthetic trees in tmp check the parser's errors and the notebook/test mapping.
"""

import csv
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.exercises import (
    NOT_FOR_STUDENTS,
    ExerciseError,
    blank,
    find_root,
    load,
    parse_regions,
    repository_files,
    scan_sources,
    write_student,
)
from megalab.lab.grading import Outcome, exercise_row, failure_line, notebook_rows, run_checks, unimplemented

REPO = Path(__file__).resolve().parent.parent
RESTORED = "dist.shard_bounds"  # the exercise pasted back for check (d)
TEST_TIMEOUT = 120

SOURCE = '''\
def f(x):
    """Doubles x."""
    if x is None:
        raise ValueError("x")
    # EXERCISE toy.double: return twice x
    ### BEGIN SOLUTION
    y = 2 * x
    return y
    ### END SOLUTION


class A:
    def g(self):
        # EXERCISE toy.g: return "g"
        ### BEGIN SOLUTION
        return "g"
        ### END SOLUTION
'''


# --------------------------------------------------------------------------- parser


def test_parse_and_blank_keep_everything_else():
    found, problems = parse_regions(SOURCE, "megalab/toy.py")
    assert problems == []
    assert [(ex.id, ex.task, ex.line, ex.indent, ex.solution) for ex in found] == [
        ("toy.double", "return twice x", 5, "    ", (5, 8)),
        ("toy.g", 'return "g"', 14, "        ", (14, 16)),
    ]
    found[0].notebook = "course/01_x/01_toy.ipynb"
    student = blank(SOURCE, found)
    assert student.splitlines()[:6] == SOURCE.splitlines()[:5] + [
        '    raise NotImplementedError("exercise toy.double: return twice x — see course/01_x/01_toy.ipynb")'
    ]
    assert '        raise NotImplementedError("exercise toy.g: return \\"g\\" — see course/")\n' in student
    compile(student, "toy.py", "exec")
    assert len(student.splitlines()) == len(SOURCE.splitlines()) - 5
    crlf = SOURCE.replace("\n", "\r\n")  # line endings are kept
    assert blank(crlf, parse_regions(crlf, "x.py")[0]) == blank(SOURCE, parse_regions(SOURCE, "x.py")[0]).replace("\n", "\r\n")


@pytest.mark.parametrize("text, expected", [
    ("    # EXERCISE a.b: t\n    ### BEGIN SOLUTION\n    x = 1\n", "unterminated region"),
    ("    # EXERCISE a.b: t\n    ### BEGIN SOLUTION\n    x = 1\n    # EXERCISE a.c: u\n    ### END SOLUTION\n",
     "unterminated region"),
    ("    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION\n", "needs a `# EXERCISE <id>: <task>` line"),
    ("    x = 1\n    ### END SOLUTION\n", "without a `### BEGIN SOLUTION`"),
    ("    # EXERCISE shard_bounds: no dot in the id\n", "malformed exercise line"),
    ("    # EXERCISE a.b: t\n  ### BEGIN SOLUTION\n    x = 1\n  ### END SOLUTION\n", "indented exactly like"),
    ("    # EXERCISE a.b: t\n    ### BEGIN SOLUTION\n\n    ### END SOLUTION\n", "is empty"),
    ("        # EXERCISE a.b: t\n        ### BEGIN SOLUTION\n    x = 1\n        ### END SOLUTION\n", "one block"),
    ("# EXERCISE a.b: t\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "module level"),
], ids=["no-end", "end-after-next-region", "begin-alone", "end-alone", "bad-id", "indent", "empty", "dedent",
        "module-level"])
def test_parse_errors_say_where_and_what(text, expected):
    _, problems = parse_regions(text, "megalab/m.py")
    assert problems and problems[0].startswith("megalab/m.py:") and expected in problems[0], problems


# --------------------------------------------------------------------------- a synthetic tree


def _notebook(path: Path, markdown: str, code: str = "", output: str = "", region_cell: str | None = None) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(markdown)]
    if code:
        cell = nbformat.v4.new_code_cell(code, execution_count=1)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)] if output else []
        nb.cells.append(cell)
    if region_cell:
        nb.cells.append(nbformat.v4.new_code_cell(region_cell, execution_count=2))
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _toy_tree(root: Path) -> Path:
    """A tiny repository: megalab/toy.py with two exercises, their tests and notebooks."""
    (root / "megalab").mkdir(parents=True)
    (root / "megalab" / "__init__.py").write_text("")
    (root / "megalab" / "lab").mkdir()
    (root / "megalab" / "lab" / "__init__.py").write_text("")
    for module in ("cpu_guard.py", "exercises.py", "grading.py", "launch.py", "notebooks.py", "procs.py", "progress.py",
                   "sandbox.py", "tracebacks.py", "translate.py", "worker.py", "workspace.py"):  # `megalab grade` loads its plugin here
        shutil.copy(REPO / "megalab" / "lab" / module, root / "megalab" / "lab" / module)
    (root / "megalab" / "toy.py").write_text(SOURCE)
    (root / "tests").mkdir()
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_toy.py").write_text(textwrap.dedent('''\
        import pytest
        from megalab.toy import A, f

        @pytest.mark.exercise("toy.double")
        def test_double():
            assert f(3) == 6

        @pytest.mark.exercise("toy.g")
        class TestG:
            def test_g(self):
                assert A().g() == "g"

        def test_unmarked():
            assert False, "graded runs leave unmarked tests out"
    '''))
    _notebook(root / "course" / "01_x" / "01_toy.ipynb", "# Toy\n**Exercise `toy.double`**: implement `f`.",
              "from megalab.toy import f\nprint(f(3))", "6\n")
    _notebook(root / "course" / "02_y" / "01_more.ipynb", "Recall `toy.double`; now **Exercise `toy.g`**.")
    _notebook(root / "course" / "01_x" / "00_intro.ipynb", "We will meet `toy.g` later.")
    return root


def test_registry_maps_notebooks_and_tests(tmp_path):
    registry = load(_toy_tree(tmp_path))
    assert registry.problems() == []
    double, g = registry.exercises["toy.double"], registry.exercises["toy.g"]
    assert double.notebook == "course/01_x/01_toy.ipynb"  # the announcing notebook wins over a mention
    assert g.notebook == "course/02_y/01_more.ipynb"  # ... even when a mention comes earlier in the course
    assert double.tests == ["tests/test_toy.py::test_double"] and g.tests == ["tests/test_toy.py::TestG::test_g"]
    assert [ex.id for ex in registry.select("01_x")] == ["toy.double"]
    assert find_root(tmp_path / "course" / "01_x") == tmp_path  # the commands work from any subfolder


def test_registry_problems(tmp_path):
    root = _toy_tree(tmp_path)
    (root / "megalab" / "copy.py").write_text("def h():\n    # EXERCISE toy.g: again\n    ### BEGIN SOLUTION\n"
                                              "    pass\n    ### END SOLUTION\n    # EXERCISE toy.lonely: x\n")
    (root / "tests" / "test_more.py").write_text('import pytest\npytestmark = [pytest.mark.exercise("toy.gone")]\n'
                                                 "def test_x():\n    pass\n")
    problems = "\n".join(load(root).problems())
    assert "megalab/toy.py:14: duplicate exercise id toy.g (first at megalab/copy.py:2)" in problems
    assert 'exercise toy.lonely has no test; mark one in tests/ with @pytest.mark.exercise("toy.lonely")' in problems
    assert "no notebook under course/ names exercise toy.lonely" in problems
    assert "tests/test_more.py::test_x: marked exercise 'toy.gone', but no `# EXERCISE toy.gone: ...`" in problems
    with pytest.raises(ExerciseError, match="duplicate exercise id toy.g"):
        write_student(root, tmp_path / "ws")


def test_student_of_a_tree_with_a_notebook_region(tmp_path, capsys):
    root = _toy_tree(tmp_path / "ref")
    region = "def k():\n    # EXERCISE nb.k: return 1\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\nprint(k())"
    nb_path = root / "course" / "01_x" / "02_k.ipynb"
    _notebook(nb_path, "# K", "print(2)", "2\n", region_cell=region)
    assert load(root).exercises["nb.k"].notebook == "course/01_x/02_k.ipynb"  # taught where it lives
    ws = tmp_path / "ws"
    (ws / "old").mkdir(parents=True)
    with pytest.raises(ExerciseError, match="not empty"):
        write_student(root, ws)
    result = write_student(root, ws, force=True)
    assert sorted(ex.id for ex in result.blanked) == ["nb.k", "toy.double", "toy.g"]
    before, after = nbformat.read(nb_path, 4), nbformat.read(ws / "course" / "01_x" / "02_k.ipynb", 4)
    assert after.cells[2].source == ('def k():\n    # EXERCISE nb.k: return 1\n'
                                     '    raise NotImplementedError("exercise nb.k: return 1 — see course/01_x/02_k.ipynb")'
                                     "\nprint(k())")
    after.cells[2].source = before.cells[2].source
    assert after == before  # outputs and everything else kept
    assert (ws / "course" / "01_x" / "01_toy.ipynb").read_bytes() == (root / "course/01_x/01_toy.ipynb").read_bytes()
    with pytest.raises(ExerciseError, match="no `### BEGIN SOLUTION` block .* already a student workspace"):
        write_student(ws, tmp_path / "ws2")


def test_grade_a_toy_workspace_end_to_end(tmp_path, monkeypatch, capsys):
    """`megalab grade` in a reference and a student tree: table, exit code, JSON, notebook-cell mapping."""
    root = _toy_tree(tmp_path / "ref")
    monkeypatch.chdir(root)
    assert cli.main(["grade", "01", "--timeout", "60", "--json", str(tmp_path / "grades" / "ada.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"toy.double +passed +1 test passed", out) and "toy.g" not in out
    assert re.search(r"course/01_x/01_toy.ipynb +passed +1 cell match", out)
    assert re.search(r"course/01_x/00_intro.ipynb +passed +no code cells", out)

    assert cli.main(["student", str(tmp_path / "ws")]) == 0
    assert "2 exercise(s) blanked in 1 file(s)" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path / "ws")
    assert cli.main(["grade", "--json", "grade.json", "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    report = json.loads(Path("grade.json").read_text())
    rows = {r["name"]: r for r in report["exercises"] + report["notebooks"]}
    assert rows["toy.double"]["status"] == rows["toy.g"]["status"] == "not implemented"
    assert rows["toy.double"]["detail"] == ("NotImplementedError: exercise toy.double: return twice x — "
                                            "see course/01_x/01_toy.ipynb")
    assert rows["toy.g"]["detail"] == 'NotImplementedError: exercise toy.g: return "g" — see course/02_y/01_more.ipynb'
    assert rows["toy.g"]["where"] == "megalab/toy.py:11" and rows["toy.g"]["notebook"] == "course/02_y/01_more.ipynb"
    nb = rows["course/01_x/01_toy.ipynb"]
    assert nb["status"] == "not implemented" and nb["detail"].startswith("Cell 0: NotImplementedError: exercise toy.double")
    assert any(i["nodeid"].endswith("::Cell 0") for i in rows["toy.double"]["items"])  # the cell counts for it
    assert "unmarked" not in json.dumps(report) and report["ok"] is False
    assert "2 exercises: 2 not implemented; 3 notebooks" in out

    # an instructor merges the class's reports (one file per student): `megalab report`
    Path("grade.json").rename(tmp_path / "grades" / "bob.json")
    reports = sorted(str(p) for p in (tmp_path / "grades").glob("*.json"))
    assert cli.main(["report", *reports, "--csv", str(tmp_path / "class.csv")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ada +1/2 +ok +n/a\n", out) and re.search(r"bob +0/2 +- +-\n", out)
    assert "columns: 1 toy.double, 2 toy.g" in out
    rows = list(csv.reader(open(tmp_path / "class.csv")))
    assert rows == [["student", "toy.double", "toy.g", "passed", "of"], ["ada", "passed", "missing", "1", "2"],
                    ["bob", "not implemented", "not implemented", "0", "2"]]
    (tmp_path / "grades" / "junk.json").write_text("{}")
    assert cli.main(["report", str(tmp_path / "grades" / "junk.json")]) == 2
    assert "junk.json: not a `megalab grade --json` report" in capsys.readouterr().err


def test_failure_lines_and_mapping():
    assert failure_line("x\n>   assert f(3) == 6\nE   assert 5 == 6\nE    +  where 5 = f(3)\n") == "assert 5 == 6"
    nbval = ("Notebook cell execution failed\nCell 2: Cell execution caused an exception\n\nInput:\nf()\n\n"
             "Traceback:\nRankFailedError: rank 1 failed: ValueError: bad\n")
    assert failure_line(nbval) == "Cell 2: Cell execution caused an exception: RankFailedError: rank 1 failed: ValueError: bad"
    mismatch = "Notebook cell execution failed\nCell 3: Cell outputs differ\n\nInput:\nprint(1)\n\nTraceback:\n mismatch 'stdout'\n"
    assert failure_line(mismatch) == "Cell 3: Cell outputs differ: mismatch 'stdout'"
    stub = 'RankFailedError: rank 0 failed: NotImplementedError: exercise a.b: do it — see course/x.ipynb\n'
    cells = {"nb::Cell 2": Outcome("nb::Cell 2", "failed", [], stub), "nb::Cell 3": Outcome("nb::Cell 3", "failed", [], nbval),
             "nb::Cell 1": Outcome("nb::Cell 1", "passed")}
    tests = {"t::a": Outcome("t::a", "passed", ["a.b"]), "t::c": Outcome("t::c", "failed", ["c.d"], "E   assert 1 == 2\n")}

    class Ex:
        id, tests = "a.b", ["t::a"]

    row = exercise_row(Ex, tests, cells)  # its tests pass, but a notebook cell says it is not implemented
    assert (row.status, row.detail) == ("not implemented", "NotImplementedError: exercise a.b: do it — see course/x.ipynb")
    tests["t::e"] = Outcome("t::e", "failed", ["e.f"], "report = {'x': 'NotImplementedError: exercise c.d: y'}\n"
                            "E   RankFailedError: rank 0 failed: NotImplementedError: exercise a.b: do it — see x\n")
    Ex.id, Ex.tests = "e.f", ["t::e"]
    row = exercise_row(Ex, tests, {})  # another exercise's stub is not this one's: failed, and the line says whose
    assert (row.status, row.detail) == ("failed", "NotImplementedError: exercise a.b: do it — see x")
    tests["t::o"] = Outcome("t::o", "failed", ["o.p"], "E   megalab.lab.launch.LaunchTimeoutError: cell timed out after "
                            "300 s: cell still computing after 900 s on 4 ranks (timeout 300 s, hard timeout 900 s), not deadlocked\n")
    Ex.id, Ex.tests = "o.p", ["t::o"]
    assert exercise_row(Ex, tests, {}).status == "not graded"  # overloaded is not a verdict on the code
    Ex.id, Ex.tests = "c.d", ["t::c"]
    assert (exercise_row(Ex, tests, {}).status, exercise_row(Ex, tests, {}).detail) == ("failed", "assert 1 == 2")
    [nb] = notebook_rows(["nb"], cells)
    assert (nb.status, nb.detail) == ("not implemented", "Cell 2: NotImplementedError: exercise a.b: do it — see "
                                      "course/x.ipynb (+1 more failing cell)")


# --------------------------------------------------------------------------- the real tree


def test_registry_of_the_course_is_consistent():
    """Every exercise has a test and a notebook; every marked test names an exercise that exists."""
    registry = load(REPO)
    assert registry.exercises, "no exercise regions found under megalab/"
    assert registry.problems() == []


_is_reference = all(ex.solution for ex in scan_sources(REPO)[0])
reference_only = pytest.mark.skipif(not _is_reference, reason="a student workspace has no solutions to check")


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return write_student(REPO, tmp_path_factory.mktemp("student"))


@reference_only
def test_student_workspace_differs_only_in_the_regions(student):
    """(a) Every file is byte-identical except each region, which became one raise at its indentation."""
    registry = load(REPO)
    assert sorted(ex.id for ex in student.blanked) == sorted(registry.exercises)
    regions = {}
    for ex in registry.exercises.values():
        regions.setdefault(ex.path, []).append(ex)
    files = [f for f in repository_files(REPO) if not f.startswith(NOT_FOR_STUDENTS)]
    assert student.files == len(files) and "megalab/lab/dist.py" in files
    assert not (student.dest / "tests" / "mistakes").exists()  # near-solutions: the grader keeps them
    checked = 0
    for rel in files:
        ours, theirs = (REPO / rel).read_bytes(), (student.dest / rel).read_bytes()
        if rel not in regions:
            assert ours == theirs, f"{rel} changed in the student workspace"
            continue
        assert not rel.endswith(".ipynb"), "notebook regions: add a cell-wise comparison here"
        ref_lines, stu_lines = ours.decode().splitlines(), theirs.decode().splitlines()
        changes = [op for op in difflib.SequenceMatcher(None, ref_lines, stu_lines, autojunk=False).get_opcodes()
                   if op[0] != "equal"]
        expected = sorted(regions[rel], key=lambda ex: ex.line)
        assert len(changes) == len(expected), f"{rel}: {len(changes)} changes for {len(expected)} regions"
        for (tag, i1, i2, j1, j2), ex in zip(changes, expected):
            begin, end = ex.solution
            if ex.buggy is not None:  # a bug hunt starts from the bug, uncommented
                assert (tag, i1, i2) == ("replace", begin, end + 1) and stu_lines[j1:j2] == ex.buggy, f"{rel}: {ex.id}"
                checked += 1
                continue
            assert (tag, i1, i2, j2 - j1) == ("replace", begin, end + 1, 1), f"{rel}: change {tag} at {i1} is not {ex.id}"
            assert stu_lines[j1] == f"{ex.indent}raise NotImplementedError({json.dumps(ex.message(), ensure_ascii=False)})"
            checked += 1
    assert checked == len(registry.exercises)


def _restore(ws, exercise_id: str) -> None:
    """Paste the reference solution of one exercise back into the student workspace `ws`."""
    ex = next(e for e in ws.blanked if e.id == exercise_id)
    begin, end = ex.solution
    solution = (REPO / ex.path).read_text().splitlines(keepends=True)[begin + 1 : end]
    lines = (ws.dest / ex.path).read_text().splitlines(keepends=True)
    raise_at = ex.line  # right after the `# EXERCISE` line (its 1-based number is the next line's index)
    assert lines[raise_at].lstrip().startswith(f'raise NotImplementedError("exercise {exercise_id}:')
    lines[raise_at : raise_at + 1] = solution
    (ws.dest / ex.path).write_text("".join(lines))


# The one end-to-end launch the student run keeps: a launched rank that reaches a blank region must fail the
# test with the exercise's message, and pass once RESTORED is pasted back. The other integration tests are
# only collected there: each launch costs seconds of rank start-up, the same failure each time.
LAUNCHED = "tests/test_dist.py::test_shard_sums_all_reduce_to_full_sum"


def _focused(exercises):
    """`megalab grade ID`'s tests of each exercise, and LAUNCHED for RESTORED."""
    return [replace(ex, integration=[t for t in ex.integration if t != LAUNCHED]) for ex in exercises]


def _collected_integration(root: Path) -> set[str]:
    """The integration tests pytest collects in `root` (their node ids, without parameters)."""
    files = sorted({node.split("::")[0] for ex in load(REPO).exercises.values() for node in ex.integration})
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:nbval", "-o", "addopts=",
                           "-p", "no:cacheprovider", "-m", "integration", *files],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"collecting the integration tests failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


@pytest.fixture(scope="module")
def outcomes(student, tmp_path_factory):
    """pytest runs of the exercise tests (one subprocess each): the student workspace, and beside it
    a student workspace with RESTORED pasted back, where we then run the tests of
    RESTORED and of every exercise whose tests stopped at RESTORED's NotImplementedError. (Any
    other test stopped at another exercise's region before RESTORED's code could matter.)
    Each exercise's focused tests run (and LAUNCHED); its integration tests are collected."""
    with ThreadPoolExecutor(2) as pool:
        in_student = pool.submit(run_checks, student.dest, _focused(student.blanked), timeout=TEST_TIMEOUT, focused=True)
        collected = pool.submit(_collected_integration, student.dest)
        restored = write_student(REPO, tmp_path_factory.mktemp("restored"))
        _restore(restored, RESTORED)
        runs = {"student": in_student.result(), "collected": collected.result()}
    waiting = {RESTORED} | {i for o in runs["student"].values() if unimplemented(o.text) == RESTORED for i in o.exercises}
    runs["restored"] = run_checks(restored.dest, _focused([ex for ex in restored.blanked if ex.id in waiting]),
                                  timeout=TEST_TIMEOUT, focused=True)
    return runs


@reference_only
def test_the_grader_runs_every_exercise_test(outcomes):
    """(b) Every marked test is run by the grader (the integration tests but one: collected). (That the
    reference passes them is the rest of this suite: the same tests on the same code in the same `make test`;
    running them a second time here cost minutes.)"""
    registry = load(REPO).exercises.values()
    expected = {node for ex in registry for node in ex.tests}
    ran = {node.split("[")[0] for node in outcomes["student"]}
    assert LAUNCHED in ran, f"{LAUNCHED}: the student run's one launch did not run"
    assert ran | outcomes["collected"] == expected
    assert {node for ex in registry for node in ex.integration} <= outcomes["collected"]


def _stub_of(node: str, o, by_id) -> str:
    """The exercise whose NotImplementedError (exact message) made this test fail (a bug hunt's test: the
    bug it names)."""
    assert o.outcome == "failed", f"{node} passes in the student workspace: does it test its exercise?"
    hunted = [i for i in o.exercises if i in by_id and by_id[i].buggy is not None]
    if hunted and unimplemented(o.text) is None:  # a bug hunt: red from the start, naming the bug
        assert o.first_line.split(": ", 1)[-1].startswith("likely mistake:"), f"{node}: {o.first_line}"
        return hunted[0]
    ex_id = unimplemented(o.text)
    assert ex_id in by_id, f"{node} fails, but not with an exercise's NotImplementedError: {o.first_line}"
    assert o.first_line == f"NotImplementedError: {by_id[ex_id].message()}"
    return ex_id


@reference_only
def test_student_workspace_fails_each_exercise_with_its_message(student, outcomes):
    """(c) Every exercise test fails with the exact NotImplementedError of its exercise, or of an
    earlier exercise whose code it runs first (comm's collectives split with dist.shard_bounds)."""
    by_id = {ex.id: ex for ex in student.blanked}
    assert outcomes["student"], "no exercise test ran in the student workspace"
    stubs = {node: _stub_of(node, o, by_id) for node, o in outcomes["student"].items() if o.outcome != "skipped"}
    assert {ex_id for node, ex_id in stubs.items() if ex_id in outcomes["student"][node].exercises}, (
        "no test fails with its own exercise's message")


@reference_only
def test_restoring_one_region_turns_exactly_that_exercise_green(outcomes):
    """(d) With the solution of RESTORED pasted back, exactly its tests pass; every other test
    still fails, with the NotImplementedError of another exercise (a test that waited for
    RESTORED now reaches its own region, or the next one it depends on)."""
    by_id = {ex.id: ex for ex in load(REPO).exercises.values()}
    assert outcomes["restored"] and outcomes["restored"].keys() <= outcomes["student"].keys()
    for node, o in outcomes["restored"].items():
        if o.exercises == [RESTORED]:
            assert o.outcome in ("passed", "skipped"), f"{node}: {o.first_line}"
        elif o.outcome != "skipped":
            assert _stub_of(node, o, by_id) != RESTORED, f"{node} still fails on {RESTORED}"
