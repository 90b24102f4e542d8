"""FP8 formats, Transformer Engine's scaling recipes and the FP8 Linear against torch's own fp8
casts, the recipe's documented formula, fp32 matmuls and bf16 training."""

import pytest
import torch

from megalab.extras.toy import mlp, regression_data
from megalab.transformer_engine import fp8
from tests.feedback import close, equal, require

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_format_table_from_bits_matches_every_fp8_bit_pattern():
    rows = {r["format"]: r for r in fp8.format_table()}
    assert all(r["matches_torch_finfo"] for r in rows.values())
    assert (rows["E4M3"]["max"], rows["E5M2"]["max"]) == (448.0, 57344.0)  # Micikevicius et al. 2022, Table 1
    for name, dtype in (("E4M3", E4M3), ("E5M2", E5M2)):
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()  # all 256 codes, decoded by torch
        finite = values[torch.isfinite(values)]
        assert finite.max().item() == rows[name]["max"]
        assert finite[finite > 0].min().item() == rows[name]["smallest_subnormal"]
        ones = finite[finite >= 1]
        assert ones[ones > 1].min().item() - 1 == rows[name]["eps"]


def _scales(amax, old, fp8_max, margin, *, margin_divides=True, keep_for_zero=True, keep_for_nonfinite=True,
            clamp_overflow=True):
    """Delayed scaling's new scale (TE's _default_sf_compute), or what one typical mistake (the flags) gives."""
    new = torch.full_like(amax, fp8_max) / amax
    new = new / 2.0**margin if margin_divides else new * 2.0**margin
    if keep_for_zero:
        new = torch.where(amax > 0, new, old)
    if keep_for_nonfinite:
        new = torch.where(torch.isfinite(amax), new, old)
    return torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new) if clamp_overflow else new


@pytest.mark.exercise("fp8.compute_scale")
def test_compute_scale_follows_the_formula_for_both_formats_and_names_the_mistake():
    amax = torch.tensor([2.0, 448.0, 0.5, 0.0, float("inf"), float("nan"), 448.0 / FP32_MAX / 4])  # the last: overflows
    old = torch.full_like(amax, 3.0)
    got = torch.stack([fp8.compute_scale(amax, old, fp8_max, 1) for fp8_max in (448.0, 57344.0)])
    expected = torch.stack([_scales(amax, old, fp8_max, 1) for fp8_max in (448.0, 57344.0)])
    require(close(got, expected, "compute_scale(amax [2, 448, 0.5, 0, inf, nan, tiny], old scale 3, margin 1), row 0 "
                                 "E4M3 (fp8_max 448), row 1 E5M2 (fp8_max 57344)", rtol=0, atol=0, mistakes={
        "forgot the margin (scale = fp8_max / amax, not / 2^margin)":
            torch.stack([_scales(amax, old, m, 0) for m in (448.0, 57344.0)]),
        "multiplied by 2^margin instead of dividing (the margin must shrink the scale)":
            torch.stack([_scales(amax, old, m, 1, margin_divides=False) for m in (448.0, 57344.0)]),
        "hard-coded E4M3's max 448 for every format (use fp8_max: 57344 for E5M2)":
            torch.stack([_scales(amax, old, 448.0, 1) for _ in range(2)]),
        "did not keep the old scale where amax is 0 (fp8_max / 0 = inf)":
            torch.stack([_scales(amax, old, m, 1, keep_for_zero=False) for m in (448.0, 57344.0)]),
        "did not keep the old scale where amax is inf or NaN":
            torch.stack([_scales(amax, old, m, 1, keep_for_nonfinite=False) for m in (448.0, 57344.0)]),
        "did not clamp an overflowing scale (a tiny amax) to FP32 max":
            torch.stack([_scales(amax, old, m, 1, clamp_overflow=False) for m in (448.0, 57344.0)]),
        "inverted the quotient: amax / fp8_max (the scale maps amax ONTO fp8_max: fp8_max / amax)":
            torch.stack([torch.where((amax > 0) & amax.isfinite(), amax / m / 2, old) for m in (448.0, 57344.0)]),
    }))


@pytest.mark.exercise("fp8.compute_scale")
def test_compute_scale_follows_transformer_engine_formula():
    old = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0])
    amax = torch.tensor([2.0, 448.0, 0.0, float("inf"), float("nan")])
    new = fp8.compute_scale(amax, old, 448.0, margin=1)
    require(equal(new.tolist(), [112.0, 0.5, 3.0, 3.0, 3.0],
                  "compute_scale(amax [2, 448, 0, inf, nan], old scale 3, fp8_max 448, margin 1) ((448 / amax) / 2^1; "
                  "the old scale where amax is 0, inf or NaN)"))
    tiny = torch.tensor([448.0 / torch.finfo(torch.float32).max / 2])  # 448 / amax overflows FP32
    require(equal(fp8.compute_scale(tiny, torch.ones(1), 448.0, margin=0).tolist(), [torch.finfo(torch.float32).max],
                  "compute_scale(a tiny amax whose 448 / amax overflows FP32): Transformer Engine clamps the scale to "
                  "FP32 max (an inf scale turns every zero into 0 * inf = NaN)"))


# ---------------------------------------------------------------- Transformer Engine's recipes, transcribed
FP32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("fmt, fp8_max", [("E4M3", 448.0), ("E5M2", 57344.0)])
@pytest.mark.parametrize("amax_case", ["zero", "tiny", "normal", "inf", "nan"])
def test_delayed_scale_update_numeric_scenarios_of_transformer_engine(fmt, fp8_max, amax_case):
    """TE tests/pytorch/test_recipe.py, test_scale_update_numeric_scenarios: a history of one amax, scale 1 before;
    the expected scales are TE's (zero, inf, NaN: unchanged; tiny: FP32 max; normal: fp8_max / amax)."""
    amax = {"zero": 0.0, "tiny": fp8_max / FP32_MAX / 2, "normal": 0.4375, "inf": float("inf"), "nan": float("nan")}[amax_case]
    expected = {"tiny": FP32_MAX, "normal": fp8_max / 0.4375}.get(amax_case, 1.0)
    assert fp8.compute_scale(torch.tensor([amax]), torch.ones(1), fp8_max, 0).item() == expected
    meta = fp8.ScalingMeta(fp8.DelayedScaling(amax_history_len=1, fp8_format="HYBRID"), fmt)
    x = torch.full((4,), amax)
    x[0] = 0.0
    meta.quantize(x)  # records amax(x) (NaN: max() propagates it), then computes the next scale
    assert meta.scale.item() == expected
    q, scale_inv = meta.quantize(torch.zeros(4))
    assert not torch.isnan(q.float()).any()  # zeros stay zeros under a clamped scale


def _te_delayed_scaling(amaxes, history_len, algo, margin, fp8_max):
    """TE's delayed scaling step by step (transformer_engine/pytorch/quantization.py: the current step's amax
    goes to history[0]; _default_get_amax_and_update_history reduces ("max" over the window, "most_recent"
    = history[0]) then rolls by -1 and zeroes slot 0; _default_sf_compute turns it into the next scale)."""
    history, scale, scales = torch.zeros(history_len), torch.ones(()), []
    for a in amaxes:
        history[0] = a
        amax = history.max() if algo == "max" else history[0].clone()
        if history_len > 1:
            history = torch.roll(history, -1, 0)
        history[0] = 0.0
        new = torch.full_like(amax, fp8_max) / amax / 2**margin
        new = torch.where(amax > 0, new, scale)
        new = torch.where(torch.isfinite(amax), new, scale)
        scale = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
        scales.append(scale.item())
    return scales


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 3, 16])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmt, fp8_max", [("E4M3", 448.0), ("E5M2", 57344.0)])
def test_delayed_scaling_history_matches_transformer_engine(algo, history_len, margin, fmt, fp8_max):
    """The scale after every step of a run whose amax grows, spikes, shrinks, hits 0: both amax algorithms, margins."""
    amaxes = [1.0, 2.0, 40.0, 3.0, 0.5, 0.0, 0.25, 7.0, 1e-3, 2.0, 0.0, 0.0, 5.0]
    recipe = fp8.DelayedScaling(margin=margin, amax_history_len=history_len, amax_compute_algo=algo)
    meta = fp8.ScalingMeta(recipe, fmt)
    ours = []
    for a in amaxes:
        meta.quantize(torch.tensor([a, -a / 2]))
        ours.append(meta.scale.item())
    assert ours == _te_delayed_scaling(amaxes, history_len, algo, margin, fp8_max)


@pytest.mark.parametrize("amax, epsilon, pow2, expected", [
    (0.0, 0.0, False, 1.0), (float("inf"), 0.0, False, 1.0), (float("nan"), 0.0, False, 1.0),
    (448.0 / FP32_MAX / 2, 0.0, False, FP32_MAX), (3.0, 0.0, False, torch.tensor(448.0) / torch.tensor(3.0)),
    (3.0, 0.0, True, 128.0), (1e-6, 1e-3, False, torch.tensor(448.0) / torch.tensor(1e-3)), (0.0, 1e-3, True, 262144.0),
])
def test_current_scaling_matches_transformer_engine(amax, epsilon, pow2, expected):
    """TE's compute_scale_from_amax (transformer_engine/common/recipe/recipe_common.cuh), E4M3: amax raised to
    amax_epsilon; 1 for a zero, inf or NaN amax; FP32 max on overflow; power_2_scale keeps the power of two below."""
    scale = fp8.compute_current_scale(torch.tensor(amax), 448.0, use_power_2_scales=pow2, amax_epsilon=epsilon)
    assert scale.item() == float(expected)
    meta = fp8.ScalingMeta(fp8.CurrentScaling(use_power_2_scales=pow2, amax_epsilon=epsilon), "E4M3")
    q, scale_inv = meta.quantize(torch.tensor([amax, 0.0]))
    assert meta.scale.item() == float(expected) and scale_inv.item() == meta.scale.reciprocal().item()


@pytest.mark.exercise("fp8.quantize")
def test_quantize_saturates_in_both_formats_and_names_the_mistake():
    x = torch.tensor([0.001, 0.01, -0.3, 1.7, 100.0, -1000.0, 30000.0], dtype=torch.bfloat16)

    def rows(fn):  # [2, 6]: E4M3 then E5M2, as floats
        return torch.stack([fn(torch.finfo(dtype).max).to(dtype).float() for dtype in (E4M3, E5M2)])

    got = torch.stack([fp8.quantize(x, torch.tensor(4.0), dtype).float() for dtype in (E4M3, E5M2)])
    require(close(got, rows(lambda m: (x.float() * 4).clamp(-m, m)),
                  "quantize(bf16 [0.001, 0.01, -0.3, 1.7, 100, -1000, 30000], scale 4) as floats, row 0 E4M3, row 1 "
                  "E5M2",
                  rtol=0, atol=0, mistakes={
                      "cast without clamping to +-fp8 max (out-of-range values overflow to inf in E5M2)":
                          rows(lambda m: x.float() * 4),
                      "divided by the scale instead of multiplying": rows(lambda m: (x.float() / 4).clamp(-m, m)),
                      "clamped to E4M3's 448 for every format (take the max from torch.finfo(dtype))":
                          rows(lambda m: (x.float() * 4).clamp(-448.0, 448.0)),
                      "cast x to FP8 before multiplying by the scale (0.001 rounds to FP8 first): multiply in fp32, "
                      "then cast once": torch.stack([(x.to(d).float() * 4).clamp(-torch.finfo(d).max, torch.finfo(d).max)
                                                     .to(d).float() for d in (E4M3, E5M2)]),
                  }))


@pytest.mark.exercise("fp8.quantize")
def test_quantize_scales_saturates_and_casts_like_torch():
    x = torch.tensor([0.01, -0.3, 1.7, 100.0, -1000.0], dtype=torch.bfloat16)
    for dtype in (E4M3, E5M2):
        q = fp8.quantize(x, torch.tensor(4.0), dtype)
        where = f"quantize(bf16 [0.01, -0.3, 1.7, 100, -1000], scale 4, {str(dtype).removeprefix('torch.')})"
        require(equal(q.dtype, dtype, f"the dtype of {where}"))
        fmax = torch.finfo(dtype).max
        expected = (x.float() * 4).clamp(-fmax, fmax).to(dtype)
        require(close(q.float(), expected.float(), f"{where}, as floats (x * scale in fp32, clamped to +-{fmax:g}, "
                                                   "then cast)", rtol=0, atol=0))
    require(equal(fp8.quantize(x, torch.tensor(4.0), E4M3).float()[-2:].tolist(), [384.0, -448.0],
                  "the last two values of quantize(..., scale 4, E4M3): 400 and -4000 (400 rounds to 384; -4000 "
                  "saturates at -448, not NaN)"))
    big = fp8.quantize(torch.tensor([30000.0, -30000.0], dtype=torch.bfloat16), torch.tensor(4.0), E5M2).float()
    require(equal(big.tolist(), [57344.0, -57344.0],
                  "quantize(bf16 [30000, -30000], scale 4, E5M2) (+-120000 saturates at E5M2's max 57344, not inf: "
                  "clamp before the cast)"))


@pytest.mark.exercise("fp8.compute_scale")
@pytest.mark.exercise("fp8.quantize")
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_uses_the_amax_history_of_earlier_steps(algo):
    amaxes = [2.0, 8.0, 0.5, 0.25, 4.0, 0.0, 1.0]
    recipe = fp8.DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo=algo)
    meta = fp8.ScalingMeta(recipe, "E4M3")
    scale = 1.0  # TE starts from scale 1
    for step, amax in enumerate(amaxes):
        x = torch.tensor([amax, -amax / 3])
        _, scale_inv = meta.quantize(x)
        assert scale_inv.item() == pytest.approx(1 / scale), (
            f"DelayedScaling(margin=1, amax_history_len=3, {algo!r}), step {step} (amaxes so far {amaxes[:step + 1]}): "
            f"scale_inv is {scale_inv.item():.6g}, expected 1/{scale:.6g} = {1 / scale:.6g} (the scale from the "
            "history of EARLIER steps)")
        window = amaxes[max(0, step + 1 - 3): step + 1]  # this step's amax joins for the next step
        reduced = max(window) if algo == "max" else window[-1]
        scale = 448.0 / reduced / 2 if reduced > 0 else scale
    require(equal(meta.amax_history.tolist(), amaxes[:-4:-1],
                  f"DelayedScaling(amax_history_len=3, {algo!r}): the amax history after {len(amaxes)} steps (newest "
                  "first)"))


@pytest.mark.exercise("fp8.compute_scale")
def test_current_scaling_maps_the_tensors_own_amax_to_fp8_max():
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 37
    for fmt, dtype in (("E4M3", E4M3), ("E5M2", E5M2)):
        q, scale_inv = fp8.ScalingMeta(fp8.CurrentScaling(), fmt).quantize(x)
        require(equal(q.float().abs().max().item(), torch.finfo(dtype).max,
                      f"CurrentScaling, {fmt}: the largest |value| after quantizing (the tensor's amax maps to the "
                      "format's max)"))
        rel = _rel(q.float() * scale_inv, x)
        assert rel < torch.finfo(dtype).eps / 2, (  # rounding only, no clipping
            f"CurrentScaling, {fmt}: dequantized values are off by {rel:.3g} (relative norm), more than rounding "
            f"({torch.finfo(dtype).eps / 2:.3g})")


def test_cpu_scaled_mm_is_the_dequantized_matmul():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(E4M3)
    b = torch.randn(48, 64, generator=g).to(E5M2)
    sa, sb = torch.tensor(0.25), torch.tensor(3.0)
    out = fp8.scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32)
    torch.testing.assert_close(out, (a.float() * sa) @ (b.float() * sb).t())


def _reference_fp8_linear(x, w, b, g):
    """y = x W^T + b and its grads with current scaling, written from torch casts alone."""
    def q(t, dtype):
        s = torch.finfo(dtype).max / t.abs().max()
        return t.float().mul(s).to(dtype).float() / s
    xq, wq, gq = q(x, E4M3), q(w, E4M3), q(g, E5M2)
    return xq @ wq.t() + b, gq @ wq, gq.t() @ xq


@pytest.mark.exercise("fp8.compute_scale")
@pytest.mark.exercise("fp8.quantize")
def test_fp8_linear_matches_reference_and_its_error_is_measured():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = fp8.Fp8Linear.from_linear(linear, fp8.CurrentScaling())
    x = torch.randn(3, 5, 64, requires_grad=True)  # 15 tokens: padded to 16 inside
    g = torch.randn(3, 5, 48)
    y = layer(x)
    grad_x, grad_w = torch.autograd.grad(y, (x, layer.weight), g)
    ref_y, ref_gx, ref_gw = _reference_fp8_linear(x.detach().reshape(15, 64), linear.weight.detach(),
                                                   linear.bias.detach(), g.reshape(15, 48))
    where = "Fp8Linear (CurrentScaling; x, W in E4M3, the output gradient in E5M2)"
    require(close(y.reshape(15, 48), ref_y, f"{where}: the output vs x_q W_q^T + b from torch casts", rtol=1e-5, atol=1e-5))
    require(close(grad_x.reshape(15, 64), ref_gx, f"{where}: the input gradient vs g_q W_q", rtol=1e-5, atol=1e-5))
    require(close(grad_w, ref_gw, f"{where}: the weight gradient vs g_q^T x_q", rtol=1e-5, atol=1e-5))
    # error vs fp32: E4M3 (3 mantissa bits) is ~16x coarser than bf16 (7 bits)
    exact = linear(x)
    bf16 = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
    assert _rel(bf16, exact) < _rel(y, exact) < 0.08, (
        f"{where}: its relative error vs fp32 is {_rel(y, exact):.3g}; expected between bf16's "
        f"{_rel(bf16, exact):.3g} and 0.08")


def test_hybrid_recipe_casts_the_output_grad_to_e5m2():
    layer = fp8.Fp8Linear(16, 16)
    assert [m.dtype for m in layer.fp8_meta.values()] == [E4M3, E4M3, E5M2]
    assert fp8.Fp8Linear(16, 16, recipe=fp8.DelayedScaling(fp8_format="E4M3")).fp8_meta["grad_output"].dtype == E4M3


def test_fp8_training_tracks_bf16():
    x, y = regression_data(samples=128, dtype=torch.float32).tensors
    losses = {}
    for name in ("bf16", "fp8"):
        model = mlp(hidden=32, dtype=torch.float32)
        if name == "fp8":
            fp8.convert_to_fp8(model, fp8.DelayedScaling(amax_history_len=16))
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
        losses[name] = []
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
                loss = (model(x).float() - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["fp8"][-1] < 0.2 * losses["fp8"][0]  # it learns
    fp8_end, bf16_end = (sum(losses[k][-5:]) / 5 for k in ("fp8", "bf16"))
    assert abs(fp8_end - bf16_end) < 0.3 * bf16_end  # the same curve, within FP8's rounding


def test_path_is_chosen_from_the_device(monkeypatch):
    assert fp8.fp8_path("cpu") == "emulated"
    for capability, path in (((9, 0), "tensor cores"), ((8, 9), "tensor cores"), ((8, 0), "emulated")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8.fp8_path("cuda") == path


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="HYBRID"):
        fp8.DelayedScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="most_recent"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        fp8.Fp8Linear(16, 16)(torch.randn(4, 8))


@pytest.mark.gpu
def test_tensor_core_path_matches_the_emulated_path():
    if fp8.fp8_path("cuda") != "tensor cores":
        pytest.skip("needs an FP8 GPU (compute capability >= 8.9)")
    torch.manual_seed(0)
    cpu = fp8.Fp8Linear(64, 48, recipe=fp8.CurrentScaling())
    gpu = fp8.Fp8Linear.from_linear(cpu, fp8.CurrentScaling()).cuda()
    x = torch.randn(40, 64)
    g = torch.randn(40, 48)
    results = []
    for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
        xd = x.to(device).requires_grad_()
        y = layer(xd)
        results.append([t.cpu() for t in (y, *torch.autograd.grad(y, (xd, layer.weight), g.to(device)))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_tensor_core_fp8_linear_in_bf16_tracks_bf16():
    if fp8.fp8_path("cuda") != "tensor cores":
        pytest.skip("needs an FP8 GPU (compute capability >= 8.9)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    y = fp8.Fp8Linear.from_linear(linear)(x)
    assert y.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert _rel(y, exact) < 0.08


def test_doctor_names_the_fp8_path():
    from megalab.lab import doctor

    fast = torch.cuda.is_available() and fp8.fp8_path("cuda") == "tensor cores"
    assert f"megalab.transformer_engine.fp8 path: {'tensor cores' if fast else 'emulated'}" in doctor.report()
