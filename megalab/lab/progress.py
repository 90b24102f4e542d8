"""Where a learner stands: hints, grades and last attempts, kept locally in .megalab/progress.json.

    megalab hint tp.column_forward          the next hint (level 1, then 2, ...); --level N for one
    megalab progress                        per chapter: done / total, hints used, last attempt
    %hint tp.column_forward                 the same in a notebook (after `%load_ext megalab`)
    %progress 03                            the table and a small chart

Hints live in the reference's source, as the first lines of each exercise's region (megalab/lab/exercises.py);
a workspace reads them from the reference it keeps (.megalab/reference), a plain student copy from the
.megalab/hints.json that `megalab student` writes. Nothing here needs a network: every number comes from
`megalab grade` runs on this machine. An exercise is done when its last grade passed.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megalab.lab.exercises import HINTS, load

STATE = ".megalab/progress.json"


class HintError(ValueError):
    """No such exercise or hint level; the message says what exists."""


# --------------------------------------------------------------------------- the state file


def load_state(root: Path) -> dict:
    path = Path(root) / STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a damaged file: start again rather than fail a learner
        state = {}
    return {"hints": dict(state.get("hints", {})), "grades": dict(state.get("grades", {}))}


def _save(root: Path, state: dict) -> None:
    path = Path(root) / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    gitignore = path.parent / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("*\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".progress-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # whole or not at all: two terminals grading at once never leave half a file


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def record_grades(root: Path, rows) -> None:
    """Remember each exercise row of a `megalab grade` run (status, its one-line verdict, when)."""
    state = load_state(root)
    for row in rows:
        state["grades"][row.name] = {"status": row.status, "detail": row.detail[:300], "when": _now(),
                                     "hints": state["hints"].get(row.name, 0)}
    _save(root, state)


def hints_used(root: Path, exercise_id: str) -> int:
    return int(load_state(root)["hints"].get(exercise_id, 0))


# --------------------------------------------------------------------------- hints


def all_hints(root: Path) -> dict[str, list[str]]:
    """{exercise id: [hint 1, hint 2, ...]} for the tree at root (a workspace reads its reference)."""
    from megalab.lab.workspace import open_workspace

    root = Path(root)
    ws = open_workspace(root)
    if ws is not None and ws.config.get("lang", "en") != "en" and (root / HINTS).is_file():
        return json.loads((root / HINTS).read_text(encoding="utf-8"))  # the translated hints
    if ws is not None and ws.reference.is_dir():
        return {ex.id: ex.hints for ex in load(ws.reference).exercises.values()}
    if (root / HINTS).is_file():
        return json.loads((root / HINTS).read_text(encoding="utf-8"))
    return {ex.id: ex.hints for ex in load(root).exercises.values()}


def hint(root: Path, exercise_id: str, level: int | None = None) -> tuple[int, int, str]:
    """(level, levels, text) of a hint: `level`, or the next one not seen yet; recorded as used."""
    hints = all_hints(root)
    if exercise_id not in hints:
        near = difflib.get_close_matches(exercise_id, list(hints), n=3)
        raise HintError(f"no exercise {exercise_id!r}" + (f"; did you mean {', '.join(near)}?" if near else
                        "; `megalab exercises` lists them"))
    levels = hints[exercise_id]
    if not levels:
        raise HintError(f"exercise {exercise_id} has no hints yet")
    state = load_state(root)
    seen = int(state["hints"].get(exercise_id, 0))
    if level is None:
        level = min(seen + 1, len(levels))
    if not 1 <= level <= len(levels):
        raise HintError(f"exercise {exercise_id} has hints 1 to {len(levels)}, not {level}")
    state["hints"][exercise_id] = max(seen, level)
    _save(root, state)
    return level, len(levels), levels[level - 1]


def format_hint(exercise_id: str, level: int, levels: int, text: str) -> str:
    kind = {1: "the idea", 2: "the approach"}.get(level, "a pitfall")
    more = (f"\n(more: `megalab hint {exercise_id}` again, or %hint {exercise_id})" if level < levels
            else "\n(that was the last hint; `megalab grade " + exercise_id + "` names the likely mistake)")
    return f"Hint {level} of {levels} for {exercise_id} ({kind}):\n  {text}{more}"


# --------------------------------------------------------------------------- progress


@dataclass
class ChapterProgress:
    chapter: str
    done: int
    total: int
    hints: int
    last: str  # when an exercise of this chapter was last graded, or "—"
    todo: list[str]  # exercises not done yet, in course order


def summary(root: Path) -> list[ChapterProgress]:
    """Per chapter, from the local grading results (.megalab/progress.json)."""
    from megalab.lab.workspace import open_workspace

    ws = open_workspace(root)
    registry = load(ws.reference if ws is not None and ws.reference.is_dir() else root)
    state = load_state(root)
    chapters: dict[str, list] = {}
    for ex in registry.select(None):
        chapters.setdefault(ex.chapter or "(no chapter)", []).append(ex)
    out = []
    for chapter, exs in sorted(chapters.items()):
        grades = [state["grades"].get(ex.id) for ex in exs]
        done = [ex.id for ex, g in zip(exs, grades) if g and g["status"] == "passed"]
        when = [g["when"] for g in grades if g]
        out.append(ChapterProgress(chapter, len(done), len(exs), sum(int(state["hints"].get(ex.id, 0)) for ex in exs),
                                   max(when) if when else "—", [ex.id for ex in exs if ex.id not in done]))
    return out


def _bar(done: int, total: int, width: int = 20) -> str:
    full = round(width * done / total) if total else 0
    return "█" * full + "░" * (width - full)


def table(rows: list[ChapterProgress]) -> str:
    w = max([len("chapter")] + [len(r.chapter) for r in rows])
    out = [f"{'chapter':<{w}}  {'done':>7}  {'':20}  {'hints':>5}  last attempt      next"]
    for r in rows:
        nxt = r.todo[0] if r.todo else "all done"
        out.append(f"{r.chapter:<{w}}  {r.done:>3} / {r.total:<2}  {_bar(r.done, r.total)}  {r.hints:>5}  "
                   f"{r.last:<16}  {nxt}")
    done, total = sum(r.done for r in rows), sum(r.total for r in rows)
    out.append(f"{'all':<{w}}  {done:>3} / {total:<2}  {_bar(done, total)}  {sum(r.hints for r in rows):>5}")
    return "\n".join(out)


def chart(rows: list[ChapterProgress], ax=None):
    """Horizontal bars: exercises done out of each chapter's total."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 0.35 * len(rows) + 0.8))
    names = [r.chapter for r in rows][::-1]
    ax.barh(names, [r.total for r in rows][::-1], color="#e6e6e6", label="to do")
    ax.barh(names, [r.done for r in rows][::-1], color="#4c9a2a", label="done")
    for y, r in enumerate(rows[::-1]):
        ax.text(r.total + 0.2, y, f"{r.done}/{r.total}" + (f"  ({r.hints} hints)" if r.hints else ""), va="center",
                fontsize=8)
    ax.set_xlabel("exercises")
    ax.set_title("your progress (from `megalab grade` on this machine)")
    ax.set_xlim(0, max((r.total for r in rows), default=1) * 1.35)
    return ax


def show(chapter: str | None = None, root: str | Path | None = None) -> None:
    """For a notebook: the progress table (one chapter, or all) and its chart."""
    import matplotlib.pyplot as plt

    from megalab.lab.exercises import find_root

    rows = summary(find_root(root or "."))
    if chapter:
        rows = [r for r in rows if r.chapter.startswith(chapter)] or rows
    print(table(rows))
    chart(rows)
    plt.show()
