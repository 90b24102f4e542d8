"""Text and grader agree (issue 34): every exercise written again from the course's text alone, by writers who
had not seen the reference, the tests or the named mistakes (tests/blind/), passes its exercise's first check.

All of them are written into one copy of the tree, as a finished learner's workspace, and each exercise's
first test runs once (`python -m megalab.lab.mutants --solutions ... --together --first-test-only`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalab.lab.exercises import load
from megalab.lab.mutants import load_solutions
from tests.test_mistakes import pytestmark  # noqa: F401  (the reference only: a student copy has no blind files)

REPO = Path(__file__).resolve().parent.parent
FILES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests" / "blind").glob("[!_]*.py"))


def _run(files, tmp_path):
    out = tmp_path / "results.json"
    args = [a for f in files for a in ("--solutions", f)]
    proc = subprocess.run([sys.executable, "-m", "megalab.lab.mutants", *args, "--together", "--first-test-only",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"the solutions runner did not finish:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return json.loads(out.read_text())


def test_every_exercise_has_one_blind_solution():
    solved = [s["exercise"] for s in load_solutions(REPO, FILES)]
    assert sorted(solved) == sorted(load(REPO).exercises), (
        f"missing: {sorted(set(load(REPO).exercises) - set(solved))}; twice: "
        f"{sorted({e for e in solved if solved.count(e) > 1})}")


@pytest.mark.slow
def test_every_blind_solution_passes(tmp_path):
    bad = [r for r in _run(FILES, tmp_path) if r["status"] != "passed"]
    assert not bad, "\n".join(f"{r['exercise']} ({r['name']}): {r['verdict']}" for r in bad)


def test_a_wrong_solution_fails(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("SOLUTIONS = [dict(exercise='dist.shard_bounds', name='the remainder on the last rank', code='"
                     "base = length // world_size\\nstart = rank * base\\n"
                     "stop = length if rank == world_size - 1 else start + base\\nreturn start, stop\\n')]\n")
    [result] = _run([str(wrong)], tmp_path)
    assert result["status"] == "FAILED" and "remainder on the last rank" in result["verdict"], result
