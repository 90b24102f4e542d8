"""Verdicts for check cells and exercise tests: right or wrong, and if wrong, in words.

A check says which quantity is wrong and by how much, so a learner (and `megalab grade`) can
act on it without remembering what the right number looked like:

    >>> v = close(out, ref, "the column-parallel output (tp=2, rank 1)")
    >>> print(f"column-parallel output == nn.Linear output: {v}")
    column-parallel output == nn.Linear output: False (the column-parallel output (tp=2, rank 1):
    12 of 64 elements differ, the largest by 0.31 at index (3, 5): got 1.2, expected 0.89 (allowed 1.3e-05))

`str(verdict)` is "True" when it holds, so a passing check cell prints exactly what the notebook
stored. Values are compared, not dtypes: a correct answer computed at higher precision (a softmax
upcast to fp32, say) passes; the tolerance is that of the less precise of the two dtypes.
Tests use `require(verdict)`, which raises AssertionError with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

# torch.testing.assert_close's defaults, by dtype: (rtol, atol)
_TOLERANCE = {"float64": (1e-7, 1e-7), "float32": (1.3e-6, 1e-5), "float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5)}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""  # why not (empty when ok)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return "True" if self.ok else f"False ({self.reason})"


RIGHT = Verdict(True)


def wrong(reason: str) -> Verdict:
    return Verdict(False, reason)


def all_of(*verdicts: Verdict) -> Verdict:
    """The first failing verdict, else RIGHT."""
    return next((v for v in verdicts if not v), RIGHT)


def require(verdict: Verdict) -> None:
    """Raise AssertionError with the reason (for tests)."""
    if not verdict:
        raise AssertionError(verdict.reason)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def close(actual, expected, what: str, *, rtol: float | None = None, atol: float | None = None) -> Verdict:
    """Is `actual` equal to `expected` within tolerance (tensors, arrays, numbers or nested sequences)?"""
    import torch

    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    if a.shape != e.shape:
        return wrong(f"{what} has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    if a.is_complex() or e.is_complex():
        raise TypeError("close() compares real values")
    floats = [str(t.dtype).removeprefix("torch.") for t in (a, e) if t.is_floating_point()]
    default = max((_TOLERANCE.get(f, _TOLERANCE["float32"]) for f in floats), default=(0.0, 0.0))
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    a64, e64 = a.detach().cpu().double(), e.detach().cpu().double()
    if a64.numel() == 0:
        return RIGHT
    nan_a, nan_e = a64.isnan(), e64.isnan()
    if (nan_a != nan_e).any():
        index = tuple(int(i) for i in (nan_a != nan_e).nonzero()[0])
        return wrong(f"{what} is NaN where it should not be (or a number where NaN is expected) at index {index}: "
                     f"got {a64[index].item()}, expected {e64[index].item()}")
    both = nan_a & nan_e
    same_inf = (a64 == e64) & a64.isinf()
    diff = torch.where(both | same_inf, 0.0, (a64 - e64).abs())
    allowed = atol + rtol * e64.abs().nan_to_num(0.0, posinf=0.0)
    bad = diff > allowed
    if not bad.any():
        return RIGHT
    worst = torch.where(bad, diff, -1.0).argmax()
    index = tuple(int(i) for i in torch.unravel_index(worst, a64.shape)) if a64.dim() else ()
    where = f" at index {index}" if index else ""
    count = f"{int(bad.sum())} of {a64.numel()} elements differ, the largest by" if a64.numel() > 1 else "off by"
    return wrong(f"{what}: {count} {_fmt(diff[index].item())}{where}: got {_fmt(a64[index].item())}, "
                 f"expected {_fmt(e64[index].item())} (allowed {_fmt(allowed[index].item())})")


def equal(actual, expected, what: str) -> Verdict:
    """Exact equality of plain values (ints, tuples, lists, dicts, strings), said in words."""
    if actual == expected:
        return RIGHT
    return wrong(f"{what} is {actual!r}, expected {expected!r}")


def show(label: str, verdict: Verdict) -> None:
    """Print one check line: `label: True`, or `label: False (why)`."""
    print(f"{label}: {verdict}")
