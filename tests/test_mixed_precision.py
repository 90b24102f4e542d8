"""Loss scaling and fp32 main params against torch.amp.GradScaler, Megatron's documented rules,
fp32 training and the bytes-per-parameter table."""

import pytest
import torch

from megalab.core.optimizer import optimizer as mp
from megalab.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalab.extras import calc
from megalab.extras.toy import mlp, regression_data
from megalab.lab import launch
from megalab.lab.checks import mistake, wrong
from tests.feedback import close, equal, require

INF, NAN = float("inf"), float("nan")


def _grad_sequence(steps=14, n=6):
    """Grads exactly representable in fp16 (k/16), a few with an inf or a NaN."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randint(-8, 9, (n,), generator=g).float() / 16 for _ in range(steps)]
    for step, bad in ((2, INF), (3, NAN), (4, -INF), (9, INF)):
        grads[step][step % n] = bad
    return grads


def _megatron_scales(overflows, initial=1024.0, min_scale=128.0, growth_interval=3, hysteresis=2, *,
                     grow_every_clean_step=False, restart_growth=True, use_hysteresis=True, refill_hysteresis=True):
    """The scale after each update under Megatron's rule, or under one typical mistake (the keyword flags)."""
    scale, growth, left, scales = initial, 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            growth = 0 if restart_growth else growth
            left -= 1
            if left <= 0 or not use_hysteresis:
                scale = max(scale * 0.5, min_scale)
        elif grow_every_clean_step:
            scale *= 2
        else:
            growth += 1
            if growth == growth_interval:
                growth, scale = 0, scale * 2
                left = hysteresis if refill_hysteresis else left
        scales.append(scale)
    return scales


@pytest.mark.exercise("mixed_precision.dynamic_update")
def test_dynamic_update_follows_megatron_rule_and_names_the_mistake():
    overflows = [False, False, True, False, False, False, True, True, False, False, True, False, False, False, True]
    scaler = DynamicGradScaler(1024.0, min_scale=128.0, growth_interval=3, hysteresis=2)
    scales = []
    for overflow in overflows:
        scaler.update(overflow)
        scales.append(scaler.scale.item())
    expected = _megatron_scales(overflows)
    verdict = close(scales, expected,
                  f"DynamicGradScaler(1024, min_scale=128, growth_interval=3, hysteresis=2): the scale after each "
                  f"update (overflows {[int(o) for o in overflows]})", rtol=0, atol=0, mistakes={
                      "grew the scale on every clean step, not after growth_interval clean steps in a row":
                          _megatron_scales(overflows, grow_every_clean_step=True),
                      "did not restart the growth count after an overflow (growth needs clean steps in a row)":
                          _megatron_scales(overflows, restart_growth=False),
                      "backed off on every overflow, ignoring the hysteresis":
                          _megatron_scales(overflows, use_hysteresis=False),
                      "did not refill the hysteresis when the scale grew":
                          _megatron_scales(overflows, refill_hysteresis=False),
                  })
    if not verdict and not verdict.reason.startswith("likely mistake"):  # no typical mistake: say what it did
        verdict = wrong(f"{_first_wrong_update(overflows, scales, expected)} — {verdict.reason}")
    require(verdict)


def _first_wrong_update(overflows, got, expected, initial=1024.0) -> str:
    """The first update whose scale differs, in words: what it did (grew, backed off, stayed) and what Megatron does."""
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    before_got, before = (got[i - 1], expected[i - 1]) if i else (initial, initial)
    clean = next((n for n, o in enumerate(reversed(overflows[: i + 1])) if o), i + 1)  # clean updates in a row
    overflows_so_far = sum(overflows[: i + 1])

    def did(a, b):
        return f"stayed at {b:g}" if a == b else ("grew to " if b > a else "backed off to ") + f"{b:g}"

    kind = (f"an overflow (overflow {overflows_so_far} so far; hysteresis=2)" if overflows[i] else
            f"a clean step, {clean} in a row (growth_interval=3)")
    return f"update {i} ({kind}): the scale {did(before_got, got[i])}; Megatron's {did(before, expected[i])}"


@pytest.mark.exercise("mixed_precision.unscale")
def test_unscale_is_in_place_by_inv_scale_and_finds_every_inf_and_nan():
    scaled = [torch.tensor([8.0, -4.0, 2.0]), torch.tensor([16.0, 0.5, -1.0])]  # exact in fp32 at every step
    grads = [g.clone() for g in scaled]
    found = mp.unscale_and_check_for_nan(grads, torch.tensor(1 / 8))
    where = "unscale_and_check_for_nan(2 finite gradients, inv_scale=1/8)"
    require(close(torch.cat(grads), torch.cat(scaled) / 8, f"{where}: the gradients afterwards (unscaled in place)",
                  rtol=0, atol=0, mistakes={
                      "divided by inv_scale (multiplied by the loss scale) instead of multiplying by inv_scale":
                          torch.cat(scaled) * 8,
                      "unscaled copies, not the gradients in place (`g = g * inv_scale` only rebinds a name)":
                          torch.cat(scaled),
                  }))
    require(equal(found, False, f"what {where} returns (True only for an inf or NaN)"))
    reported, left_scaled = {}, []
    for position in (0, 1):
        for bad in (INF, NAN):
            grads = [g.clone() for g in scaled]
            grads[position][1] = bad
            reported[position, str(bad)] = bool(mp.unscale_and_check_for_nan(grads, torch.tensor(1 / 8)))
            if position == 0 and torch.equal(grads[1], scaled[1]):
                left_scaled.append(str(bad))
    if left_scaled:
        require(mistake("stopped at the first inf/NaN: the gradients after it were left scaled (unscale every "
                        "gradient, then report)", f"with a{'n' if left_scaled[0] == 'inf' else ''} {left_scaled[0]} "
                        "in gradient 0 of 2, gradient 1 came back unchanged (still x 8)"))
    missed = [f"{bad} in gradient {position}" for (position, bad), found in reported.items() if not found]
    if missed == [f"{bad} in gradient {position}" for position in (0, 1) for bad in ("inf", "nan")]:
        require(mistake("never reported an inf/NaN (found_inf stays False)", "no inf or NaN in 2 gradients was found"))
    if missed == ["nan in gradient 0", "nan in gradient 1"]:
        require(mistake("checked for inf only: a NaN is not an inf (ask torch.isfinite)", "a NaN was not reported"))
    if missed == ["inf in gradient 0", "nan in gradient 0"]:
        require(mistake("overwrote found_inf for every gradient, so only the last gradient counts (use |=)",
                        "an inf/NaN in gradient 0 of 2 was not reported"))
    require(equal(missed, [], "the inf/NaN values unscale_and_check_for_nan(2 gradients, one holding an inf or a NaN) "
                              "did not report"))


@pytest.mark.exercise("mixed_precision.dynamic_update")
@pytest.mark.exercise("mixed_precision.unscale")
def test_dynamic_scaler_matches_torch_grad_scaler():
    # Megatron's hysteresis has no torch equivalent: hysteresis=1 backs off on every overflow, as torch does.
    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    torch_param = torch.nn.Parameter(torch.ones(6))
    torch_opt = torch.optim.SGD([torch_param], lr=0.5)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, **kw)
    torch_scaler.scale(torch.ones(()))  # creates its scale tensor
    model_param = torch.nn.Parameter(torch.ones(6, dtype=torch.float16))
    ours = mp.Float16OptimizerWithFloat16Params(
        torch.optim.SGD([model_param], lr=0.5), DynamicGradScaler(2.0**4, min_scale=2.0**-24, hysteresis=1, **kw))
    skipped = []
    for step, grad in enumerate(_grad_sequence()):
        torch_param.grad = grad * torch_scaler.get_scale()  # the grad of the scaled loss
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        model_param.grad = (grad * ours.get_loss_scale()).half()
        ok, _ = ours.step()
        skipped.append(not ok)
        where = (f"step {step} (gradients {'with an inf/NaN' if not grad.isfinite().all() else 'finite'}; "
                 "growth_interval=3, hysteresis=1)")
        require(equal(ours.get_loss_scale().item(), torch_scaler.get_scale(),
                      f"{where}: the loss scale after the step vs torch.amp.GradScaler's"))
        require(close(ours.fp32_from_float16_groups[0][0], torch_param.detach(),
                      f"{where}: the fp32 main parameter vs torch's parameter", rtol=0, atol=0))
        require(close(model_param.detach(), torch_param.detach().half(),
                      f"{where}: the fp16 model parameter vs torch's parameter in fp16", rtol=0, atol=0))
    require(equal(skipped, [False, False, True, True, True, False, False, False, False, True, False, False, False, False],
                  "the steps skipped for an inf/NaN gradient, per step"))


@pytest.mark.exercise("mixed_precision.dynamic_update")
def test_hysteresis_follows_megatron_rule():
    # Megatron's rule by hand: an overflow restarts growth and uses up one unit of hysteresis; with
    # none left the scale halves (again on every overflow until the next growth); growth_interval
    # clean steps double it and refill the hysteresis.
    scaler = DynamicGradScaler(1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    found_inf = [True, False, True, True, False, False, False, True, True, False, False, True]
    expected = [1024, 1024, 512, 256, 256, 256, 512, 512, 256, 256, 256, 128]
    scales = []
    for f in found_inf:
        scaler.update(f)
        scales.append(scaler.scale.item())
    require(equal(scales, expected, f"DynamicGradScaler(1024, growth_interval=3, hysteresis=2): the scale after each "
                                    f"update, overflows {found_inf}"))


@pytest.mark.exercise("mixed_precision.dynamic_update")
def test_scale_never_below_min_scale_and_state_dict_round_trip():
    scaler = DynamicGradScaler(8.0, min_scale=2.0, growth_interval=2, hysteresis=1)
    for _ in range(5):
        scaler.update(True)
    require(equal(scaler.scale.item(), 2.0, "DynamicGradScaler(8, min_scale=2): the scale after 5 overflows (never "
                                            "below min_scale)"))
    scaler.update(False)
    copy = DynamicGradScaler(8.0, min_scale=2.0, growth_interval=2, hysteresis=1)
    copy.load_state_dict(scaler.state_dict())
    for s in (scaler, copy):
        s.update(False)
    require(equal(scaler.scale.item(), 4.0, "DynamicGradScaler(8, min_scale=2, growth_interval=2): the scale after 5 "
                                            "overflows then 2 clean steps (doubled)"))
    require(equal(copy.scale.item(), 4.0, "the scale of a scaler restored from its state_dict after one clean step, "
                                          "then one more (the growth tracker must be in the state_dict)"))


@pytest.mark.exercise("mixed_precision.unscale")
def test_unscale_matches_torch_fused_kernel():
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(i)) * 1024 for i in range(3)]
    inv_scale = torch.tensor(1 / 1024)
    for bad in (None, INF, NAN):
        ours, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
        if bad is not None:
            ours[1][2] = theirs[1][2] = bad
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, inv_scale)
        where = f"unscale_and_check_for_nan(3 gradients{f', one holding {bad}' if bad is not None else ''}, 1/1024)"
        require(equal(mp.unscale_and_check_for_nan(ours, inv_scale), bool(found.item()),
                      f"what {where} returns (True: an inf or NaN was found)"))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            require(close(a, b, f"{where}: gradient {i} after unscaling in place vs torch's fused kernel", rtol=0, atol=0))


@pytest.mark.exercise("mixed_precision.unscale")
def test_loss_scaling_rescues_fp16_gradients_from_underflow():
    data = regression_data(samples=32, dtype=torch.float32)
    x, y = data.tensors

    def grads(scale):
        model = mlp(dtype=torch.float32).half()
        opt = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD(model.parameters(), lr=0.0),
                                                   ConstantGradScaler(scale))
        loss = 1e-6 * (model(x.half()).float() - y).square().mean()  # a tiny loss: tiny grads
        opt.scale_loss(loss).backward()
        assert opt.step()[0], f"loss scale {scale:g}: the step was skipped; the gradients are finite"
        return torch.cat([p.grad.flatten() for p in opt.fp32_from_float16_groups[0]])

    reference = mlp(dtype=torch.float32)
    (1e-6 * (reference(x) - y).square().mean()).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    unscaled, scaled = grads(1.0), grads(2.0**16)
    zeros = (unscaled == 0).float().mean().item()
    assert zeros > 0.5, f"without loss scaling only {zeros:.0%} of the fp16 gradients underflowed to 0 (expected most)"
    rel = ((scaled - expected).norm() / expected.norm()).item()
    assert rel < 0.02, (f"with loss scale 2^16 the unscaled fp32 main gradients are off from fp32 training's by {rel:.3g} "
                        "(relative norm; tolerance 0.02)")


def test_fp32_main_params_keep_updates_bf16_would_round_away():
    pure = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    pure_opt = torch.optim.SGD([pure], lr=1.0)
    model_param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ours = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD([model_param], lr=1.0), accumulate_grads_in_fp32=True)
    for _ in range(10):
        pure.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
        pure_opt.step()
        ours.zero_grad()
        (model_param.float() * 1e-3).sum().backward()
        ours.step()
    assert torch.equal(pure.detach(), torch.ones(4, dtype=torch.bfloat16))  # 1 - 1e-3 rounds back to 1
    torch.testing.assert_close(ours.fp32_from_float16_groups[0][0], torch.full((4,), 0.99))
    assert torch.equal(model_param.detach(), torch.full((4,), 0.99).bfloat16())


def test_bf16_accumulates_micro_batches_in_fp32_main_grad():
    model = mlp(dtype=torch.float32).bfloat16()
    ours = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD(model.parameters(), lr=0.0), accumulate_grads_in_fp32=True)
    x, y = regression_data(samples=16, dtype=torch.float32).tensors
    expected = [torch.zeros(p.shape) for p in model.parameters()]
    for chunk in (slice(0, 8), slice(8, 16)):
        loss = (model(x[chunk].bfloat16()).float() - y[chunk]).square().mean()
        for e, g in zip(expected, torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)):
            e += g.float()
        loss.backward()
    ours.step()
    for p, main, e in zip(model.parameters(), ours.fp32_from_float16_groups[0], expected):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert main.grad is p.main_grad  # the main params step on the fp32 buffer itself
        torch.testing.assert_close(p.main_grad, e)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_bytes_per_parameter_match_megatron_table(precision):
    model = mlp(dtype=torch.float32)
    if precision == "fp32":
        opt = torch.optim.Adam(model.parameters())
    else:
        model = model.half() if precision == "fp16" else model.bfloat16()
        opt = mp.Float16OptimizerWithFloat16Params(
            torch.optim.Adam(model.parameters()), DynamicGradScaler(2.0**8) if precision == "fp16" else None,
            accumulate_grads_in_fp32=precision == "bf16")
    x = regression_data(samples=8, dtype=torch.float32).tensors[0].to(next(model.parameters()).dtype)
    loss = model(x).float().square().mean()
    (loss if precision == "fp32" else opt.scale_loss(loss)).backward()
    opt.step()
    measured = mp.bytes_per_parameter(model, opt)
    assert measured == calc.mixed_precision_bytes_per_parameter(precision)
    assert measured["total"] == {"fp16": 20, "bf16": 18, "fp32": 16}[precision]


def test_bad_input_says_what_to_do():
    with pytest.raises(TypeError, match="model.half"):
        mp.Float16OptimizerWithFloat16Params(torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="grad_scaler"):
        mp.Float16OptimizerWithFloat16Params(torch.optim.SGD(mlp().half().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="min_scale"):
        DynamicGradScaler(1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicGradScaler(hysteresis=0)
    with pytest.raises(ValueError, match="precision"):
        calc.mixed_precision_bytes_per_parameter("fp8")


def _overflow_on_one_rank():
    """Rank 1's grad overflows; returns, per case, (step taken, new scale) on this rank."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    rank, _ = mdist.init()
    out = {}
    for case, group in (("alone", None), ("group", dist.group.WORLD)):
        param = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        opt = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD([param], lr=0.1),
                                                   DynamicGradScaler(16.0, hysteresis=1), found_inf_group=group)
        param.grad = torch.tensor([INF if rank == 1 else 1.0, 1.0, 1.0, 1.0], dtype=torch.float16)
        ok, _ = opt.step()
        out[case] = (ok, opt.get_loss_scale().item())
    dist.barrier()
    return out


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_of_the_group():
    returns = launch.run_function(_overflow_on_one_rank, 2, launch=dict(timeout=120)).returns
    assert [returns[r]["alone"] for r in (0, 1)] == [(True, 16.0), (False, 8.0)]  # the ranks would diverge
    assert [returns[r]["group"] for r in (0, 1)] == [(False, 8.0), (False, 8.0)]


def _clip_a_tp_split_model():
    """2 ranks as TP: one weight split in halves (tensor_model_parallel), one replicated bias; returns
    (grad norm, the main grads after clipping) on this rank."""
    import torch.distributed as dist

    from megalab.lab import dist as mdist

    rank, _ = mdist.init()
    full_weight_grad = torch.arange(1.0, 9.0).reshape(4, 2)  # [4, 2]: rank r holds rows 2r, 2r + 1
    weight = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    bias = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))  # replicated: the same grad on both ranks
    opt = mp.Float16OptimizerWithFloat16Params(torch.optim.SGD([weight, bias], lr=0.0), clip_grad=1.0,
                                               found_inf_group=dist.group.WORLD, tp_rank=rank)
    weight.grad = full_weight_grad[2 * rank: 2 * rank + 2].bfloat16()
    bias.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    _, norm = opt.step()
    grads = [main.grad.clone() for main in opt.fp32_from_float16_groups[0]]
    dist.barrier()
    return norm, grads


def test_fp16_optimizer_clips_by_the_whole_models_norm_under_tp():
    """Megatron's MixedPrecisionOptimizer clips by get_grad_norm_fp32 over the model-parallel group, each TP
    duplicate once: the norm of the unsplit model, and the same clip factor on every rank."""
    returns = launch.run_function(_clip_a_tp_split_model, 2, launch=dict(timeout=120)).returns
    full = torch.cat([torch.arange(1.0, 9.0), torch.tensor([3.0, 4.0])])
    expected = float(full.norm())
    norms = [returns[r][0] for r in (0, 1)]
    require(close(norms, [expected, expected], "the fp16/bf16 optimizer's grad norm on ranks 0, 1 of a TP=2 model "
                  "(the unsplit model's: squares summed over found_inf_group, the replicated bias counted once)",
                  atol=1e-4))
    factor = 1.0 / (expected + 1e-6)
    for r in (0, 1):
        weight_grad, bias_grad = returns[r][1]
        require(close(weight_grad, torch.arange(1.0, 9.0).reshape(4, 2)[2 * r: 2 * r + 2] * factor,
                      f"rank {r}'s clipped weight grad", atol=1e-6))
        require(close(bias_grad, torch.tensor([3.0, 4.0]) * factor, f"rank {r}'s clipped bias grad", atol=1e-6))
