"""Independent wrong answers (issue 34): realistic learner mistakes written BLIND, from the course's text alone (the
notebooks' prose, the `# EXERCISE` task lines, the docstrings and hints), before their writer read tests/mistakes/,
megalab/lab/mutants.py or any test's failure messages. They estimate how well the grader NAMES a mistake it was not
built against (the hidden set of issue 34 is not ours).

Each file lists `WRONG = [dict(exercise=ID, name=..., behaviour=..., expect=REGEX, code=REGION BODY), ...]`:
  behaviour  what a correct verdict would say the code did (one line, written with the answer)
  expect     a case-insensitive regular expression that a verdict naming this behaviour matches (written with the
             answer, before any verdict was seen); a verdict that fails and matches it is "named"
  code       the exercise region's body, as tests/blind/ solutions give it (swapped in by megalab.lab.mutants)
`SOLUTIONS = WRONG` too, so `python -m megalab.lab.mutants --solutions FILE` runs them unchanged.
"""
