"""The %%torchrun cell magic in a real IPython shell."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

from megalab.lab import launch
from megalab.lab.launch import RankFailedError


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "megalab")
    yield ip
    InteractiveShell.clear_instance()


def test_cell_output_and_published_values(shell, capsys, facilities):
    cell = (
        "from megalab.lab import dist as mdist\n"
        "rank, world = mdist.init()\n"
        "print(f'rank {rank} of {world}')\n"
        "mdist.publish('losses', [1.0 / (rank + 1)])\n"
    )
    shell.run_cell_magic("torchrun", "-n 2 --timeout 120", cell)
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2\n[rank 1] rank 1 of 2\n" in out
    assert shell.user_ns["losses"] == {0: [1.0], 1: [0.5]}


def test_rank_zero_only_and_errors(shell, capsys):
    shell.run_cell_magic("torchrun", "-n 2 --ranks 0", "import os\nprint('I am', os.environ['RANK'])\n")
    assert "I am 0\n" in capsys.readouterr().out
    with pytest.raises(RankFailedError, match="rank 1 failed: ZeroDivisionError"):
        shell.run_cell_magic("torchrun", "-n 2", "import os\nif os.environ['RANK'] == '1':\n    1 / 0\n")


def test_hard_timeout_flag_reaches_the_launcher(shell, monkeypatch):
    seen = {}

    def fake_run(code, nproc, **options):
        seen.update(options)
        raise launch.LaunchTimeoutError("stopped", "", {}, "overloaded")

    monkeypatch.setattr(launch, "run", fake_run)
    with pytest.raises(launch.LaunchTimeoutError) as info:
        shell.run_cell_magic("torchrun", "-n 2 --timeout 30 --hard-timeout 45", "pass\n")
    assert (seen["timeout"], seen["hard_timeout"]) == (30, 45) and info.value.kind == "overloaded"


BLANK = ("exercise parallel_state.create_groups: one group per slice of the rank grid — see "
         "course/02_core_architecture/02_parallel_state.ipynb")


def test_a_blank_exercise_reached_from_another_notebook_says_which_and_where(shell, capsys):
    # 03.03's tp check reaching chapter 02's blank create_groups: the error line and what to do about it, never
    # the other exercise's traceback (issue 34)
    shell.run_cell(f"def check():\n    raise NotImplementedError({BLANK!r})\ncheck()")
    out = capsys.readouterr().out
    assert f"NotImplementedError: {BLANK}" in out and ("This needs exercise parallel_state.create_groups first "
                                                       "(taught in course/02_core_architecture/02_parallel_state.ipynb)") in out, out
    assert "Traceback" not in out and "check()" not in out, out  # no frames
    shell.run_cell("raise NotImplementedError('plain')")  # not an exercise: the traceback only
    out = capsys.readouterr().out
    assert "This needs" not in out and "Traceback" in out
    err = RankFailedError(0, "rank 0 failed: NotImplementedError",
                          f"Traceback ...\n  File \"cell\", line 3, in row_forward\nNotImplementedError: {BLANK}\n")
    rendered = err._render_traceback_()
    assert rendered[1:] == [f"NotImplementedError: {BLANK}", rendered[-1]] and "line 3" not in "\n".join(rendered)
    assert rendered[-1].startswith("This needs exercise parallel_state.create_groups first")


def test_slurm_status_line_counts_every_nodes_ranks_and_names_the_step(shell, monkeypatch):
    """%%torchrun --slurm -n 2 on a 3-node allocation: 6 ranks on the status line; the step is named after the cell."""
    from megalab.lab import magic

    updates, seen = [], {}

    class Handle:
        def update(self, data, raw=True):
            updates.append(data["text/plain"])

    def fake_run(code, nproc, **options):
        seen.update(options)
        options["on_progress"](1.0, "step 1")
        raise launch.LaunchError("stop here")

    monkeypatch.setattr(magic, "display", lambda *a, **k: Handle())
    monkeypatch.setattr(launch, "slurm_nodes", lambda: ["n1", "n2", "n3"])
    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ada/course/01_foundations/01_setup_and_torchrun.ipynb")
    with pytest.raises(launch.LaunchError):
        shell.run_cell_magic("torchrun", "--slurm -n 2", "pass\n")
    assert updates[0].startswith("running on 6 ranks, 1 s · step 1"), updates
    assert seen["name"] == f"01_setup_and_torchrun-cell{shell.execution_count}" and seen["slurm"]
