"""FP8 formats, Transformer Engine's scaling recipes and the FP8 Linear against torch's own fp8
casts, the recipe's documented formula, fp32 matmuls and bf16 training."""

import pytest
import torch

from megalab.extras.toy import mlp, regression_data
from megalab.lab.checks import mistake
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


# ---------------------------------------------------------------- MXFP8 and blockwise FP8 (TE's block recipes)
def _pow2_at_least(v):
    """2^ceil(log2(v)) for v > 0, via frexp (v = m 2^e, m in [0.5, 1)): an independent route to TE's E8M0 rounding."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(m == 0.5, e - 1, e))


def _mx_reference(x, dtype, *, block_dim=-1, amax="block", pow2="up", multiply=False):
    """MXFP8 rowwise data (as floats) and dequantization scales [M, K/32], or what one typical mistake gives."""
    fmax = torch.finfo(dtype).max
    xt = x.float() if block_dim == -1 else x.float().t()
    M, K = xt.shape
    blocks = xt.reshape(M, K // 32, 32)
    a = blocks.abs().amax(-1) if amax == "block" else xt.abs().max().expand(M, K // 32)
    if pow2 == "up":
        s_inv = _pow2_at_least(a * torch.tensor(1 / fmax, dtype=torch.float32))
    elif pow2 == "nearest":  # torch's own cast to float8_e8m0fnu rounds to nearest
        s_inv = (a / fmax).to(torch.float8_e8m0fnu).float()
    else:  # fp8_max / amax itself, no power of two
        s_inv = a / fmax
    scaled = blocks * s_inv[..., None] if multiply else blocks / s_inv[..., None]  # multiply: the inverted slip
    data = scaled.clamp(-fmax, fmax).to(dtype).float().reshape(M, K)
    return (data, s_inv) if block_dim == -1 else (data.t(), s_inv)


def _mx_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-4, 4, 96)  # [64, 96]: columns spanning 8 decades
    x[5, 40] = 3.0e4  # an outlier token
    return x


@pytest.mark.exercise("mxfp8.quantize_rowwise")
def test_mxfp8_rowwise_block_scales_and_names_the_mistake():
    from megalab.transformer_engine import mxfp8_tensor as mx

    x = _mx_input()
    data, scale_inv = mx.mxfp8_quantize_rowwise(x, E4M3)
    require(equal(tuple(data.shape), (64, 96), "the shape of the data of mxfp8_quantize_rowwise(x [64, 96])"))
    if tuple(scale_inv.shape) == (2, 96):
        require(mistake("blocks along the wrong dimension (32 rows down a column; MXFP8's rowwise blocks run along "
                        "the last dim)", "scale_inv has shape [M/32, K] = (2, 96), expected [M, K/32] = (64, 3)"))
    require(equal(tuple(scale_inv.shape), (64, 3), "the shape of scale_inv (one E8M0 byte per 32 elements of a row)"))
    expected, expected_s = _mx_reference(x, E4M3)
    wrong_dim = lambda: _mx_reference(x, E4M3, block_dim=0)[0]
    require(close(data.float(), expected, "the FP8 data of mxfp8_quantize_rowwise(x [64, 96], E4M3), as floats",
                  rtol=0, atol=0, mistakes={
                      "scale not a power of two (scaled by fp8_max / amax; MXFP8 scales are E8M0 exponents)":
                          lambda: _mx_reference(x, E4M3, pow2="none")[0],
                      "amax of the whole tensor (one scale for all: that is current scaling, not a block scale)":
                          lambda: _mx_reference(x, E4M3, amax="tensor")[0],
                      "blocks along the wrong dimension (32 rows down a column; MXFP8's rowwise blocks run along "
                      "the last dim)": wrong_dim,
                      "rounded the exponent to nearest (a plain cast to float8_e8m0fnu) instead of up: the block's "
                      "largest values saturate": lambda: _mx_reference(x, E4M3, pow2="nearest")[0],
                      "multiplied by the dequantization scale 2^e instead of dividing by it (the quantization "
                      "scale is its reciprocal: TE's exp2f_rcp)": lambda: _mx_reference(x, E4M3, multiply=True)[0],
                  }))
    require(close(mx.e8m0_to_float(scale_inv), expected_s, "the scales 2^(scale_inv - 127) (E8M0 biased exponents "
                                                             "of the power of two >= block amax / 448)", rtol=0,
                  atol=0))


@pytest.mark.exercise("mxfp8.quantize_rowwise")
def test_mxfp8_quantizer_rowwise_and_columnwise_in_both_formats():
    from megalab.transformer_engine import mxfp8_tensor as mx

    x = _mx_input().reshape(2, 32, 96)  # [b, s, h]: 64 rows
    for dtype in (E4M3, E5M2):
        q = mx.MXFP8Quantizer(dtype)(x)
        x2 = x.reshape(64, 96)
        data, s = _mx_reference(x2, dtype)
        require(close(q.rowwise_data.float(), data, f"rowwise data ({dtype})", rtol=0, atol=0))
        data_c, s_c = _mx_reference(x2, dtype, block_dim=0)  # blocks of 32 down each column
        require(equal(tuple(q.columnwise_scale_inv.shape), (2, 96), "columnwise scale_inv shape [M/32, K]"))
        require(close(q.columnwise_data.float(), data_c, f"columnwise data ({dtype})", rtol=0, atol=0))
        require(close(mx.e8m0_to_float(q.columnwise_scale_inv), s_c.t(), f"columnwise scales ({dtype})", rtol=0,
                      atol=0))
        deq = q.dequantize()
        require(equal(tuple(deq.shape), (2, 32, 96), "dequantize() shape"))
        require(close(deq.reshape(64, 96), data * s.repeat_interleave(32, 1), f"dequantized ({dtype})", rtol=0,
                      atol=0))
        # nothing saturates: the exponent rounds up, so every block's amax scales to <= fp8 max
        assert _rel(deq, x) < 0.07 and (q.rowwise_data.float().abs().amax() <= torch.finfo(dtype).max)


def test_e8m0_rounds_up_as_transformer_engine_and_decodes_as_torch():
    from megalab.transformer_engine import mxfp8_tensor as mx

    v = torch.tensor([1.0, 1.5, 3.0, 0.75, 2.0**-127, 2.0**-128, 0.0, float("inf"), float("nan"), 2.0**127 * 1.5,
                      2.0**-126 * 1.25])
    # TE's float_to_e8m0: exponent rounded up on any mantissa; NaN 0xFF, inf 0xFE, 0 0x00, saturating at 0xFE;
    # subnormals up to 2^-127 stay 0x00
    assert mx.float_to_e8m0(v).tolist() == [127, 128, 129, 127, 0, 0, 0, 254, 255, 254, 2]
    # torch's cast rounds to nearest instead: 1.25 * 2^-126 -> 2^-126 (byte 1), inf -> NaN
    assert v.to(torch.float8_e8m0fnu).view(torch.uint8).tolist()[-1] == 1
    codes = torch.arange(255).to(torch.uint8)
    assert torch.equal(mx.e8m0_to_float(codes), torch.ldexp(torch.ones(255), codes.int() - 127))
    assert torch.equal(mx.exp2f_rcp(codes) * mx.e8m0_to_float(codes), torch.ones(255))  # exact reciprocals
    assert torch.isnan(mx.exp2f_rcp(torch.tensor([255], dtype=torch.uint8))).all()
    amax = torch.rand(1000) * 1e3
    assert torch.equal(mx.e8m0_to_float(mx.float_to_e8m0(amax)), _pow2_at_least(amax))


def test_mxfp8_refuses_shapes_32_does_not_divide():
    from megalab.transformer_engine import mxfp8_tensor as mx

    for shape in ((64, 48), (40, 64), (2, 10, 64), (64,)):
        with pytest.raises(ValueError, match=r"multiples? of 32|2 or more dims") as info:
            mx.MXFP8Quantizer()(torch.randn(shape))
        if len(shape) > 1:
            assert "get_fp8_align_size" in str(info.value) and str(list(shape)) in str(info.value)
    mx.check_mxfp8_shape((2, 16, 64))  # 32 rows, 64 columns: fine


def _block_reference(x, dtype, tile, *, pow2=True, eps=0.0):
    """TE's tests/pytorch/references/blockwise_quantizer_reference.py + quantize_scale_calc.py (frexp route)."""
    M, K = x.shape
    pm, pk = -M % tile[0], -K % tile[1]
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm))
    t = xp.reshape((M + pm) // tile[0], tile[0], (K + pk) // tile[1], tile[1])
    amax = torch.max(t.abs().amax(dim=(1, 3)), torch.tensor(eps))
    fmax = torch.finfo(dtype).max
    scale = torch.div(fmax, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(x.dtype).max, scale)
    if pow2:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - 1)
    scale = torch.where(amax == 0, 1.0, scale)
    q = (t * scale[:, None, :, None]).clamp(-fmax, fmax).to(dtype).reshape(M + pm, K + pk)[:M, :K]
    return q.float(), scale.reciprocal()


@pytest.mark.parametrize("dim, pow2, dtype", [(1, True, E4M3), (1, False, E5M2), (2, True, E5M2), (2, False, E4M3)])
def test_blockwise_matches_transformer_engines_reference_with_partial_tiles(dim, pow2, dtype):
    from megalab.transformer_engine.float8_blockwise_tensor import Float8BlockQuantizer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(136, 132, generator=g) * torch.logspace(-3, 3, 132)  # 136 x 132: partial tiles both ways
    x[:, 128:] = 0  # a zero tile: scale 1
    tile = (1, 128) if dim == 1 else (128, 128)
    q = Float8BlockQuantizer(dtype, block_scaling_dim=dim, force_pow_2_scales=pow2)(x)
    data, s_inv = _block_reference(x, dtype, tile, pow2=pow2)
    where = f"{tile[0]}x{tile[1]} tiles, pow2={pow2}, {dtype}"
    require(close(q.rowwise_data.float(), data, f"rowwise data ({where})", rtol=0, atol=0))
    require(close(q.rowwise_scale_inv, s_inv, f"rowwise scale_inv ({where})", rtol=0, atol=0))
    data_t, s_inv_t = _block_reference(x.t(), dtype, tile, pow2=pow2)
    if dim == 1:  # columnwise: the transpose [132, 136] tiled again, 1x128 along the 136 rows
        require(close(q.columnwise_data.float(), data_t, f"columnwise data ({where})", rtol=0, atol=0))
        require(close(q.columnwise_scale_inv, s_inv_t, f"columnwise scale_inv ({where})", rtol=0, atol=0))
    else:  # square blocks: the columnwise copy is the same numbers transposed
        require(close(q.columnwise_data.float().t(), data, f"columnwise = rowwise^T ({where})", rtol=0, atol=0))
    require(close(q.dequantize(), data * s_inv.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)
                  [:136, :132], f"dequantize ({where})", rtol=0, atol=0))
    assert _rel(q.dequantize(columnwise=True), x) < (0.04 if dtype == E4M3 else 0.08)  # the same x, back
    if pow2:
        s = q.rowwise_scale_inv
        require(equal(bool((torch.frexp(s)[0] == 0.5).all()), True, f"every scale a power of two ({where})"))


def test_blockwise_scale_edge_cases_follow_compute_scale_from_amax():
    from megalab.transformer_engine.float8_blockwise_tensor import Float8BlockQuantizer

    x = torch.zeros(2, 128)
    x[0, 0] = 1e-38  # tiny: 448 / 1e-38 overflows fp32 -> the INPUT dtype's max (compute_scale_from_types)
    for dtype, expected in ((torch.float32, FP32_MAX), (torch.bfloat16, torch.finfo(torch.bfloat16).max)):
        q = Float8BlockQuantizer(E4M3, block_scaling_dim=1, force_pow_2_scales=False, columnwise=False)(x.to(dtype))
        assert q.rowwise_scale_inv[:, 0].tolist() == torch.tensor([1 / expected, 1.0]).tolist()  # zero row: scale 1
    eps = Float8BlockQuantizer(E4M3, block_scaling_dim=1, force_pow_2_scales=False, amax_epsilon=1.0,
                               columnwise=False)(torch.full((1, 128), 0.01))
    assert eps.rowwise_scale_inv.item() == pytest.approx(1 / 448)  # amax raised to the epsilon
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="2D by 2D"):
        fp8.Float8BlockScaling(x_block_scaling_dim=2)


def test_get_fp8_recipe_maps_megatrons_flags():
    import importlib.util
    import re
    from types import SimpleNamespace

    from megalab.transformer_engine import fp8_recipes

    # the installed megatron-core's TransformerConfig, read as text (importing it costs seconds)
    source = open(importlib.util.find_spec("megatron.core").submodule_search_locations[0]
                  + "/transformer/transformer_config.py").read()
    literal = re.search(r"fp8_recipe: Optional\[Literal\[([^\]]*)\]\] = \(?\s*['\"](\w+)", source)
    choices = set(re.findall(r"'(\w+)'", literal.group(1)))
    assert choices - {"custom"} == set(fp8_recipes.FP8_RECIPES) and literal.group(2) == "delayed"
    defaults = {f: re.search(rf"\n    {f}: [^=\n]+= ([^\n]+)", source).group(1).strip("'\"")
                for f in ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")}
    assert defaults == {"fp8_margin": "0", "fp8_amax_history_len": "1", "fp8_amax_compute_algo": "most_recent"}
    expected = {"delayed": fp8.DelayedScaling, "tensorwise": fp8.CurrentScaling, "mxfp8": fp8.MXFP8BlockScaling,
                "blockwise": fp8.Float8BlockScaling}
    for name, kind in expected.items():
        recipe = fp8_recipes.get_fp8_recipe(SimpleNamespace(fp8="hybrid", fp8_recipe=name))
        assert type(recipe) is kind and recipe.fp8_format == "HYBRID"
    delayed = fp8_recipes.get_fp8_recipe(SimpleNamespace(fp8="e4m3"))
    assert delayed == fp8.DelayedScaling(margin=0, fp8_format="E4M3", amax_history_len=1,
                                         amax_compute_algo="most_recent")
    with pytest.raises(ValueError, match="e4m3"):
        fp8_recipes.get_fp8_recipe(type("C", (), {"fp8": None})())
    with pytest.raises(ValueError, match="mxfp8"):
        fp8_recipes.get_fp8_recipe(type("C", (), {"fp8": "hybrid", "fp8_recipe": "nvfp4"})())


@pytest.mark.exercise("mxfp8.quantize_rowwise")
def test_block_recipes_keep_the_small_values_that_per_tensor_scaling_flushes():
    from megalab.transformer_engine import fp8_recipes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    plain = {k: fp8_recipes.quantization_error(x, fp8_recipes.fake_quantize(x, r, "input", x.abs().max()))
             for k, r in fp8_recipes.default_recipes("E4M3").items()}
    # no outliers: a power-of-two scale changes no value's relative rounding, so the recipes tie
    spread = max(v["rel_error"] for v in plain.values()) - min(v["rel_error"] for v in plain.values())
    assert spread < 0.002 and all(v["zeroed"] == 0 for v in plain.values())
    x[::64, :2] *= 3e4  # massive activations: a few tokens, two channels
    errs = {k: fp8_recipes.quantization_error(x, fp8_recipes.fake_quantize(x, r, "input", x.abs().max()))
            for k, r in fp8_recipes.default_recipes("E4M3").items()}
    assert errs["tensorwise"]["zeroed"] > 0.05 and errs["delayed"]["zeroed"] > 0.05
    assert errs["mxfp8"]["zeroed"] < 0.005 and errs["blockwise"]["zeroed"] < 0.005  # only the outlier tokens' tiles
    with pytest.raises(ValueError, match="previous_amax"):
        fp8_recipes.fake_quantize(x, fp8.DelayedScaling(), "input")


def test_block_scaled_gemm_on_torch_scaled_mm_is_the_dequantized_matmul():
    from megalab.transformer_engine import float8_blockwise_tensor as fbt
    from megalab.transformer_engine import fp8_recipes
    from megalab.transformer_engine import mxfp8_tensor as mx

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-2, 2, 64)[:, None]  # [M, K]: a partial K-block
    w = torch.randn(96, 300, generator=g) * 0.02                                   # [N, K]
    qx = fbt.Float8BlockQuantizer(block_scaling_dim=1, columnwise=False)(x)        # 1x128 tiles
    qw = fbt.Float8BlockQuantizer(block_scaling_dim=2, columnwise=False)(w)        # 128x128 blocks
    y = fp8_recipes.block_scaled_mm(qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data,
                                    qw.rowwise_scale_inv.repeat_interleave(128, 0)[:96], 128)
    require(close(y, qx.dequantize() @ qw.dequantize().T, "blockwise GEMM from per-K-block torch._scaled_mm",
                  rtol=1e-5, atol=1e-4))
    qx, qw = mx.MXFP8Quantizer(columnwise=False)(x[:, :256]), mx.MXFP8Quantizer(columnwise=False)(w[:, :256])
    y = fp8_recipes.block_scaled_mm(qx.rowwise_data, mx.e8m0_to_float(qx.rowwise_scale_inv), qw.rowwise_data,
                                    mx.e8m0_to_float(qw.rowwise_scale_inv), 32)
    require(close(y, qx.dequantize() @ qw.dequantize().T, "MXFP8 GEMM from per-K-block torch._scaled_mm",
                  rtol=1e-5, atol=1e-4))
    assert _rel(y, x[:, :256] @ w[:, :256].T) < 0.06  # and it is the product of the unquantized tensors, roughly


def test_fp8_linear_under_mxfp8_uses_each_gemms_own_blocks():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    # values spanning 12 decades along the last dim: rowwise and columnwise blocks flush different values, so
    # using one copy where the GEMM needs the other shows
    wide = lambda n: torch.logspace(-6, 6, n)
    with torch.no_grad():
        linear.weight.mul_(wide(64))
    x = (torch.randn(2, 32, 64) * wide(64)).requires_grad_()  # 64 tokens
    g = torch.randn(2, 32, 96) * wide(96)
    layer = fp8.Fp8Linear.from_linear(linear, fp8.MXFP8BlockScaling())  # E4M3 everywhere, TE's default

    def deq(t, along):  # MXFP8 blocks of 32 along dim `along` of the 2-D t, dequantized (the frexp reference)
        data, s = _mx_reference(t, E4M3, block_dim=-1 if along == 1 else 0)
        return data * (s.repeat_interleave(32, 1) if along == 1 else s.t().repeat_interleave(32, 0))

    y = layer(x)
    dx, dw = torch.autograd.grad(y, (x, layer.weight), g)
    x2, w, g2 = x.detach().reshape(64, 64), linear.weight.detach(), g.reshape(64, 96)
    where = "Fp8Linear (MXFP8BlockScaling)"
    require(close(y.reshape(64, 96), deq(x2, 1) @ deq(w, 1).T + linear.bias.detach(),
                  f"{where}: y vs x W^T from blocks along K", rtol=1e-5, atol=1e-5))
    require(close(dx.reshape(64, 64), deq(g2, 1) @ deq(w, 0), f"{where}: dx vs g W from blocks along N (W columnwise)",
                  rtol=1e-5, atol=1e-5))
    require(close(dw, deq(g2, 0).T @ deq(x2, 0), f"{where}: dW vs g^T x from blocks along M (both columnwise)",
                  rtol=1e-5, atol=1e-5))
    x, g, plain = torch.randn(64, 64, requires_grad=True), torch.randn(64, 96), torch.nn.Linear(64, 96)
    exact = torch.autograd.grad(plain(x), x, g)[0]
    dx_e4m3, dx_hybrid = (torch.autograd.grad(fp8.Fp8Linear.from_linear(plain, fp8.Float8BlockScaling(
        fp8_format=f))(x), x, g)[0] for f in ("E4M3", "HYBRID"))
    assert _rel(dx_e4m3, exact) < 0.7 * _rel(dx_hybrid, exact)  # E4M3 gradients: one more mantissa bit than E5M2
