"""Blind solutions: every exercise written again from the course's text alone (the notebook, the task line, the
docstring and the hints), by hands that had not seen the reference, the tests or the named mistakes (issue 34).

Each file lists `SOLUTIONS = [dict(exercise=ID, name=..., code=REGION BODY), ...]`, the first try as written from
the text; where the first try failed for a reason the text did not give, the text or the grader was fixed and
the first try kept (it passes now), and where it failed for the writer's own bug the fixed body is kept and the
name says so. `python -m megalab.lab.mutants --solutions tests/blind/FILE.py` swaps each in and runs the
exercise's tests; tests/test_blind.py requires every one to pass.
"""
