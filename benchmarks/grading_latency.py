"""From a wrong answer to the message that names it: `megalab grade ID` in a learner's workspace.

For three multi-rank exercises, a workspace gets each one's first named mistake (tests/mistakes/) written
into its region, and we time `megalab grade ID` (wall clock, the whole command) until it prints its
verdict; then the reference solution in the same workspace, graded the same way, is the yardstick
(ratio = wrong / right: a wrong answer should not cost more than a right one, since the first failing
check stops the run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXERCISES = ["comm.ring_all_reduce", "tp.row_forward", "cp.ring_step"]


def write_region(ws: Path, ex, body: list[str]) -> None:
    """Put `body` (lines at the region's indent) in place of the workspace's blank (the raise under `# EXERCISE`)."""
    path = ws / ex.path
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"# EXERCISE {ex.id}:")) + 1
    assert lines[at].strip().startswith("raise NotImplementedError"), f"{ex.id}: the region is not blank"
    lines[at : at + 1] = body
    path.write_text("".join(lines))


def grade(ws: Path, exercise_id: str) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "grade", exercise_id], cwd=ws, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    lines = proc.stdout.splitlines()
    return seconds, (lines[1].strip() if len(lines) > 1 else proc.stderr.strip()[-200:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exercises", nargs="+", default=EXERCISES)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="CI smoke: one single-process exercise, once")
    args = p.parse_args()
    if args.quick:
        args.exercises, args.repeats = ["dist.shard_bounds"], 1
    from megalab.lab.exercises import load
    from megalab.lab.mutants import load_mistakes
    from megalab.lab.workspace import create

    registry = load(REPO)
    mistakes = {}
    for m in load_mistakes(REPO):
        mistakes.setdefault(m.exercise, m)
    rows = []
    with tempfile.TemporaryDirectory(prefix="megalab-bench-grading-") as tmp:
        ws = create(REPO, Path(tmp) / "ws").dest
        ref_text = {}
        for ex_id in args.exercises:
            ex, m = registry.exercises[ex_id], mistakes[ex_id]
            blank = (ws / ex.path).read_text()
            ref_text[ex_id] = (REPO / ex.path).read_text().splitlines(keepends=True)[ex.solution[0] + 1 : ex.solution[1]]
            wrong_body = [ex.indent + line if line.strip() else "\n"
                          for line in textwrap.dedent(m.code).strip("\n").splitlines(keepends=True)]
            wrong_body = [line if line.endswith("\n") else line + "\n" for line in wrong_body]
            timings = {"wrong": [], "right": []}
            verdict = ""
            for _ in range(args.repeats):
                for kind, body in (("wrong", wrong_body), ("right", ref_text[ex_id])):
                    (ws / ex.path).write_text(blank)
                    write_region(ws, ex, body)
                    seconds, said = grade(ws, ex_id)
                    timings[kind].append(seconds)
                    if kind == "wrong":
                        verdict = said
            (ws / ex.path).write_text(blank)
            named = m.says.lower() in verdict.lower()
            rows.append([ex_id, m.name[:40], median(timings["wrong"]), median(timings["right"]),
                         median(timings["wrong"]) / median(timings["right"]), named, verdict[:90]])
    report("grading_latency", ["exercise", "mistake", "wrong s", "right s", "wrong/right", "named", "verdict"], rows)


if __name__ == "__main__":
    main()
