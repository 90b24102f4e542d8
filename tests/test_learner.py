"""A learner's day one, played for real: make a workspace, run a notebook's check in a real kernel
with an exercise blank, wrong, then right, saving the notebook each time as JupyterLab's autosave
would; `megalab grade ID` and the notebook check must give the right verdict each time and name
the right exercise. Then the same for a multi-rank exercise on a machine kept busy on purpose.
"""

import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from megalab.lab.workspace import create

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

WRONG = {  # a typical mistake for each exercise played here
    "dist.shard_bounds": ["base = length // world_size", "start = rank * base",
                          "stop = start + base if rank < world_size - 1 else length  # the last rank takes the rest",
                          "return start, stop"],
    "comm.broadcast": ["me = (rank - src) % world", "step = 1", "while step < world:",
                       "    if me < step and me + step < world:",
                       "        dist.send(tensor, group_dst=(src + me + step) % world, group=group)",
                       "    elif step <= me < 2 * step:",
                       "        received = torch.empty_like(tensor)  # ... and never copied into `tensor`",
                       "        dist.recv(received, group_src=(src + me - step) % world, group=group)",
                       "    step *= 2"],
}


NAMED = {"dist.shard_bounds": "remainder on the last rank",
         "comm.broadcast": "likely mistake: a rank never received the data"}  # what the grader says of each WRONG


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return create(REPO, tmp_path_factory.mktemp("learner") / "megalab-workspace").dest


_BLANK: dict[Path, str] = {}  # each module as the workspace was written (its regions blank)


def _solve(ws: Path, exercise_id: str, lines: list[str] | None) -> None:
    """Write `lines` (None: the reference solution) as the exercise's region, in the blank module."""
    from megalab.lab.exercises import load

    ref = load(ws / ".megalab" / "reference").exercises[exercise_id]
    begin, end = ref.solution
    ref_lines = (ws / ".megalab" / "reference" / ref.path).read_text().splitlines(keepends=True)
    body = ref_lines[begin + 1 : end] if lines is None else [ref.indent + line + "\n" for line in lines]
    path = ws / ref.path
    blank = _BLANK.setdefault(path, path.read_text()).splitlines(keepends=True)
    i = next(i for i, line in enumerate(blank) if line.strip().startswith(f'raise NotImplementedError("exercise {exercise_id}:'))
    path.write_text("".join(blank[:i] + body + blank[i + 1 :]))


def _check_cell(nb, exercise_id: str) -> int:
    """The first code cell after the markdown announcing the exercise that calls its function."""
    name = exercise_id.split(".")[-1]
    announced = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and f"Exercise `{exercise_id}`" in c.source)
    return next(i for i, c in enumerate(nb.cells) if i > announced and c.cell_type == "code" and name in c.source)


def _run_and_save(ws: Path, notebook: str, exercise_id: str) -> tuple[str, str]:
    """Run `%load_ext megalab` and the exercise's check cell in a fresh kernel started like JupyterLab's
    (the reference's Python, no PYTHONPATH), save the notebook with their new outputs (autosave), and
    return (the banner, the check cell's output as text)."""
    path = ws / notebook
    nb = nbformat.read(path, as_version=4)
    load_ext = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "%load_ext megalab" in c.source)
    check = _check_cell(nb, exercise_id)
    run = nbformat.v4.new_notebook(cells=[nb.cells[load_ext], nb.cells[check]], metadata=nb.metadata)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with _environ(env):
        NotebookClient(run, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.cells[load_ext], nb.cells[check] = run.cells
    nbformat.write(nb, path)  # what JupyterLab's autosave does with the learner's run

    def text(cell):
        return "".join(o.get("text", "") + "\n".join(o.get("traceback", [])) + o.get("evalue", "") for o in cell.outputs)

    return text(run.cells[0]), text(run.cells[1])


@contextmanager
def _environ(env):
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


def _grade(ws: Path, target: str) -> str:
    out = subprocess.run([sys.executable, "-m", "megalab.lab.cli", "grade", target], cwd=ws, capture_output=True, text=True)
    return out.stdout + out.stderr


def _implemented(banner: str) -> int:
    return int(re.search(r"· (\d+) of \d+ exercises implemented", banner)[1])


def _play(ws: Path, notebook: str, exercise_id: str) -> None:
    banner, check = _run_and_save(ws, notebook, exercise_id)
    assert f"your workspace {ws}/megalab · " in banner, banner  # the kernel runs the workspace, not the reference
    done = _implemented(banner)
    assert f"exercise {exercise_id}:" in check and "NotImplementedError" in check, check
    assert _grade(ws, exercise_id).startswith(f"{exercise_id}: not implemented\n")

    _solve(ws, exercise_id, WRONG[exercise_id])
    banner, check = _run_and_save(ws, notebook, exercise_id)
    assert _implemented(banner) == done + 1
    assert re.search(r"\bFalse\b", check) and "True" not in check, check
    verdict = _grade(ws, exercise_id)
    assert verdict.startswith(f"{exercise_id}: failed\n"), verdict
    assert "NotImplementedError" not in verdict  # about this exercise, not another one
    assert NAMED[exercise_id] in verdict, verdict  # the verdict names the mistake, not only the numbers

    _solve(ws, exercise_id, None)
    banner, check = _run_and_save(ws, notebook, exercise_id)
    assert re.search(r"\bTrue\b", check) and "False" not in check, check
    assert _grade(ws, exercise_id).startswith(f"{exercise_id}: passed\n")


def test_a_learner_blank_wrong_right_with_autosave(ws):
    notebook = "course/01_foundations/01_setup_and_torchrun.ipynb"
    _play(ws, notebook, "dist.shard_bounds")
    # the saved notebook holds the learner's runs now; grading still compares with the expected outputs
    saved = nbformat.read(ws / notebook, as_version=4)
    assert any("your workspace" in "".join(o.get("text", "")) for c in saved.cells for o in c.get("outputs", []))
    report = _grade(ws, notebook)
    assert re.search(r"dist.shard_bounds +passed", report) and re.search(rf"{re.escape(notebook)} +passed", report), report


@contextmanager
def _busy(processes: int = 2):
    """Keep every core busy (a machine shared with other learners' jobs)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


def test_a_multi_rank_exercise_on_a_loaded_machine(ws):
    # The kernel's side (banner, check cell, autosave) and the blank verdict are the test above; here the
    # grader's verdicts for a multi-rank exercise while every core is busy: wrong, then right, each naming it.
    exercise_id = "comm.broadcast"
    with _busy():
        _solve(ws, exercise_id, WRONG[exercise_id])
        verdict = _grade(ws, exercise_id)
        assert verdict.startswith(f"{exercise_id}: failed\n"), verdict
        assert "NotImplementedError" not in verdict and "not graded" not in verdict
        assert NAMED[exercise_id] in verdict, verdict
        _solve(ws, exercise_id, None)
        verdict = _grade(ws, exercise_id)
        assert verdict.startswith(f"{exercise_id}: passed\n"), verdict


def test_an_edit_takes_effect_at_the_next_cell_without_a_restart(tmp_path):
    # One kernel for the whole play, as a learner keeps it open: blank -> save a wrong answer -> re-run the
    # cells (from `%load_ext megalab`, as README says) -> save a syntax error -> save the right answer.
    ws = create(REPO, tmp_path / "megalab-workspace").dest
    notebook, exercise_id = "course/01_foundations/01_setup_and_torchrun.ipynb", "dist.shard_bounds"
    nb = nbformat.read(ws / notebook, as_version=4)
    load_ext = next(c for c in nb.cells if c.cell_type == "code" and "%load_ext megalab" in c.source)
    run = nbformat.v4.new_notebook(cells=[load_ext, nb.cells[_check_cell(nb, exercise_id)]], metadata=nb.metadata)
    client = NotebookClient(run, timeout=600, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str((ws / notebook).parent)}})

    def cells(*which):
        out = ""
        for i in which:
            client.execute_cell(run.cells[i], i)
            out += "".join(o.get("text", "") + "\n".join(o.get("traceback", [])) + o.get("evalue", "")
                           for o in run.cells[i].outputs)
        return out

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with _environ(env), client.setup_kernel():
        assert "NotImplementedError" in cells(0, 1)
        _solve(ws, exercise_id, WRONG[exercise_id])
        said = cells(0, 1)
        assert "reloaded megalab/lab/dist.py" in said, said
        assert "NotImplementedError" not in said and re.search(r"\bFalse\b", said) and "True" not in said, said
        _solve(ws, exercise_id, ["return (0, length"])  # a save half-way through typing
        said = cells(1)
        assert "your edit to megalab/lab/dist.py does not load: SyntaxError" in said and "stays in use" in said, said
        assert re.search(r"\bFalse\b", said), said  # the last version that loaded, said plainly
        _solve(ws, exercise_id, None)
        said = cells(1)
        assert "reloaded megalab/lab/dist.py" in said and re.search(r"\bTrue\b", said) and "False" not in said, said
