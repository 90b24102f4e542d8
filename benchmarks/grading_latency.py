"""From a wrong answer to the message that names it: `megalab grade ID` in a learner's workspace.

For three multi-rank exercises (every exercise with --all: the issue-34 target is both verdicts within
TARGET = 15 s on a quiet 2-core machine), a workspace gets each one's first named mistake (tests/mistakes/) written
into its region, and we time `megalab grade ID` (wall clock, the whole command) until it prints its
verdict; then the reference solution in the same workspace, graded the same way, is the yardstick
(ratio = wrong / right: a wrong answer should not cost more than a right one, since the first failing
check stops the run).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.lab.workspace import _shipped_bugs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXERCISES = ["comm.ring_all_reduce", "tp.row_forward", "cp.ring_step"]
TARGET = 15.0  # seconds: a one-exercise verdict, right or wrong, on a quiet 2-core machine (issue 34)


def write_region(ws: Path, ex, body: list[str]) -> None:
    """Put `body` (lines at the region's indent) in place of the workspace's blank (the raise under `# EXERCISE`)."""
    path = ws / ex.path
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"# EXERCISE {ex.id}:")) + 1
    if lines[at].strip().startswith("raise NotImplementedError"):
        lines[at : at + 1] = body
    else:  # a bug hunt: the region holds the shipped bug
        shipped = _shipped_bugs(ws)[ex.id]
        assert [line.rstrip("\n") for line in lines[at : at + len(shipped)]] == shipped, f"{ex.id}: not as shipped"
        lines[at : at + len(shipped)] = body
    path.write_text("".join(lines))


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs (the grader's pytest, its ranks)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def grade(ws: Path, exercise_id: str) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, the verdict line) of `megalab grade exercise_id` in the workspace ws. The CPU
    seconds hardly depend on the machine's load: on a quiet 2-core machine the wall time is about max(CPU / 2,
    the longest single chain of work) plus waits, so they tell which verdicts stay slow when the machine is quiet."""
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "grade", exercise_id], cwd=ws, capture_output=True,
                          text=True)
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
    lines = proc.stdout.splitlines()
    return seconds, cpu, (lines[1].strip() if len(lines) > 1 else proc.stderr.strip()[-200:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exercises", nargs="+", default=EXERCISES)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--all", action="store_true", help="every exercise of the course (once each: about 20 minutes)")
    p.add_argument("--quick", action="store_true", help="CI smoke: one single-process exercise, once")
    p.add_argument("--kinds", nargs="+", choices=["wrong", "right"], default=["wrong", "right"],
                   help="which verdicts to time (the wrong answer's first check, the right answer's every test)")
    args = p.parse_args()
    if args.quick:
        args.exercises, args.repeats = ["dist.shard_bounds"], 1
    from megalab.lab.exercises import load
    from megalab.lab.mutants import load_mistakes
    from megalab.lab.workspace import create

    registry = load(REPO)
    if args.all:
        args.exercises, args.repeats = list(registry.exercises), 1
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
            cpu = {"wrong": [], "right": []}
            verdict = ""
            for _ in range(args.repeats):
                for kind, body in (("wrong", wrong_body), ("right", ref_text[ex_id])):
                    if kind not in args.kinds:
                        continue
                    (ws / ex.path).write_text(blank)
                    write_region(ws, ex, body)
                    seconds, cpu_s, said = grade(ws, ex_id)
                    timings[kind].append(seconds)
                    cpu[kind].append(cpu_s)
                    if kind == "wrong":
                        verdict = said
            (ws / ex.path).write_text(blank)
            named = m.says.lower() in verdict.lower()
            wrong_s, right_s, wrong_cpu, right_cpu = (median(v) if v else float("nan") for v in (
                timings["wrong"], timings["right"], cpu["wrong"], cpu["right"]))
            rows.append([ex_id, m.name[:40], wrong_s, right_s, wrong_cpu, right_cpu, wrong_s / right_s,
                         max(t for t in (wrong_s, right_s) if t == t) <= TARGET, named, verdict[:90]])
            print(f"{ex_id}: wrong {wrong_s:.1f} s ({wrong_cpu:.1f} s CPU), right {right_s:.1f} s ({right_cpu:.1f} s "
                  f"CPU), load {os.getloadavg()[0]:.1f}, named: {named}", flush=True)
    slow = [r[0] for r in rows if not r[7]]
    print(f"{len(rows) - len(slow)} of {len(rows)} exercises give both verdicts within {TARGET:g} s"
          + (f"; slower: {', '.join(slow)}" if slow else ""))
    report("grading_latency", ["exercise", "mistake", "wrong s", "right s", "wrong cpu s", "right cpu s", "wrong/right",
                               f"<= {TARGET:g} s", "named", "verdict"], rows, {"target_s": TARGET, "slower": slow})


if __name__ == "__main__":
    main()
