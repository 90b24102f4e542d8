"""`megalab class`: an instructor's view of a whole class, re-graded from each learner's code.

    megalab class /shared/megalab/students               every exercise, every learner
    megalab class /shared/megalab/students 03 -j 4       chapter 03's exercises, 4 learners at a time
    megalab class STUDENTS dist.shard_bounds --csv class.csv --html class.html

A class is a folder of workspaces (`megalab workspace`), one per learner, named after the learner. Each
learner is graded in a sandbox of their own: the exercise files of their workspace are *copied* into a private
temporary folder, and there run against the reference's tests, package and pytest plugin (this repository's,
the instructor's: never the copy a learner could edit in `.megalab/reference`). Nothing is written into a
learner's workspace, and their `.megalab/progress.json` is only read: hints used, last attempt and time stuck
come from it and are shown as self-reported; pass/fail never does. Every test runs under the grading CPU
limit (megalab/lab/cpu_guard.py) and the per-test timeout.

The learner's code runs with the grader's rights: run `megalab class` as an ordinary user (the instructor's), not
as root.
"""

from __future__ import annotations

import ast
import csv
import html
import io
import json
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from megalab.lab.exercises import SOURCE_DIR, TESTS_DIR, Exercise, ExerciseError, load
from megalab.lab.workspace import CONFIG, STATE_DIR

STATUSES = ("passed", "failed", "not implemented", "not graded")
_IMPORT_FAILURE = re.compile(r"\b(SyntaxError|IndentationError|TabError|ModuleNotFoundError|ImportError)\b")
_SKIP_TOP = {SOURCE_DIR, TESTS_DIR, STATE_DIR, ".git", ".venv", "build", "__pycache__"}


class ClassError(ValueError):
    """The class folder or the reference cannot be used; the message says what to do."""


@dataclass
class Cell:
    """One learner, one exercise: the re-graded verdict and what the learner's own progress file says."""

    status: str
    detail: str
    hints: int | None = None  # self-reported (None: no progress file, or unreadable)
    last: str | None = None  # self-reported: when they last graded it
    stuck: str | None = None  # self-reported: first attempt to first pass (or to now, "+")
    claimed: str | None = None  # self-reported: the status of their last grade


@dataclass
class Learner:
    name: str
    path: str
    cells: dict[str, Cell] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the instructor should know (does not import, ...)

    @property
    def passed(self) -> int:
        return sum(c.status == "passed" for c in self.cells.values())


@dataclass
class ClassView:
    folder: str
    reference: str
    exercises: list[str]
    learners: list[Learner]
    problems: list[str]  # entries of the class folder that are not workspaces
    seconds: float = 0.0

    # ------------------------------------------------------------------ outputs

    def rows(self) -> list[list[str]]:
        """The long table (CSV): one row per learner and exercise."""
        out = [["learner", "exercise", "status", "detail", "hints (self-reported)", "last attempt (self-reported)",
                "time stuck (self-reported)", "own file says"]]
        for learner in self.learners:
            for ex in self.exercises:
                c = learner.cells.get(ex)
                if c is None:
                    continue
                out.append([learner.name, ex, c.status, c.detail, _opt(c.hints), _opt(c.last), _opt(c.stuck),
                            _opt(c.claimed)])
        return out

    def table(self, width: int = 150) -> str:
        names = [ln.name for ln in self.learners] or ["-"]
        w0 = max(len("learner"), *map(len, names))
        w1 = max([len("exercise")] + [len(e) for e in self.exercises])
        lines = [f"{'learner':<{w0}}  {'exercise':<{w1}}  {'status':<15}  {'hints*':>6}  {'last attempt*':<16}  "
                 f"{'stuck*':<10}  detail"]
        for learner in self.learners:
            for ex in self.exercises:
                c = learner.cells.get(ex)
                if c is None:
                    continue
                flag = f" [own file says {c.claimed}]" if c.claimed and c.claimed != c.status else ""
                line = (f"{learner.name:<{w0}}  {ex:<{w1}}  {c.status:<15}  {_opt(c.hints, '-'):>6}  "
                        f"{_opt(c.last, '-'):<16}  {_opt(c.stuck, '-'):<10}  {c.detail}{flag}")
                lines.append(line if len(line) <= width else line[: width - 1] + "…")
        lines.append("")
        for learner in self.learners:
            lines.append(f"{learner.name}: {learner.passed} of {len(learner.cells)} passed")
            lines += [f"  ! {note}" for note in learner.notes]
        lines += [f"! {p}" for p in self.problems]
        lines += ["", "status: re-graded now from each learner's code (their own grade files are not trusted); "
                  "* = self-reported, from the learner's .megalab/progress.json (stuck: first attempt to first pass, "
                  "+ = not passed yet, counted to now)",
                  f"{len(self.learners)} learner(s), {len(self.exercises)} exercise(s), graded against {self.reference} "
                  f"({self.seconds:.1f} s)"]
        return "\n".join(lines)

    def csv(self) -> str:
        buf = io.StringIO()
        csv.writer(buf).writerows(self.rows())
        return buf.getvalue()

    def html(self) -> str:
        """A small self-contained page: learners x exercises, coloured by the re-graded status."""
        colour = {"passed": "#c8e6c9", "failed": "#ffcdd2", "not implemented": "#eeeeee", "not graded": "#fff9c4"}
        e = html.escape
        head = "".join(f"<th>{e(ex)}</th>" for ex in self.exercises)
        body = []
        for learner in self.learners:
            cells = []
            for ex in self.exercises:
                c = learner.cells.get(ex)
                if c is None:
                    cells.append("<td></td>")
                    continue
                tip = f"{c.detail}\nhints: {_opt(c.hints, '-')}, last attempt: {_opt(c.last, '-')}, " \
                      f"stuck: {_opt(c.stuck, '-')} (self-reported)"
                claim = f"<br><small>own file says {e(c.claimed)}</small>" if c.claimed and c.claimed != c.status else ""
                extra = f"<br><small>{_opt(c.hints, '-')} hints · {e(_opt(c.stuck, '-'))}</small>"
                cells.append(f'<td style="background:{colour.get(c.status, "#fff")}" title="{e(tip)}">'
                             f"{e(c.status)}{extra}{claim}</td>")
            notes = "".join(f"<br><small>{e(n)}</small>" for n in learner.notes)
            body.append(f"<tr><th>{e(learner.name)}{notes}</th>{''.join(cells)}"
                        f"<td>{learner.passed} / {len(learner.cells)}</td></tr>")
        problems = "".join(f"<li>{e(p)}</li>" for p in self.problems)
        return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>megalab class: {e(self.folder)}</title>"
                "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #bbb;"
                "padding:4px 8px;text-align:left;vertical-align:top}</style></head><body>"
                f"<h1>megalab class: {e(self.folder)}</h1>"
                f"<p>Re-graded from each learner's code against {e(self.reference)} on {time.strftime('%Y-%m-%d %H:%M')}."
                " Hints and time stuck are self-reported (the learner's progress file); hover a cell for the detail.</p>"
                f"<table><tr><th>learner</th>{head}<th>passed</th></tr>{''.join(body)}</table>"
                + (f"<h2>Not graded</h2><ul>{problems}</ul>" if problems else "") + "</body></html>\n")


def _opt(value, none: str = "") -> str:
    return none if value is None else str(value)


# --------------------------------------------------------------------------- self-reported progress


def _minutes(a: str, b: str) -> int:
    fmt = "%Y-%m-%d %H:%M"
    return int((time.mktime(time.strptime(b, fmt)) - time.mktime(time.strptime(a, fmt))) // 60)


def _duration(minutes: int) -> str:
    minutes = max(minutes, 0)
    if minutes < 60:
        return f"{minutes} min"
    if minutes < 24 * 60:
        return f"{minutes // 60} h {minutes % 60:02d}"
    return f"{minutes // (24 * 60)} d {minutes % (24 * 60) // 60} h"


def self_reported(state: dict, exercise_id: str, now: str | None = None) -> dict:
    """hints, last, stuck, claimed for one exercise from a progress state (megalab/lab/progress.py's load_state)."""
    grade = state["grades"].get(exercise_id) or {}
    history = state.get("history", {}).get(exercise_id) or {}
    stuck = None
    try:
        if history.get("first") and history.get("passed"):
            stuck = _duration(_minutes(history["first"], history["passed"]))
        elif history.get("first"):
            stuck = _duration(_minutes(history["first"], now or time.strftime("%Y-%m-%d %H:%M"))) + "+"
    except (ValueError, TypeError):  # a hand-edited date: no time rather than a wrong one
        stuck = None
    try:
        hints = int(state["hints"].get(exercise_id, 0))
    except (ValueError, TypeError):
        hints = None
    return {"hints": hints, "last": grade.get("when") if isinstance(grade, dict) else None, "stuck": stuck,
            "claimed": grade.get("status") if isinstance(grade, dict) else None}


# --------------------------------------------------------------------------- the class folder


def find_learners(folder: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(name, workspace) for each workspace in the class folder, and a message for each entry that is not one."""
    if not folder.is_dir():
        raise ClassError(f"{folder} is not a folder: give the folder that holds the learners' workspaces "
                         "(one per learner, made by `megalab workspace DIR`)")
    learners, problems = [], []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if not entry.is_dir():
            problems.append(f"{entry.name}: not a folder, skipped (a class folder holds one workspace per learner; "
                            "move it elsewhere)")
            continue
        config = entry / CONFIG
        try:
            json.loads(config.read_text())
        except FileNotFoundError:
            problems.append(f"{entry.name}: not a megalab workspace (no {CONFIG}), skipped; fix: make it with "
                            f"`megalab workspace {entry}` or move it out of the class folder")
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{entry.name}: its {CONFIG} cannot be read ({exc}), skipped; fix: the learner runs "
                            "`megalab update` in it, or make it again with `megalab workspace`")
            continue
        learners.append((entry.name, entry))
    return learners, problems


def _sandbox(workspace: Path, reference: Path, selected: list[Exercise], tmp: Path) -> tuple[Path, list[str], set[str]]:
    """A private tree holding only copies of the learner's files that hold `selected`, and links to the
    reference's other top-level entries (pyproject.toml, data/, ...). Returns (tree, notes, missing files)."""
    tree = tmp / "learner"
    tree.mkdir()
    notes, missing = [], set()
    for rel in sorted({ex.path for ex in selected}):
        src = workspace / rel
        try:
            text = src.read_bytes()
        except FileNotFoundError:
            missing.add(rel)
            notes.append(f"{rel} is missing from the workspace: its exercises count as failed; fix: the learner "
                         f"restores it from .megalab/reference/{rel} (or runs `megalab update`)")
            continue
        except OSError as exc:
            missing.add(rel)
            notes.append(f"{rel} cannot be read ({exc.strerror}): its exercises were not graded; fix: the learner "
                         f"makes it readable (`chmod a+r {rel}`)")
            continue
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(text)
        try:
            ast.parse(text, rel)
        except (SyntaxError, ValueError) as exc:
            line = f", line {exc.lineno}" if getattr(exc, "lineno", None) else ""
            notes.append(f"{rel} does not import ({type(exc).__name__}: {getattr(exc, 'msg', exc)}{line}): its "
                         "exercises count as failed, the rest is graded as usual; fix: the learner corrects that line")
    for entry in reference.iterdir():
        if entry.name not in _SKIP_TOP and not entry.name.startswith(".") and not (tree / entry.name).exists():
            os.symlink(entry, tree / entry.name)
    return tree, notes, missing


def regrade(name: str, workspace: Path, reference: Path, selected: list[Exercise], exercises: dict[str, Exercise],
            timeout: float) -> Learner:
    """One learner: grade their code in a private sandbox; read their progress file (never write it)."""
    from megalab.lab.grading import Row, grade_in_workspace
    from megalab.lab.progress import ProgressError, load_state

    learner = Learner(name, str(workspace))
    with tempfile.TemporaryDirectory(prefix="megalab-class-") as tmp:
        tree, notes, missing = _sandbox(workspace, reference, selected, Path(tmp))
        learner.notes += notes
        present = [ex for ex in selected if ex.path not in missing]
        try:
            rows = grade_in_workspace(tree, SimpleNamespace(reference=reference), present, exercises, timeout)
        except (RuntimeError, ExerciseError) as exc:  # pytest itself did not run
            rows = [Row(ex.id, "not graded", f"the grader could not run: {str(exc).splitlines()[0]}") for ex in present]
            learner.notes.append(f"not graded: {exc}")
    rows += [Row(ex.id, "failed", f"{ex.path} is missing or unreadable") for ex in selected if ex.path in missing]
    by_id = {row.name: row for row in rows}
    failing_imports = {}
    for ex in selected:
        row = by_id[ex.id]
        learner.cells[ex.id] = Cell(row.status, row.detail)
        if row.status == "failed" and _IMPORT_FAILURE.search(row.detail) and ex.path not in missing:
            failing_imports.setdefault(ex.path, row.detail)
    for rel, detail in failing_imports.items():
        if not any(note.startswith(f"{rel} does not import") for note in learner.notes):
            learner.notes.append(f"{rel} does not import ({detail}): its exercises count as failed, the rest is "
                                 "graded as usual; fix: the learner corrects it")
    try:
        state = load_state(workspace)  # read only
    except ProgressError as exc:
        learner.notes.append("progress not shown: " + str(exc).replace("your progress file", "their progress file"))
        return learner
    for ex_id, cell in learner.cells.items():
        for key, value in self_reported(state, ex_id).items():
            setattr(cell, key, value)
    return learner


def collect(folder: str | Path, reference: str | Path, target: str | None = None, jobs: int = 1,
            timeout: float = 300, cpu_limit: float | None = None) -> ClassView:
    """Re-grade every workspace of the class folder on the exercises `target` selects (an id, a chapter, or all)."""
    from megalab.lab.cpu_guard import ENV
    from megalab.lab.grading import choose
    from megalab.lab.workspace import open_workspace

    start = time.perf_counter()
    folder, reference = Path(folder).resolve(), Path(reference).resolve()
    if open_workspace(reference) is not None:
        raise ClassError(f"{reference} is a workspace: run `megalab class` from the reference repository (the course "
                         "the workspaces were made from), or pass it with --reference")
    registry = load(reference)
    try:
        _, selected, _ = choose(registry, target, reference)
    except ValueError as exc:
        raise ClassError(str(exc)) from None
    if not selected:
        raise ClassError(f"no exercises selected by {target!r}")
    learners, problems = find_learners(folder)
    if cpu_limit:
        os.environ[ENV] = str(cpu_limit)  # the grading plugin and the ranks it starts read it
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        graded = list(pool.map(lambda nl: regrade(nl[0], nl[1], reference, selected, registry.exercises, timeout),
                               learners))
    return ClassView(str(folder), str(reference), [ex.id for ex in selected], graded, problems,
                     time.perf_counter() - start)
