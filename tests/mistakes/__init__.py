"""Named mistakes: typical wrong answers to each exercise, as mutants the grader must fail AND name.

Each file here lists `MISTAKES = [Mistake(...), ...]`. `python -m megalab.lab.mutants` swaps each one's code
into its exercise's region and runs that exercise's tests (tests/test_mistakes.py runs them all): the
first failing test's one-line verdict must contain `says`.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    exercise: str  # the exercise id
    name: str  # the mistake in a learner's words: "forgot the 1/world_size scale"
    says: str  # a phrase the grader's one-line verdict must contain (case-insensitive)
    code: str  # the whole wrong region body, dedented (the runner indents it like the region)
    fresh: bool = False  # run in a fresh process on a patched copy of the tree (code that cannot be swapped live)
