"""megalab.core.distributed.distributed_data_parallel: DDP against torch DDP and single-process training; ZeRO-1/2/3 against
unsharded training; buckets, hooks and memory against what they should be.

One launch per world size (2, 4) runs every case (each in a try, so one broken exercise does not
hide the others); each test reads its own part of the report.
"""

import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel, all_reduce_gradients
from megalab.core.distributed.param_and_grad_buffer import build_buckets
from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer, optimizer_state_bytes
from megalab.extras import calc, toy
from megalab.lab import launch
from tests.feedback import equal, require, require_no_error, require_within

STEPS, MICRO_BATCH = 10, 4
OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-2)), "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def _model(dtype=torch.float32) -> nn.Sequential:
    """8 -> 32 -> 32 -> 32 -> 1 with tanh, seeded: 8 parameters, 2465 elements."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                  nn.Linear(32, 1)]
        return nn.Sequential(*layers).to(dtype)


def _batches(rank, world, accum, dtype=torch.float32):
    """Step k, micro-batch j of `rank`: MICRO_BATCH rows; all ranks together cover the global batch."""
    x, y = toy.regression_data(samples=STEPS * world * accum * MICRO_BATCH, dtype=dtype).tensors
    per_step = world * accum * MICRO_BATCH
    for k in range(STEPS):
        yield [(x[s : s + MICRO_BATCH], y[s : s + MICRO_BATCH])
               for j in range(accum) for s in [k * per_step + (j * world + rank) * MICRO_BATCH]]


def _single_process(world, accum, opt="adam", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The reference: one process, one step per global batch."""
    model = _model(dtype)
    cls, kwargs = OPTIMIZERS[opt]
    optimizer = cls(model.parameters(), **kwargs)
    x, y = toy.regression_data(samples=STEPS * world * accum * MICRO_BATCH, dtype=dtype).tensors
    per_step = world * accum * MICRO_BATCH
    for k in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x[k * per_step : (k + 1) * per_step]), y[k * per_step : (k + 1) * per_step]).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> dict[str, float]:
    """{parameter name: largest absolute difference} (a dict: a failure names the parameter)."""
    return {n: (a[n].double() - b[n].double()).abs().max().item() for n in a}


def _train_ours(rank, world, *, stage=0, accum=1, opt="adam", dtype=torch.float32, **ddp_kwargs):
    model = DistributedDataParallel(_model(dtype), zero_stage=stage, **ddp_kwargs)
    cls, kwargs = OPTIMIZERS[opt]
    optimizer = cls(model.parameters(), **kwargs) if stage == 0 else DistributedOptimizer(model, cls, **kwargs)
    for micro_batches in _batches(rank, world, accum, dtype):
        model.zero_grad_buffer()
        for j, (x, y) in enumerate(micro_batches):
            loss = F.mse_loss(model(x), y) / accum
            if j < accum - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        model.finish_grad_sync()
        optimizer.step()
    return model, optimizer


def _check(report, name, fn):
    try:
        report[name] = fn()
    except Exception:  # noqa: BLE001 (reported back to the test that owns this case)
        report[name] = traceback.format_exc(limit=-3)


def _dp_worker() -> dict:
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    report = {}

    def ddp_cases():
        ref = _single_process(world, 1)
        torch_model = nn.parallel.DistributedDataParallel(_model())
        torch_opt = torch.optim.Adam(torch_model.parameters(), lr=1e-2)
        naive = _model()
        naive_opt = torch.optim.Adam(naive.parameters(), lr=1e-2)
        for [(x, y)] in _batches(rank, world, 1):
            for m, o, sync in ((torch_model, torch_opt, None), (naive, naive_opt, all_reduce_gradients)):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                if sync:
                    sync(m)
                o.step()
        torch_params = {n.removeprefix("module."): p.detach() for n, p in torch_model.named_parameters()}
        out = {"naive_vs_single": _max_diff({n: p.detach() for n, p in naive.named_parameters()}, ref)}
        for name, kwargs in {"buckets": dict(bucket_size=500), "one_bucket": dict(bucket_size=10**9),
                             "no_overlap": dict(bucket_size=500, overlap_grad_reduce=False)}.items():
            params = _train_ours(rank, world, **kwargs)[0].full_parameters()
            out[f"{name}_vs_torch_ddp"] = _max_diff(params, torch_params)
            out[f"{name}_vs_single"] = _max_diff(params, ref)
        accum = _train_ours(rank, world, accum=3, bucket_size=500)[0].full_parameters()
        out["accum3_vs_single"] = _max_diff(accum, _single_process(world, 3))
        fp32 = _train_ours(rank, world, dtype=torch.float64, grad_reduce_in_fp32=True, bucket_size=500)[0]
        out["fp32_main_grads_vs_single"] = _max_diff(fp32.full_parameters(), _single_process(world, 1, dtype=torch.float64))
        out["fp32_main_grads_dtype"] = str(fp32.buckets[0].grad_data.dtype)
        return out

    def zero_cases():
        out = {}
        for stage in (1, 2, 3):
            for opt in OPTIMIZERS:
                for accum in (1, 2):
                    params = _train_ours(rank, world, stage=stage, accum=accum, opt=opt, bucket_size=500)[0]
                    out[(stage, opt, accum)] = _max_diff(params.full_parameters(), _single_process(world, accum, opt))
        return out

    def bucket_cases():
        numels = [p.numel() for p in _model().parameters()]
        out = {}
        for size in (1, 100, 500, 1100, 10**9):
            model = DistributedDataParallel(_model(), bucket_size=size)
            out[size] = ([(len(b.params), b.numel) for b in model.buckets],
                         [(len(ids), end - start) for ids, start, end in build_buckets(numels, size, world)])
        return out

    def hook_cases():
        model = DistributedDataParallel(_model(), bucket_size=100)
        [(x, y)] = next(_batches(rank, world, 1))
        model.zero_grad_buffer()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        backward_end = time.perf_counter()
        model.finish_grad_sync()
        launches = [t for t, event, _ in model.timeline if event == "launch"]
        ready = [t for t, event, _ in model.timeline if event == "grad_ready"]
        return {"buckets": len(model.buckets), "launched_in_backward": sum(t < backward_end for t in launches),
                "first_launch_before_last_grad": min(launches) < max(ready)}

    def memory_cases():
        out = {}
        for stage in range(4):
            model, optimizer = _train_ours(rank, world, stage=stage, bucket_size=500)
            if stage == 0:
                measured = {**model.memory_bytes(), "optimizer": optimizer_state_bytes(optimizer)}
            else:
                measured = optimizer.memory_bytes()
            num_params = sum(p.numel() for p in model.parameters())
            formula = calc.zero_memory_per_device(num_params, world, stage, optimizer_bytes_per_param=8,
                                                  param_bytes=4, grad_bytes=4)
            out[stage] = (measured, formula)
        return out

    for name, fn in [("ddp", ddp_cases), ("zero", zero_cases), ("buckets", bucket_cases), ("hooks", hook_cases),
                     ("memory", memory_cases)]:
        _check(report, name, fn)
    dist.barrier()
    return report


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def dp_report(request):
    res = launch.run_function(_dp_worker, request.param, launch=dict(timeout=300))
    return request.param, res.returns[0]


def _part(dp_report, name):
    world, report = dp_report
    require_no_error(f"{world} ranks, rank 0, the {name} cases", report[name] if isinstance(report[name], str) else None)
    return world, report[name]


def _params_close(diffs: dict, tol: float, where: str, against: str):
    require_within({f"parameter {n}": d for n, d in diffs.items()}, tol, where=where, against=against)


@pytest.mark.exercise("data_parallel.build_buckets")
def test_build_buckets_reverse_order_and_padding():
    rule = "(ids, start, end) per bucket: parameters in reverse order, a bucket closes at >= bucket_size elements"
    require(equal(build_buckets([4, 2, 6, 3], 5, pad_to=2), [([3, 2], 0, 10), ([1, 0], 10, 16)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=5, pad_to=2) {rule}, its length padded to a multiple of 2"))
    require(equal(build_buckets([4, 2, 6, 3], 100), [([3, 2, 1, 0], 0, 15)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=100) {rule}"))
    require(equal(build_buckets([4, 2, 6, 3], 1, pad_to=4), [([3], 0, 4), ([2], 4, 12), ([1], 12, 16), ([0], 16, 20)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=1, pad_to=4) {rule}, its length padded to a multiple of 4"))
    require(equal(build_buckets([], 10), [], "build_buckets([], 10) (no parameters: no buckets)"))
    with pytest.raises(ValueError, match="bucket_size"):
        build_buckets([3], 0)


@pytest.mark.exercise("data_parallel.build_buckets")
def test_bucket_count_follows_bucket_size(dp_report):
    world, cases = _part(dp_report, "buckets")
    counts = {size: len(ours) for size, (ours, _) in cases.items()}
    require(equal(counts[1], 8, f"{world} ranks: the number of DDP buckets with bucket_size=1 (one per parameter)"))
    require(equal(counts[10**9], 1, f"{world} ranks: the number of DDP buckets with bucket_size=10**9 (one for all)"))
    assert counts[1] >= counts[100] >= counts[500] >= counts[1100] >= counts[10**9], (
        f"{world} ranks: DDP bucket counts by bucket_size {counts} should not grow with bucket_size")
    for size, (ours, expected) in cases.items():
        require(equal(ours, expected, f"{world} ranks, bucket_size={size}: DDP's buckets as (parameters, elements) vs "
                                      "build_buckets'"))
        assert all(numel % world == 0 for _, numel in ours), (
            f"{world} ranks, bucket_size={size}: bucket sizes {[n for _, n in ours]} should be padded to a multiple of "
            f"the {world} ranks")


@pytest.mark.exercise("data_parallel.build_buckets")
@pytest.mark.exercise("data_parallel.grad_hook")
@pytest.mark.exercise("data_parallel.finish_grad_sync")
def test_ddp_matches_torch_ddp_and_single_process(dp_report):
    world, ddp = _part(dp_report, "ddp")
    after = f"the parameters after {STEPS} Adam steps"
    for name, words in (("buckets", "DDP with bucket_size=500"), ("one_bucket", "DDP with one bucket"),
                        ("no_overlap", "DDP with bucket_size=500, overlap_grad_reduce=False")):
        where = f"{world} ranks, {words}: {after}"
        _params_close(ddp[f"{name}_vs_torch_ddp"], 1e-6, where, "torch DDP's")
        _params_close(ddp[f"{name}_vs_single"], 1e-6, where, "single-process training's")
    _params_close(ddp["naive_vs_single"], 1e-6, f"{world} ranks, all_reduce_gradients after backward: {after}",
                  "single-process training's")
    _params_close(ddp["accum3_vs_single"], 1e-6, f"{world} ranks, DDP with 3 micro-batches accumulated (no_sync): "
                  f"{after}", "single-process training's")
    require(equal(ddp["fp32_main_grads_dtype"], "torch.float32",
                  f"{world} ranks: the dtype of the gradient buffer of a float64 model with grad_reduce_in_fp32=True"))
    _params_close(ddp["fp32_main_grads_vs_single"], 1e-5, f"{world} ranks, a float64 model with grad_reduce_in_fp32: "
                  f"{after}", "single-process float64 training's")


@pytest.mark.exercise("data_parallel.grad_hook")
@pytest.mark.exercise("data_parallel.finish_grad_sync")
def test_hooks_launch_buckets_before_backward_ends(dp_report):
    world, hooks = _part(dp_report, "hooks")
    assert hooks["buckets"] > 1, f"{world} ranks: bucket_size=100 gave {hooks['buckets']} bucket(s), expected several"
    require(equal(hooks["launched_in_backward"], hooks["buckets"],
                  f"{world} ranks: the number of buckets whose all-reduce was launched during backward (each bucket "
                  "should launch from the hook of its last gradient, not in finish_grad_sync)"))
    assert hooks["first_launch_before_last_grad"], (
        f"{world} ranks: the first bucket's all-reduce was launched after the last gradient was ready: launch each "
        "bucket as soon as its gradients are all in, overlapping communication with the rest of backward")


@pytest.mark.exercise("data_parallel.grad_hook")
@pytest.mark.exercise("data_parallel.reduce_scatter")
@pytest.mark.exercise("data_parallel.zero_step")
def test_zero_1_2_match_unsharded_training(dp_report):
    world, zero = _part(dp_report, "zero")
    for (stage, opt, accum), diffs in zero.items():
        if stage in (1, 2):
            _params_close(diffs, 1e-5, f"{world} ranks, ZeRO-{stage}, {opt}, {accum} micro-batch(es) per step: the "
                          f"parameters after {STEPS} steps", "unsharded single-process training's")


@pytest.mark.exercise("data_parallel.reduce_scatter")
@pytest.mark.exercise("data_parallel.zero_step")
@pytest.mark.exercise("data_parallel.zero3_gather")
def test_zero_3_matches_unsharded_training(dp_report):
    world, zero = _part(dp_report, "zero")
    for (stage, opt, accum), diffs in zero.items():
        if stage == 3:
            _params_close(diffs, 1e-5, f"{world} ranks, ZeRO-3, {opt}, {accum} micro-batch(es) per step: the "
                          f"parameters after {STEPS} steps", "unsharded single-process training's")


@pytest.mark.exercise("data_parallel.finish_grad_sync")
@pytest.mark.exercise("data_parallel.zero_step")
@pytest.mark.exercise("data_parallel.zero3_gather")
def test_memory_per_rank_matches_zero_formula(dp_report):
    world, memory = _part(dp_report, "memory")
    words = {"params": "parameter", "grads": "gradient", "optimizer": "optimizer-state"}
    for stage, (measured, formula) in memory.items():
        for part in ("params", "grads", "optimizer"):  # padding to a multiple of the dp size: a few elements
            assert measured[part] == pytest.approx(formula[part], rel=0.01), (
                f"{world} ranks, ZeRO stage {stage}: rank 0 holds {measured[part]} bytes of {words[part]}s, the ZeRO "
                f"formula says {formula[part]:.0f} (within 1%)")


def test_zero_memory_formula_matches_paper():
    """ZeRO paper, Figure 1: 7.5B parameters, N_d = 64, K = 12."""
    totals = [calc.zero_memory_per_device(7.5e9, 64, stage)["total"] / 1e9 for stage in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    with pytest.raises(ValueError, match="stage"):
        calc.zero_memory_per_device(1e9, 8, 4)
