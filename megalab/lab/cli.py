"""The `megalab` command: doctor, notebooks, timings; the learner's tools (workspace, grade, restore, update) and the
instructor's (exercises, student, report, class)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megalab.lab.translate import LANGS


def course_lang(value: str) -> str:
    """--lang: a language the course is written in; any other is refused with the list."""
    if value == "en" or value in LANGS:
        return value
    known = ", ".join(f"{code} ({name})" for code, name in {"en": "English", **LANGS}.items())
    raise argparse.ArgumentTypeError(f"no course language {value!r}; the course has: {known} "
                                     f"(e.g. `make workspace LANG=zh` or `megalab workspace DIR --lang zh`)")


def _doctor(args: argparse.Namespace) -> int:
    if args.slurm:
        from megalab.lab.doctor import slurm_report

        text, ok = slurm_report()
        print(text)
        return 0 if ok else 1
    from megalab.lab.doctor import report

    print(report())
    return 0


def _notebooks(args: argparse.Namespace) -> int:
    from megalab.lab.notebooks import execute_all

    return execute_all(args.paths, timeout=args.timeout)


def _timings(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import find_root
    from megalab.lab.notebooks import course_timings, timings_table

    print(timings_table(course_timings(find_root() / "course")))
    return 0


def _exercises(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import ExerciseError, find_root, load

    try:
        registry = load(find_root())
    except ExerciseError as exc:
        print(f"megalab exercises: {exc}", file=sys.stderr)
        return 2
    rows = [(ex.id, ex.where, ex.notebook or "(no notebook)", f"{len(ex.tests)} test(s)") for ex in registry.select(None)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)] if rows else []
    for row in rows:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)), row[3])
    problems = registry.problems()
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print(f"{len(registry.exercises)} exercise(s), {len(problems)} problem(s)")
    return 1 if problems else 0


def _student(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import ExerciseError, find_root, write_student
    from megalab.lab.translate import TranslationError, edition

    try:
        root = find_root()
        ws = write_student(root, args.dir, force=args.force, edition=None if args.lang == "en" else edition(root, args.lang))
    except (ExerciseError, TranslationError) as exc:
        print(f"megalab student: {exc}", file=sys.stderr)
        return 1
    for ex in ws.blanked:
        print(f"  blanked {ex.id:<28} {ex.where:<28} -> see {ex.notebook or '(no notebook yet)'}")
    for warning in ws.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote the student workspace {ws.dest}: {ws.files} files copied, {len(ws.blanked)} exercise(s) blanked "
          f"in {len(ws.changed)} file(s)")
    return 0


def _grade(args: argparse.Namespace) -> int:
    import json

    from megalab.lab.exercises import find_root
    from megalab.lab.grading import grade

    try:
        report = grade(find_root(), args.target, timeout=args.timeout, notebooks=not args.no_notebooks)
    except (ValueError, RuntimeError) as exc:  # ExerciseError is a ValueError
        print(f"megalab grade: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    for problem in report.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # e.g. grades/$USER.json for a class
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1, ensure_ascii=False)
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _translate(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import find_root
    from megalab.lab.translate import GENERATED, TranslationError, build, glossary, glossary_problems, status, stub

    root = find_root()
    try:
        if args.action == "stub":
            for notebook in args.notebooks:
                print(f"{notebook}: {stub(root, notebook, args.lang)} section(s) to translate")
            return 0
        if args.action == "build":
            out = Path(args.out) if args.out else root / GENERATED.format(lang=args.lang)
            written = build(root, args.lang, out, allow_missing=args.allow_missing)
            print(f"wrote {len(written)} notebook(s) under {out}")
            return 0
        rows = status(root, args.lang, args.notebooks or None)
        problems, terms = glossary_problems(root, args.lang, args.notebooks or None), glossary(root, args.lang)
    except TranslationError as exc:
        print(f"megalab translate: {exc}", file=sys.stderr)
        return 2
    for r in rows:
        flag = "ok" if r.ok else f"{len(r.missing)} missing, {len(r.stale)} stale" + (
            f", {len(r.orphans)} orphaned" if r.orphans else "")
        print(f"{r.notebook:66} {r.done:>3} / {r.cells:<3} {r.exercises_done:>2} / {r.exercises:<2} {flag}")
        for key in r.missing + r.stale + r.orphans:
            if args.notebooks:  # asked about these notebooks: name each section to (re)translate
                state = "missing" if key in r.missing else "stale" if key in r.stale else "orphaned (cell gone)"
                print(f"    {key}: {state}")
    for line in problems:
        print(f"glossary: {line}")
    from megalab.lab.i18n import MESSAGES, untranslated

    unsaid = [(kind, en, where) for kind, said in untranslated(root, args.lang).items() for en, where in said.items()]
    for kind, en, where in unsaid:
        print(f"message ({kind}, {where}): no translation in {MESSAGES.format(lang=args.lang)}: {en!r}")
    print(f"\n{sum(r.done for r in rows)} of {sum(r.cells for r in rows)} markdown cells and "
          f"{sum(r.exercises_done for r in rows)} of {sum(r.exercises for r in rows)} exercises (task and hints) "
          f"translated and current ({args.lang}); glossary: {len(terms)} terms, {len(problems)} miss(es); "
          f"tools' messages: {len(unsaid)} untranslated")
    return 0 if all(r.ok for r in rows) and not problems and not unsaid else 1


def _hint(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import find_root
    from megalab.lab.i18n import lang_of
    from megalab.lab.progress import HintError, format_hint, hint

    try:
        root = find_root()
        level, levels, text = hint(root, args.id, args.level)
    except (HintError, ValueError) as exc:
        print(f"megalab hint: {exc}", file=sys.stderr)
        return 2
    print(format_hint(args.id, level, levels, text, lang_of(root)))
    return 0


def _progress(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from megalab.lab.exercises import find_root
    from megalab.lab.i18n import lang_of
    from megalab.lab.progress import summary, table

    try:
        root = find_root()
        rows = summary(root)
    except ValueError as exc:  # a ProgressError too: an unreadable or damaged progress file, left as it is
        print(f"megalab progress: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else table(rows, lang_of(root)))
    return 0


def _workspace(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import ExerciseError, find_root
    from megalab.lab.i18n import say
    from megalab.lab.workspace import FIRST_NOTEBOOK, WorkspaceError, create

    start = time.perf_counter()
    try:
        ws = create(find_root(), args.dir, force=args.force, lang=None if args.lang == "en" else args.lang)
    except (ExerciseError, WorkspaceError) as exc:
        print(f"megalab workspace: {exc}", file=sys.stderr)
        return 1
    for warning in ws.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    lang = args.lang
    print(say("Your workspace is ready in {dest} ({seconds:.1f} s): {n} exercises to implement, in megalab/.", lang,
              dest=ws.dest, seconds=time.perf_counter() - start, n=len(ws.blanked)))
    print()
    print(say("Next:", lang))
    steps = [(f"cd {ws.dest}", ""),
             ("make lab", say("JupyterLab here, on {notebook}", lang, notebook=FIRST_NOTEBOOK)),
             ("make grade ID=dist.shard_bounds", say("check one exercise, from any shell (or %grade ID in a notebook)",
                                                     lang)),
             (f"export PATH={Path(sys.prefix) / 'bin'}:$PATH",
              say("then `megalab grade ID`, `megalab hint ID` ... in this shell too (JupyterLab's terminal: already)",
                  lang))]
    for cmd, note in steps:  # each note on its own line: nothing wraps at 80 columns
        print(f"  # {note}\n  {cmd}" if note else f"  {cmd}")
    return 0


def _restore(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import find_root
    from megalab.lab.i18n import say
    from megalab.lab.workspace import WorkspaceError, open_workspace, restore

    ws = open_workspace(find_root())
    if ws is None:
        print("megalab restore: this is not a workspace (no .megalab/workspace.json); in the reference repository "
              "use `git checkout -- NOTEBOOK`", file=sys.stderr)
        return 2
    lang = ws.config.get("lang", "en")
    try:
        for notebook in args.notebooks:
            backup = restore(ws, notebook)
            saved = say(" (your copy is in {backup})", lang, backup=backup.relative_to(ws.root)) if backup else ""
            print(say("restored {notebook} with its expected outputs{saved}", lang, notebook=notebook, saved=saved))
    except WorkspaceError as exc:
        print(f"megalab restore: {exc}", file=sys.stderr)
        return 2
    return 0


def _update(args: argparse.Namespace) -> int:
    from megalab.lab.exercises import ExerciseError, find_root
    from megalab.lab.i18n import say
    from megalab.lab.workspace import WorkspaceError, open_workspace, update

    ws = open_workspace(find_root())
    if ws is None:
        print("megalab update: run it inside a workspace (made by `megalab workspace DIR`)", file=sys.stderr)
        return 2
    try:
        result = update(ws)
    except (ExerciseError, WorkspaceError) as exc:
        print(f"megalab update: {exc}", file=sys.stderr)
        return 2
    lang = ws.config.get("lang", "en")
    for rel in result.merged:
        if rel in result.conflicts:
            lines = ", ".join(map(str, result.conflicts[rel]))
            print(say("  CONFLICT {rel} (line {lines}): you and the course changed the same lines; both versions are "
                      "between <<<<<<< and >>>>>>> markers (yours first): keep what is right, delete the markers",
                      lang, rel=rel, lines=lines))
        else:
            print(say("  merged   {rel}: the course's changes, with your edits and solutions kept", lang, rel=rel))
    for rel in result.replaced:
        print(say("  updated  {rel}", lang, rel=rel))
    for rel in result.kept:
        print(say("  kept     {rel} (your edit; the course did not change it)", lang, rel=rel))
    for rel in result.removed:
        print(say("  removed  {rel} (the course no longer has it)", lang, rel=rel))
    if result.backups:
        print(say("your previous copies of changed files are in {folder}", lang,
                  folder=result.backups.relative_to(ws.root)))
    conflicts = say(", {n} with conflicts to resolve", lang, n=len(result.conflicts)) if result.conflicts else ""
    print(say("workspace up to date with {source}: {n} file(s) changed{conflicts}", lang, source=ws.source,
              n=len(result.replaced) + len(result.merged), conflicts=conflicts))
    return 1 if result.conflicts else 0


def _report(args: argparse.Namespace) -> int:
    import csv

    from megalab.lab.grading import class_report

    try:
        table, rows = class_report(args.files)
    except ValueError as exc:
        print(f"megalab report: {exc}", file=sys.stderr)
        return 2
    print(table)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows(rows)
        print(f"wrote {args.csv}")
    return 0


def _class(args: argparse.Namespace) -> int:
    from megalab.lab.classview import ClassError, collect
    from megalab.lab.exercises import ExerciseError, find_root

    try:
        reference = Path(args.reference) if args.reference else find_root()
        view = collect(args.folder, reference, args.target, jobs=args.jobs, timeout=args.timeout,
                       cpu_limit=args.cpu_limit)
    except (ClassError, ExerciseError) as exc:
        print(f"megalab class: {exc}", file=sys.stderr)
        return 2
    print(view.table())
    for path, text in ((args.csv, view.csv), (args.html, view.html)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text(), encoding="utf-8")
            print(f"wrote {path}")
    return 0 if view.learners else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megalab", description="megalab: build Megatron-LM's ideas yourself")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="what this machine can run: versions, GPUs, FP8, flash-attn, Triton")
    p.add_argument("--slurm", action="store_true",
                   help="pre-flight for %%%%torchrun --slurm in this allocation: srun, export setting, node names, "
                        "shared run folder, GPUs per node")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("notebooks", help="re-execute notebooks in place, top to bottom, in a clean kernel")
    p.add_argument("paths", nargs="*", default=["course"], help="notebooks or folders (default: course)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cell")
    p.set_defaults(func=_notebooks)

    p = sub.add_parser("timings", help="per chapter: study time (the notebooks' headers) and recorded run time")
    p.set_defaults(func=_timings)

    p = sub.add_parser("exercises", help="list the exercises (id, where, notebook, tests) and check their markers")
    p.set_defaults(func=_exercises)

    p = sub.add_parser("student", help="instructors: a plain blank copy of this repository (learners: `workspace`)")
    p.add_argument("dir", help="an empty folder to create the workspace in")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder (overwrites its files)")
    p.add_argument("--lang", type=course_lang, default="en",
                   help="the course's language: zh = 简体中文 (notebooks, exercise tasks and hints; code stays English)")
    p.set_defaults(func=_student)

    p = sub.add_parser("workspace", help="learners start here: write your workspace (every exercise blank) in DIR")
    p.add_argument("dir", help="an empty folder for the workspace, e.g. ~/megalab-work")
    p.add_argument("--force", action="store_true", help="write into a non-empty folder (overwrites its files)")
    p.add_argument("--lang", type=course_lang, default="en",
                   help="the course's language: zh = 简体中文 (notebooks, exercise tasks and hints; code stays English)")
    p.set_defaults(func=_workspace)

    p = sub.add_parser("restore", help="put a notebook's expected outputs back (your copy is kept in .megalab/backup)")
    p.add_argument("notebooks", nargs="+", help="the notebook(s), e.g. course/01_foundations/01_setup_and_torchrun.ipynb")
    p.set_defaults(func=_restore)

    p = sub.add_parser("update", help="bring this workspace up to the course's current version, keeping your work")
    p.set_defaults(func=_update)

    p = sub.add_parser("grade", help="grade one exercise (in isolation, seconds), a chapter, or everything")
    p.add_argument("target", nargs="?", help="an exercise id (dist.shard_bounds), a chapter (01 or 01_foundations); "
                   "default: everything")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON (for instructors)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test and per notebook cell (default 300)")
    p.add_argument("--no-notebooks", action="store_true", help="run the exercise tests only")
    p.set_defaults(func=_grade)

    p = sub.add_parser("translate", help="translations: status (missing/stale cells), build the notebooks, stub new cells")
    p.add_argument("action", choices=["status", "build", "stub"])
    p.add_argument("notebooks", nargs="*", help="English notebooks (default: all)")
    p.add_argument("--lang", type=course_lang, default="zh")
    p.add_argument("--out", help="build: the folder to write the translated course into (default build/LANG)")
    p.add_argument("--allow-missing", action="store_true", help="build: keep the English where no translation is current")
    p.set_defaults(func=_translate)

    p = sub.add_parser("hint", help="a hint for an exercise: the idea first, then the approach (never the code)")
    p.add_argument("id", help="the exercise id, e.g. tp.column_forward")
    p.add_argument("--level", type=int, help="this hint level (default: the next one you have not seen)")
    p.set_defaults(func=_hint)

    p = sub.add_parser("progress", help="per chapter: exercises done, hints used, last attempt (from your grades)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_progress)

    p = sub.add_parser("report", help="merge a class's `grade --json` files: one row per student (file name)")
    p.add_argument("files", nargs="+", help="the students' JSON files, e.g. grades/*.json")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.set_defaults(func=_report)

    p = sub.add_parser("class", help="instructors: re-grade every workspace of a class folder from the learners' code "
                       "(in a sandbox each, nothing written into theirs); a table, CSV and HTML")
    p.add_argument("folder", help="the class folder: one workspace per learner, named after the learner")
    p.add_argument("target", nargs="?", help="an exercise id or a chapter (default: every exercise)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="learners graded at once (default 1)")
    p.add_argument("--reference", help="the course the workspaces were made from (default: the repository here)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test (default 300)")
    p.add_argument("--cpu-limit", type=float, help="CPU seconds per test before it is an endless loop (default 30)")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.add_argument("--html", metavar="FILE", help="also write a small HTML page")
    p.set_defaults(func=_class)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
