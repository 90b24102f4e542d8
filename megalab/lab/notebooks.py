"""Execute course notebooks in place, top to bottom, each in a clean kernel (`make notebooks`).

The wall time of each run is stored in the notebook's metadata (`megalab.run_seconds`), so the
budget check in tests/test_notebooks.py can report it without running anything.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

BUDGET_SECONDS = 180  # DESIGN.md §4: about a minute, never over three, on 2 CPU cores


def find_notebooks(paths: list[str]) -> list[Path]:
    found = []
    for p in map(Path, paths):
        found += sorted(p.rglob("*.ipynb")) if p.is_dir() else [p]
    return [p for p in found if ".ipynb_checkpoints" not in p.parts]


def execute(path: Path, timeout: float = 600) -> float:
    """Run one notebook in place; returns its wall time in seconds."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    nb.metadata.setdefault("megalab", {})["run_seconds"] = round(seconds, 1)
    nbformat.write(nb, path)
    return seconds


def execute_all(paths: list[str], timeout: float = 600) -> int:
    status = 0
    for path in find_notebooks(paths):
        try:
            seconds = execute(path, timeout)
        except Exception as exc:  # report every notebook, then fail
            print(f"FAILED  {path}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
            status = 1
            continue
        flag = "" if seconds <= BUDGET_SECONDS else f"  over the {BUDGET_SECONDS} s budget"
        print(f"ok      {path}  {seconds:6.1f} s{flag}")
    return status


STUDY_TIME = re.compile(r"\*\*Time\.\*\*\s*(?:About\s+)?(\d+)\s+minutes", re.IGNORECASE)


def study_minutes(nb) -> int | None:
    """The reader's time a notebook declares in its header (`**Time.** About 40 minutes.`)."""
    for cell in nb.cells[:4]:
        if cell.cell_type == "markdown" and (match := STUDY_TIME.search(cell.source)):
            return int(match.group(1))
    return None


def course_timings(course: Path) -> list[dict]:
    """One row per chapter: notebooks, the readers' study time and the recorded run time on this machine."""
    rows = {}
    for path in find_notebooks([str(course)]):
        nb = nbformat.read(path, as_version=4)
        row = rows.setdefault(path.parent.name, {"chapter": path.parent.name, "notebooks": 0, "study_minutes": 0,
                                                 "run_seconds": 0.0})
        row["notebooks"] += 1
        row["study_minutes"] += study_minutes(nb) or 0
        row["run_seconds"] += nb.metadata.get("megalab", {}).get("run_seconds", 0.0)
    return [rows[name] for name in sorted(rows)]


def timings_table(rows: list[dict]) -> str:
    """The README's course-timings table (markdown)."""
    lines = ["| chapter | notebooks | study time | run time, 2 CPU cores |", "|---|---:|---:|---:|"]
    for r in rows + [{"chapter": "**whole course**", "notebooks": sum(r["notebooks"] for r in rows),
                      "study_minutes": sum(r["study_minutes"] for r in rows),
                      "run_seconds": sum(r["run_seconds"] for r in rows)}]:
        hours, minutes = divmod(r["study_minutes"], 60)
        study = f"{hours} h {minutes:02d} min" if hours else f"{minutes} min"
        lines.append(f"| {r['chapter']} | {r['notebooks']} | {study} | {r['run_seconds'] / 60:.1f} min |")
    return "\n".join(lines)
