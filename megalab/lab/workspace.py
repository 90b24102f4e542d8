"""A learner's workspace: the course with every exercise blank, ready to run in seconds.

    megalab workspace ~/megalab-work        (or: make workspace DIR=~/megalab-work)

writes the student version of this repository (megalab/lab/exercises.py) and, beside it, what the
tool keeps for itself in `.megalab/` (hidden in JupyterLab):

    .megalab/workspace.json     the reference it came from, the shared Python environment, and a
                                hash of every file as written (so `update` knows what you changed)
    .megalab/reference/         the grader's truth: the reference megalab/ (solutions), tests/ and
                                the notebooks with their expected outputs
    .megalab/backup/            whatever `restore` or `update` replaced, by time

No second install: the workspace runs on the reference's environment, with the workspace first
on PYTHONPATH (`make lab` there sets it; `%load_ext megalab` checks it), so the kernel and every
rank import *your* megalab.

Grading one exercise in isolation (`megalab grade ID`, megalab/lab/grading.py) runs its tests in an
overlay: the reference package with only the module that holds ID taken from the workspace, in
which every other exercise's function is the reference's. A failure therefore always names the
exercise at fault, whatever state the rest of the workspace is in. (A chapter runs its exercises
in one overlay first and re-runs alone only those that fail.)
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megalab.lab.exercises import (
    COURSE_DIR,
    HINTS,
    SOURCE_DIR,
    TESTS_DIR,
    Edition,
    Exercise,
    ExerciseError,
    load,
    write_student,
)

STATE_DIR = ".megalab"
CONFIG = f"{STATE_DIR}/workspace.json"
REFERENCE = f"{STATE_DIR}/reference"
BACKUP = f"{STATE_DIR}/backup"
BASE = f"{STATE_DIR}/base"  # each source file as the course last wrote it here: the base of update's 3-way merge
KEPT = (SOURCE_DIR, TESTS_DIR, COURSE_DIR)  # what the snapshot keeps of the reference
FIRST_NOTEBOOK = "course/01_foundations/01_setup_and_torchrun.ipynb"


class WorkspaceError(RuntimeError):
    """A workspace operation cannot go ahead; the message says what to do."""


_BANNER = re.compile(r"megalab \d+\.\d+\.\d+ · [^\"\n]*")  # the line `%load_ext megalab` prints (sanitize.cfg's)
# which tree `megalab doctor` says a notebook runs (megalab/lab/doctor.py): the reference's, in a stored output
_DOCTOR = re.compile(r"from this folder's tree: [^\"\n]*?, \d+ of \d+ exercises implemented")


def _sha(path: Path) -> str:
    """The file's SHA-256; a notebook's without the lines that say which tree it runs (the workspace writes its own)."""
    data = path.read_bytes()
    if path.suffix == ".ipynb":
        text = data.decode("utf-8", "surrogateescape")
        text = _DOCTOR.sub("DOCTOR", _BANNER.sub("megalab BANNER", text)).rstrip("\n")
        data = text.encode("utf-8", "surrogateescape")
    return hashlib.sha256(data).hexdigest()


def show_banner(ws_root: Path, notebooks: list[Path]) -> None:
    """In each notebook's stored outputs, say this workspace where the reference said itself: the banner of
    `%load_ext megalab` (what it prints here now) and `megalab doctor`'s line on which tree runs, in place of the
    reference's "every exercise solved"."""
    from megalab import banner

    line = banner(ws_root)
    done, total = progress(ws_root)
    ws = open_workspace(ws_root)
    tree = (f"from this folder's tree: a workspace made from {ws.source if ws else ws_root}, {done} of {total} "
            f"exercises implemented")
    for path in notebooks:
        text = path.read_text(encoding="utf-8")
        if not _BANNER.search(text) and not _DOCTOR.search(text):
            continue
        nb = json.loads(text)
        for cell in nb.get("cells", []):
            for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
                if out.get("output_type") == "stream":
                    said = "".join(out.get("text", []))
                    new = _DOCTOR.sub(lambda m: tree, _BANNER.sub(lambda m: line, said))
                    if new != said:
                        out["text"] = new.splitlines(keepends=True)
        dumped = json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False)
        path.write_text(dumped + ("\n" if text.endswith("\n") else ""), encoding="utf-8")


def _git_commit(root: Path) -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# --------------------------------------------------------------------------- what a workspace knows


@dataclass
class Workspace:
    root: Path
    config: dict

    @property
    def reference(self) -> Path:
        """The snapshot of the reference this workspace grades against."""
        return self.root / REFERENCE

    @property
    def source(self) -> Path:
        """The reference repository it was made from (for `update`)."""
        return Path(self.config["reference"])


def open_workspace(root: str | Path) -> Workspace | None:
    """The workspace at `root`, or None for a plain repository (the reference)."""
    path = Path(root) / CONFIG
    if not path.is_file():
        return None
    return Workspace(Path(root).resolve(), json.loads(path.read_text()))


def progress(root: Path) -> tuple[int, int]:
    """(exercises implemented, exercises) in the tree at root; a blank region is its `raise` line, a bug hunt
    not yet touched still holds the shipped bug. Reads megalab/ only (fast enough for `%load_ext megalab`)."""
    from megalab.lab.exercises import _files, parse_regions

    bugs = _shipped_bugs(root)
    done = total = 0
    for path in _files(root, SOURCE_DIR, ".py"):
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        for ex in parse_regions("\n".join(lines), rel)[0]:
            total += 1
            bug = bugs.get(ex.id)
            untouched = bug is not None and lines[ex.line : ex.line + len(bug)] == bug
            done += ex.solution is not None or (blank_message(root, ex) is None and not untouched)
    return done, total


def _shipped_bugs(root: Path) -> dict[str, list[str]]:
    """{id: the bug's lines} of the bug-hunt regions of the reference a workspace keeps (none elsewhere)."""
    from megalab.lab.exercises import _files, parse_regions

    reference = root / REFERENCE
    bugs = {}
    for path in _files(reference, SOURCE_DIR, ".py") if reference.is_dir() else []:
        text = path.read_text(encoding="utf-8")
        if "### BUGGY" in text:
            bugs.update({ex.id: ex.buggy for ex in parse_regions(text, path.name)[0] if ex.buggy is not None})
    return bugs


def blank_message(root: Path, ex: Exercise) -> str | None:
    """The NotImplementedError message if the region of `ex` is still blank in the tree at root."""
    path = root / ex.path
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    marker, prefix = f"# EXERCISE {ex.id}:", f'raise NotImplementedError("exercise {ex.id}:'
    for above, line in zip(lines, lines[1:]):
        text = line.strip()
        if above.strip().startswith(marker) and text.startswith(prefix) and text.endswith('")'):
            return json.loads(text[len("raise NotImplementedError(") : -1])
    return None


# --------------------------------------------------------------------------- create


def create(reference: str | Path, dest: str | Path, force: bool = False, lang: str | None = None):
    """Write the student workspace of `reference` into `dest`, with its snapshot and config (in `lang`:
    the translated notebooks, tasks and hints; `update` keeps the language)."""
    reference, dest = Path(reference).resolve(), Path(dest).resolve()
    if open_workspace(reference):
        raise WorkspaceError(f"{reference} is itself a workspace; make new workspaces from the reference repository "
                             f"({open_workspace(reference).source})")
    translation = _edition(reference, lang)
    written = write_student(reference, dest, force=force, edition=translation)
    files = {rel: _sha(dest / rel) for rel in sorted(_tracked(dest))}  # as written: `update` tells your edits by them
    _keep_base(dest, dest)
    _snapshot(reference, dest, translation)
    config = {"reference": str(reference), "venv": sys.prefix, "python": sys.executable, "lang": lang or "en",
              "commit": _git_commit(reference), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    (dest / CONFIG).write_text(json.dumps(config, indent=1))
    (dest / STATE_DIR / ".gitignore").write_text("*\n")
    (dest / STATE_DIR / "env.mk").write_text(  # read by the Makefile: `make lab` etc. use the shared environment
        f"WORKSPACE := 1\nVENV := {sys.prefix}\nREFERENCE := {reference}\n")
    show_banner(dest, sorted((dest / COURSE_DIR).rglob("*.ipynb")))
    return written


def _tracked(root: Path) -> list[str]:
    """Files of the workspace that came from the reference (everything but the tool's own folder)."""
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] != STATE_DIR and "__pycache__" not in rel.parts \
                and ".ipynb_checkpoints" not in rel.parts:
            out.append(rel.as_posix())
    return out


def _edition(reference: Path, lang: str | None) -> Edition | None:
    """The course in `lang` (None for English); a missing or stale translation is a WorkspaceError."""
    from megalab.lab.translate import TranslationError, edition

    if not lang or lang == "en":
        return None
    try:
        return edition(reference, lang)
    except TranslationError as exc:
        raise WorkspaceError(str(exc)) from None


def _snapshot(reference: Path, dest: Path, translation: Edition | None = None) -> None:
    """The grader's copy of the reference (its notebooks in the learner's language: what `restore` puts back)."""
    import nbformat

    from megalab.lab.exercises import repository_files

    snap = dest / REFERENCE
    if snap.exists():
        shutil.rmtree(snap)
    notebooks = translation.notebooks if translation else {}
    for rel in repository_files(reference, exclude=dest):
        if rel.split("/")[0] in KEPT:
            (snap / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel in notebooks:  # same code cells and outputs as the English: graded alike
                nbformat.write(notebooks[rel], snap / rel)
            else:
                shutil.copy2(reference / rel, snap / rel)


# --------------------------------------------------------------------------- restore and update


def _mergeable(rel: str) -> bool:
    """Text files a learner edits by hand: merged three-way on update (notebooks are JupyterLab's to save)."""
    return rel.startswith(SOURCE_DIR + "/") and rel.endswith(".py")


def _keep_base(written: Path, ws_root: Path) -> None:
    """Copy each mergeable file of `written` (the course as just written) to the workspace's base folder."""
    base = ws_root / BASE
    if base.exists():
        shutil.rmtree(base)
    for rel in _tracked(written):
        if _mergeable(rel):
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(written / rel, base / rel)


_EXERCISE_LINE = re.compile(r"^(\s*)# EXERCISE ([\w.]+):.*$")
_RAISE_LINE = re.compile(r'^(\s*)raise NotImplementedError\("exercise ([\w.]+):.*$')


def _canonical(text: str) -> tuple[str, dict[str, str]]:
    """`text` with each exercise's task line and blank `raise` reduced to their id (their wording is the course's
    alone: a new wording must never collide with your solution below it), and the original lines by key."""
    lines, originals = [], {}
    for line in text.splitlines(keepends=True):
        for kind, pattern in (("EXERCISE", _EXERCISE_LINE), ("RAISE", _RAISE_LINE)):
            m = pattern.match(line.rstrip("\n"))
            if m:
                key = f"{m[1]}#megalab-{kind} {m[2]}\n"
                originals[key] = line if line.endswith("\n") else line + "\n"
                line = key
                break
        lines.append(line)
    return "".join(lines), originals


def merge3(yours: str, base: str, theirs: str, rel: str) -> tuple[str, int]:
    """Three-way merge as git does it (`git merge-file`): the course's changes since `base` applied to `yours`.
    Returns (text, conflicts); a conflict is left between git's markers, your lines first."""
    import subprocess

    (y, mine), (b, before), (t, now) = _canonical(yours), _canonical(base), _canonical(theirs)
    originals = {**mine, **before, **now}  # the course's current wording wins
    with tempfile.TemporaryDirectory(prefix="megalab-merge-") as tmp:
        paths = []
        for name, text in (("yours", y), ("base", b), ("theirs", t)):
            path = Path(tmp) / name
            path.write_text(text, encoding="utf-8")
            paths.append(str(path))
        try:
            proc = subprocess.run(["git", "merge-file", "-p", "-L", f"{rel} (yours)", "-L", f"{rel} (as the course "
                                   "wrote it before)", "-L", f"{rel} (the course now)", *paths],
                                  capture_output=True, text=True)
        except FileNotFoundError:
            raise WorkspaceError("`megalab update` merges the course's changes into your files with git: install git "
                                 "(https://git-scm.com/downloads) and run it again; nothing was changed") from None
    if proc.returncode < 0 or proc.returncode > 127:
        raise WorkspaceError(f"git merge-file failed on {rel}: {proc.stderr.strip()}; nothing was changed")
    lines = [originals.get(line, line) for line in proc.stdout.splitlines(keepends=True)]
    return "".join(lines), proc.returncode


def _conflict_lines(text: str) -> list[int]:
    return [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith("<<<<<<< ")]


def _backup(ws: Workspace, rel: str, stamp: str) -> Path:
    target = ws.root / BACKUP / stamp / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ws.root / rel, target)
    return target


def restore(ws: Workspace, notebook: str | Path) -> Path:
    """Put the reference version of a notebook (its expected outputs) back; returns the backup path."""
    path = Path(notebook).resolve()
    try:
        rel = path.relative_to(ws.root).as_posix()
    except ValueError:
        raise WorkspaceError(f"{notebook} is not inside the workspace {ws.root}") from None
    pristine = ws.reference / rel
    if not rel.endswith(".ipynb") or not pristine.is_file():
        known = sorted(p.relative_to(ws.reference).as_posix() for p in (ws.reference / COURSE_DIR).rglob("*.ipynb"))
        raise WorkspaceError(f"{rel} is not one of the course's notebooks; choose one of:\n  " + "\n  ".join(known))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = _backup(ws, rel, stamp) if path.exists() else None
    shutil.copy2(pristine, path)
    show_banner(ws.root, [path])
    return backup


@dataclass
class Update:
    replaced: list[str]  # files you had not changed, now the new version
    merged: list[str]  # exercise modules: the new version with your implemented functions carried over
    kept: list[str]  # files you changed that the course did not: left as they are
    backups: Path | None
    removed: list[str] = field(default_factory=list)  # files the course no longer has (copied to the backups)
    conflicts: dict[str, list[int]] = field(default_factory=dict)  # file -> lines of git's conflict markers


def update(ws: Workspace) -> Update:
    """Bring the workspace to the reference's current version without losing your work.

    Files the course did not change stay as you left them. Files you never changed take the new
    version. A megalab/ file both you and the course changed is merged three-way, as git merges: the
    course's changes since it last wrote the file (.megalab/base/) are applied to yours, so a fix the course
    made inside a function you implemented arrives, and your solutions stay; where both changed the same
    lines, the file keeps git's conflict markers (yours first) and the conflict is reported. An exercise the
    course moved to another module takes your implementation with it. Other files you changed (notebooks,
    saved by JupyterLab) take the new version. Files the course no longer has are removed. Whatever is
    replaced, merged or removed is copied to .megalab/backup/<time>/ first.
    """
    source = ws.source
    if not (source / SOURCE_DIR / "__init__.py").is_file():
        raise WorkspaceError(f"the reference {source} is gone; clone the course again and run "
                             f"`megalab workspace` there, then copy your solutions over")
    with tempfile.TemporaryDirectory(prefix="megalab-update-") as tmp:
        fresh = Path(tmp) / "ws"
        translation = _edition(source, ws.config.get("lang"))
        written = write_student(source, fresh, edition=translation)
        mine = {ex.id: ex for ex in load(ws.root).exercises.values()}
        yours = {ex.path: (ws.root / ex.path).read_text(encoding="utf-8") for ex in mine.values()}  # before any write
        stamp = time.strftime("%Y%m%d-%H%M%S")
        replaced, merged, kept, backed, conflicts = [], [], [], False, {}
        by_path: dict[str, list[Exercise]] = {}
        for ex in written.blanked:
            by_path.setdefault(ex.path, []).append(ex)
        for rel in sorted(_tracked(fresh)):
            new, old = fresh / rel, ws.root / rel
            if old.exists() and _sha(old) == _sha(new):
                continue
            as_written = ws.config["files"].get(rel)  # the file as the course last wrote it here
            changed_by_you = old.exists() and as_written != _sha(old)
            if old.exists() and as_written == _sha(new):  # the course did not change it
                if changed_by_you:
                    kept.append(rel)
                continue
            base = ws.root / BASE / rel
            three_way = changed_by_you and _mergeable(rel) and base.is_file()
            donors: dict[str, list[Exercise]] = {}  # a file of yours -> the exercises of this module it holds
            for ex in by_path.get(rel, []):
                moved = mine.get(ex.id) is not None and mine[ex.id].path != rel
                if ex.id in mine and mine[ex.id].path.endswith(".py") and (moved or (changed_by_you and not three_way)):
                    donors.setdefault(mine[ex.id].path, []).append(ex)
            if three_way or donors:  # your file with the course's changes, your solutions from wherever they were
                text = new.read_text(encoding="utf-8")
                if three_way:
                    text, clashes = merge3(old.read_text(encoding="utf-8"), base.read_text(encoding="utf-8"), text, rel)
                    if clashes:
                        conflicts[rel] = _conflict_lines(text)
                for donor, exercises in sorted(donors.items()):
                    text = carry_over(yours[donor], text, exercises, rel)
                if not old.exists() or text != old.read_text(encoding="utf-8"):
                    if old.exists():
                        _backup(ws, rel, stamp)
                        backed = True
                    old.parent.mkdir(parents=True, exist_ok=True)
                    old.write_text(text, encoding="utf-8")
                    merged.append(rel)
                continue
            if changed_by_you:
                _backup(ws, rel, stamp)
                backed = True
            old.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(new, old)
            replaced.append(rel)
        fresh_files = set(_tracked(fresh))
        removed = sorted(rel for rel in ws.config["files"] if rel not in fresh_files and (ws.root / rel).exists())
        for rel in removed:  # gone from the course (moved or deleted): out of the way of the new files
            _backup(ws, rel, stamp)
            backed = True
            (ws.root / rel).unlink()
        _snapshot(source, ws.root, translation)
        show_banner(ws.root, [ws.root / rel for rel in replaced + merged if rel.endswith(".ipynb")])
        _keep_base(fresh, ws.root)
        shutil.copy2(fresh / HINTS, ws.root / HINTS)  # the hints as the course now words them
        # each file as the course wrote it (never your edit): what the next update compares with
        ws.config.update(files={rel: _sha(fresh / rel) for rel in _tracked(fresh)}, commit=_git_commit(source),
                         updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        (ws.root / CONFIG).write_text(json.dumps(ws.config, indent=1))
    return Update(replaced, merged, kept, ws.root / BACKUP / stamp if backed else None, removed, conflicts)


# --------------------------------------------------------------------------- functions by name


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """qualname -> def node, for every function and method (nested ones too)."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found.setdefault(name, child)
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def enclosing_function(tree: ast.Module, line: int) -> str | None:
    """The qualname of the innermost function around a 1-based line."""
    best, size = None, None
    for name, node in _functions(tree).items():
        if node.lineno <= line <= node.end_lineno and (size is None or node.end_lineno - node.lineno < size):
            best, size = name, node.end_lineno - node.lineno
    return best


def _span(node) -> tuple[int, int]:
    """0-based [first, last] lines of a def, decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first - 1, node.end_lineno - 1


def parse_module(text: str, rel: str) -> ast.Module:
    """ast.parse, with a syntax error said the way Python says it, and where."""
    try:
        return ast.parse(text, rel)
    except SyntaxError as exc:
        where = f"{rel}, line {exc.lineno}" if exc.lineno else rel
        raise ExerciseError([f"{type(exc).__name__}: {exc.msg} ({where})"]) from None


def swap_functions(target: str, donor: str, names: list[str], rel: str) -> str:
    """`target` with the defs named `names` replaced by `donor`'s (a def missing in either is left alone;
    a def nested in another one named is swapped with it)."""
    t_lines, d_lines = target.splitlines(keepends=True), donor.splitlines(keepends=True)
    t_funcs, d_funcs = _functions(parse_module(target, rel)), _functions(parse_module(donor, rel))
    outer = {n for n in names if not any(n.startswith(m + ".") for m in names)}
    spans = sorted((_span(t_funcs[n]), _span(d_funcs[n])) for n in outer if n in t_funcs and n in d_funcs)
    for (t0, t1), (d0, d1) in reversed(spans):  # bottom-up: earlier line numbers stay valid
        t_lines[t0 : t1 + 1] = d_lines[d0 : d1 + 1]
    return "".join(t_lines)


def carry_over(mine: str, new: str, exercises: list[Exercise], rel: str) -> str:
    """The new version of a module, with each exercise function you implemented (no longer blank) from yours."""
    tree = parse_module(mine, rel)
    lines = mine.splitlines()
    names = []
    for ex in exercises:
        name = enclosing_function(tree, _exercise_line(lines, ex.id))
        func = _functions(tree).get(name)
        if func is not None and f'raise NotImplementedError("exercise {ex.id}:' not in "\n".join(
                lines[func.lineno - 1 : func.end_lineno]):
            names.append(name)
    return swap_functions(new, mine, names, rel) if names else new


def _exercise_line(lines: list[str], exercise_id: str) -> int:
    """1-based line of `# EXERCISE <id>:` in a module's lines."""
    marker = f"# EXERCISE {exercise_id}:"
    for i, line in enumerate(lines):
        if line.strip().startswith(marker):
            return i + 1
    raise ExerciseError([f"the `{marker}` line is gone; put it back above your solution (or `megalab update`)"])


# --------------------------------------------------------------------------- grading overlay


def isolate(ws_root: Path, reference: Path, rel: str, yours: list[Exercise], ref_exercises: list[Exercise]) -> str:
    """Module `rel` as it should run when grading the exercises `yours` (all in this module): your file,
    in which every other exercise runs the reference (its function swapped in; for a region in the same
    function as one of yours, or around or inside it, the reference solution pasted over its blank)."""
    mine = (ws_root / rel).read_text(encoding="utf-8")
    ref = (reference / rel).read_text(encoding="utf-8")
    mine_tree, ref_tree = parse_module(mine, rel), parse_module(ref, rel)
    ref_lines = ref.splitlines()
    own = {enclosing_function(ref_tree, _exercise_line(ref_lines, ex.id)): ex for ex in yours}
    for name, ex in own.items():
        if name not in _functions(mine_tree):
            raise ExerciseError([f"{rel}: the function {name} (which holds exercise {ex.id}) is missing; restore it "
                                 f"from {REFERENCE}/{rel} and write your solution in it again"])
    ids = {ex.id for ex in yours}
    swap = []
    for other in (e for e in ref_exercises if e.path == rel and e.id not in ids):
        name = enclosing_function(ref_tree, other.line)
        if any(name == o or o.startswith(name + ".") or name.startswith(o + ".") for o in own):
            mine = _fill_blank(mine, ref_lines, other)  # entangled with yours: fill its blank, keep what you wrote
        else:
            swap.append(name)
    mine = swap_functions(mine, ref, swap, rel) if swap else mine
    have, ref_funcs = _functions(parse_module(mine, rel)), _functions(ref_tree)
    for name in dict.fromkeys(swap):  # gone from your file: the reference's, appended
        if name not in have and "." not in name:
            first, last = _span(ref_funcs[name])
            mine = mine.rstrip("\n") + "\n\n\n" + "\n".join(ref_lines[first : last + 1]) + "\n"
    return mine


def _fill_blank(text: str, ref_lines: list[str], ex: Exercise) -> str:
    lines = text.splitlines(keepends=True)
    begin, end = ex.solution
    for i, line in enumerate(lines):
        if line.strip().startswith(f'raise NotImplementedError("exercise {ex.id}:'):
            lines[i : i + 1] = [ln + "\n" for ln in ref_lines[begin + 1 : end]]
            break
    return "".join(lines)


def overlay(ws_root: Path, reference: Path, yours: list[Exercise], ref_exercises: list[Exercise]) -> Path:
    """A temporary tree to grade the exercises `yours` without the rest of your workspace: the reference
    package with the modules that hold them isolated from your workspace, the reference tests, and links
    to the rest of the workspace (data, course). The caller removes it."""
    by_path: dict[str, list[Exercise]] = {}
    for ex in yours:
        by_path.setdefault(ex.path, []).append(ex)
    modules = {rel: isolate(ws_root, reference, rel, exs, ref_exercises) for rel, exs in by_path.items()}
    tmp = Path(tempfile.mkdtemp(prefix="megalab-grade-"))  # (a syntax error raised above, before this)
    shutil.copytree(reference / SOURCE_DIR, tmp / SOURCE_DIR, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(reference / TESTS_DIR, tmp / TESTS_DIR, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in modules.items():
        (tmp / rel).write_text(text, encoding="utf-8")
    for entry in ws_root.iterdir():
        if entry.name not in (SOURCE_DIR, TESTS_DIR, STATE_DIR, ".git", ".venv") and not (tmp / entry.name).exists():
            os.symlink(entry, tmp / entry.name)
    return tmp


def expected_notebook(ws: Workspace | None, root: Path, rel: str) -> Path:
    """The notebook whose stored outputs are the expected ones: the reference's, never your saved copy."""
    if ws is not None and (ws.reference / rel).is_file():
        return ws.reference / rel
    return root / rel


def graded_copy(ws: Workspace | None, root: Path, rel: str) -> Path:
    """A hidden copy of the expected notebook next to yours (same folder: relative paths work), to run
    under nbval against your megalab. The caller removes it."""
    import nbformat

    source = expected_notebook(ws, root, rel)
    folder = (root / rel).parent
    fd, name = tempfile.mkstemp(prefix=".megalab-grade-", suffix=".ipynb", dir=folder)
    os.close(fd)
    nb = nbformat.read(source, as_version=nbformat.NO_CONVERT)
    nbformat.write(nb, name)
    return Path(name)
