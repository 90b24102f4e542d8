"""Where a learner stands: hints, grades and last attempts, kept locally in .megalab/progress.json.

    megalab hint tp.column_forward          the next hint (level 1, then 2, ...); --level N for one
    megalab progress                        per chapter: done / total, hints used, last attempt
    %hint tp.column_forward                 the same in a notebook (after `%load_ext megalab`)
    %progress 03                            the table and a small chart

Hints live in the reference's source, as the first lines of each exercise's region (megalab/lab/exercises.py);
a workspace reads them from the reference it keeps (.megalab/reference), a plain student copy from the
.megalab/hints.json that `megalab student` writes. Nothing here needs a network: every number comes from
`megalab grade` runs on this machine. An exercise is done when its last grade passed.

The file is the learner's alone: another user (an instructor grading this workspace) never writes it, a file
that cannot be read or is damaged is said so and left as it is, and every write replaces it whole.
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


class ProgressError(ValueError):
    """The progress file cannot be read or written (another user's file, a damaged one); nothing was changed."""


# --------------------------------------------------------------------------- the state file


def _owner(path: Path) -> str:
    try:
        import pwd

        uid = path.stat().st_uid
        try:
            return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
        except KeyError:
            return f"uid {uid}"
    except (ImportError, OSError):
        return "another user"


def foreign_owner(root: Path) -> str | None:
    """Who owns the workspace at `root` when it is not the user running this (an instructor grading a learner's
    workspace, root included), else None. Such a workspace is only ever read, never written."""
    if not hasattr(os, "geteuid"):
        return None
    for path in (Path(root) / ".megalab", Path(root)):
        try:
            uid = path.stat().st_uid
        except OSError:
            continue
        return None if uid == os.geteuid() else _owner(path)
    return None


def load_state(root: Path) -> dict:
    """{"hints": {id: deepest level seen}, "grades": {id: the last grade}, "history": {id: first attempt, attempts,
    first pass}}. No file yet: empty. A file that cannot be read or is damaged: ProgressError (never an empty
    history that the next save would write over the real one)."""
    path = Path(root) / STATE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"hints": {}, "grades": {}, "history": {}}
    except OSError as exc:
        raise ProgressError(f"cannot read your progress file {path} ({exc.strerror}; it belongs to {_owner(path)}, mode "
                            f"{oct(path.stat().st_mode & 0o777) if path.exists() else '?'}): it was left as it is. "
                            f"Fix: make it yours again (`sudo chown $USER {path}` or ask whoever wrote it), then retry"
                            ) from None
    try:
        state = json.loads(text)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return {key: dict(state.get(key, {})) for key in ("hints", "grades", "history")}
    except (ValueError, TypeError) as exc:
        raise ProgressError(f"your progress file {path} is damaged ({exc}): it was left as it is. Fix: repair it, or "
                            f"move it away to start a new history (`mv {path} {path}.damaged`)") from None


def _save(root: Path, state: dict) -> None:
    """Write the state whole or not at all (two terminals at once never leave half a file; a failure keeps the old
    file); never into another user's workspace; the file keeps its mode."""
    path = Path(root) / STATE
    owner = foreign_owner(root)
    if owner is not None:
        raise ProgressError(f"not recorded: this workspace ({Path(root)}) belongs to {owner}; grading or reading "
                            f"another user's workspace never writes into it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        gitignore = path.parent / ".gitignore"
        if not gitignore.exists():
            gitignore.write_text("*\n")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".progress-", suffix=".json")
    except OSError as exc:
        raise ProgressError(f"cannot write your progress file {path} ({exc.strerror}; {path.parent} belongs to "
                            f"{_owner(path.parent)}): nothing was changed. Fix: make that folder writable for you "
                            f"(`chmod u+w {path.parent}`, or `sudo chown -R $USER {path.parent}`)") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ProgressError(f"cannot write your progress file {path} ({exc}): the old file was kept") from None


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def _attempt(state: dict, exercise_id: str, passed: bool | None = None) -> None:
    """History of one exercise: when it was first tried (a grade or a hint), how many grades, when it first passed."""
    now = _now()
    entry = state["history"].setdefault(exercise_id, {"first": now, "attempts": 0})
    if passed is not None:
        entry["attempts"] = int(entry.get("attempts", 0)) + 1
        if passed and not entry.get("passed"):
            entry["passed"] = now


def record_grades(root: Path, rows) -> str | None:
    """Remember each exercise row of a `megalab grade` run (status, its one-line verdict, when). Returns None, or
    why nothing was recorded (another user's workspace, an unreadable file): grading still goes on."""
    try:
        state = load_state(root)
        for row in rows:
            state["grades"][row.name] = {"status": row.status, "detail": row.detail[:300], "when": _now(),
                                         "hints": state["hints"].get(row.name, 0)}
            _attempt(state, row.name, row.status == "passed")
        _save(root, state)
    except ProgressError as exc:
        return str(exc)
    return None


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
    from megalab.lab.i18n import lang_of, say

    hints, lang = all_hints(root), lang_of(root)
    if exercise_id not in hints:
        near = difflib.get_close_matches(exercise_id, list(hints), n=3)
        raise HintError(say("no exercise {id!r}", lang, id=exercise_id) + (
            say("; did you mean {near}?", lang, near=", ".join(near)) if near else
            say("; `megalab exercises` lists them", lang)))
    levels = hints[exercise_id]
    if not levels:
        raise HintError(say("exercise {id} has no hints yet", lang, id=exercise_id))
    state = load_state(root)
    seen = int(state["hints"].get(exercise_id, 0))
    if level is None:
        level = min(seen + 1, len(levels))
    if not 1 <= level <= len(levels):
        raise HintError(say("exercise {id} has hints 1 to {n}, not {level}", lang, id=exercise_id, n=len(levels),
                            level=level))
    state["hints"][exercise_id] = max(seen, level)
    _attempt(state, exercise_id)
    _save(root, state)
    return level, len(levels), levels[level - 1]


def format_hint(exercise_id: str, level: int, levels: int, text: str, lang: str = "en") -> str:
    """The hint as `megalab hint` and %hint print it, framed in the workspace's language."""
    from megalab.lab.i18n import say

    kind = say("the idea", lang) if level == 1 else say("the approach", lang) if level == 2 else say("a pitfall", lang)
    more = (say("(more: `megalab hint {id}` again, or %hint {id})", lang, id=exercise_id) if level < levels
            else say("(that was the last hint; `megalab grade {id}` names the likely mistake)", lang, id=exercise_id))
    head = say("Hint {level} of {levels} for {id} ({kind}):", lang, level=level, levels=levels, id=exercise_id,
               kind=kind)
    return f"{head}\n  {text}\n{more}"


# --------------------------------------------------------------------------- progress


@dataclass
class ChapterProgress:
    chapter: str
    done: int
    total: int
    hints: int
    last: str  # when an exercise of this chapter was last graded, or "—"
    todo: list[str]  # exercises not done yet, in course order


def reading_order(root: Path, exercises) -> dict[str, tuple]:
    """{id: sort key}: the course's reading order, i.e. each exercise's notebook, then where its markdown
    announces it (**Exercise `id`**: cell, then place in the cell; else where it first names it), then the code."""
    import re

    first: dict[str, tuple[int, int]] = {}
    for notebook in sorted({ex.notebook for ex in exercises if ex.notebook}):
        path = Path(root) / notebook
        if not path.is_file():
            continue
        cells = [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]
        for ex in (e for e in exercises if e.notebook == notebook):
            named = f"`{ex.id}`"
            found = [(i, m.start()) for i, (kind, text) in enumerate(cells) if kind == "markdown"
                     for m in re.finditer(rf"Exercise\W{{0,4}}{re.escape(named)}", text, flags=re.IGNORECASE)]
            found = found or [(i, text.index(named)) for i, (kind, text) in enumerate(cells)
                              if kind == "markdown" and named in text]
            first[ex.id] = found[0] if found else (len(cells), 0)
    return {ex.id: (ex.notebook or "~", *first.get(ex.id, (0, 0)), ex.path, ex.cell or 0, ex.line) for ex in exercises}


def summary(root: Path) -> list[ChapterProgress]:
    """Per chapter, from the local grading results (.megalab/progress.json); `todo` in reading order."""
    from megalab.lab.workspace import open_workspace

    ws = open_workspace(root)
    source = ws.reference if ws is not None and ws.reference.is_dir() else Path(root)
    registry = load(source)
    state = load_state(root)
    exercises = registry.select(None)
    order = reading_order(source, exercises)
    chapters: dict[str, list] = {}
    for ex in sorted(exercises, key=lambda ex: order[ex.id]):
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
    """Done in solid blocks, to do in dots: an empty bar reads empty, a bar is full only when all is done."""
    full = done * width // total if total else 0
    if done and not full:
        full = 1
    if done < total and full == width:
        full = width - 1
    return "█" * full + "·" * (width - full)


def table(rows: list[ChapterProgress], lang: str = "en") -> str:
    from megalab.lab.i18n import cols, pad, say

    head = [say("chapter", lang), say("done", lang), say("hints", lang), say("last attempt", lang), say("next", lang)]
    w = max([cols(head[0]), cols(say("all", lang))] + [cols(r.chapter) for r in rows])
    line = f"{pad(head[0], w)}  {pad(head[1], 7, right=True)}  {'':20}  {pad(head[2], 5, right=True)}  "
    out = [f"{line}{pad(head[3], 16)}  {head[4]}"]
    for r in rows:
        nxt = r.todo[0] if r.todo else say("all done", lang)
        out.append(f"{pad(r.chapter, w)}  {r.done:>3} / {r.total:<2}  {_bar(r.done, r.total)}  {r.hints:>5}  "
                   f"{pad(r.last, 16)}  {nxt}")
    done, total = sum(r.done for r in rows), sum(r.total for r in rows)
    out.append(f"{pad(say('all', lang), w)}  {done:>3} / {total:<2}  {_bar(done, total)}  {sum(r.hints for r in rows):>5}")
    return "\n".join(out)


def chart(rows: list[ChapterProgress], ax=None):
    """Horizontal bars: exercises done out of each chapter's total (to do: an outline only, never a filled bar)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 0.35 * len(rows) + 0.8))
    names = [r.chapter for r in rows][::-1]
    ax.barh(names, [r.total for r in rows][::-1], color="none", edgecolor="#b0b0b0", label="to do")
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
    from megalab.lab.i18n import lang_of

    tree = find_root(root or ".")
    rows = summary(tree)
    if chapter:
        rows = [r for r in rows if r.chapter.startswith(chapter)] or rows
    print(table(rows, lang_of(tree)))
    chart(rows)
    plt.show()
