"""megalab.lab.checks: verdicts say which quantity is wrong and by how much; correct upcasts pass."""

import torch

from megalab.lab.checks import RIGHT, all_of, close, equal, require


def test_close_names_the_quantity_the_index_and_the_error():
    x = torch.arange(32.0).reshape(4, 8)
    y = x.clone()
    y[3, 5] += 0.31
    v = close(y, x, "the output")
    assert not v and str(v).startswith("False (")
    assert v.reason == ("the output: 1 of 32 elements differ, the largest by 0.31 at index (3, 5): got 29.31, "
                        "expected 29 (allowed 4.77e-05)")
    assert str(close(x, x, "the output")) == "True"


def test_higher_precision_answers_pass_and_shapes_and_nans_are_caught():
    x = torch.randn(16, 16)
    assert close(x.double(), x, "an fp64 answer")  # values, not dtypes
    assert close(x, x.bfloat16(), "vs bf16")  # the looser dtype's tolerance
    assert "has shape (16, 16), expected (8, 16)" in close(x, x[:8], "x").reason
    nan = torch.tensor([1.0, float("nan")])
    assert "NaN" in close(nan, torch.tensor([1.0, 2.0]), "y").reason
    assert close(nan, nan.clone(), "NaN where expected")
    assert close(torch.tensor([float("inf")]), torch.tensor([float("inf")]), "inf")


def test_equal_all_of_and_require():
    assert equal((0, 3), (0, 3), "bounds") is RIGHT
    v = equal((0, 3), (0, 4), "rank 0's [start, stop)")
    assert v.reason == "rank 0's [start, stop) is (0, 3), expected (0, 4)"
    assert all_of(RIGHT, v, equal(1, 2, "b")) is v
    try:
        require(v)
    except AssertionError as exc:
        assert str(exc) == v.reason
    else:
        raise AssertionError("require() let a wrong verdict pass")


def test_a_mismatch_names_the_mistake_it_matches_first():
    ref = torch.arange(1.0, 9.0).reshape(2, 4)
    wrong_value = ref * 2
    v = close(wrong_value, ref, "the all-reduced grad", mistakes={
        "forgot the 1/world_size scale (a sum, not a mean)": lambda: ref * 2,
        "all-reduced twice": ref * 4,
    })
    assert v.reason.startswith("likely mistake: forgot the 1/world_size scale (a sum, not a mean) — the all-reduced grad: ")
    # no named mistake matches: the generic pattern is said after the numbers
    assert "exactly 3 x the expected" in close(ref * 3, ref, "g", mistakes={"twice": ref * 2}).reason
    assert close(ref, ref, "g", mistakes={"never evaluated": lambda: 1 / 0})  # right: mistakes are not computed


def test_generic_patterns_are_named():
    x = torch.arange(16.0).reshape(4, 4) + 1
    said = {
        "negative": close(-x, x, "y").reason,
        "transpose": close(x.T, x, "y").reason,
        "zeros": close(torch.zeros(4, 4), x, "y").reason,
        "order": close(x[[2, 3, 0, 1]], x, "y").reason,
        "shift": close(torch.cat([x[:1], x[:-1]]), x, "y").reason,
        "shard": close(x[:2], x, "y").reason,
    }
    assert "the negative of the expected" in said["negative"]
    assert "the transpose of the expected" in said["transpose"]
    assert "all zeros" in said["zeros"]
    assert "in another order" in said["order"]
    assert "shifted by one along dim 0" in said["shift"]
    assert "1/2 of the expected elements" in said["shard"]
    noise = x + torch.randn(4, 4)
    assert "it looks like" not in close(noise, x, "y").reason


def test_a_factor_names_a_cause_only_when_the_evidence_shows_one():
    """Issue 34: a factor is said as measured, never with a cause the numbers cannot show (which scale went missing
    is the test's to name); one number alone (always a multiple of the expected) says nothing about a factor, and
    values that repeat are no evidence of slices in another order."""
    x = torch.arange(1.0, 7.0)
    quarter = close(x / 4, x, "y").reason
    assert "exactly 0.25 x the expected: a factor of 4 missing or extra" in quarter and "world_size" not in quarter
    assert "another order" not in close(torch.tensor([0, 1, 0, 0, 1]), torch.tensor([0, 0, 1, 0, 1]), "y").reason
    odd = close(x * 0.5721, x, "y").reason
    assert "exactly 0.5721 x the expected (one constant factor)" in odd and "world_size" not in odd
    assert "it looks like" not in close(torch.tensor([6.053, 6.053]), torch.tensor([10.58, 10.58]), "y").reason
