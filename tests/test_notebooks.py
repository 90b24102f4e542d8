"""Every committed notebook was executed top to bottom in a clean kernel, within the time budget.

`make notebooks` (megalab notebooks) runs each notebook in a fresh kernel and records its wall
time in `metadata.megalab.run_seconds`; these checks read the committed files and run nothing.
"""

from pathlib import Path

import nbformat
import pytest

from megalab.lab.notebooks import BUDGET_SECONDS, course_timings, find_notebooks, study_minutes, timings_table

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = [p.relative_to(ROOT).as_posix() for p in find_notebooks([str(ROOT / "course")])]
COURSE_BUDGET_SECONDS = 30 * 60  # DESIGN.md §4: the whole course in well under 30 minutes
RAISES_TAGS = {"raises-exception", "nbval-raises-exception"}


def _marked_to_raise(cell) -> bool:
    comments = {line.strip().lstrip("#").strip() for line in cell.source.splitlines() if line.strip().startswith("#")}
    return "NBVAL_RAISES_EXCEPTION" in comments or bool(RAISES_TAGS & set(cell.metadata.get("tags", [])))


def execution_problems(nb) -> list[str]:
    """What shows that a notebook was not run top to bottom in one clean kernel."""
    problems, expected = [], 1
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue  # empty cells are never executed
        where = f"cell {index} ({cell.source.strip().splitlines()[0][:40]!r})"
        if cell.execution_count is None:
            problems.append(f"{where} was not executed")
        else:
            if cell.execution_count != expected:
                problems.append(f"{where} has execution count {cell.execution_count}, expected {expected} "
                                "(cells run out of order, twice, or not in a fresh kernel)")
            expected = cell.execution_count + 1
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors and not _marked_to_raise(cell):
            problems.append(f"{where} has an error output ({errors[0].ename}) but is not marked "
                            "`# NBVAL_RAISES_EXCEPTION` / tagged raises-exception")
    return problems


def test_execution_problems_are_found():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("a = 1", execution_count=1), nbformat.v4.new_code_cell(""),
                nbformat.v4.new_code_cell("%%torchrun -n 2\n# NBVAL_RAISES_EXCEPTION\nboom()", execution_count=2),
                nbformat.v4.new_code_cell("b = 2", execution_count=4), nbformat.v4.new_code_cell("c = 3"),
                nbformat.v4.new_code_cell("d = 4", execution_count=5)]
    boom = nbformat.v4.new_output("error", ename="NameError", evalue="boom", traceback=[])
    nb.cells[2].outputs = [boom]
    nb.cells[5].outputs = [boom]
    assert execution_problems(nb) == [
        "cell 3 ('b = 2') has execution count 4, expected 3 (cells run out of order, twice, or not in a fresh kernel)",
        "cell 4 ('c = 3') was not executed",
        "cell 5 ('d = 4') has an error output (NameError) but is not marked `# NBVAL_RAISES_EXCEPTION` / tagged "
        "raises-exception",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_was_executed_top_to_bottom(path):
    problems = execution_problems(nbformat.read(ROOT / path, as_version=4))
    assert not problems, f"{path}: re-run it with `megalab notebooks {path}`:\n" + "\n".join(problems)


def test_notebook_run_times_within_budget(capsys):
    """Reports each notebook's recorded run time; fails when one is over budget or was never timed."""
    rows, bad, total = [], [], 0.0
    for path in NOTEBOOKS:
        seconds = nbformat.read(ROOT / path, as_version=4).metadata.get("megalab", {}).get("run_seconds")
        if seconds is None:
            bad.append(f"{path}: no recorded run time; execute it with `megalab notebooks {path}`")
            rows.append(f"{'—':>8}  {path}  (not timed)")
            continue
        total += seconds
        over = seconds > BUDGET_SECONDS
        rows.append(f"{seconds:7.1f}s  {path}" + ("  OVER BUDGET" if over else ""))
        if over:
            bad.append(f"{path}: {seconds:.1f} s is over the {BUDGET_SECONDS} s budget; make it smaller")
    rows.append(f"{total:7.1f}s  total for {len(NOTEBOOKS)} notebooks (budget {BUDGET_SECONDS} s each, "
                f"{COURSE_BUDGET_SECONDS // 60} min for the course)")
    with capsys.disabled():
        print("\nnotebook run times (recorded by `megalab notebooks`):\n" + "\n".join(rows))
    if total > COURSE_BUDGET_SECONDS:
        bad.append(f"the course takes {total:.0f} s, over {COURSE_BUDGET_SECONDS} s")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_declares_study_time(path):
    nb = nbformat.read(ROOT / path, as_version=4)
    assert study_minutes(nb), f"{path}: its header needs a line like `**Time.** About 30 minutes.`"


def test_study_time_is_parsed():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T\n**Goals.** x\n**Time.** About 45 minutes.")]
    assert study_minutes(nb) == 45
    nb.cells[0].source = "# T\nno time here"
    assert study_minutes(nb) is None


@pytest.mark.parametrize("readme, whole", [("README.md", "**whole course**"), ("README.zh.md", "**全部课程**")])
def test_readme_course_timings_are_current(readme, whole):
    """README's timings table (and the Chinese README's) lists every chapter with its study time, and a run
    time close to the recorded one."""
    listed = {}
    for line in (ROOT / readme).read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[3].endswith(" min") and cells[1].isdigit():
            listed[cells[0]] = cells
    expected = timings_table(course_timings(ROOT / "course")).splitlines()[2:]
    fix = f"update {readme} with the table `megalab timings` prints"
    for line in expected:
        chapter, count, study, run = (c.strip() for c in line.strip("|").split("|"))
        chapter = whole if chapter == "**whole course**" else chapter
        assert chapter in listed, f"{readme}'s timings table lacks {chapter}: {fix}"
        assert listed[chapter][1:3] == [count, study], f"{readme}'s timings for {chapter} are stale: {fix}"
        recorded, shown = float(run.split()[0]), float(listed[chapter][3].split()[0])
        assert abs(shown - recorded) <= max(0.5, 0.3 * recorded), f"{readme}'s run time for {chapter} is stale: {fix}"
