"""Named mistakes and hints, for every exercise.

- every exercise has at least two named mistakes (tests/mistakes/) and two levels of hints, and no hint
  holds a line of the solution's code;
- every mistake is failed by the exercise's tests AND the grader's one-line verdict names it
  (`python -m megalab.lab.mutants`, one run per file of mistakes);
- the runner itself: a "mistake" that is the solution is reported NOT CAUGHT, a verdict that does not say
  the phrase is "caught, not named", and a mutant reaches the ranks of a multi-rank test.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalab.lab.exercises import load, solution_code
from megalab.lab.mutants import load_mistakes

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not all(ex.solution for ex in load(REPO).exercises.values()),
                                reason="a student copy has no solutions, and no mistakes (the grader keeps them)")
FILES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests" / "mistakes").glob("[!_]*.py"))
SLOW = ["tests/mistakes/ch03_dp_tp.py", "tests/mistakes/ch03_pp_cp_moe.py", "tests/mistakes/bug_hunt.py"]  # about
# half of the sweep's time (10-15 s of CPU per file): a test file of its own (test_mistakes_dp_tp.py), so the two
# pytest workers of `make test` share the sweep


@pytest.fixture(scope="module")
def registry():
    return load(REPO)


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_every_exercise_has_two_named_mistakes(registry):
    mistakes = load_mistakes(REPO)
    by_id: dict[str, list] = {}
    for m in mistakes:
        assert m.exercise in registry.exercises, f"{m.name!r}: no exercise {m.exercise}"
        assert m.says.strip() and m.name.strip(), f"{m.exercise}: a mistake needs a name and a phrase to say"
        ex = registry.exercises[m.exercise]
        solution = "".join(_norm(line) for line in solution_code((REPO / ex.path).read_text(), ex))
        assert _norm(m.code) != solution, f"{m.exercise}: mistake {m.name!r} is the solution itself"
        by_id.setdefault(m.exercise, []).append(m)
    few = {ex_id: len(by_id.get(ex_id, [])) for ex_id in registry.exercises if len(by_id.get(ex_id, [])) < 2}
    assert not few, f"exercises with fewer than 2 named mistakes in tests/mistakes/: {few}"


def test_every_exercise_has_tiered_hints_that_do_not_give_the_code(registry):
    missing = {ex.id: len(ex.hints) for ex in registry.exercises.values() if len(ex.hints) < 2}
    assert not missing, f"exercises with fewer than 2 hint levels (# HINT 1:, # HINT 2: in the region): {missing}"
    for ex in registry.exercises.values():
        code = [_norm(line) for line in solution_code((REPO / ex.path).read_text(), ex)
                if line.strip() and not line.strip().startswith("#")]
        for level, hint in enumerate(ex.hints, 1):
            leaked = [line for line in code if len(line) >= 12 and line in _norm(hint)]
            assert not leaked, f"{ex.id}: hint {level} gives away solution code: {leaked[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", [f for f in FILES if f not in SLOW])
def test_every_mistake_is_caught_and_named(path, tmp_path):
    sweep(path, tmp_path)


def sweep(path: str, tmp_path: Path) -> None:
    """Every mistake in `path` is caught and named (one run of the mutant runner)."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "megalab.lab.mutants", "--file", path, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"the mutant runner did not finish:\n{(proc.stdout + proc.stderr)[-3000:]}"
    bad = [r for r in json.loads(out.read_text()) if r["status"] != "caught + named"]
    assert not bad, "\n".join(f"{r['exercise']}: {r['name']}: {r['status']}: {r['verdict']}" for r in bad)


def _mistakes_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "mine.py"
    path.write_text("from tests.mistakes import Mistake\n\nMISTAKES = [\n" + body + "\n]\n")
    return str(path)


def test_the_runner_tells_caught_named_from_not_named_and_not_caught(tmp_path):
    ex = load(REPO).exercises["dist.shard_bounds"]
    solution = "\n".join(line[len(ex.indent):] for line in solution_code((REPO / ex.path).read_text(), ex))
    wrong = "base = length // world_size\\nstart = rank * base\\nreturn start, start + base"
    path = _mistakes_file(tmp_path, f"""
    Mistake("dist.shard_bounds", "the solution itself", says="x", code={solution!r}),
    Mistake("dist.shard_bounds", "drops the remainder", says="a phrase no check prints", code="{wrong}"),
    Mistake("dist.shard_bounds", "drops the remainder", says="the shards should start at 0", code="{wrong}"),
    Mistake("comm.broadcast", "src broadcasts to nobody", says="comm.broadcast is wrong", code="return tensor"),
    """)
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "megalab.lab.mutants", "--file", path, "--json", str(out)], cwd=REPO,
                   capture_output=True, text=True, timeout=600)
    statuses = [r["status"] for r in json.loads(out.read_text())]
    assert statuses == ["NOT CAUGHT", "caught, not named", "caught + named", "caught + named"], statuses
