"""Notebook check cells catch what the grader's first checks catch, and say why.

For a handful of single-process check cells (chapters 01-02), the cell's own code runs here twice: with the
exercise's solution it prints `True` on every check line; with a named mistake from tests/mistakes/ swapped in
(megalab/lab/mutate.py, as the mutant runner does) it prints `False (likely mistake: ...)`, naming it.
"""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from megalab.lab.exercises import load
from megalab.lab.mutants import load_mistakes
from megalab.lab.mutate import mutated_source, swap

REPO = Path(__file__).resolve().parent.parent
REGISTRY = load(REPO)
pytestmark = pytest.mark.skipif(not all(ex.solution for ex in REGISTRY.exercises.values()),
                                reason="a student copy has no solutions, and no mistakes (the grader keeps them)")

NB_0103 = "course/01_foundations/03_cost_model.ipynb"
NB_0203 = "course/02_core_architecture/03_transformer_layer.ipynb"
NB_0204 = "course/02_core_architecture/04_gpt_and_recompute.ipynb"
SETUP_0203 = ["config = TransformerConfig(", "norm = RMSNorm(16, eps=eps)"]  # imports and config; the x [s, b, h]

# (notebook, cells that set up, the check cell, exercise, the mistake (a substring of its name), what the cell says)
CASES = [
    (NB_0103, ["ALPHA, BETA = "], "model_times = [comm.all_reduce_time(", "comm.fit_alpha_beta", "fitted absolute errors",
     "likely mistake: fitted absolute errors"),
    (NB_0203, SETUP_0203[:1], "norm = RMSNorm(16, eps=eps)", "model.norm", "eps outside",
     "likely mistake: eps outside the square root"),
    (NB_0203, SETUP_0203, "unfused = CoreAttention(", "model.core_attention", "forgot the causal mask",
     "likely mistake: forgot the causal mask"),
    (NB_0203, SETUP_0203, "for name, change in [(\"GeLU MLP\"", "model.mlp", "gated: the activation on both",
     "likely mistake: gated: the activation on both halves"),
    (NB_0203, SETUP_0203, "layer = TransformerLayer(config).eval()", "model.layer_forward", "input_layernorm",
     "(pre_mlp_layernorm unused)"),
    (NB_0204, ["config = TransformerConfig("], "logits = model(ids)\n", "model.gpt_forward", "[s, b, V]",
     "likely mistake: returned the logits as [s, b, V]"),
]


def cell_code(notebook: str, marker: str) -> str:
    """The source of the notebook's only code cell that contains `marker`, magics dropped."""
    cells = json.loads((REPO / notebook).read_text(encoding="utf-8"))["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{notebook}: {len(found)} code cells contain {marker!r}"
    return "\n".join(line for line in "".join(found[0]["source"]).splitlines() if not line.startswith("%"))


def run_cells(notebook: str, setup: list[str], check: str) -> list[str]:
    """Run the setup cells, then the check cell, in one namespace; the check cell's lines that hold a verdict."""
    namespace: dict = {}
    threads = torch.get_num_threads()  # a setup cell may set it (torch.set_num_threads(1)): restored after
    try:
        return _run(notebook, setup, check, namespace)
    finally:
        torch.set_num_threads(threads)


def _run(notebook: str, setup: list[str], check: str, namespace: dict) -> list[str]:
    for marker in setup:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(cell_code(notebook, marker), f"{notebook}:{marker}", "exec"), namespace)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(cell_code(notebook, check), f"{notebook}:{check}", "exec"), namespace)
    return [line for line in out.getvalue().splitlines() if ": True" in line or ": False" in line]


@contextlib.contextmanager
def mistake_in(exercise: str, name_part: str):
    ex = REGISTRY.exercises[exercise]
    (m,) = [m for m in load_mistakes(REPO) if m.exercise == exercise and name_part in m.name]
    undo = swap(REPO, ex.path, ex.line, mutated_source((REPO / ex.path).read_text(encoding="utf-8"), ex, m.code))
    try:
        yield m
    finally:
        undo()


@pytest.fixture(autouse=True)
def _headless(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")


@pytest.mark.parametrize("notebook,setup,check,exercise,mistake,says", CASES, ids=[c[3] for c in CASES])
def test_check_cell_names_the_mistake_and_passes_the_solution(notebook, setup, check, exercise, mistake, says):
    right = run_cells(notebook, setup, check)
    assert right and all(line.endswith(": True") for line in right), "\n".join(right)
    with mistake_in(exercise, mistake):
        wrong = run_cells(notebook, setup, check)
    named = [line for line in wrong if ": False (" in line and says in line]
    assert named, f"no line of the check cell says False ({says} ...) with {exercise}'s mistake {mistake!r}:\n" + \
        "\n".join(wrong)
