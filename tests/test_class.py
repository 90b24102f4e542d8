"""An instructor's class view and grading another user's workspace (megalab/lab/classview.py, `megalab class`,
megalab/lab/progress.py): re-graded from each learner's code in a sandbox of its own, never from their JSON;
nothing of a learner's is ever written; a progress file a learner cannot read or write is said, and kept."""

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalab.lab import cli
from megalab.lab.classview import self_reported
from megalab.lab.grading import Row, grade
from megalab.lab.progress import ProgressError, hint, load_state, record_grades
from megalab.lab.workspace import create
from tests.test_exercises import _notebook, _toy_tree
from tests.test_workspace import CHAIN, CHAIN_TESTS, NOTEBOOK

REPO = Path(__file__).resolve().parents[1]
OTHER_UID = 65534  # "another user" (nobody): the owner of a workspace that is not the grader's


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = _toy_tree(tmp_path_factory.mktemp("class") / "ref")
    (ref / "megalab" / "chain.py").write_text(CHAIN.replace("    ### BEGIN SOLUTION\n    return 2 * x\n",
                                                            "    ### BEGIN SOLUTION\n    # HINT 1: Twice.\n    return 2 * x\n"))
    (ref / "tests" / "test_chain.py").write_text(CHAIN_TESTS)
    _notebook(ref / NOTEBOOK, "**Exercise `chain.double`**, **Exercise `chain.quadruple`**, **Exercise "
              "`chain.first`** and **Exercise `chain.second`**.")
    return ref


def _solve(ws: Path, exercise_id: str, code: str) -> None:
    path = ws / "megalab" / "chain.py"
    text = path.read_text()
    line = re.search(rf'^( *)raise NotImplementedError\("exercise {re.escape(exercise_id)}:.*$', text, re.M)
    path.write_text(text[: line.start()] + line[1] + code + text[line.end() :])


def _tree_hash(root: Path) -> dict[str, str]:
    """Every file and folder under root: its bytes and mode (a new, changed or removed entry shows)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        out[rel] = f"{oct(st.st_mode)}:{st.st_uid}:" + (hashlib.sha256(path.read_bytes()).hexdigest()
                                                         if path.is_file() and not path.is_symlink() else "")
    return out


@pytest.fixture
def klass(reference, tmp_path):
    """A class of three workspaces (alice right, bob wrong but his own file claims a pass, carol's module does not
    parse and her progress file is damaged), a stray folder and a stray file."""
    folder = tmp_path / "students"
    for name in ("alice", "bob", "carol"):
        create(reference, folder / name)
    _solve(folder / "alice", "chain.double", "return 2 * x")
    hint(folder / "alice", "chain.double")
    _solve(folder / "bob", "chain.double", "return 2 * x + 1")
    (folder / "bob" / ".megalab" / "progress.json").write_text(json.dumps({  # faked: a pass, no hint, solved fast
        "hints": {}, "grades": {"chain.double": {"status": "passed", "detail": "1 test passed",
                                                 "when": "2026-01-01 10:00", "hints": 0}},
        "history": {"chain.double": {"first": "2026-01-01 09:55", "attempts": 1, "passed": "2026-01-01 10:00"}}}))
    _solve(folder / "carol", "chain.double", "return 2 * (x")
    (folder / "carol" / ".megalab" / "progress.json").write_text("{damaged")
    (folder / "stray").mkdir()
    (folder / "notes.txt").write_text("not a learner")
    return folder


def test_the_class_view_regrades_each_learner_in_a_sandbox_and_writes_nothing_of_theirs(klass, reference, tmp_path,
                                                                                          monkeypatch, capsys):
    before = _tree_hash(klass)
    monkeypatch.chdir(reference)
    out_csv, out_html = tmp_path / "out" / "class.csv", tmp_path / "out" / "class.html"
    assert cli.main(["class", str(klass), "chain.double", "-j", "2", "--timeout", "60", "--csv", str(out_csv),
                     "--html", str(out_html)]) == 0
    text = capsys.readouterr().out
    assert _tree_hash(klass) == before  # not a byte, mode or file of any learner changed

    rows = {(r["learner"], r["exercise"]): r for r in csv.DictReader(io.StringIO(out_csv.read_text()))}
    assert sorted(rows) == [("alice", "chain.double"), ("bob", "chain.double"), ("carol", "chain.double")]
    alice, bob, carol = (rows[(n, "chain.double")] for n in ("alice", "bob", "carol"))
    assert alice["status"] == "passed" and alice["hints (self-reported)"] == "1"
    assert alice["time stuck (self-reported)"].endswith("min+")  # first seen at the hint, not passed by her own run
    assert bob["status"] == "failed" and "double(3) is 7, expected 6" in bob["detail"]  # the truth, not his JSON
    assert bob["own file says"] == "passed" and bob["time stuck (self-reported)"] == "5 min"
    assert "[own file says passed]" in text
    assert carol["status"] == "failed" and carol["detail"].startswith("SyntaxError")
    assert "megalab/chain.py does not import (SyntaxError: '(' was never closed, line 4)" in text
    assert "progress not shown: their progress file" in text and "is damaged" in text  # carol's, kept as it was
    assert "notes.txt: not a folder" in text and "stray: not a megalab workspace (no .megalab/workspace.json)" in text
    page = out_html.read_text()
    assert page.startswith("<!doctype html>") and page.count("<tr>") == 4 and "own file says passed" in page


def test_a_broken_class_folder_or_reference_is_one_clear_message(klass, reference, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(klass / "alice")  # a workspace is not the reference to grade against
    assert cli.main(["class", str(klass), "chain.double"]) == 2
    assert "is a workspace: run `megalab class` from the reference repository" in capsys.readouterr().err
    assert cli.main(["class", str(tmp_path / "nowhere"), "chain.double", "--reference", str(reference)]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main(["class", str(klass), "chain.nope", "--reference", str(reference)]) == 2
    assert "no exercise 'chain.nope'" in capsys.readouterr().err


def test_self_reported_times():
    state = {"hints": {"a": 2}, "grades": {"a": {"status": "failed", "when": "2026-01-01 11:00"}},
             "history": {"a": {"first": "2026-01-01 09:00", "attempts": 3}, "b": {"first": "2026-01-01 09:00",
                                                                                "passed": "2026-01-02 10:30"}}}
    assert self_reported(state, "a", now="2026-01-01 12:05") == {"hints": 2, "last": "2026-01-01 11:00",
                                                                  "stuck": "3 h 05+", "claimed": "failed"}
    assert self_reported(state, "b")["stuck"] == "1 d 1 h"
    assert self_reported({"hints": {}, "grades": {}}, "c") == {"hints": 0, "last": None, "stuck": None, "claimed": None}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a workspace to another uid")
def test_grading_another_users_workspace_grades_a_copy_and_never_writes_into_it(reference, tmp_path):
    ws = tmp_path / "learner"
    create(reference, ws)
    _solve(ws, "chain.double", "return 2 * x")
    hint(ws, "chain.double")
    for path in [ws, *ws.rglob("*")]:
        os.lchown(path, OTHER_UID, OTHER_UID)  # the learner's; we (root) are the instructor
    before = _tree_hash(ws)
    report = grade(ws, "chain.double", timeout=60)
    assert [(r.name, r.status, r.hints) for r in report.exercises] == [("chain.double", "passed", 1)]
    assert report.root == str(ws) and any("graded a private copy" in p and f"uid {OTHER_UID}" in p
                                          for p in report.problems)
    assert _tree_hash(ws) == before
    assert record_grades(ws, report.exercises).startswith("not recorded: this workspace")


def _as_learner() -> list[str]:
    """A command prefix under which permission bits hold for us (root drops its override), or skip."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable to us")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


def test_a_progress_file_the_learner_cannot_read_or_write_is_said_and_kept(reference, tmp_path):
    ws = tmp_path / "learner"
    create(reference, ws)
    hint(ws, "chain.double")
    state = ws / ".megalab" / "progress.json"
    kept = state.read_bytes()
    prefix = _as_learner()
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from megalab.lab.cli import main\n"
              "for argv in (['progress'], ['hint', 'chain.double']): print('rc', main(argv), flush=True)")

    def run():
        proc = subprocess.run([*prefix, sys.executable, "-c", script, str(REPO)], cwd=ws, capture_output=True,
                              text=True, timeout=120)
        return [word for line in proc.stdout.splitlines() if line.startswith("rc ") for word in line.split()], proc.stderr

    # what an instructor's `megalab grade` used to leave: the learner's history in a file only they cannot read
    if prefix:
        os.chown(state, OTHER_UID, OTHER_UID)
    state.chmod(0o600 if prefix else 0o000)
    out, err = run()
    assert out == ["rc", "2", "rc", "2"], err
    assert err.count("cannot read your progress file") == 2 and "Permission denied" in err and "chown" in err
    state.chmod(0o644)
    assert state.read_bytes() == kept
    # readable, but its folder is not writable: the hint is refused, the old file kept
    os.chown(state, os.getuid(), os.getgid())
    (ws / ".megalab").chmod(0o555)
    try:
        out, err = run()
    finally:
        (ws / ".megalab").chmod(0o755)
    assert out == ["rc", "0", "rc", "2"], err
    assert "cannot write your progress file" in err and "nothing was changed" in err
    assert state.read_bytes() == kept and load_state(ws)["hints"] == {"chain.double": 1}


def test_a_damaged_progress_file_is_said_and_kept(reference, tmp_path):
    ws = tmp_path / "learner"
    create(reference, ws)
    state = ws / ".megalab" / "progress.json"
    state.write_text("{not json")
    with pytest.raises(ProgressError, match=r"is damaged .* left as it is. Fix: .*mv "):
        hint(ws, "chain.double")
    assert record_grades(ws, [Row("chain.double", "passed", "1 test passed")]).startswith("your progress file")
    assert state.read_text() == "{not json"


def test_history_keeps_the_first_attempt_and_the_first_pass(reference, tmp_path):
    ws = tmp_path / "learner"
    create(reference, ws)
    hint(ws, "chain.double")
    first = load_state(ws)["history"]["chain.double"]["first"]
    assert record_grades(ws, [Row("chain.double", "failed", "no")]) is None
    assert record_grades(ws, [Row("chain.double", "passed", "yes")]) is None
    assert record_grades(ws, [Row("chain.double", "failed", "broke it again")]) is None
    history = load_state(ws)["history"]["chain.double"]
    assert history["first"] == first and history["attempts"] == 3 and history["passed"] >= first
    assert oct(os.stat(ws / ".megalab" / "progress.json").st_mode & 0o777) == "0o644"
    assert time.strptime(history["passed"], "%Y-%m-%d %H:%M")
