"""Hints, progress and bug-hunt regions (megalab/lab/progress.py, megalab/lab/exercises.py): the student copy
hides the hints and starts a bug hunt from the bug; `megalab hint` reveals one level at a time and records it;
`megalab progress` counts what the last grades passed; a check that only skipped never counts as passed."""

import json

import matplotlib
import nbformat
import pytest

from megalab.lab import cli
from megalab.lab.exercises import load, write_student
from megalab.lab.grading import Outcome, Row, exercise_row
from megalab.lab.progress import HintError, ProgressError, chart, hint, load_state, record_grades, summary, table

matplotlib.use("Agg")

MODULE = '''def add(a, b):
    # EXERCISE toy.add: add two numbers
    ### BEGIN SOLUTION
    # HINT 1: The idea: addition.
    # HINT 2: The approach: one operator,
    #         between the two arguments.
    return a + b
    ### END SOLUTION


def seed(base, rank):
    # EXERCISE toy.seed: each rank its own seed
    ### BEGIN SOLUTION
    # HINT 1: Same seed everywhere means identical dropout masks.
    # HINT 2: Offset the base by something that differs per rank.
    return base + 2718 + rank
    ### BUGGY
    # return base
    ### END SOLUTION
'''


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "ref"
    (root / "megalab").mkdir(parents=True)
    (root / "megalab" / "__init__.py").write_text("")
    (root / "megalab" / "toy.py").write_text(MODULE)
    (root / "tests").mkdir()
    (root / "tests" / "test_toy.py").write_text(
        "import pytest\nfrom megalab.toy import add, seed\n\n@pytest.mark.exercise('toy.add')\ndef test_add():\n"
        "    assert add(2, 3) == 5\n\n@pytest.mark.exercise('toy.seed')\ndef test_seed():\n    assert seed(0, 1) != seed(0, 0)\n")
    (root / "course" / "01_x").mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("**Exercise `toy.add`**, **Exercise `toy.seed`**")])
    nbformat.write(nb, root / "course" / "01_x" / "01_toy.ipynb")
    return root


def test_the_student_copy_hides_hints_and_starts_the_bug_hunt_from_the_bug(tree, tmp_path):
    ex = load(tree).exercises
    assert ex["toy.add"].hints == ["The idea: addition.", "The approach: one operator, between the two arguments."]
    assert ex["toy.seed"].buggy == ["    return base"]
    student = tmp_path / "student"
    write_student(tree, student)
    text = (student / "megalab" / "toy.py").read_text()
    assert "HINT" not in text and "BUGGY" not in text and "2718" not in text
    assert "    # EXERCISE toy.seed: each rank its own seed\n    return base\n" in text  # the bug, live
    assert 'raise NotImplementedError("exercise toy.add:' in text
    assert json.loads((student / ".megalab" / "hints.json").read_text())["toy.seed"][1].startswith("Offset the base")
    level, levels, said = hint(student, "toy.seed")  # a plain student copy reads .megalab/hints.json
    assert (level, levels) == (1, 2) and said.startswith("Same seed")


def test_hints_come_one_level_at_a_time_and_are_recorded(tree):
    assert hint(tree, "toy.add")[0] == 1
    assert hint(tree, "toy.add")[0] == 2
    assert hint(tree, "toy.add")[0] == 2  # the last one again, not an error
    assert hint(tree, "toy.add", level=1)[0] == 1
    assert load_state(tree)["hints"] == {"toy.add": 2}  # the deepest level seen
    with pytest.raises(HintError, match="has hints 1 to 2, not 3"):
        hint(tree, "toy.add", level=3)
    with pytest.raises(HintError, match="did you mean toy.add"):
        hint(tree, "toy.ad")


def test_progress_counts_the_last_grades_and_the_hints(tree):
    hint(tree, "toy.seed")
    record_grades(tree, [Row("toy.add", "passed", "1 test passed"), Row("toy.seed", "failed", "likely mistake: ...")])
    [chapter] = summary(tree)
    assert (chapter.chapter, chapter.done, chapter.total, chapter.hints, chapter.todo) == ("01_x", 1, 2, 1, ["toy.seed"])
    assert "1 / 2" in table([chapter]) and "toy.seed" in table([chapter])
    record_grades(tree, [Row("toy.seed", "passed", "1 test passed")])
    assert summary(tree)[0].done == 2 and "all done" in table(summary(tree))
    assert len(chart(summary(tree)).patches) == 2  # the to-do bar and the done bar


def test_the_commands(tree, capsys, monkeypatch):
    monkeypatch.chdir(tree)
    assert cli.main(["hint", "toy.add"]) == 0
    assert "Hint 1 of 2 for toy.add (the idea):\n  The idea: addition." in capsys.readouterr().out
    assert cli.main(["hint", "toy.add", "--level", "5"]) == 2
    assert "has hints 1 to 2" in capsys.readouterr().err
    assert cli.main(["progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("01_x") and "0 / 2" in out
    assert cli.main(["progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hints"] == 1


def test_a_damaged_progress_file_is_said_never_replaced(tree):
    assert load_state(tree) == {"hints": {}, "grades": {}, "history": {}}  # none yet: an empty history
    (tree / ".megalab").mkdir()
    (tree / ".megalab" / "progress.json").write_text("{not json")
    with pytest.raises(ProgressError, match="is damaged"):
        hint(tree, "toy.add")
    assert (tree / ".megalab" / "progress.json").read_text() == "{not json"
    (tree / ".megalab" / "progress.json").rename(tree / ".megalab" / "progress.json.damaged")  # the fix it names
    hint(tree, "toy.add")
    assert load_state(tree)["hints"] == {"toy.add": 1}


def test_a_check_that_only_skipped_is_not_graded_never_passed(tree):
    ex = load(tree).exercises["toy.add"]
    skipped = {"t": Outcome("tests/test_toy.py::test_add", "skipped", ["toy.add"], "Skipped: needs a GPU")}
    row = exercise_row(ex, skipped, {})
    assert row.status == "not graded" and "every test was skipped" in row.detail


def test_the_hint_magic(tree, capsys, monkeypatch):
    import megalab

    monkeypatch.chdir(tree)
    megalab.hint_magic("toy.seed 2")
    assert "Hint 2 of 2 for toy.seed (the approach):\n  Offset the base" in capsys.readouterr().out
    megalab.hint_magic("")
    assert capsys.readouterr().out.startswith("usage: %hint EXERCISE_ID [LEVEL]")
    megalab.hint_magic("toy.nope")
    assert "%hint: no exercise 'toy.nope'" in capsys.readouterr().out


def test_the_verdict_of_a_chained_failure_is_the_last_exception():
    from megalab.lab.grading import failure_line

    text = ("E   megalab.lab.launch.LaunchTimeoutError: ranks stuck\n\nDuring handling of the above exception, another "
            "exception occurred:\n\n    def test_x():\nE   AssertionError: likely mistake: all-reduce on one rank only\n")
    assert failure_line(text) == "AssertionError: likely mistake: all-reduce on one rank only"


def test_grading_one_exercise_stops_at_its_first_failing_check(tree):
    from megalab.lab.grading import run_checks

    (tree / "tests" / "test_toy.py").write_text(
        "import pytest\nfrom megalab.toy import add\n\n@pytest.mark.exercise('toy.add')\ndef test_a_first_focused_check():\n"
        "    assert add(2, 2) == 5, 'likely mistake: none, this check is wrong on purpose'\n\n"
        "@pytest.mark.exercise('toy.add')\ndef test_b_heavy_check():\n    assert add(1, 1) == 2\n")
    ex = load(tree).exercises["toy.add"]
    first = run_checks(tree, [ex], first_failure=True)
    assert [o.outcome for o in first.values()] == ["failed", "not run"]
    assert [o.outcome for o in run_checks(tree, [ex]).values()] == ["failed", "passed"]


def test_the_progress_magic_works_in_a_notebook_outside_any_tree(tmp_path, capsys, monkeypatch):
    import megalab

    monkeypatch.chdir(tmp_path)  # a copied notebook's folder: no megalab/ above it
    megalab.progress_magic("01")
    out = capsys.readouterr().out
    assert out.startswith("chapter") and "01_foundations" in out  # this megalab's own course
