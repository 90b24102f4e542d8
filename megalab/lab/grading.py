"""`megalab grade`: one exercise in seconds and in isolation, or a chapter's table with its notebooks.

    megalab grade dist.shard_bounds     one exercise: its focused tests (not those marked integration)
    megalab grade 03                    every exercise of chapter 03, then its notebooks
    megalab grade                       the whole course

In a learner's workspace (megalab/lab/workspace.py) each exercise is graded **alone**: its tests run
on an overlay where every other exercise is the reference's, so a failure always names the
exercise at fault, whatever else is blank or wrong. A blank region is "not implemented" at once,
without running anything. Notebooks are graded against the **expected** outputs the tool keeps
(.megalab/reference/), never against what JupyterLab saved in your copy.

In the reference repository (and in an old-style student tree) the selected exercises' tests and
the notebooks go in ONE pytest run, as before. Status per exercise:

    passed            every test passed
    not implemented   its region still raises its NotImplementedError
    failed            anything else (wrong answer, crash, deadlock), with the test's own words
    not graded        the machine was too loaded for a multi-rank check to finish: grade again

This module is also that run's pytest plugin (`-p megalab.lab.grading`): when MEGALAB_GRADE_OUT is
set it keeps only the selected exercises' tests (and the notebook cells) and writes every outcome
there as JSON.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pluggy

from megalab.lab.exercises import COURSE_DIR, Exercise, ExerciseError, load
from megalab.lab.launch import HARD_TIMEOUT_FACTOR
from megalab.lab.workspace import blank_message, graded_copy, open_workspace, overlay

_OUT, _IDS = "MEGALAB_GRADE_OUT", "MEGALAB_GRADE_IDS"
_NOT_IMPLEMENTED = re.compile(r"NotImplementedError: (exercise ([\w.]+): [^\n]*)")
_MENTION = re.compile(r"exercise ([\w.]+):")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")
DEFAULT_TIMEOUT = 300  # seconds per test and per notebook cell
# megalab.lab.launch's words for a run that was not stuck, only slow (LaunchTimeoutError kinds "overloaded" and
# "not started" on a busy machine): not a verdict on the code
_OVERLOADED = re.compile(r"cell still computing after|torchrun was still starting them, the machine is overloaded")


@dataclass
class Outcome:
    """One pytest item (a test, or a notebook cell): passed / failed / skipped and why."""

    nodeid: str
    outcome: str
    exercises: list[str] = field(default_factory=list)
    text: str = ""  # the failure report, colour codes removed

    @property
    def first_line(self) -> str:
        return "did not run (pytest stopped before it)" if self.outcome == "not run" else failure_line(self.text)


@dataclass
class Row:
    name: str  # exercise id or notebook path
    status: str  # passed / failed / not implemented / not graded
    detail: str  # first line of the (first) failure, or what passed
    outcomes: list[Outcome] = field(default_factory=list)
    where: str = ""  # an exercise's file:line and notebook
    notebook: str | None = None
    hints: int = 0  # hint levels the learner has seen for this exercise (megalab hint)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


_CHAINED = re.compile(r"^(During handling of the above exception, another exception occurred:|"
                      r"The above exception was the direct cause of the following exception:)\s*$", re.MULTILINE)


def failure_line(text: str) -> str:
    """The line of a failure report worth showing in the table (of a chain of exceptions, the last one's:
    a check that names the mistake while handling a launch's error is what the learner must read)."""
    text = _CHAINED.split(text)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = [line[1:].strip() for line in lines if line.startswith("E ")]  # pytest's report: "E   Error: ..."
    for candidates in (raised, lines):
        for line in candidates:
            m = _NOT_IMPLEMENTED.search(line)
            if m:
                return f"NotImplementedError: {m[1].strip()}"
    if raised and raised[0].startswith('File "'):  # a syntax error: pytest shows where before what
        kind = next((line for line in raised if _ERROR_LINE.match(line)), None)
        where = re.match(r'File "([^"]+)", line (\d+)', raised[0])
        if kind and where:
            path = where[1][where[1].rfind("megalab/"):] if "megalab/" in where[1] else Path(where[1]).name
            return f"{kind} ({path}, line {where[2]})"
        if kind:
            return kind
    if raised:
        return raised[0]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    cell = next((line for line in lines if re.match(r"Cell \d+: ", line)), None)  # nbval's report
    if cell:  # "Cell 3: Cell outputs differ" then, after "Traceback:", the exception or the mismatch
        after = lines[lines.index("Traceback:") + 1 :] if "Traceback:" in lines else []
        why = errors[-1] if errors else (after[0] if after else "")
        return f"{cell}: {why}" if why else cell
    return errors[-1] if errors else (lines[-1] if lines else "")


def unimplemented(text: str) -> str | None:
    """The id of the exercise whose NotImplementedError a failure report shows, if any."""
    m = _NOT_IMPLEMENTED.match(failure_line(text))
    return m[2] if m else None


# --------------------------------------------------------------------------- running pytest


def run_checks(root: Path, exercises: list[Exercise], notebooks: list[str] = (),
               timeout: float = DEFAULT_TIMEOUT, first_failure: bool = False, focused: bool = False
               ) -> dict[str, Outcome]:
    """ONE pytest run in `root`: the tests marked with `exercises`, then `notebooks` under strict nbval.

    Returns {nodeid: Outcome}; notebook cells have node ids "<notebook>::Cell N". Outcomes are
    written as they come, so a crash of pytest itself leaves the rest "not run" (a failure).
    first_failure: stop at the first failing test (one exercise: its first, focused test names the
    likely mistake in seconds; the heavy tests after it only run when it passes).
    focused: only each exercise's verdict_tests (`megalab grade ID`: not the end-to-end launches marked
    integration, which a chapter's grade and `make test` still run).
    """
    if focused:  # node ids: pytest collects only those tests
        paths = list(dict.fromkeys(node for ex in exercises for node in ex.verdict_tests))
    else:  # whole files: the plugin below keeps the marked tests
        paths = sorted({node.split("::")[0] for ex in exercises for node in ex.tests})
    if not paths and not notebooks:
        return {}
    if importlib.util.find_spec("pytest_timeout") is None:
        raise RuntimeError("grading needs pytest-timeout (a hanging test must fail, not hang): pip install -e '.[dev]'")
    # the last resort against a hang outside any launch; a launch itself stops at its own (hard) timeout
    backstop = timeout * (HARD_TIMEOUT_FACTOR + 1)
    args = [f"--timeout={backstop:g}", *paths, *notebooks] + (["-x"] if first_failure else [])
    if notebooks:
        args += ["--nbval", "--nbval-current-env", f"--nbval-cell-timeout={backstop:g}"]
    else:  # no notebooks: skip loading nbval (and the addopts that configure it); saves seconds
        args += ["-p", "no:nbval", "-o", "addopts="]
    with tempfile.TemporaryDirectory(prefix="megalab-grade-") as tmp:
        out = Path(tmp) / "outcomes.json"
        env = {k: v for k, v in os.environ.items() if k != _IDS}
        env.update({_OUT: str(out), _IDS: ",".join(ex.id for ex in exercises)})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", "-p", "megalab.lab.grading", "-p", "no:cacheprovider", "-q", "--no-header",
               "-rN", "--continue-on-collection-errors", *args]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"pytest did not run ({' '.join(cmd[2:])}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        data = json.loads(out.read_text())
    return {nodeid: Outcome(nodeid, **value) for nodeid, value in data.items()}


# --------------------------------------------------------------------------- results -> rows


def exercise_row(ex: Exercise, tests: dict[str, Outcome], cells: dict[str, Outcome]) -> Row:
    mine = [o for o in tests.values() if ex.id in o.exercises]
    mine += [o for o in tests.values() if o.outcome == "failed" and not o.exercises and  # collection errors
             any(node.split("::")[0] == o.nodeid for node in ex.tests)]
    mine += [o for o in cells.values() if o.outcome == "failed" and ex.id in _MENTION.findall(o.text)]
    failed = [o for o in mine if o.outcome in ("failed", "not run")]
    if not mine:
        return Row(ex.id, "failed", f'no test ran: mark its tests @pytest.mark.exercise("{ex.id}")')
    if failed:
        own = [o for o in failed if unimplemented(o.text) == ex.id]
        if own:
            return Row(ex.id, "not implemented", own[0].first_line, mine)
        loaded = [o for o in failed if _OVERLOADED.search(o.text)]
        if loaded and len(loaded) == len(failed):
            return Row(ex.id, "not graded", f"the machine was too busy to finish a multi-rank check "
                       f"({loaded[0].first_line}); grade again when it is quieter", mine)
        return Row(ex.id, "failed", failed[0].first_line, mine)
    passed = sum(o.outcome == "passed" for o in mine)
    if not passed:  # never a pass by skipping: a check that did not run says nothing about the code
        return Row(ex.id, "not graded", f"every test was skipped ({_n(len(mine), 'test')}): {mine[0].first_line or ''}"
                   .rstrip(": "), mine)
    return Row(ex.id, "passed", f"{_n(passed, 'test')} passed", mine)


def grade_in_workspace(root: Path, ws, selected: list[Exercise], reference: dict[str, Exercise],
                       timeout: float, focused: bool = False) -> list[Row]:
    """Exercises (of the reference's registry) in the workspace at root, each judged on its own: every
    exercise not being graded runs the reference. The implemented ones run together first; those that
    fail there are re-run alone, so a failure is only ever blamed on the exercise that causes it.
    focused: one exercise's verdict (run_checks)."""
    rows: dict[str, Row] = {}
    for ex in selected:
        message = blank_message(root, ex)
        if message:
            rows[ex.id] = Row(ex.id, "not implemented", f"NotImplementedError: {message}")
    todo = [ex for ex in selected if ex.id not in rows]
    if len(todo) > 1:
        together = _run_in_overlay(root, ws, todo, reference, timeout)
        if isinstance(together, dict):
            for ex in todo:
                row = exercise_row(ex, together, {})
                if row.status == "passed":
                    rows[ex.id] = row
    for ex in todo:
        if ex.id not in rows:
            alone = _run_in_overlay(root, ws, [ex], reference, timeout, focused)
            rows[ex.id] = alone if isinstance(alone, Row) else exercise_row(ex, alone, {})
    return [rows[ex.id] for ex in selected]


def _run_in_overlay(root: Path, ws, yours: list[Exercise], reference: dict[str, Exercise],
                    timeout: float, focused: bool = False) -> dict[str, Outcome] | Row:
    """The tests of `yours` with only them taken from the workspace; a Row when the code cannot even be read."""
    try:
        tree = overlay(root, ws.reference, yours, list(reference.values()))
    except ExerciseError as exc:  # a syntax error in your module, or a function of an exercise is gone
        return Row(yours[0].id, "failed", exc.problems[0])
    try:
        return run_checks(tree, yours, timeout=timeout, first_failure=len(yours) == 1, focused=focused)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def notebook_rows(notebooks: list[str], cells: dict[str, Outcome], blank: dict[str, list[Exercise]] | None = None
                  ) -> list[Row]:
    """One row per notebook. `blank`: per notebook, the exercises its code reaches that are still blank (see
    `blank_dependencies`): a failed notebook that needs one says so first, whatever error it died of."""
    rows = []
    for nb in notebooks:
        mine = [o for o in cells.values() if o.nodeid.split("::")[0] == nb]
        failed = [o for o in mine if o.outcome in ("failed", "not run")]
        if not mine:
            rows.append(Row(nb, "passed", "no code cells"))
        elif failed:
            first = failed[0]
            needs = (blank or {}).get(nb, [])
            status = "not implemented" if unimplemented(first.text) or needs else "failed"
            cell = first.nodeid.split("::")[-1]
            line = first.first_line
            detail = line if line.startswith(cell) else f"{cell}: {line}"
            if needs and not unimplemented(first.text):
                detail = "needs " + ", ".join(f"{ex.id} ({ex.notebook or ex.path})" for ex in needs) + \
                         f" first (not implemented yet) — {detail}"
            more = f" (+{_n(len(failed) - 1, 'more failing cell')})" if len(failed) > 1 else ""
            rows.append(Row(nb, status, detail + more, mine))
        else:
            rows.append(Row(nb, "passed", f"{_n(len(mine), 'cell')} match", mine))
    return rows


def _module_file(root: Path, module: str) -> Path | None:
    base = root / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _parse(text: str) -> ast.Module | None:
    """A notebook cell or module, magics and shell lines blanked (their line numbers kept); None if it does not parse."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in text.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _reach(root: Path, module: str, name: str | None, reached: dict[str, set | None], package: str = "") -> None:
    """Record that code imports `name` from megalab module `module` (None: the whole module), following a
    package's re-exports to the module that defines the name."""
    if module.startswith("."):  # relative, inside `package`
        depth = len(module) - len(module.lstrip("."))
        base = package.split(".")[: len(package.split(".")) - depth + 1]
        module = ".".join(base + ([module.lstrip(".")] if module.lstrip(".") else []))
    if not module.startswith("megalab"):
        return
    if name is not None and _module_file(root, f"{module}.{name}") is not None:
        module, name = f"{module}.{name}", None  # `from megalab.x import submodule`
    path = _module_file(root, module)
    if path is None:
        return
    rel = path.relative_to(root).as_posix()
    if name is None:
        reached[rel] = None
        return
    if reached.get(rel, set()) is None or name in reached.setdefault(rel, set()):
        return
    reached[rel].add(name)
    if path.name == "__init__.py" and (tree := _parse(path.read_text(encoding="utf-8"))) is not None:
        for node in tree.body:  # a package's face: where its names come from
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                src = "." * node.level + (node.module or "")
                original = next(a.name for a in node.names if (a.asname or a.name) == name)
                _reach(root, src, original, reached, module)


def blank_dependencies(root: Path, notebook: str, exercises: list[Exercise]) -> list[Exercise]:
    """The exercises still blank in the tree at `root` that `notebook`'s code imports: an exercise counts when the
    notebook imports the function or class that holds it (through a package's re-exports too), or its whole
    module. What the notebook cannot run without, by name, never a neighbour it does not use."""
    import nbformat

    from megalab.lab.workspace import enclosing_function

    nb = nbformat.read(root / notebook, as_version=4)
    reached: dict[str, set | None] = {}
    for cell in nb.cells:
        tree = _parse(cell.source) if cell.cell_type == "code" else None
        for node in ast.walk(tree) if tree is not None else []:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    _reach(root, node.module, alias.name, reached)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    _reach(root, alias.name, None, reached)
    found = []
    for ex in exercises:
        if ex.path not in reached or blank_message(root, ex) is None:
            continue
        names = reached[ex.path]
        if names is None:
            found.append(ex)
            continue
        text = (root / ex.path).read_text(encoding="utf-8")
        tree = _parse(text)
        marker = next((i + 1 for i, line in enumerate(text.splitlines()) if line.strip().startswith(f"# EXERCISE {ex.id}:")), None)
        holder = enclosing_function(tree, marker) if tree is not None and marker else None
        if holder is None or holder.split(".")[0] in names:
            found.append(ex)
    return found


# --------------------------------------------------------------------------- the command


def chapter_folder(root: Path, chapter: str | None) -> str | None:
    """`01` or `01_foundations` -> `01_foundations` (a folder of course/)."""
    if chapter is None:
        return None
    folders = sorted(p.name for p in (root / COURSE_DIR).iterdir() if p.is_dir()) if (root / COURSE_DIR).is_dir() else []
    for name in folders:
        if name == chapter or name.split("_")[0] == chapter:
            return name
    raise ValueError(f"no chapter {chapter!r} under {COURSE_DIR}/; choose one of: {', '.join(folders) or '(none)'}"
                     " (or an exercise id such as dist.shard_bounds: `megalab exercises` lists them)")


def choose(registry, target: str | None, root: Path) -> tuple[str | None, list[Exercise], list[str] | None]:
    """`target` -> (label, the exercises, the notebooks or None for the chapter's): an exercise id,
    a notebook of the tree at `root` (with the exercises it teaches), a chapter, or everything."""
    if target and target.endswith(".ipynb"):
        path = Path(target).resolve()
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else target
        if not (root / rel).is_file():
            raise ValueError(f"no notebook {target} in {root}")
        return rel, [ex for ex in registry.select(None) if ex.notebook == rel], [rel]
    if target and "." in target:
        if target not in registry.exercises:
            from megalab.lab.i18n import lang_of, say

            close, lang = difflib.get_close_matches(target, list(registry.exercises), n=3), lang_of(root)
            hint = say("; did you mean {near}?", lang, near=" or ".join(close)) if close else say(
                "; `megalab exercises` lists them", lang)
            raise ValueError(say("no exercise {id!r}", lang, id=target) + hint)
        return target, [registry.exercises[target]], []
    folder = chapter_folder(root, target)
    return folder, registry.select(folder), None


# A one-exercise verdict in the learner's language (statuses stay English in tables and JSON: tools read them).
VERDICT_WORDS = {
    "en": {"where": "your code: {where}; taught in {notebook}", "hints used": "; hints used: {n}",
           "stuck": "; stuck? `megalab hint {id}`"},
    "zh": {"passed": "通过 (passed)", "failed": "未通过 (failed)", "not implemented": "未实现 (not implemented)",
           "not graded": "未评分 (not graded)", "where": "你的代码：{where}；讲解见 {notebook}",
           "hints used": "；已用提示：{n}", "stuck": "；卡住了？试试 `megalab hint {id}`"},
}


@dataclass
class Report:
    root: str
    chapter: str | None
    seconds: float
    exercises: list[Row]
    notebooks: list[Row]
    problems: list[str]
    lang: str = "en"  # the workspace's: a one-exercise verdict is said in it

    @property
    def ok(self) -> bool:
        return all(r.status == "passed" for r in self.exercises + self.notebooks)

    def verdict(self) -> str:
        """One exercise, said in full: status, the whole reason, where to work on it."""
        [r] = self.exercises
        say = VERDICT_WORDS.get(self.lang, VERDICT_WORDS["en"])
        lines = [f"{r.name}: {say.get(r.status, r.status)}"]
        if r.status != "passed":
            from megalab.lab.i18n import diagnosis

            lines += [f"  {line}" for line in diagnosis(r.detail, self.lang).splitlines()]
        else:
            from megalab.lab.i18n import diagnosis

            lines += [f"  {diagnosis(r.detail, self.lang)}"]
        hints = say["hints used"].format(n=r.hints) if r.hints else (
            "" if r.status == "passed" else say["stuck"].format(id=r.name))
        lines.append("  " + say["where"].format(where=r.where, notebook=r.notebook) + f"{hints}  ({self.seconds:.1f} s)")
        return "\n".join(lines)

    def table(self, width: int | None = None) -> str:
        """Per exercise and notebook: status and the first line of the failure, in the workspace's language, cut to
        the terminal's width (CJK characters count two columns)."""
        if len(self.exercises) == 1 and not self.notebooks and self.exercises[0].where:
            return self.verdict()
        from megalab.lab.i18n import clip, cols, diagnosis, pad, say, terminal_width

        width, lang = width or terminal_width(), self.lang
        say_status = VERDICT_WORDS.get(lang, VERDICT_WORDS["en"])
        rows = [(r.name, say_status.get(r.status, r.status), diagnosis(r.detail, lang)) for r in self.exercises]
        nb_rows = [(r.name, say_status.get(r.status, r.status), diagnosis(r.detail, lang)) for r in self.notebooks]
        w0 = max([cols(say("exercise", lang)), cols(say("notebook", lang))] + [cols(r[0]) for r in rows + nb_rows])
        w1 = max([cols(say_status.get(s, s)) for s in ("passed", "failed", "not implemented", "not graded")])
        out = [clip(f"{pad(say('exercise', lang), w0)}  {pad(say('status', lang), w1)}  "
                    f"{say('first line of the failure', lang)}", width)]

        def fmt(name, status, detail):
            return clip(f"{pad(name, w0)}  {pad(status, w1)}  {detail}", width)

        out += [fmt(*r) for r in rows] or [say("(no exercises)", lang)]
        if nb_rows:
            out += ["", f"{pad(say('notebook', lang), w0)}  {say('status', lang)}"]
            out += [fmt(*r) for r in nb_rows]

        def count(rs):
            return say(", ", lang).join(f"{sum(r.status == s for r in rs)} {say_status.get(s, s)}"
                                        for s in ("passed", "failed", "not implemented", "not graded")
                                        if any(r.status == s for r in rs)) or say("none", lang)

        if lang == "en":
            total = f"{_n(len(rows), 'exercise')}: {count(self.exercises)}; {_n(len(nb_rows), 'notebook')}: "
        else:
            total = say("{n} exercise(s): ", lang, n=len(rows)) + count(self.exercises) + say(
                "; {n} notebook(s): ", lang, n=len(nb_rows))
        out += ["", f"{total}{count(self.notebooks)}  ({self.seconds:.1f} s)"]
        return "\n".join(out)

    def to_json(self) -> dict:
        def row(r: Row) -> dict:
            out = {"name": r.name, "status": r.status, "detail": r.detail}
            if r.where:  # an exercise
                out.update(where=r.where, notebook=r.notebook, hints=r.hints)
            out["items"] = [{**asdict(o), "text": o.text[-4000:]} for o in r.outcomes]  # the tail of each report
            return out

        return {"workspace": self.root, "chapter": self.chapter, "seconds": round(self.seconds, 1), "ok": self.ok,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "problems": self.problems,
                "exercises": [row(r) for r in self.exercises], "notebooks": [row(r) for r in self.notebooks]}


def grade(root: str | Path = ".", target: str | None = None, timeout: float = DEFAULT_TIMEOUT,
          notebooks: bool = True) -> Report:
    """Grade the tree at `root`: one exercise (`target` an id: no notebooks), one notebook (and the exercises it
    teaches), a chapter, or everything."""
    from megalab.lab.progress import ProgressError, foreign_owner, load_state, record_grades  # (not at import: this
    # module is also pytest's plugin)

    start = time.perf_counter()
    root = Path(root).resolve()
    ws = open_workspace(root)
    owner = foreign_owner(root) if ws else None
    if owner:  # another user's workspace (an instructor grading it): grade a copy, write nothing into theirs
        from megalab.lab.sandbox import private_copy

        with private_copy(root) as copy:
            report = grade(copy, target, timeout, notebooks)
        report.root = str(root)
        report.problems.append(f"graded a private copy of {root}: it belongs to {owner}, and grading another user's "
                               "workspace never writes into it (its progress is not updated; `megalab class` views a "
                               "whole class)")
        return report
    registry = load(root)  # in a workspace the exercises are the reference's: deleting a marker hides none
    reference = load(ws.reference) if ws else registry
    label, selected, nb_paths = choose(reference, target, root)
    if nb_paths is None:  # a chapter or everything: its notebooks
        course = root / COURSE_DIR / label if label else root / COURSE_DIR
        from megalab.lab.notebooks import find_notebooks  # here: nbformat's import costs ~1.5 s of CPU, which
        # grading one exercise (no notebook) does not need

        nb_paths = [p.relative_to(root).as_posix() for p in find_notebooks([str(course)]) if not p.name.startswith(".")]
    if not notebooks:
        nb_paths = []
    focused = bool(target) and target in reference.exercises  # one exercise: its verdict_tests
    if ws is None:  # the reference: one pytest run for everything
        outcomes = run_checks(root, selected, nb_paths, timeout, focused=focused)
        cells = {node: o for node, o in outcomes.items() if node.split("::")[0].endswith(".ipynb")}
        rows = [exercise_row(ex, {n: o for n, o in outcomes.items() if n not in cells}, cells) for ex in selected]
    else:
        rows = grade_in_workspace(root, ws, selected, reference.exercises, timeout, focused)
        cells = grade_notebooks(root, ws, nb_paths, timeout)
    try:
        used = load_state(root)["hints"]
    except ProgressError:  # said below, by record_grades; the grade itself stands
        used = {}
    for row, ex in zip(rows, selected):
        mine = registry.exercises.get(ex.id)
        row.where = mine.where if mine else f"{ex.path} (its `# EXERCISE {ex.id}:` line is gone: put it back)"
        row.notebook = ex.notebook
        row.hints = int(used.get(ex.id, 0))
    unrecorded = record_grades(root, rows)  # `megalab progress` reads them; None, or why they were not recorded
    blank = {nb: blank_dependencies(root, nb, list(reference.exercises.values())) for nb in nb_paths} if ws else None
    return Report(str(root), label, time.perf_counter() - start, rows, notebook_rows(nb_paths, cells, blank),
                  registry.problems() + ([unrecorded] if unrecorded else []), ws.config.get("lang", "en") if ws else "en")


def grade_notebooks(root: Path, ws, notebooks: list[str], timeout: float) -> dict[str, Outcome]:
    """The notebooks, as the reference wrote them, run against your megalab and compared with the
    expected outputs (not with what your copy saved). Node ids name your notebooks."""
    if not notebooks:
        return {}
    copies = {graded_copy(ws, root, rel).relative_to(root).as_posix(): rel for rel in notebooks}
    try:
        outcomes = run_checks(root, [], list(copies), timeout)
    finally:
        for copy in copies:
            (root / copy).unlink(missing_ok=True)
    renamed = {}
    for node, o in outcomes.items():
        path, _, cell = node.partition("::")
        o.nodeid = f"{copies.get(path, path)}::{cell}" if cell else copies.get(path, path)
        renamed[o.nodeid] = o
    return renamed


# --------------------------------------------------------------------------- the pytest plugin


_recorded: dict[str, dict] = {}


STATUS_MARK = {"passed": "ok", "failed": "FAIL", "not implemented": "-", "missing": "n/a"}


def class_report(paths: list[str | Path]) -> tuple[str, list[list[str]]]:
    """Merge a class's `megalab grade --json` files (one per student, named after the student)
    into a table: one row per student, one column per exercise, and each student's totals.

    Returns (text table, CSV rows). A file that is not a grade report raises ValueError naming it.
    """
    students = {}
    for path in map(Path, paths):
        try:
            data = json.loads(path.read_text())
            students[path.stem] = {row["name"]: row["status"] for row in data["exercises"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a `megalab grade --json` report ({exc.__class__.__name__}: {exc})") from None
    if not students:
        raise ValueError("no grade reports given: pass the JSON files written by `megalab grade --json FILE`")
    exercises = sorted({name for statuses in students.values() for name in statuses})
    header = ["student", *exercises, "passed", "of"]
    rows = [[name, *(statuses.get(ex, "missing") for ex in exercises),
             str(sum(s == "passed" for s in statuses.values())), str(len(exercises))]
            for name, statuses in sorted(students.items())]
    width = max(len(r[0]) for r in [header, *rows])
    lines = [f"{'student':<{width}}  passed  " + " ".join(f"{i + 1:>4}" for i in range(len(exercises)))]
    for r in rows:
        marks = " ".join(f"{STATUS_MARK.get(s, '?'):>4}" for s in r[1:-2])
        lines.append(f"{r[0]:<{width}}  {r[-2]:>3}/{r[-1]:<3} {marks}")
    lines += ["", "columns: " + ", ".join(f"{i + 1} {ex}" for i, ex in enumerate(exercises)),
              "ok = passed, FAIL = failed, - = not implemented, n/a = not in that report (another chapter)"]
    return "\n".join(lines), [header, *rows]


def pytest_collection_modifyitems(config, items):
    if _OUT not in os.environ:
        return
    wanted = set(os.environ.get(_IDS, "").split(","))
    keep, drop = [], []
    for item in items:
        marked = list(dict.fromkeys(m.args[0] for m in item.iter_markers("exercise") if m.args))
        if wanted.intersection(marked) or item.path.suffix == ".ipynb":
            keep.append(item)
            _recorded[item.nodeid] = {"outcome": "not run", "exercises": marked, "text": ""}
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _save()


def _record(nodeid: str, report) -> None:
    entry = _recorded.setdefault(nodeid, {"outcome": "not run", "exercises": [], "text": ""})
    if report.failed and entry["outcome"] != "failed":
        entry.update(outcome="failed", text=_ANSI.sub("", report.longreprtext))
    elif report.skipped and entry["outcome"] != "failed":
        entry.update(outcome="skipped", text=_ANSI.sub("", report.longreprtext))
    elif report.passed and report.when == "call" and entry["outcome"] == "not run":
        entry["outcome"] = "passed"


def _save() -> None:
    tmp = Path(os.environ[_OUT] + ".tmp")
    tmp.write_text(json.dumps(_recorded))
    tmp.replace(os.environ[_OUT])


@pluggy.HookimplMarker("pytest")(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """While grading: an endless loop in a test (or in a rank it launches) fails it after CPU_LIMIT seconds of
    CPU, naming the line; machine load cannot trigger it (megalab/lab/cpu_guard.py)."""
    if _OUT not in os.environ:
        yield
        return
    from megalab.lab.cpu_guard import CPU_LIMIT, ENV, cpu_limit

    saved = os.environ.get(ENV)
    os.environ[ENV] = saved or str(CPU_LIMIT)  # inherited by the ranks the test launches (megalab/lab/worker.py)
    try:
        with cpu_limit(float(os.environ[ENV])):
            yield
    finally:  # only for this test: a notebook's kernel started later (and its ranks) must not inherit the limit
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def pytest_runtest_logreport(report):
    if _OUT in os.environ:
        _record(report.nodeid, report)
        _save()


def pytest_collectreport(report):
    if _OUT in os.environ and report.failed:  # a test file or notebook that cannot be collected
        _record(report.nodeid, report)
        _save()
