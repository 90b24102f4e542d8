"""Grade every wrong answer of tests/independent/ch04_07.py the way `megalab grade` does and classify it.

    python -m tests.independent.ch04_07_measure [--exercise ID ...] [--half dev|held] [--json OUT]

A row: NOT CAUGHT (every test passed), caught + named (the first failure's verdict matches every `words` regex),
caught, not named. Whether a verdict that does not match names the mistake WRONGLY is judged by reading it
(RESULTS_ch04_07.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def classify(verdict_status: str, verdict: str, words: list[str]) -> str:
    if verdict_status in ("NOT CAUGHT", "error"):
        return verdict_status
    return "caught + named" if all(re.search(w, verdict, re.I) for w in words) else "caught, not named"


def measure(wrong: list[dict], echo: bool = False) -> list[dict]:
    from megalab.lab.mutants import run

    as_mistakes = [SimpleNamespace(exercise=w["exercise"], name=w["name"], says="\0", code=w["code"],
                                   fresh=w.get("fresh", False)) for w in wrong]
    rows = []
    for w, r in zip(wrong, run(ROOT, as_mistakes, echo=echo)):
        row = {**asdict(r), "status": classify(r.status, r.verdict, w["words"]), "expect": w["expect"],
               "words": w["words"], "half": w["half"]}
        row.pop("says")
        rows.append(row)
    return rows


def table(rows: list[dict], judged: dict | None = None) -> str:
    """Markdown: counts per half and status, then one row per answer (judged: {(exercise, name): (status, why)}
    overrides the regex where a reader judged the verdict otherwise)."""
    from tests.independent.ch04_07 import NOT_WRONG

    judged = {**{key: ("not wrong", "") for key in NOT_WRONG}, **(judged or {})}
    out = []
    for r in rows:
        status, why = judged.get((r["exercise"], r["name"]), (r["status"], ""))
        out.append({**r, "status": status, "why": why})
    kinds = ["caught + named", "caught, not named", "named WRONGLY", "NOT CAUGHT", "not wrong", "error"]
    lines = ["| half | answers | " + " | ".join(kinds) + " | named rate |", "|---" * (len(kinds) + 3) + "|"]
    for half in ("dev", "held"):
        mine = [r for r in out if r["half"] == half]
        counted = [r for r in mine if r["status"] != "not wrong"]
        named = sum(r["status"] == "caught + named" for r in counted)
        lines.append(f"| {half} | {len(mine)} | " + " | ".join(str(sum(r['status'] == k for r in mine)) for k in kinds)
                     + f" | {named}/{len(counted)} = {100 * named / max(len(counted), 1):.0f} % |")
    lines += ["", "| half | exercise | wrong answer | status | the grader's line (start) |", "|---|---|---|---|---|"]
    for r in out:
        verdict = r["verdict"].replace("AssertionError: ", "").replace("|", "\\|")[:220]
        note = f" ({r['why']})" if r["why"] else ""
        lines.append(f"| {r['half']} | `{r['exercise']}` | {r['name']} | {r['status']}{note} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exercise", action="append")
    p.add_argument("--half")
    p.add_argument("--name", action="append", help="only answers with this name")
    p.add_argument("--json")
    p.add_argument("--table", nargs=2, metavar=("JSON", "MD"), help="write the markdown table of a --json run")
    args = p.parse_args(argv)
    if args.table:
        Path(args.table[1]).write_text(table(json.loads(Path(args.table[0]).read_text())))
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.independent.ch04_07 import WRONG

    wrong = [w for w in WRONG if (not args.exercise or w["exercise"] in args.exercise)
             and (not args.half or w["half"] == args.half) and (not args.name or w["name"] in args.name)]
    rows = measure(wrong)
    for r in rows:
        print(f"{r['half']:4} {r['exercise']:32.32} {r['name'][:40]:40} {r['status']:18} {r['seconds']:6.1f}s  "
              f"{r['verdict'][:300]}", flush=True)
    for half in ("dev", "held"):
        mine = [r for r in rows if r["half"] == half]
        if mine:
            print(f"{half}: {len(mine)} answers, {sum(r['status'] != 'NOT CAUGHT' for r in mine)} fail, "
                  f"{sum(r['status'] == 'caught + named' for r in mine)} named")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
