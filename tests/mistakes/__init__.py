# tests/mistakes/__init__.py (aids-core owns it)
from dataclasses import dataclass

@dataclass(frozen=True)
class Mistake:
    exercise: str   # the exercise id
    name: str       # the mistake in a learner's words: "forgot the 1/world_size scale"
    says: str       # a phrase the grader's one-line verdict must contain (case-insensitive), e.g. "1/world_size"
    code: str       # the WHOLE wrong region body, dedented (the runner indents it like the region)
    fresh: bool = False  # True: run this mutant in a fresh process on a patched copy (see below)
