"""Exercises from one source: the reference code carries the solutions, the student workspace blanks them.

An exercise region inside a function in megalab/ (or in a notebook's code cell) reads, shown
here behind a "|" margin:

    |    # EXERCISE dist.shard_bounds: balanced contiguous split (first length % world_size ranks get one more)
    |    ### BEGIN SOLUTION
    |    base, extra = divmod(length, world_size)
    |    ...
    |    ### END SOLUTION

`megalab student DIR` copies the repository and turns every BEGIN..END block into one line at
the same indentation; the `# EXERCISE` line stays, so the task is still written there:

    |    # EXERCISE dist.shard_bounds: balanced contiguous split (first length % world_size ranks get one more)
    |    raise NotImplementedError("exercise dist.shard_bounds: balanced ... — see course/01_foundations/01_....ipynb")

A region starts with its hints (`megalab hint ID` shows them one level at a time; blanking takes them
out of the learner's file with the solution):

    |    ### BEGIN SOLUTION
    |    # HINT 1: the idea, in words
    |    # HINT 2: the approach (which function, which collective), never the code
    |    #         (a hint goes on over indented comment lines)

A bug-hunt region ends with the bug the learner starts from, commented out in the reference; the
student version gets those lines uncommented instead of the raise (its checks start red, naming the bug):

    |    ### BUGGY
    |    # return base_seed
    |    ### END SOLUTION

The registry is derived from the source every time, in either workspace:
    id, task, where        the `# EXERCISE <id>: <task>` line
    hints                  the `# HINT n:` lines that open the region
    notebook               the notebook under course/ whose markdown names the id in backticks
                           (**Exercise `dist.shard_bounds`** preferred over a passing mention)
    tests                  tests/ functions marked @pytest.mark.exercise("<id>") (read with ast); those also
                           marked @pytest.mark.integration are left out of `megalab grade <id>` (verdict_tests)
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

SOURCE_DIR, COURSE_DIR, TESTS_DIR = "megalab", "course", "tests"
_EXERCISE = re.compile(r"^(?P<indent>[ \t]*)# EXERCISE (?P<id>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+): (?P<task>\S.*?)\s*$")
_EXERCISE_LIKE = re.compile(r"^[ \t]*#\s*EXERCISE\b")
_BEGIN = re.compile(r"^[ \t]*### BEGIN SOLUTION\s*$")
_END = re.compile(r"^[ \t]*### END SOLUTION\s*$")
_BUGGY = re.compile(r"^[ \t]*### BUGGY\s*$")
_HINT = re.compile(r"^[ \t]*# HINT (?P<level>\d+): ?(?P<text>.*)$")
_HINT_MORE = re.compile(r"^[ \t]*#   +(?P<text>\S.*)$")  # a hint's next line: indented under its text
# the grader's only: wrong answers one edit from a solution (mistakes/, independent/), and whole solutions (blind/)
NOT_FOR_STUDENTS = ("tests/mistakes/", "tests/independent/", "tests/blind/")
_SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".megalab",
              "node_modules", "build", "dist"}

HINTS = ".megalab/hints.json"  # a student copy's hints (blanking takes them out of the code)


class ExerciseError(ValueError):
    """The exercise markers in the source are inconsistent; the message lists every problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class Exercise:
    id: str
    task: str
    path: str  # relative to the repository root, with "/"
    line: int  # 1-based line of the `# EXERCISE` comment (within its cell, in a notebook)
    indent: str
    cell: int | None = None  # index of the notebook cell that holds the region
    solution: tuple[int, int] | None = None  # 0-based lines of BEGIN and END; None once blanked
    hints: list[str] = field(default_factory=list)  # level 1, 2, ... (the `# HINT n:` lines)
    buggy: list[str] | None = None  # a bug hunt: the code the learner starts from (uncommented), else None
    notebook: str | None = None
    tests: list[str] = field(default_factory=list)
    integration: list[str] = field(default_factory=list)  # those of `tests` marked @pytest.mark.integration
    lang: str = "en"  # the language of `task` and `hints` (a translated student copy: megalab/lab/translate.py)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.cell is None else f"{self.path} cell {self.cell} line {self.line}"

    @property
    def verdict_tests(self) -> list[str]:
        """What `megalab grade ID` runs: its tests but the integration ones (end-to-end launches that check
        the same behaviour again, inside a whole feature; `make test` and a chapter's grade run those too)."""
        return [t for t in self.tests if t not in self.integration]

    @property
    def chapter(self) -> str | None:
        """The course chapter folder of its notebook, e.g. `01_foundations`."""
        return Path(self.notebook).parts[1] if self.notebook else None

    def message(self) -> str:
        """The blank region's NotImplementedError text (the grader reads `exercise <id>:` at its start)."""
        see = {"zh": "见"}.get(self.lang, "see")
        return f"exercise {self.id}: {self.task} — {see} {self.notebook or COURSE_DIR + '/'}"


_BLANK_RAISED = re.compile(r"NotImplementedError: exercise ([\w.]+): .*? — (?:see|见) (\S+)")


def needs_first(text: str) -> str | None:
    """For a traceback that ends in a blank region's NotImplementedError: the line that says which exercise this
    code needs first and where it is taught (a cell of another notebook can reach another chapter's exercise)."""
    found = _BLANK_RAISED.findall(text)
    if not found:
        return None
    exercise_id, notebook = found[-1]
    return (f"This needs exercise {exercise_id} first (taught in {notebook}): implement it there, then run this cell "
            f"again (`%grade {exercise_id}` checks it on its own).")


# --------------------------------------------------------------------------- parsing


def parse_regions(text: str, path: str, cell: int | None = None) -> tuple[list[Exercise], list[str]]:
    """The exercises in one source text, and its problems ("path:line: what is wrong")."""
    lines = text.splitlines()
    found, problems = [], []

    def at(i: int) -> str:
        return f"{path}:{i + 1}" if cell is None else f"{path} cell {cell} line {i + 1}"

    i = 0
    while i < len(lines):
        line, m = lines[i], _EXERCISE.match(lines[i])
        if m:
            ex = Exercise(m["id"], m["task"], path, i + 1, m["indent"], cell)
            found.append(ex)
            if cell is None and not ex.indent:
                problems.append(f"{at(i)}: {ex.id} is at module level; put the region inside a function body "
                                "(a module-level raise would break `import`)")
            if i + 1 < len(lines) and _BEGIN.match(lines[i + 1]):
                end = _region_end(lines, i + 2)
                begin_indent = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip())]
                if end is None:
                    problems.append(f"{at(i + 1)}: unterminated region: `### BEGIN SOLUTION` of {ex.id} has no "
                                    "`### END SOLUTION` before the next region or the end of the file")
                    i += 2
                    continue
                body = lines[i + 2 : end]
                if begin_indent != ex.indent or not lines[end].startswith(ex.indent):
                    problems.append(f"{at(i + 1)}: the BEGIN/END markers of {ex.id} must be indented exactly like "
                                    "its `# EXERCISE` line")
                elif not any(b.strip() for b in body):
                    problems.append(f"{at(i + 1)}: the solution of {ex.id} is empty")
                elif any(b.strip() and not b.startswith(ex.indent) for b in body):
                    problems.append(f"{at(i + 1)}: the solution of {ex.id} must be one block of statements at its "
                                    "markers' indentation (or deeper)")
                ex.solution = (i + 1, end)
                ex.hints, code, ex.buggy, bad = _split_body(lines[i + 2 : end], ex.indent)
                problems += [f"{at(i + 2)}: {ex.id}: {why}" for why in bad]
                i = end + 1
                continue
        elif _BEGIN.match(line):
            problems.append(f"{at(i)}: `### BEGIN SOLUTION` needs a `# EXERCISE <id>: <task>` line right above it")
        elif _END.match(line):
            problems.append(f"{at(i)}: `### END SOLUTION` without a `### BEGIN SOLUTION` before it")
        elif _EXERCISE_LIKE.match(line):
            problems.append(f"{at(i)}: malformed exercise line; write `# EXERCISE <module>.<name>: <one-line task>`")
        i += 1
    return found, problems


def _split_body(body: list[str], indent: str) -> tuple[list[str], list[str], list[str] | None, list[str]]:
    """A region's lines -> (hints, solution code lines, the bug's lines uncommented or None, problems)."""
    hints, problems, i = [], [], 0
    while i < len(body):
        m = _HINT.match(body[i])
        if m:
            if int(m["level"]) != len(hints) + 1:
                problems.append(f"hint {m['level']} comes after {len(hints)} hint(s); number them 1, 2, ...")
            hints.append(m["text"].strip())
        elif hints and _HINT_MORE.match(body[i]):
            hints[-1] += " " + _HINT_MORE.match(body[i])["text"].strip()
        else:
            break
        i += 1
    rest = body[i:]
    if not any(line.strip() and not line.strip().startswith("#") for line in rest):
        problems.append("the solution has no code (only hints or comments)")
    marks = [j for j, line in enumerate(rest) if _BUGGY.match(line)]
    if not marks:
        return hints, rest, None, problems
    code, bug = rest[: marks[0]], rest[marks[0] + 1 :]
    buggy = []
    for line in bug:
        text = line[len(indent):] if line.startswith(indent) else line.lstrip()
        if text.strip() and not text.startswith("#"):
            problems.append("the lines under `### BUGGY` must be commented out (`# ` + the code) in the reference")
            break
        buggy.append(indent + (text[2:] if text.startswith("# ") else text[1:]) if text.strip() else "")
    if len(marks) > 1 or not any(b.strip() for b in buggy):
        problems.append("a region has at most one `### BUGGY` part, and it must hold the commented-out buggy code")
    return hints, code, buggy, problems


def solution_code(text: str, ex: Exercise) -> list[str]:
    """The solution's code lines of `ex` in `text` (without its hints and its bug)."""
    begin, end = ex.solution
    return _split_body(text.splitlines()[begin + 1 : end], ex.indent)[1]


def _region_end(lines: list[str], start: int) -> int | None:
    for j in range(start, len(lines)):
        if _END.match(lines[j]):
            return j
        if _BEGIN.match(lines[j]) or _EXERCISE.match(lines[j]):
            return None
    return None


def _files(root: Path, folder: str, suffix: str) -> list[Path]:
    base = root / folder
    if not base.is_dir():
        return []
    return sorted(p for p in base.rglob(f"*{suffix}") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
                  and not p.name.startswith("."))  # e.g. the grader's hidden notebook copies


def notebook_cells(path: Path) -> list[tuple[str, str]]:
    """A notebook's cells as (cell type, source), read as plain JSON: nbformat's import and schema check cost
    seconds of CPU, and `megalab grade ID` reads every notebook to find the exercises (nbformat 4; older ones
    are converted by nbformat)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("nbformat") != 4:
        import nbformat

        data = {"cells": [dict(c) for c in nbformat.read(path, as_version=4).cells]}
    return [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
            for c in data["cells"]]


def scan_sources(root: Path) -> tuple[list[Exercise], list[str]]:
    """Every exercise in megalab/**/*.py and in course notebooks' code cells, with the problems found."""
    exercises, problems = [], []
    for path in _files(root, SOURCE_DIR, ".py"):
        rel = path.relative_to(root).as_posix()
        found, bad = parse_regions(path.read_text(encoding="utf-8"), rel)
        exercises += found
        problems += bad
    for path in _files(root, COURSE_DIR, ".ipynb"):
        rel = path.relative_to(root).as_posix()
        for i, (kind, source) in enumerate(notebook_cells(path)):
            if kind != "code":
                continue
            found, bad = parse_regions(source, rel, cell=i)
            exercises += found
            problems += bad
    seen: dict[str, Exercise] = {}
    for ex in exercises:
        if ex.id in seen:
            problems.append(f"{ex.where}: duplicate exercise id {ex.id} (first at {seen[ex.id].where}); ids must be unique")
        seen.setdefault(ex.id, ex)
    return exercises, problems


# --------------------------------------------------------------------------- notebooks and tests


def notebook_mentions(root: Path) -> dict[str, tuple[set[str], set[str]]]:
    """notebook path -> (ids named as "Exercise `id`", ids named in backticks anywhere) in its markdown."""
    mentions = {}
    for path in _files(root, COURSE_DIR, ".ipynb"):
        text = "\n".join(source for kind, source in notebook_cells(path) if kind == "markdown")
        strong = set(re.findall(r"Exercise\W{0,4}`([\w.]+)`", text, flags=re.IGNORECASE))
        mentions[path.relative_to(root).as_posix()] = (strong, set(re.findall(r"`([\w.]+)`", text)))
    return mentions


def find_notebook(exercise_id: str, mentions: dict[str, tuple[set[str], set[str]]]) -> str | None:
    """The notebook that teaches it: the first (in course order) that announces it as an exercise,
    else the first that names it in backticks."""
    for kind in (0, 1):
        for path in sorted(mentions):
            if exercise_id in mentions[path][kind]:
                return path
    return None


def _exercise_marks(decorators: list[ast.expr]) -> list[str]:
    """Ids from `@pytest.mark.exercise("id")` / `@mark.exercise("id")` decorators (or a pytestmark list)."""
    ids = []
    for node in decorators:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exercise"
                and isinstance(node.func.value, (ast.Attribute, ast.Name))
                and getattr(node.func.value, "attr", getattr(node.func.value, "id", None)) == "mark"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            ids.append(node.args[0].value)
    return ids


def _integration_mark(decorators: list[ast.expr]) -> bool:
    """Whether `@pytest.mark.integration` is among the decorators (or a pytestmark list)."""
    for node in decorators:
        node = node.func if isinstance(node, ast.Call) else node
        if (isinstance(node, ast.Attribute) and node.attr == "integration"
                and getattr(node.value, "attr", getattr(node.value, "id", None)) == "mark"):
            return True
    return False


def find_tests(root: Path) -> tuple[dict[str, list[str]], set[str]]:
    """(exercise id -> pytest node ids of the tests marked with it, the node ids marked integration)
    in tests/**/*.py, read with ast."""
    tests: dict[str, list[str]] = {}
    integration: set[str] = set()
    for path in _files(root, TESTS_DIR, ".py"):
        text = path.read_text(encoding="utf-8")
        if "mark.exercise" not in text:  # (most test files: parsing them all costs a grade ~0.3 s of CPU)
            continue
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(text, rel)
        module_marks, module_integration = [], False
        for node in tree.body:  # pytestmark = pytest.mark.exercise(...) or [ ... ]
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
                module_marks += _exercise_marks(marks)
                module_integration |= _integration_mark(marks)

        def visit(body, prefix, marks, whole):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                    for ex_id in dict.fromkeys(marks + _exercise_marks(node.decorator_list)):
                        tests.setdefault(ex_id, []).append(f"{prefix}::{node.name}")
                    if whole or _integration_mark(node.decorator_list):
                        integration.add(f"{prefix}::{node.name}")
                elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                    visit(node.body, f"{prefix}::{node.name}", marks + _exercise_marks(node.decorator_list),
                          whole or _integration_mark(node.decorator_list))

        visit(tree.body, rel, module_marks, module_integration)
    return tests, integration


# --------------------------------------------------------------------------- registry


@dataclass
class Registry:
    root: Path
    exercises: dict[str, Exercise]
    errors: list[str]  # the markers themselves are broken (no student workspace can be written)
    unknown_tests: dict[str, list[str]]  # ids used by test markers that no `# EXERCISE` line defines

    def problems(self) -> list[str]:
        """Everything an author must fix: broken markers, exercises without a test or a notebook."""
        out = list(self.errors)
        for ex in self.exercises.values():
            if not ex.tests:
                out.append(f"{ex.where}: exercise {ex.id} has no test; mark one in tests/ with "
                           f'@pytest.mark.exercise("{ex.id}")')
            elif not ex.verdict_tests:
                out.append(f"{ex.where}: every test of exercise {ex.id} is marked integration, so `megalab grade "
                           f"{ex.id}` would run none; give it a focused test (threaded world or one process)")
            if not ex.notebook:
                out.append(f"{ex.where}: no notebook under {COURSE_DIR}/ names exercise {ex.id}; write "
                           f"**Exercise `{ex.id}`** in the markdown of the notebook that teaches it")
        for ex_id, nodes in self.unknown_tests.items():
            out.append(f"{nodes[0]}: marked exercise {ex_id!r}, but no `# EXERCISE {ex_id}: ...` line defines it")
        return out

    def select(self, chapter: str | None) -> list[Exercise]:
        """The exercises of one chapter folder (all of them for None), in course order."""
        chosen = [ex for ex in self.exercises.values() if chapter is None or ex.chapter == chapter]
        return sorted(chosen, key=lambda ex: (ex.notebook or "~", ex.path, ex.cell or 0, ex.line))


def find_root(start: str | Path = ".") -> Path:
    """The workspace around `start`: the nearest folder (upwards) holding megalab/__init__.py."""
    from megalab import _tree_of

    start = Path(start).resolve()
    root = _tree_of(start)
    if root is not None:
        return root
    raise ExerciseError([f"{start} is not inside a megalab workspace (no {SOURCE_DIR}/__init__.py here or above)"])


def load(root: str | Path = ".") -> Registry:
    root = Path(root).resolve()
    exercises, errors = scan_sources(root)
    by_id = {}
    for ex in exercises:
        by_id.setdefault(ex.id, ex)
    mentions = notebook_mentions(root)
    tests, integration = find_tests(root)
    for ex in by_id.values():
        ex.notebook = find_notebook(ex.id, mentions) or (ex.path if ex.cell is not None else None)
        ex.tests = tests.get(ex.id, [])
        ex.integration = [t for t in ex.tests if t in integration]
    unknown = {ex_id: nodes for ex_id, nodes in tests.items() if ex_id not in by_id}
    return Registry(root, by_id, errors, unknown)


# --------------------------------------------------------------------------- the student workspace


def blank(text: str, exercises: list[Exercise]) -> str:
    """`text` with each exercise's BEGIN..END block (hints included) replaced by a raise at the region's
    indentation, or, in a bug hunt, by the bug the learner starts from. A translated exercise's
    `# EXERCISE` line takes its translated task."""
    lines = text.splitlines(keepends=True)
    for ex in sorted(exercises, key=lambda ex: ex.line, reverse=True):
        begin, end = ex.solution
        newline = lines[begin][len(lines[begin].rstrip("\r\n")):] or "\n"
        if ex.lang != "en":
            lines[ex.line - 1] = f"{ex.indent}# EXERCISE {ex.id}: {ex.task}{newline}"
        if ex.buggy is not None:
            lines[begin : end + 1] = [line + newline for line in ex.buggy]
            continue
        raise_line = f"{ex.indent}raise NotImplementedError({json.dumps(ex.message(), ensure_ascii=False)})"
        lines[begin : end + 1] = [raise_line + newline]
    return "".join(lines)


def repository_files(root: Path, exclude: Path | None = None) -> list[str]:
    """Files of the repository: tracked files in a git checkout, else a walk that skips venvs and caches."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except FileNotFoundError:  # no git on this machine
        top = None
    if top and top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
        return [f for f in listed.decode().split("\0") if f and (root / f).is_file()]
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (path.is_file() and not _SKIP_DIRS.intersection(rel.parts[:-1]) and path.suffix != ".pyc"
                and not any(p.endswith(".egg-info") for p in rel.parts)
                and not (exclude and path.resolve().is_relative_to(exclude))):
            files.append(rel.as_posix())
    return files


@dataclass
class Edition:
    """A translated course, as `megalab.lab.translate.edition(root, lang)` reads it."""
    lang: str
    notebooks: dict  # English notebook path -> the translated notebook (nbformat)
    words: dict[str, tuple[str, list[str]]]  # exercise id -> (task, hints)


@dataclass
class StudentWorkspace:
    dest: Path
    files: int  # files written
    changed: list[str]  # files that had exercise regions
    blanked: list[Exercise]
    warnings: list[str]


def write_student(root: str | Path, dest: str | Path, force: bool = False, edition: Edition | None = None
                  ) -> StudentWorkspace:
    """Copy the repository at `root` into `dest`, blanking every exercise region.

    Refuses a non-empty `dest` unless `force` (then files are overwritten, others left alone).
    Broken markers raise ExerciseError; exercises without a test or notebook only warn. With an `edition`
    (megalab/lab/translate.py) the notebooks are its translated ones (same paths; code cells and outputs
    unchanged) and the exercises' tasks and hints are its words.
    """
    import nbformat

    root, dest = Path(root).resolve(), Path(dest).resolve()
    if dest == root or root.is_relative_to(dest):
        raise ExerciseError([f"{dest} holds the reference repository itself; choose another folder"])
    if dest.exists() and not dest.is_dir():
        raise ExerciseError([f"{dest} is a file, not a folder"])
    if dest.exists() and any(dest.iterdir()) and not force:
        raise ExerciseError([f"{dest} is not empty; choose an empty folder or pass --force to overwrite its files"])
    registry = load(root)
    errors = registry.errors or [  # (a broken region is reported once, above)
        f"{ex.where}: exercise {ex.id} has no `### BEGIN SOLUTION` block under its `# EXERCISE` line "
        "(is this already a student workspace?)" for ex in registry.exercises.values() if ex.solution is None]
    if errors:
        raise ExerciseError(errors)
    exercises = list(registry.exercises.values())
    notebooks = edition.notebooks if edition else {}  # English notebook -> its translation
    if edition:
        exercises = [replace(ex, task=edition.words[ex.id][0], hints=edition.words[ex.id][1], lang=edition.lang)
                     for ex in exercises]
    by_path: dict[str, list[Exercise]] = {}
    for ex in exercises:
        by_path.setdefault(ex.path, []).append(ex)

    files = [rel for rel in repository_files(root, exclude=dest) if not rel.startswith(NOT_FOR_STUDENTS)]
    for rel in files:
        src, out = root / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if rel in notebooks and rel not in by_path:
            out.write_text(nbformat.writes(notebooks[rel]), encoding="utf-8")
            shutil.copymode(src, out)
        elif rel not in by_path:
            if out.is_symlink() or out.exists():
                out.unlink()
            shutil.copy2(src, out, follow_symlinks=False)
        elif rel.endswith(".ipynb"):
            nb = notebooks.get(rel) or nbformat.read(src, as_version=nbformat.NO_CONVERT)
            for cell_index, cell_exercises in _group(by_path[rel], lambda ex: ex.cell).items():
                cell = nb.cells[cell_index]
                cell.source = blank(cell.source, cell_exercises)
            out.write_text(nbformat.writes(nb), encoding="utf-8")
            shutil.copymode(src, out)
        else:
            out.write_text(blank(src.read_text(encoding="utf-8"), by_path[rel]), encoding="utf-8")
            shutil.copymode(src, out)
    blanked = [ex for rel in files for ex in by_path.get(rel, [])]
    hints = dest / HINTS  # blanking took them out of the code; `megalab hint` reads them here
    hints.parent.mkdir(exist_ok=True)
    hints.write_text(json.dumps({ex.id: ex.hints for ex in exercises}, indent=1, ensure_ascii=False))
    if not (hints.parent / ".gitignore").exists():
        (hints.parent / ".gitignore").write_text("*\n")
    missing = sorted(set(by_path) - set(files))
    warnings = [f"{p}: has exercises but is not a tracked file, so it was not copied" for p in missing]
    warnings += [p for p in registry.problems() if p not in registry.errors]
    return StudentWorkspace(dest, len(files), sorted(set(by_path) & set(files)), blanked, warnings)


def _group(items, key) -> dict:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
