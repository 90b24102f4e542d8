"""A learner's workspace (megalab/lab/workspace.py, `megalab workspace|grade|restore|update`) on a small tree.

What it must guarantee: grading one exercise names that exercise whatever else is blank or wrong
(the others run the reference); saving a notebook never changes a verdict (grading compares with
the expected outputs the tool keeps); restore and update lose nothing.
"""

import json
import re
import textwrap

import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.exercises import ExerciseError, load
from megalab.lab.grading import grade
from megalab.lab.workspace import BACKUP, create, enclosing_function, open_workspace, progress, swap_functions
from tests.test_exercises import _notebook, _toy_tree

CHAIN = '''\
def double(x):
    """Twice x."""
    # EXERCISE chain.double: return 2 * x
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION


def quadruple(x):
    # EXERCISE chain.quadruple: double twice, with double()
    ### BEGIN SOLUTION
    return double(double(x))
    ### END SOLUTION


def both(x):
    # EXERCISE chain.first: y = x + 1
    ### BEGIN SOLUTION
    y = x + 1
    ### END SOLUTION
    # EXERCISE chain.second: return 10 y
    ### BEGIN SOLUTION
    return 10 * y
    ### END SOLUTION
'''

CHAIN_TESTS = '''\
import pytest
from megalab.chain import both, double, quadruple

@pytest.mark.exercise("chain.double")
def test_double():
    assert double(3) == 6, f"double(3) is {double(3)}, expected 6"

@pytest.mark.exercise("chain.quadruple")
def test_quadruple():
    assert quadruple(3) == 12, f"quadruple(3) is {quadruple(3)}, expected 12"

@pytest.mark.exercise("chain.first")
@pytest.mark.exercise("chain.second")
def test_both():
    assert both(2) == 30, f"both(2) is {both(2)}, expected 30"
'''
NOTEBOOK = "course/01_x/02_chain.ipynb"


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A reference tree with the chain exercises and its workspace; the cwd is the workspace."""
    ref = _toy_tree(tmp_path / "ref")
    (ref / "megalab" / "chain.py").write_text(CHAIN)
    (ref / "tests" / "test_chain.py").write_text(CHAIN_TESTS)
    _notebook(ref / NOTEBOOK, "**Exercise `chain.double`**, **Exercise `chain.quadruple`**, **Exercise "
              "`chain.first`** and **Exercise `chain.second`**.", "from megalab.chain import quadruple\n"
              "print('quadruple(3) == 12:', quadruple(3) == 12)", "quadruple(3) == 12: True\n")
    create(ref, tmp_path / "ws")
    monkeypatch.chdir(tmp_path / "ws")
    return open_workspace(tmp_path / "ws")


def _write(ws, exercise_id: str, code: str) -> None:
    """Replace the blank of `exercise_id` in the workspace by `code` (one line, the region's indentation)."""
    path = ws.root / "megalab" / "chain.py"
    text = path.read_text()
    line = re.search(rf'^( *)raise NotImplementedError\("exercise {re.escape(exercise_id)}:.*$', text, re.M)
    path.write_text(text[: line.start()] + line[1] + code + text[line.end() :])


def _verdict(target: str):
    [row] = grade(".", target, timeout=60).exercises
    return row.status, row.detail


def test_create_writes_the_student_tree_and_keeps_the_reference(ws):
    assert (ws.root / ".megalab" / "env.mk").read_text().startswith("WORKSPACE := 1\nVENV := ")
    assert "### BEGIN SOLUTION" not in (ws.root / "megalab/chain.py").read_text()
    assert (ws.reference / "megalab/chain.py").read_text() == CHAIN  # the solutions, for grading
    assert (ws.reference / NOTEBOOK).is_file() and (ws.reference / "tests/test_chain.py").is_file()
    assert progress(ws.root) == (0, 6) and progress(ws.source) == (6, 6)
    config = json.loads((ws.root / ".megalab/workspace.json").read_text())
    assert config["reference"] == str(ws.source) and "megalab/chain.py" in config["files"]
    with pytest.raises(Exception, match="is itself a workspace"):
        create(ws.root, ws.root.parent / "again")


def test_one_exercise_is_graded_alone(ws):
    assert _verdict("chain.quadruple") == ("not implemented", "NotImplementedError: exercise chain.quadruple: double "
                                           "twice, with double() — see course/01_x/02_chain.ipynb")
    _write(ws, "chain.quadruple", "return double(double(x))")
    assert _verdict("chain.quadruple") == ("passed", "1 test passed")  # chain.double is still blank: reference runs
    _write(ws, "chain.double", "return x + x + 1")
    status, detail = _verdict("chain.double")
    assert status == "failed" and detail == "AssertionError: double(3) is 7, expected 6"
    assert _verdict("chain.quadruple")[0] == "passed"  # not blamed for chain.double's bug
    _write(ws, "chain.first", "y = x + 1")  # its partner in the same function is still blank
    assert _verdict("chain.first")[0] == "passed"
    assert _verdict("chain.second")[0] == "not implemented"
    # the chapter: run together first, the failing ones again alone: the same verdicts
    report = grade(".", "01", timeout=60, notebooks=False)
    assert {r.name: r.status for r in report.exercises} == {
        "toy.double": "not implemented", "chain.double": "failed", "chain.quadruple": "passed",
        "chain.first": "passed", "chain.second": "not implemented"}


def test_one_exercise_leaves_out_its_integration_tests_a_chapter_runs_them(ws):
    """`megalab grade ID` runs the exercise's focused tests only: one marked integration (an end-to-end launch of a
    whole feature) is left out, and the chapter's grade runs it too. Every exercise needs a focused test."""
    (ws.reference / "tests" / "test_chain_end_to_end.py").write_text(
        "import pytest\nfrom megalab.chain import double\n\n\n@pytest.mark.integration\n"
        "@pytest.mark.exercise('chain.double')\ndef test_double_end_to_end():\n"
        "    assert double(0.5) == 1.0, f'double(0.5) is {double(0.5)}, expected 1.0'\n")
    ex = load(ws.reference).exercises["chain.double"]
    assert ex.integration == ["tests/test_chain_end_to_end.py::test_double_end_to_end"]
    assert ex.verdict_tests == ["tests/test_chain.py::test_double"]
    _write(ws, "chain.double", "return 2 * int(x)")  # right on whole numbers (its focused test), wrong on 0.5
    assert _verdict("chain.double") == ("passed", "1 test passed")
    [row] = [r for r in grade(".", "01", timeout=60, notebooks=False).exercises if r.name == "chain.double"]
    assert (row.status, row.detail) == ("failed", "AssertionError: double(0.5) is 0, expected 1.0")
    (ws.reference / "tests" / "test_chain.py").write_text(CHAIN_TESTS.replace(
        '@pytest.mark.exercise("chain.double")', '@pytest.mark.integration\n@pytest.mark.exercise("chain.double")'))
    assert any("every test of exercise chain.double is marked integration" in p for p in load(ws.reference).problems())


def test_a_syntax_error_is_named_with_its_type_and_place(ws):
    _write(ws, "chain.quadruple", "return double(double(x)")
    status, detail = _verdict("chain.quadruple")
    assert status == "failed" and detail.startswith("SyntaxError: ") and "(megalab/chain.py, line 9)" in detail


def test_saved_outputs_never_decide_a_verdict_and_restore_brings_them_back(ws, capsys):
    nb_path = ws.root / NOTEBOOK
    _write(ws, "chain.double", "return 2 * x")
    _write(ws, "chain.quadruple", "return double(x) + x")  # wrong ...
    nb = nbformat.read(nb_path, 4)
    assert nb.cells[1].outputs[0]["text"] == "quadruple(3) == 12: True\n"  # ... and the saved output says True
    [row] = grade(".", NOTEBOOK, timeout=60).notebooks
    assert row.status == "failed" and row.detail.startswith("Cell 0: Cell outputs differ")
    _write_solution = (ws.root / "megalab/chain.py").read_text().replace("return double(x) + x", "return double(double(x))")
    (ws.root / "megalab/chain.py").write_text(_write_solution)
    nb.cells[1].outputs[0]["text"] = "quadruple(3) == 12: False\n"  # autosave after a run of the wrong code
    nbformat.write(nb, nb_path)
    report = grade(".", NOTEBOOK, timeout=60)
    assert [r.status for r in report.notebooks] == ["passed"] and report.notebooks[0].name == NOTEBOOK
    assert {r.name: r.status for r in report.exercises}["chain.quadruple"] == "passed"
    assert not list(nb_path.parent.glob(".megalab-grade-*"))  # the graded copies are gone

    assert cli.main(["restore", NOTEBOOK]) == 0
    assert nbformat.read(nb_path, 4).cells[1].outputs[0]["text"] == "quadruple(3) == 12: True\n"
    [backup] = (ws.root / BACKUP).rglob("02_chain.ipynb")
    assert nbformat.read(backup, 4).cells[1].outputs[0]["text"] == "quadruple(3) == 12: False\n"
    assert "your copy is in .megalab/backup/" in capsys.readouterr().out
    assert cli.main(["restore", "megalab/chain.py"]) == 2
    assert "not one of the course's notebooks" in capsys.readouterr().err


def test_update_takes_the_new_course_and_keeps_your_work(ws, capsys):
    _write(ws, "chain.quadruple", "return double(double(x))  # mine")
    (ws.root / NOTEBOOK).write_text((ws.root / NOTEBOOK).read_text().replace("Exercise", "EXERCISE", 1))
    chain = ws.source / "megalab" / "chain.py"
    chain.write_text(chain.read_text().replace('"""Twice x."""', '"""Twice x (new wording)."""'))
    (ws.source / "megalab" / "toy.py").write_text((ws.source / "megalab" / "toy.py").read_text() + "\nNEW = 1\n")
    ref_nb = ws.source / NOTEBOOK
    ref_nb.write_text(ref_nb.read_text().replace("and **Exercise", "and then **Exercise"))
    assert cli.main(["update"]) == 0
    out = capsys.readouterr().out
    assert "merged   megalab/chain.py" in out and "updated  megalab/toy.py" in out and f"updated  {NOTEBOOK}" in out
    text = (ws.root / "megalab/chain.py").read_text()
    assert "new wording" in text and "return double(double(x))  # mine" in text
    assert 'raise NotImplementedError("exercise chain.double:' in text  # still blank: the new blank
    assert "NEW = 1" in (ws.root / "megalab/toy.py").read_text() and "NEW = 1" in (ws.reference / "megalab/toy.py").read_text()
    backups = ws.root / BACKUP
    assert {p.name for p in backups.rglob("*") if p.is_file()} == {"chain.py", "02_chain.ipynb"}
    assert _verdict("chain.quadruple")[0] == "passed"
    assert cli.main(["update"]) == 0 and "0 file(s) changed" in capsys.readouterr().out  # idempotent
    # your edit of a file the course then changes elsewhere: both, merged; yours also in the backups
    (ws.root / "megalab/toy.py").write_text("MINE = 1\n" + (ws.root / "megalab/toy.py").read_text())
    assert cli.main(["update"]) == 0 and "kept     megalab/toy.py" in capsys.readouterr().out
    (ws.source / "megalab" / "toy.py").write_text((ws.source / "megalab" / "toy.py").read_text() + "\nNEWER = 2\n")
    assert cli.main(["update"]) == 0 and "merged   megalab/toy.py" in capsys.readouterr().out
    assert "NEWER = 2" in (ws.root / "megalab/toy.py").read_text() and "MINE = 1" in (ws.root / "megalab/toy.py").read_text()
    assert any("MINE = 1" in p.read_text() for p in backups.rglob("toy.py"))


def test_update_merges_a_course_fix_inside_a_function_you_implemented(ws, capsys):
    """Three-way, as git merges: a fix the course makes in an implemented function, outside its exercise
    region, arrives; so does a new task wording; your solution stays; the same lines changed on both sides
    are a conflict, reported, with both versions in the file."""
    _write(ws, "chain.quadruple", "return double(double(x))  # mine")
    chain = ws.source / "megalab" / "chain.py"
    chain.write_text(chain.read_text().replace("def quadruple(x):\n", "def quadruple(x):\n    x = int(x)  # course fix\n")
                     .replace("double twice, with double()", "double twice (new task wording)"))
    assert cli.main(["update"]) == 0
    assert "merged   megalab/chain.py" in capsys.readouterr().out
    text = (ws.root / "megalab/chain.py").read_text()
    assert "x = int(x)  # course fix" in text and "return double(double(x))  # mine" in text, text
    assert "# EXERCISE chain.quadruple: double twice (new task wording)" in text
    assert _verdict("chain.quadruple")[0] == "passed"
    assert cli.main(["update"]) == 0
    assert "0 file(s) changed" in capsys.readouterr().out
    assert "x = int(x)  # course fix" in (ws.root / "megalab/chain.py").read_text()  # true now: nothing left behind

    _write(ws, "chain.double", "return x + x  # mine")
    chain.write_text(chain.read_text().replace('"""Twice x."""', '"""Twice x, for ints."""'))
    (ws.root / "megalab/chain.py").write_text((ws.root / "megalab/chain.py").read_text()
                                              .replace('"""Twice x."""', '"""Twice x, my words."""'))
    assert cli.main(["update"]) == 1
    out = capsys.readouterr().out
    assert "CONFLICT megalab/chain.py (line " in out and "1 with conflicts to resolve" in out, out
    text = (ws.root / "megalab/chain.py").read_text()
    assert "my words" in text and "for ints" in text and "<<<<<<< megalab/chain.py (yours)" in text
    assert "return x + x  # mine" in text and "return double(double(x))  # mine" in text


def test_isolation_helpers():
    tree = __import__("ast").parse(CHAIN)
    assert enclosing_function(tree, 4) == "double" and enclosing_function(tree, 19) == "both"
    mine = CHAIN.replace("return 2 * x", "return 0")
    assert swap_functions(mine, CHAIN, ["double", "missing"], "chain.py") == CHAIN
    with pytest.raises(ExerciseError, match=r"SyntaxError: .*\(chain.py, line 1\)"):
        swap_functions("def (:", CHAIN, ["double"], "chain.py")


def test_a_deleted_marker_or_function_is_said_plainly(ws):
    """The exercises come from the kept reference: deleting an `# EXERCISE` line hides none."""
    (ws.root / "megalab/chain.py").write_text(textwrap.dedent("""\
        def double(x):
            return 2 * x
    """))
    report = grade(".", "chain.quadruple", timeout=60)
    [row] = report.exercises
    assert row.status == "failed" and "the function quadruple (which holds exercise chain.quadruple) is missing" in row.detail
    assert row.where == "megalab/chain.py (its `# EXERCISE chain.quadruple:` line is gone: put it back)"
    assert _verdict("chain.double") == ("passed", "1 test passed")  # solved, marker deleted: still graded


def test_update_follows_a_module_the_course_moved(ws, capsys):
    """A new layout moves an exercise module (megalab/chain.py -> megalab/lib/chain.py, as the Megatron
    layout moved every module): your implementation goes with it, the old file goes to the backups."""
    _write(ws, "chain.quadruple", "return double(double(x))  # mine")
    src = ws.source
    (src / "megalab" / "lib").mkdir()
    (src / "megalab" / "lib" / "__init__.py").write_text("")
    (src / "megalab" / "chain.py").rename(src / "megalab" / "lib" / "chain.py")
    for rel in ("tests/test_chain.py", NOTEBOOK):
        (src / rel).write_text((src / rel).read_text().replace("megalab.chain", "megalab.lib.chain"))
    assert cli.main(["update"]) == 0
    out = capsys.readouterr().out
    assert "merged   megalab/lib/chain.py" in out and "removed  megalab/chain.py" in out, out
    assert not (ws.root / "megalab/chain.py").exists()
    assert "return double(double(x))  # mine" in (ws.root / "megalab/lib/chain.py").read_text()
    assert any("# mine" in p.read_text() for p in (ws.root / BACKUP).rglob("chain.py"))
    assert progress(ws.root) == (1, 6)
    assert _verdict("chain.quadruple")[0] == "passed"


def test_a_failed_notebook_names_the_blank_exercise_it_needs(ws):
    """A notebook that dies of another error (a server answering 500, so the cell sees KeyError: 'choices')
    while an exercise its code imports is still blank: the row says which exercise to implement first."""
    from megalab.lab.exercises import load
    from megalab.lab.grading import Outcome, blank_dependencies, notebook_rows

    exercises = list(load(ws.reference).exercises.values())
    # the notebook imports quadruple: its exercise counts, not the blank neighbours in the module it does not use
    assert [ex.id for ex in blank_dependencies(ws.root, NOTEBOOK, exercises)] == ["chain.quadruple"]
    cell = Outcome(f"{NOTEBOOK}::Cell 1", "failed", [], "KeyError: 'choices'")
    needs = {NOTEBOOK: blank_dependencies(ws.root, NOTEBOOK, exercises)}
    [row] = notebook_rows([NOTEBOOK], {cell.nodeid: cell}, needs)
    assert row.status == "not implemented" and row.detail.startswith("needs chain.quadruple ("), row.detail
    assert "KeyError: 'choices'" in row.detail  # and what the notebook died of
    for ex in ("chain.double", "chain.quadruple", "chain.first", "chain.second"):
        _write(ws, ex, "return 0")
    assert blank_dependencies(ws.root, NOTEBOOK, exercises) == []
    [row] = notebook_rows([NOTEBOOK], {cell.nodeid: cell}, {NOTEBOOK: []})
    assert row.status == "failed" and row.detail == "Cell 1: KeyError: 'choices'", row.detail


def test_an_endless_loop_is_a_verdict_with_its_line(ws, monkeypatch):
    """While grading, a test may burn MEGALAB_CPU_LIMIT seconds of CPU (30 by default; 2 here): past that, the
    verdict names the endless loop and the learner's line, whatever the machine's load."""
    monkeypatch.setenv("MEGALAB_CPU_LIMIT", "2")
    _write(ws, "chain.double", "while x == x:\n        x = x + 0\n    return 2 * x")
    status, detail = _verdict("chain.double")
    assert status == "failed" and "EndlessLoop" in detail and "an endless loop?" in detail, detail
    assert "megalab/chain.py:" in detail, detail  # the line it was stuck on
