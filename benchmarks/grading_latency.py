"""From an answer to its verdict: `megalab grade ID` in a learner's workspace, for a wrong and a right answer.

Issue 34's target: both verdicts of every exercise within TARGET = 15 s on a quiet 2-core machine. For each
exercise a workspace gets its first named mistake (tests/mistakes/) written into its region and we time
`megalab grade ID` (the whole command, until it prints its verdict); then the reference solution, graded the
same way. Each verdict is checked too: the wrong answer must fail and name its mistake, the right one pass.

    python benchmarks/grading_latency.py                 three multi-rank exercises, twice each
    python benchmarks/grading_latency.py --all --jobs 2  every exercise once, right and wrong (the issue's table)
    python benchmarks/grading_latency.py --quick         CI smoke: one single-process exercise's wrong answer

Wall seconds depend on the machine's load (several sessions share 2 cores here), CPU seconds hardly: the CPU
seconds of the grade command and everything it waited for (its pytest, the ranks they launch). A verdict is
mostly one chain of work (start pytest, import torch, run the checks; the ranks of a launch run in parallel), so
on a quiet 2-core machine its wall time is about its CPU seconds or less: the table's `<= 15 s` column judges the
CPU seconds when the machine was loaded (1-minute load above 2 at the start or end), else the wall seconds.
--jobs N grades N exercises at a time, each in its own workspace (its CPU seconds are its own: os.wait4). The right
answers go first (those of exercises with end-to-end launches first); every verdict is kept as it comes in
results/grading_latency.partial.json, so a stopped run goes on with --resume (--table-only: its table as it is).
The issue's table, every exercise, is kept in benchmarks/grading_latency.json (its "note" says how it was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, median, report  # noqa: E402

from megalab.lab.workspace import _shipped_bugs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXERCISES = ["comm.ring_all_reduce", "tp.row_forward", "cp.ring_step"]
QUICK = ["dist.shard_bounds"]
TARGET = 15.0  # seconds: a one-exercise verdict, right or wrong, on a quiet 2-core machine (issue 34)
QUIET = 2.0  # a 1-minute load average at most this on 2 cores: wall seconds mean what they would on a quiet machine


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


def grade(ws: Path, exercise_id: str) -> tuple[float, float, str, str]:
    """(wall seconds, CPU seconds, status, the verdict's reason) of `megalab grade exercise_id` in the workspace ws.
    The CPU seconds are the command's and those of every process it waited for (os.wait4: its own, even while
    other grades run beside it)."""
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "megalab.lab.cli", "grade", exercise_id], cwd=ws,
                                stdout=out_file, stderr=err_file)
        _, status, used = os.wait4(proc.pid, 0)  # (not proc.wait(): wait4 also says what the process used)
        seconds, cpu = time.perf_counter() - start, used.ru_utime + used.ru_stime
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    lines = out.splitlines()
    said = lines[0].split(": ", 1)[1].strip() if lines and ": " in lines[0] else "no verdict"
    reason = lines[1].strip() if len(lines) > 1 else err.strip()[-200:]
    return seconds, cpu, said, reason


def bodies(registry, mistakes, ex_id: str) -> dict[str, list[str]]:
    """{"wrong": the first named mistake's region body, "right": the reference's}, as lines at the region's indent."""
    ex, m = registry.exercises[ex_id], mistakes[ex_id]
    wrong = [ex.indent + line if line.strip() else "\n"
             for line in textwrap.dedent(m.code).strip("\n").splitlines(keepends=True)]
    right = (REPO / ex.path).read_text().splitlines(keepends=True)[ex.solution[0] + 1 : ex.solution[1]]
    return {"wrong": [line if line.endswith("\n") else line + "\n" for line in wrong], "right": right}


def measure(ws: Path, registry, mistakes, ex_id: str, kinds: list[str], repeats: int) -> dict:
    """Both verdicts of one exercise in the workspace ws (its region blank again afterwards)."""
    ex, m = registry.exercises[ex_id], mistakes[ex_id]
    blank = (ws / ex.path).read_text()
    out = {}
    try:
        for kind in kinds:
            runs = []
            for _ in range(repeats):
                (ws / ex.path).write_text(blank)
                write_region(ws, ex, bodies(registry, mistakes, ex_id)[kind])
                runs.append(grade(ws, ex_id))
            wall, cpu = median([r[0] for r in runs]), median([r[1] for r in runs])
            status, reason = runs[-1][2], runs[-1][3]
            right = status == "passed" if kind == "right" else (status == "failed" and m.says.lower() in reason.lower())
            out[kind] = dict(wall=wall, cpu=cpu, status=status, reason=reason, as_expected=right)
    finally:
        (ws / ex.path).write_text(blank)
    return out


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exercises", nargs="+", default=EXERCISES)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--all", action="store_true", help="every exercise of the course, once each")
    p.add_argument("--quick", action="store_true", help="CI smoke: one single-process exercise's wrong answer")
    p.add_argument("--jobs", type=int, default=1, help="exercises graded at a time (each in its own workspace)")
    p.add_argument("--kinds", nargs="+", choices=["wrong", "right"], default=["wrong", "right"],
                   help="which verdicts to time (the wrong answer's, the right answer's)")
    p.add_argument("--resume", action="store_true", help="keep the verdicts a stopped run already measured "
                   "(grading_latency.partial.json, written after each verdict)")
    p.add_argument("--table-only", action="store_true", help="measure nothing: the table of a stopped run (--resume)")
    args = p.parse_args()
    if args.quick:  # one verdict (a workspace costs ~2 s of CPU, a verdict ~4 s: pytest and torch's import)
        args.exercises, args.repeats, args.jobs, args.kinds = QUICK, 1, 1, ["wrong"]
    from megalab.lab.exercises import load
    from megalab.lab.mutants import load_mistakes
    from megalab.lab.workspace import create

    registry = load(REPO)
    if args.all:
        args.exercises, args.repeats = list(registry.exercises), 1
    mistakes = {}
    for m in load_mistakes(REPO):
        mistakes.setdefault(m.exercise, m)
    load_start, started = os.getloadavg(), time.perf_counter()
    results, lock, last_load = {e: {} for e in args.exercises}, threading.Lock(), None
    partial = RESULTS / "grading_latency.partial.json"
    if (args.resume or args.table_only) and partial.exists():
        kept = json.loads(partial.read_text())
        load_start, last_load = kept["load_start"], kept.get("load_end")
        results.update({e: r for e, r in kept["results"].items() if e in results})
        print(f"resumed: {sum(map(len, results.values()))} verdict(s) measured before", flush=True)
    # the right answers first (issue 34's gap), those of exercises with end-to-end launches first among them
    todo = sorted(((e, k) for k in args.kinds for e in args.exercises if k not in results[e] and not args.table_only),
                  key=lambda job: (job[1] == "wrong", not registry.exercises[job[0]].integration))
    with tempfile.TemporaryDirectory(prefix="megalab-bench-grading-") as tmp:
        free = [create(REPO, Path(tmp) / f"ws{j}").dest for j in range(min(max(1, args.jobs), len(todo)))]

        def one(job):
            ex_id, kind = job
            with lock:
                ws = free.pop()
            try:
                r = measure(ws, registry, mistakes, ex_id, [kind], args.repeats)[kind]
            finally:
                with lock:
                    free.append(ws)
            print(f"{ex_id}: {kind} {r['wall']:.1f} s ({r['cpu']:.1f} s CPU) {r['status']}"
                  f"{'' if r['as_expected'] else ' UNEXPECTED'}; load {_load()}", flush=True)
            with lock:
                results[ex_id][kind] = r
                RESULTS.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"load_start": load_start, "load_end": os.getloadavg(),
                                               "results": results}))

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(one, todo))
    load_end = last_load if args.table_only and last_load else os.getloadavg()  # (the last measurement's)
    loaded = max(load_start[0], load_end[0]) > QUIET
    rows, slow, wrong_verdicts = [], [], []
    for ex_id in args.exercises:
        res, row = results[ex_id], [ex_id]
        for kind in ("wrong", "right"):
            r = res.get(kind)
            row += [r["wall"], r["cpu"], r["status"] + ("" if r["as_expected"] else " (!)")] if r else ["", "", "-"]
            if r and not r["as_expected"]:
                wrong_verdicts.append(f"{ex_id} ({kind}: {r['status']}: {r['reason'][:120]})")
        judged = [r["cpu" if loaded else "wall"] for r in res.values()]
        row.append(max(judged) <= TARGET if judged else "-")
        if row[-1] is False:
            slow.append(ex_id)
        row.append(mistakes[ex_id].name[:40])
        rows.append(row)
    measured = [e for e in args.exercises if results[e]]
    cpu = {kind: [results[e][kind]["cpu"] for e in measured if kind in results[e]] for kind in args.kinds}
    wall = {kind: [results[e][kind]["wall"] for e in measured if kind in results[e]] for kind in args.kinds}
    worst = sorted(measured, key=lambda e: -max(r["cpu"] for r in results[e].values()))[:5]
    summary = {kind: {"measured": len(cpu[kind]), "wall_max": max(wall[kind]), "wall_median": statistics.median(wall[kind]),
                      "cpu_max": max(cpu[kind]), "cpu_median": statistics.median(cpu[kind])}
               for kind in args.kinds if cpu[kind]}
    judge = "CPU" if loaded else "wall"
    print(f"load (1, 5, 15 min) at the start {tuple(round(x, 1) for x in load_start)}, at the end "
          f"{tuple(round(x, 1) for x in load_end)}; {time.perf_counter() - started:.0f} s in all, {args.jobs} at a time")
    for kind, s in summary.items():
        print(f"{kind} answers ({s['measured']} of {len(args.exercises)} measured): wall max {s['wall_max']:.1f} s, "
              f"median {s['wall_median']:.1f} s; CPU max {s['cpu_max']:.1f} s, median {s['cpu_median']:.1f} s")
    print("slowest (CPU): " + ", ".join(f"{e} {max(r['cpu'] for r in results[e].values()):.1f} s" for e in worst))
    print(f"{len(measured) - len(slow)} of {len(measured)} exercises measured give every measured verdict within "
          f"{TARGET:g} s ({judge} seconds{': the machine was loaded' if loaded else ''})"
          + (f"; slower: {', '.join(slow)}" if slow else ""))
    if wrong_verdicts:
        print("verdicts not as expected: " + "; ".join(wrong_verdicts))
    header = ["exercise", "wrong s", "wrong cpu s", "wrong verdict", "right s", "right cpu s", "right verdict",
              f"<= {TARGET:g} s", "mistake"]
    report("grading_latency", header, rows, {
        "target_s": TARGET, "judged_by": judge, "load_start": load_start, "load_end": load_end, "jobs": args.jobs,
        "summary": summary, "slowest": worst, "slower": slow, "verdicts_not_as_expected": wrong_verdicts,
        "results": results})
    if all(len(results[e]) == len(args.kinds) for e in args.exercises):
        partial.unlink(missing_ok=True)  # complete: the report above is the result
    if wrong_verdicts:
        sys.exit(1)


if __name__ == "__main__":
    main()
