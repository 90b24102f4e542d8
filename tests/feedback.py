"""Failure messages for the exercise tests: WHICH quantity is wrong, WHERE, and BY HOW MUCH.

`megalab grade` shows the first `E` line of a failing test as the learner's feedback, so an
assertion in an exercise test says in words what it compared, e.g.

    tp=2, rank 0, the Column -> GeLU -> Row MLP with sequence parallelism: the output differs
    from the single-device MLP's by up to 6.42 (tolerance 1e-05)

never a bare tuple. Tensors compared in the test process go through megalab.lab.checks (close /
equal + require); the helpers here word the numbers that worker processes send back (their
precomputed worst differences) and the errors they caught.
"""

from __future__ import annotations

import math

import torch

from megalab.lab.checks import close, equal, require  # noqa: F401  (re-exported: one import for the tests)


def fmt(x: float) -> str:
    return f"{x:.3g}"


def max_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float | str:
    """The largest absolute difference of two tensors, or a string saying why they cannot be compared
    (for worker processes: a float or a short string pickles back cheaply)."""
    if a is None or b is None:
        return "is missing (None)" if a is None else f"is a {tuple(a.shape)} tensor, expected None"
    if a.shape != b.shape:
        return f"has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def too_large(errors: dict[str, float | str], tol: float) -> list[tuple[str, float | str]]:
    """The (quantity, error) pairs of {quantity: max_error(...)} that are not within tol, in order."""
    return [(q, e) for q, e in errors.items() if isinstance(e, str) or e is None or math.isnan(e) or not e < tol]


def _words(quantity: str, err: float | str, against: str | None, first: bool) -> str:
    if isinstance(err, str):
        return f"{quantity} {err}"
    if err is None or math.isnan(err):
        return f"{quantity} is NaN (or missing)"
    if not first:
        return f"{quantity} (by {fmt(err)})"
    return f"{quantity} differs from {against} by up to {fmt(err)}" if against else f"{quantity} is off by up to {fmt(err)}"


def require_within(errors: dict[str, float | str], tol: float, *, where: str, against: str | None = None,
                   shown: int = 3) -> None:
    """AssertionError "<where>: <quantity> differs from <against> by up to <err>; also <q2> (by <e2>), ...
    and N more (tolerance <tol>)": the first `shown` failing quantities in the order of `errors`
    (outputs before gradients), a count of the rest. Without `against`: "<quantity> is off by up to <err>"."""
    bad = too_large(errors, tol)
    if not bad:
        return
    first = _words(*bad[0], against, True)
    rest = [_words(q, e, against, False) for q, e in bad[1:shown]]
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    also = f"; also {', '.join(rest)}{more}" if rest else ""
    raise AssertionError(f"{where}: {first}{also} (tolerance {tol:g})")


def equal_lists(actual: list, expected: list, what: str, item: str = "item"):
    """equal() for long lists: the first differing item and how many differ, not both lists whole."""
    from megalab.lab.checks import RIGHT, wrong

    actual, expected = list(actual), list(expected)
    if actual == expected:
        return RIGHT
    if len(actual) != len(expected):
        return wrong(f"{what} has {len(actual)} {item}s, expected {len(expected)}: "
                     f"{_short(actual)} vs expected {_short(expected)}")
    bad = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    return wrong(f"{what}: {len(bad)} of {len(expected)} {item}s differ; {item} {bad[0]} is {actual[bad[0]]!r}, "
                 f"expected {expected[bad[0]]!r}")


def _short(items: list, n: int = 4) -> str:
    return repr(items) if len(items) <= n else f"[{', '.join(map(repr, items[:n]))}, ...]"


def last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def require_no_error(where: str, error: str | None) -> None:
    """A worker's caught traceback as an AssertionError that starts with where and the exception."""
    if error:
        raise AssertionError(f"{where} raised {last_line(error)}\n{error}")
