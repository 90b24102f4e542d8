"""One short 2-rank launch for the focused first test of each exercise (issue 27).

The first test marked with an exercise is what `megalab grade` and the mutant runner look at, so it
must be fast and name the mistake. A test module defines QUICK = {exercise id: case}, each case a
module-level `case(rank, world, group) -> picklable result` that runs in the ranks on tiny tensors;
its `quick` fixture (`quick_fixture(QUICK)`) launches ONE run for the exercises of the selected tests
that use it (all of them in a full run, one under `megalab grade ID`), and `quick.get(id)` returns
{rank: result}. Each case gets its own process group with a short collective timeout, so a case where
one rank skips a collective fails (an error in that case) instead of hanging the others; a launch that
still hangs becomes a verdict that names the stuck lines.
"""

from __future__ import annotations

import datetime
import importlib
import traceback

import pytest

from megalab.lab import launch
from megalab.lab.checks import mistake, require

WORLD = 2
LAUNCH_TIMEOUT = 90  # seconds before the launcher asks whether the ranks are stuck (generous on a loaded machine)
COLLECTIVE_TIMEOUT = 30  # seconds a rank waits in one case's collective for the other rank


def quick_worker(module: str, exercises: list[str]) -> dict[str, object]:
    """In each rank: run the cases of `exercises` from `module`.QUICK, each on a fresh group; errors are kept."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    cases = importlib.import_module(module).QUICK
    out = {}
    for exercise in exercises:
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
        try:
            out[exercise] = cases[exercise](rank, world, group)
        except Exception:  # noqa: BLE001 (reported to the test that owns this case)
            out[exercise] = {"error": traceback.format_exc(limit=-4)}
    return out


def _stuck(err: launch.LaunchTimeoutError) -> str:
    """Each rank's innermost frame in megalab/ or tests/ when the launch was stopped."""
    lines = []
    for rank, stack in sorted(err.stacks.items()):
        frame = next((ln.strip() for ln in stack.splitlines() if "megalab/" in ln or "tests/" in ln), "?")
        lines.append(f"rank {rank}: {frame}")
    return "; ".join(lines)


class Quick:
    """The results of one quick launch, made on the first get()."""

    def __init__(self, module: str, exercises: list[str]):
        self.module, self.exercises = module, exercises
        self.results: dict[str, dict[int, object]] | None = None
        self.failure: tuple[str, str] | None = None

    def _launch(self) -> None:
        try:
            res = launch.run_function(quick_worker, WORLD, self.module, self.exercises,
                                      launch=dict(timeout=LAUNCH_TIMEOUT))
        except launch.LaunchTimeoutError as e:
            self.failure = "hang", _stuck(e)
            return
        except launch.RankFailedError as e:
            self.failure = "failed", str(e).splitlines()[0]
            return
        self.results = {ex: {r: res.returns[r][ex] for r in res.returns} for ex in self.exercises}

    def get(self, exercise: str) -> dict[int, object]:
        """{rank: the case's result}; an AssertionError naming the mistake if the launch hung or failed."""
        if self.results is None and self.failure is None:
            self._launch()
        if self.failure is not None:
            kind, detail = self.failure
            if kind == "hang":
                require(mistake(HANG, f"stuck at {detail}"))
            raise AssertionError(f"the quick {WORLD}-rank check of {exercise} failed: {detail}")
        if exercise not in self.results:
            raise AssertionError(f"the quick check of {exercise} did not run (is its test selected with the quick "
                                 "fixture?)")
        return self.results[exercise]


def quick_fixture(cases: dict):
    """A module-scoped `quick` fixture for the test module that defines QUICK = cases."""

    @pytest.fixture(scope="module")
    def quick(request):
        wanted = {m.args[0] for item in request.session.items if "quick" in getattr(item, "fixturenames", ())
                  for m in item.iter_markers("exercise")}
        return Quick(request.module.__name__, [ex for ex in cases if ex in wanted])

    return quick


HANG = ("a rank waits in a collective the other rank never joins (a wrong group, a collective only some ranks "
        "call, or a forgotten wait)")


def results(quick: Quick, exercise: str, part=None, known: dict[str, str] | None = None) -> dict[int, object]:
    """{rank: the case's result}. A rank that raised (in the case, or in its `part`) fails the test: with the
    mistake of `known` ({text in the error: mistake}) that its error matches, a hang's, or its error as it is."""
    res = quick.get(exercise)
    for rank, value in sorted(res.items()):
        if part is not None and not (isinstance(value, dict) and "error" in value):
            value = value[part]
        if isinstance(value, dict) and "error" in value:
            err = value["error"]
            for text, name in {**(known or {}), f"Timed out waiting {COLLECTIVE_TIMEOUT * 1000}ms": HANG}.items():
                if text in err:
                    require(mistake(name, f"rank {rank}: {last_error_line(err)}"))
            raise AssertionError(f"{exercise}, quick {WORLD}-rank check{f' ({part})' if part else ''}, rank {rank} "
                                 f"raised {last_error_line(err)}")
    return res


def errors_of(results: dict[int, object]) -> dict[int, str]:
    """{rank: traceback} of the ranks whose case raised."""
    return {r: v["error"] for r, v in results.items() if isinstance(v, dict) and "error" in v}


def last_error_line(tb: str) -> str:
    """The exception line of a formatted traceback ("IndexError: index out of range in self")."""
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else tb
