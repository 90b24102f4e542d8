"""The focused first test of each multi-rank exercise (issues 27, 34): 2 ranks as threads, in a fraction of a second.

The first test marked with an exercise is what `megalab grade` and the mutant runner look at, so it
must be fast and name the mistake. A test module defines QUICK = {exercise id: case}, each case a
module-level `case(rank, world, group) -> result` that runs in the ranks on tiny tensors; its `quick`
fixture (`quick_fixture(QUICK)`) runs a case the first time a test asks for it, `quick.get(id)` returns
{rank: result}. The ranks are the threads of a 2-rank threaded world (tests/threaded_world.py: no process
start-up, one rank runs at a time, so seeding torch's RNG works as in separate processes); each case gets a
fresh world, so a broken case cannot disturb the next. A rank's error is kept as its result; a rank that
waits for a collective the other rank never joins fails that wait at once (a named hang, not a timeout), and
a rank in an endless loop is stopped at its line (EndlessLoop).
The real multi-process launches of the same code come later in each test file.
"""

from __future__ import annotations

import traceback

import pytest

from megalab.lab.checks import mistake, require
from tests import threaded_world

WORLD = 2


class Quick:
    """The results of the quick cases of one test module, each run on the first get()."""

    def __init__(self, cases: dict):
        self.cases = cases
        self.results: dict[str, dict[int, object]] = {}

    def _run(self, exercise: str) -> dict[int, object]:
        case = self.cases[exercise]

        def rank_fn(rank, group):
            try:
                return case(rank, WORLD, group)
            except Exception:  # noqa: BLE001 (reported to the test that owns this case)
                return {"error": traceback.format_exc(limit=-4)}

        return threaded_world.World(WORLD).run(rank_fn)  # an endless loop raises EndlessLoop at its line

    def get(self, exercise: str) -> dict[int, object]:
        """{rank: the case's result} (a rank's error as {"error": its traceback})."""
        if exercise not in self.cases:
            raise AssertionError(f"no quick case for {exercise} in this test module's QUICK")
        if exercise not in self.results:
            self.results[exercise] = self._run(exercise)
        return self.results[exercise]


def quick_fixture(cases: dict):
    """A module-scoped `quick` fixture for the test module that defines QUICK = cases."""

    @pytest.fixture(scope="module")
    def quick():
        return Quick(cases)

    return quick


HANG = ("a rank waits in a collective the other rank never joins (a wrong group, a collective only some ranks "
        "call, or a forgotten wait)")


def results(quick: Quick, exercise: str, part=None, known: dict[str, str] | None = None) -> dict[int, object]:
    """{rank: the case's result}. A rank that raised (in the case, or in its `part`) fails the test: with the
    mistake of `known` ({text in the error: mistake}) that its error matches, a hang's, or its error as it is."""
    res = quick.get(exercise)
    errors = {}
    for rank, value in sorted(res.items()):
        if part is not None and not (isinstance(value, dict) and "error" in value):
            value = value[part]
        if isinstance(value, dict) and "error" in value:
            errors[rank] = value["error"]
    # a rank's own error first: the other rank, left waiting for it in a collective, only shows the hang
    for text, name in {**(known or {}), "RankStuck:": HANG}.items():
        for rank, err in errors.items():
            if text in err:
                require(mistake(name, f"rank {rank}: {last_error_line(err)}"))
    for rank, err in errors.items():
        if "RankStuck:" not in err:
            raise AssertionError(f"{exercise}, quick {WORLD}-rank check{f' ({part})' if part else ''}, rank {rank} "
                                 f"raised {last_error_line(err)}")
    return res


def last_error_line(tb: str) -> str:
    """The exception line of a formatted traceback ("IndexError: index out of range in self")."""
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else tb
