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
Tests use `require(verdict)`, which raises AssertionError with the reason. A check names the likely
mistake when it can (`close(..., mistakes={name: what it computes})`, `mistake(name)`), first in the
reason, so the grader's one-line verdict says what to fix, not only "mismatch".
"""

from __future__ import annotations

from dataclasses import dataclass

# torch.testing.assert_close's defaults, by dtype: (rtol, atol)
_TOLERANCE = {"float64": (1e-7, 1e-7), "float32": (1.3e-6, 1e-5), "float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5)}
_TOLERANCE["tf32"] = (2e-3, 1e-5)  # fp32 matmuls on TF32 tensor cores: 10-bit mantissa inputs, fp32 sums


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


def reduction_tolerance(dtype=None, device="cpu") -> tuple[float, float]:
    """(rtol, atol) for two runs of one computation in `dtype` (default float32) on `device` that add in different
    orders (another parallel layout, another kernel): relative, as rounding is. torch.testing's tolerance for the
    dtype; on CUDA, where fp32 matmuls may run in TF32 (10-bit mantissa: torch.backends.cuda.matmul.allow_tf32,
    or a float32_matmul_precision other than "highest"), TF32's."""
    import torch

    dtype = str(dtype or torch.float32).removeprefix("torch.")
    if dtype == "float32" and torch.device(device).type == "cuda" and (
            torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        return _TOLERANCE["tf32"]
    return _TOLERANCE.get(dtype, _TOLERANCE["float32"])


def close(actual, expected, what: str, *, rtol: float | None = None, atol: float | None = None,
          mistakes: dict | None = None) -> Verdict:
    """Is `actual` equal to `expected` within tolerance (tensors, arrays, numbers or nested sequences)?

    When it is not, the reason says where and by how much, and names the likely mistake: `mistakes` maps a
    mistake, in a learner's words, to what that mistake computes (a value like `expected`, or a callable
    returning one, evaluated only on a mismatch); the first that `actual` matches is named first, as
    "likely mistake: <name>". Otherwise generic patterns are named (a constant factor, a sign, a transpose,
    rows in another order, a shift by one, all zeros, a shard's worth of elements).
    """
    import torch

    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    if a.is_complex() or e.is_complex():
        raise TypeError("close() compares real values")
    floats = [str(t.dtype).removeprefix("torch.") for t in (a, e) if t.is_floating_point()]
    default = max((_TOLERANCE.get(f, _TOLERANCE["float32"]) for f in floats), default=(0.0, 0.0))
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    reason = _mismatch(a, e, rtol, atol)
    if reason is None:
        return RIGHT
    reason = f"{what} {reason}" if reason.startswith(("has shape", "is NaN")) else f"{what}: {reason}"
    for name, wrong_value in (mistakes or {}).items():
        value = wrong_value() if callable(wrong_value) else wrong_value
        if value is not None and _mismatch(a, torch.as_tensor(value), rtol, atol) is None:
            return mistake(name, reason)
    pattern = _pattern(a, e, rtol, atol)
    return wrong(reason + (f" — it looks like {pattern}" if pattern else ""))


def mistake(name: str, detail: str = "") -> Verdict:
    """A wrong verdict that names the likely mistake first (what `megalab grade` shows in one line)."""
    return wrong(f"likely mistake: {name}" + (f" — {detail}" if detail else ""))


def _mismatch(a, e, rtol: float, atol: float) -> str | None:
    """None when a equals e within tolerance, else where and by how much (shapes, NaNs, the worst element)."""
    import torch

    if a.shape != e.shape:
        return f"has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
    a64, e64 = a.detach().cpu().double(), e.detach().cpu().double()
    if a64.numel() == 0:
        return None
    nan_a, nan_e = a64.isnan(), e64.isnan()
    if (nan_a != nan_e).any():
        index = tuple(int(i) for i in (nan_a != nan_e).nonzero()[0])
        return (f"is NaN where it should not be (or a number where NaN is expected) at index {index}: "
                f"got {a64[index].item()}, expected {e64[index].item()}")
    both = nan_a & nan_e
    same_inf = (a64 == e64) & a64.isinf()
    diff = torch.where(both | same_inf, 0.0, (a64 - e64).abs())
    allowed = atol + rtol * e64.abs().nan_to_num(0.0, posinf=0.0)
    bad = diff > allowed
    if not bad.any():
        return None
    worst = torch.where(bad, diff, -1.0).argmax()
    index = tuple(int(i) for i in torch.unravel_index(worst, a64.shape)) if a64.dim() else ()
    where = f" at index {index}" if index else ""
    count = f"{int(bad.sum())} of {a64.numel()} elements differ, the largest by" if a64.numel() > 1 else "off by"
    return (f"{count} {_fmt(diff[index].item())}{where}: got {_fmt(a64[index].item())}, "
            f"expected {_fmt(e64[index].item())} (allowed {_fmt(allowed[index].item())})")


def _pattern(a, e, rtol: float, atol: float) -> str | None:
    """What a wrong `a` looks like next to `e`, in words (None when no simple pattern fits)."""

    if a.shape != e.shape:
        n, m = a.numel(), e.numel()
        if n and m and m % n == 0 and m > n:
            return f"1/{m // n} of the expected elements: one rank's shard (a gather missing, or on the wrong dim?)"
        if n and m and n % m == 0 and n > m:
            return f"{n // m}x the expected elements: gathered twice, or along the wrong dim?"
        if n == m:
            return "the right number of elements in another shape: a wrong dim, or a missing view or transpose?"
        return None
    if not a.is_floating_point() and not e.is_floating_point():
        a, e = a.double(), e.double()
    a64, e64 = a.detach().cpu().double(), e.detach().cpu().double()
    if a64.isnan().any() or e64.isnan().any() or not a64.numel():
        return None

    def same(x, y):
        return x.shape == y.shape and _mismatch(x, y, max(rtol, 1e-6), max(atol, 1e-6)) is None

    if not a64.abs().any():
        return "all zeros: a result never written, or a buffer never received?"
    if same(a64, -e64):
        return "the negative of the expected: a sign flipped?"
    norm = float((e64 * e64).sum())
    if norm > 0:
        k = float((a64 * e64).sum()) / norm
        if abs(k - 1) > 1e-3 and k != 0 and same(a64, k * e64):
            whole = max(abs(k), 1 / abs(k))  # a factor of n or 1/n is what a missing or extra scale gives
            if abs(whole - round(whole)) < 1e-3 * whole:  # said as measured: which scale it is, the test names
                return f"exactly {_fmt(k)} x the expected: a factor of {round(whole)} missing or extra"
            if len({round(x, 9) for x in e64.flatten().tolist() if x}) >= 2:  # one factor across different values
                return f"exactly {_fmt(k)} x the expected (one constant factor)"
    if a64.dim() >= 2 and a64.shape[-1] == a64.shape[-2] and same(a64, e64.transpose(-1, -2)):
        return "the transpose of the expected: a transposed shard or weight?"
    for dim in range(a64.dim()):
        if a64.shape[dim] < 2:
            continue
        rows_a = a64.movedim(dim, 0).reshape(a64.shape[dim], -1)
        rows_e = e64.movedim(dim, 0).reshape(e64.shape[dim], -1)
        if same(rows_a[1:], rows_e[:-1]) or same(rows_a[:-1], rows_e[1:]):
            return f"the expected shifted by one along dim {dim}: an off-by-one index or chunk?"
        distinct = len({tuple(r) for r in rows_e.round(decimals=5).tolist()}) == rows_e.shape[0]
        if distinct and same(_sorted_rows(rows_a), _sorted_rows(rows_e)):  # repeated rows: any shuffle would do
            return f"the right slices along dim {dim} in another order: chunks or ranks in the wrong order?"
    return None


def _sorted_rows(rows):
    """Rows in a canonical order (lexicographic), so two permutations of the same rows compare equal."""
    import torch

    order = sorted(range(rows.shape[0]), key=lambda i: rows[i].round(decimals=5).tolist())
    return rows[torch.tensor(order, dtype=torch.long)]


def equal(actual, expected, what: str) -> Verdict:
    """Exact equality of plain values (ints, tuples, lists, dicts, strings), said in words."""
    if actual == expected:
        return RIGHT
    return wrong(f"{what} is {actual!r}, expected {expected!r}")


def show(label: str, verdict: Verdict) -> None:
    """Print one check line: `label: True`, or `label: False (why)`."""
    print(f"{label}: {verdict}")
