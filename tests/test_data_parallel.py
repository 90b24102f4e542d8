"""megalab.core.distributed.distributed_data_parallel: DDP against torch DDP and single-process training; ZeRO-1/2/3 against
unsharded training; buckets, hooks and memory against what they should be.

One launch per world size (2, 4) runs every case (each in a try, so one broken exercise does not
hide the others); each test reads its own part of the report.
"""

import threading
import time
import traceback
from contextlib import contextmanager

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
from megalab.lab.checks import close, mistake
from tests.feedback import equal, require, require_no_error, require_within
from tests.quick_launch import quick_fixture
from tests.quick_launch import results as quick_results

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


FORWARD = "filled the buckets in forward order (backward produces the last parameter's gradient first: reverse them)"
STRICT = "closed a bucket only when it exceeds bucket_size (> instead of >=)"
UNPADDED = "bucket length not padded to a multiple of pad_to (_round_up)"
NEXT_UNPADDED = "the next bucket starts at the previous one's unpadded end (start at the padded end)"
# build_buckets(numels, bucket_size=5, pad_to=2): the right buckets, and what each typical mistake gives
BUCKET_CASES = {
    (4, 2, 6, 3): ([([3, 2], 0, 10), ([1, 0], 10, 16)], {
        FORWARD: [([0, 1], 0, 6), ([2], 6, 12), ([3], 12, 16)], UNPADDED: [([3, 2], 0, 9), ([1, 0], 9, 15)],
        NEXT_UNPADDED: [([3, 2], 0, 10), ([1, 0], 9, 15)]}),
    (3, 2, 5): ([([2], 0, 6), ([1, 0], 6, 12)], {  # 5 elements exactly: the bucket closes
        FORWARD: [([0, 1], 0, 6), ([2], 6, 12)], STRICT: [([2, 1], 0, 8), ([0], 8, 12)],
        UNPADDED: [([2], 0, 5), ([1, 0], 5, 10)], NEXT_UNPADDED: [([2], 0, 6), ([1, 0], 5, 11)]}),
}


@pytest.mark.exercise("data_parallel.build_buckets")
def test_build_buckets_reverse_order_and_padding():
    rule = "(ids, start, end) per bucket: parameters in reverse order, a bucket closes at >= bucket_size elements"
    for numels, (expected, mistakes) in BUCKET_CASES.items():
        got = build_buckets(list(numels), 5, pad_to=2)
        what = f"build_buckets({list(numels)}, bucket_size=5, pad_to=2) {rule}, its length padded to a multiple of 2"
        for name, wrong in mistakes.items():
            if got == wrong and got != expected:
                require(mistake(name, f"{what}: got {got}, expected {expected}"))
        require(equal(got, expected, what))
    require(equal(build_buckets([4, 2, 6, 3], 5, pad_to=2), [([3, 2], 0, 10), ([1, 0], 10, 16)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=5, pad_to=2) {rule}, its length padded to a multiple of 2"))
    require(equal(build_buckets([4, 2, 6, 3], 100), [([3, 2, 1, 0], 0, 15)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=100) {rule}"))
    require(equal(build_buckets([4, 2, 6, 3], 1, pad_to=4), [([3], 0, 4), ([2], 4, 12), ([1], 12, 16), ([0], 16, 20)],
                  f"build_buckets([4, 2, 6, 3], bucket_size=1, pad_to=4) {rule}, its length padded to a multiple of 4"))
    require(equal(build_buckets([], 10), [], "build_buckets([], 10) (no parameters: no buckets)"))
    with pytest.raises(ValueError, match="bucket_size"):
        build_buckets([3], 0)


# ------------------------------------------------------------------ quick checks (issue 27): 2 ranks as threads
# (tests/quick_launch.py), a 4 -> 4 -> 2 model in 2 buckets; each exercise's first test, fast, naming the typical
# mistakes (the real processes: the launches of the tests further down)


def _tiny() -> nn.Sequential:
    """4 -> 4 -> 2 with tanh, seeded: 4 parameters, 30 elements; bucket_size 10 makes 2 buckets."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _tiny_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _tiny_rows(rank, world, micro=1, j=0):
    """Rows of `rank`'s micro-batch j (of `micro`): together the ranks' micro-batches cover the 8 rows."""
    n = 8 // (world * micro)
    start = (j * world + rank) * n
    return slice(start, start + n)


def _tiny_grads(rows=slice(None)) -> list[torch.Tensor]:
    """The single-process gradient of the mean loss over `rows` (all 8 rows: what DP must give)."""
    model, (x, y) = _tiny(), _tiny_data()
    F.mse_loss(model(x[rows]), y[rows]).backward()
    return [p.grad.clone() for p in model.parameters()]


class _LazyWork:
    """An async collective that runs when waited for (a slow network): forgetting wait() then shows."""

    def __init__(self, fn, args, kwargs, log):
        self.fn, self.args, self.kwargs, self.done = fn, args, kwargs, False
        log.append(self)

    def wait(self, *args, **kwargs):
        if not self.done:
            self.fn(*self.args, **self.kwargs)
            self.done = True
        return True

    def is_completed(self):
        return self.done


_LAZY = threading.local()  # .log: the works of this rank (a thread of a threaded world), while it is inside
_LAZY_STATE = {"inside": 0, "saved": None}  # ranks inside _lazy_collectives; the functions the wrappers replaced


@contextmanager
def _lazy_collectives():
    """Inside, this rank's async all_reduce / broadcast are _LazyWork; yields the list of works launched. The
    ranks of a threaded world share torch.distributed: the first one in installs the wrappers (which defer the
    calls of the ranks inside only), the last one out restores the functions."""
    if not _LAZY_STATE["inside"]:
        saved = _LAZY_STATE["saved"] = (dist.all_reduce, dist.broadcast)

        def lazy(fn):
            def call(*args, async_op=False, **kwargs):
                log = getattr(_LAZY, "log", None)
                return _LazyWork(fn, args, kwargs, log) if async_op and log is not None else \
                    fn(*args, async_op=async_op, **kwargs)
            return call

        dist.all_reduce, dist.broadcast = lazy(saved[0]), lazy(saved[1])
    _LAZY_STATE["inside"] += 1
    _LAZY.log = log = []
    try:
        yield log
    finally:
        _LAZY.log = None
        _LAZY_STATE["inside"] -= 1
        if not _LAZY_STATE["inside"]:
            dist.all_reduce, dist.broadcast = _LAZY_STATE["saved"]


def _step_grads(ddp, rank, world, micro=1):
    """One backward (micro micro-batches, the first ones under no_sync) and finish_grad_sync; p.grad per parameter."""
    x, y = _tiny_data()
    ddp.zero_grad_buffer()
    for j in range(micro):
        rows = _tiny_rows(rank, world, micro, j)
        loss = F.mse_loss(ddp(x[rows]), y[rows]) / micro
        if j < micro - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    backward_end = time.perf_counter()
    ddp.finish_grad_sync()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in ddp.module.parameters()]
    return grads, backward_end


def _attempt(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 (the test names the mistake from the error)
        return {"error": traceback.format_exc(limit=-4)}


def _quick_grad_hook(rank, world, group):
    out = {"expected": _tiny_grads()}

    def one_step():
        ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10)
        grads, backward_end = _step_grads(ddp, rank, world)
        launches = [t for t, event, _ in ddp.timeline if event == "launch"]
        return {"grads": grads, "buckets": len(ddp.buckets), "launched_in_backward": sum(t < backward_end for t in launches)}

    in_no_sync = []  # the evidence that tells "launched inside no_sync" from "launched twice" when a bucket is reduced twice

    def accumulate():
        ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10)
        launch = ddp.start_grad_sync

        def spy(bucket):
            if not ddp._sync:
                in_no_sync.append(bucket.index)
            return launch(bucket)

        ddp.start_grad_sync = spy
        return {"grads": _step_grads(ddp, rank, world, micro=2)[0]}

    out["one step"], out["accumulate"] = _attempt(one_step), _attempt(accumulate)
    out["launched in no_sync"] = len(in_no_sync)
    # what "copied instead of added" gives: only the last micro-batch, averaged over the ranks (/ 2 micro-batches)
    last = [sum(gs) / (2 * world) for gs in zip(*[_tiny_grads(_tiny_rows(r, world, 2, 1)) for r in range(world)])]
    out["last micro-batch only"] = last
    # what "kept param.grad" gives: autograd adds micro-batch 2 onto the kept .grad, so micro-batch 1 counts twice
    first = [sum(gs) / (2 * world) for gs in zip(*[_tiny_grads(_tiny_rows(r, world, 2, 0)) for r in range(world)])]
    out["first micro-batch twice"] = [2 * a + b for a, b in zip(first, last)]
    return out


def _quick_finish_grad_sync(rank, world, group):
    out = {"expected": _tiny_grads(), "local": _tiny_grads(_tiny_rows(rank, world))}

    def overlap():
        with _lazy_collectives() as log:
            ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10)
            first = _step_grads(ddp, rank, world)[0]
            unwaited = sum(not w.done for w in log)
            second = _step_grads(ddp, rank, world)[0]
        return {"grads": first, "unwaited": unwaited, "second step": second}

    def no_overlap():
        ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10, overlap_grad_reduce=False)
        return {"grads": _step_grads(ddp, rank, world)[0]}

    out["overlap"], out["no overlap"] = _attempt(overlap), _attempt(no_overlap)
    return out


def _flat(ddp, bucket, grads) -> torch.Tensor:
    """The bucket's flat gradient buffer [numel] built from per-parameter gradients."""
    flat = torch.zeros(bucket.numel)
    index = {p: i for i, p in enumerate(ddp.module.parameters())}
    for p, (start, end) in bucket.ranges.items():
        flat[start:end] = grads[index[p]].reshape(-1)
    return flat


def _quick_reduce_scatter(rank, world, group):
    expected = _tiny_grads()
    out = {}
    for stage in (1, 2):
        def shards(stage=stage):
            ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10, zero_stage=stage)
            _step_grads(ddp, rank, world)
            got = [(b.grad_data[b.shard] if stage == 1 else b.grad_shard).detach().clone() for b in ddp.buckets]
            return {"shards": got, "expected": [_flat(ddp, b, expected)[b.shard] for b in ddp.buckets]}
        out[stage] = _attempt(shards)
    return out


def _sgd_expected(lr=0.1) -> list[torch.Tensor]:
    """The parameters after one SGD step on the full batch."""
    model = _tiny()
    return [(p.detach() - lr * g) for p, g in zip(model.parameters(), _tiny_grads())]


def _quick_zero_step(rank, world, group):
    out = {}
    for stage in (1, 2):
        def step(stage=stage):
            with _lazy_collectives() as log:
                ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10, zero_stage=stage)
                optimizer = DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
                before = [b.param_data.clone() for b in ddp.buckets]
                _step_grads(ddp, rank, world)
                launched = len(log)
                optimizer.step()
                gathers = len(log) - launched
                unwaited = sum(not w.done for w in log)
            new = [_flat(ddp, b, _sgd_expected()) for b in ddp.buckets]
            stale = []  # what "no all-gather" leaves: this rank's shard new, the rest as before the step
            for b, old, full in zip(ddp.buckets, before, new):
                s = old.clone()
                s[b.shard] = full[b.shard]
                stale.append(s)
            return {"params": [b.param_data.detach().clone() for b in ddp.buckets], "expected": new,
                    "own shard only": stale, "gathers": gathers, "unwaited": unwaited}
        out[stage] = _attempt(step)

    def bf16_step():  # a bf16 model: SGD steps the fp32 main params, the bf16 params are their rounded copy
        ddp = DistributedDataParallel(_tiny().bfloat16(), group=group, bucket_size=10, zero_stage=1,
                                      grad_reduce_in_fp32=True)
        optimizer = DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
        before = [b.param_data.clone() for b in ddp.buckets]
        x, y = _tiny_data()
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x[_tiny_rows(rank, world)].bfloat16()), y[_tiny_rows(rank, world)].bfloat16()).backward()
        ddp.finish_grad_sync()
        optimizer.step()
        grads = []  # the same step on one process: each rank's bf16 gradient, averaged in fp32 (as the buffer)
        for r in range(world):
            model = _tiny().bfloat16()
            F.mse_loss(model(x[_tiny_rows(r, world)].bfloat16()), y[_tiny_rows(r, world)].bfloat16()).backward()
            grads.append([p.grad.float() / world for p in model.parameters()])
        grads = [sum(gs) for gs in zip(*grads)]
        new = [p.detach().float() - 0.1 * g for p, g in zip(_tiny().bfloat16().parameters(), grads)]
        return {"params": [b.param_data.float() for b in ddp.buckets],
                "expected": [_flat(ddp, b, new).bfloat16().float() for b in ddp.buckets],
                "not copied back": [b.float() for b in before]}
    out["bf16"] = _attempt(bf16_step)

    # stage 3 gathers on demand: the step updates the shards and gathers nothing
    out[3] = _attempt(lambda: _zero3_sgd_step(rank, world, group))
    return out


UNBACKED = "storage was never refilled"


def _gathered_views_backed(ddp):
    """Gather every bucket (stage 3), then check that each parameter's storage holds its view: reading a view of a
    freed (0-byte) storage crashes the whole process, every rank thread with it, instead of raising."""
    for b in ddp.buckets:
        ddp._gather_params(b)
    for name, p in ddp.module.named_parameters():
        need, has = (p.storage_offset() + p.numel()) * p.element_size(), p.untyped_storage().nbytes()
        if has < need:
            raise RuntimeError(f"parameter {name} is a view of {need} bytes of a storage of {has}: its {UNBACKED}")


def _quick_zero3_gather(rank, world, group):
    def shards_changed():  # every rank adds 1 to its shards: the gathered parameters must all be 1 larger
        ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10, zero_stage=3)
        for b in ddp.buckets:
            b.param_shard.add_(1.0)
        _gathered_views_backed(ddp)
        got = ddp.full_parameters()
        return {"params": [got[n] for n, _ in ddp.module.named_parameters()],
                "expected": [p.detach() + 1.0 for p in _tiny().parameters()],
                "own": {n: _own_mask(ddp, p, rank) for n, p in ddp.module.named_parameters()}}

    return {"shards changed": _attempt(shards_changed), "one step": _attempt(lambda: _zero3_sgd_step(rank, world, group))}


def _zero3_sgd_step(rank, world, group) -> dict:
    """One ZeRO-3 SGD step on the tiny model, then every bucket gathered: the parameters and what they should be."""
    ddp = DistributedDataParallel(_tiny(), group=group, bucket_size=10, zero_stage=3)
    optimizer = DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    _step_grads(ddp, rank, world)
    optimizer.step()
    _gathered_views_backed(ddp)
    got = ddp.full_parameters()
    return {"params": [got[n] for n, _ in ddp.module.named_parameters()], "expected": _sgd_expected(),
            "shard elements": sum(b.param_shard.numel() for b in ddp.buckets)}


def _own_mask(ddp, param, rank) -> torch.Tensor:
    """Which elements of `param` lie in this rank's shard of its bucket."""
    for b in ddp.buckets:
        if param in b.ranges:
            start, end = b.ranges[param]
            idx = torch.arange(start, end)
            return ((idx >= b.shard.start) & (idx < b.shard.stop)).reshape(param.shape)
    raise KeyError("parameter in no bucket")


QUICK = {"data_parallel.grad_hook": _quick_grad_hook, "data_parallel.finish_grad_sync": _quick_finish_grad_sync,
         "data_parallel.reduce_scatter": _quick_reduce_scatter, "data_parallel.zero3_gather": _quick_zero3_gather,
         "data_parallel.zero_step": _quick_zero_step}
quick = quick_fixture(QUICK)
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _grads_close(got, expected, where, mistakes=None):
    for name, g, e in zip(NAMES, got, expected):
        if g is None:
            require(mistake("p.grad was not set from the bucket buffer after the wait (stage 0)",
                            f"{where}: parameter {name}.grad is None"))
        require(close(g, e, f"{where}: the gradient of {name}", mistakes={k: v[NAMES.index(name)]
                                                                        for k, v in (mistakes or {}).items()}))


@pytest.mark.exercise("data_parallel.grad_hook")
def test_quick_grad_hook_accumulates_and_launches_full_buckets(quick):
    results = quick_results(quick, "data_parallel.grad_hook", "one step")
    for rank, r in results.items():
        one = r["one step"]
        _grads_close(one["grads"], r["expected"], f"rank {rank}, one DDP step (2 buckets)")
        if one["launched_in_backward"] == 0:
            require(mistake("the hook never launches a full bucket (no overlap: every bucket waits for "
                            "finish_grad_sync)", f"rank {rank}: 0 of {one['buckets']} buckets launched during backward"))
        require(equal(one["launched_in_backward"], one["buckets"], f"rank {rank}: buckets launched during backward"))
    inside = any(r.get("launched in no_sync") for r in quick.get("data_parallel.grad_hook").values()
                 if isinstance(r, dict))
    results = quick_results(quick, "data_parallel.grad_hook", "accumulate", known={
        "reduced twice": "launched the bucket inside no_sync() (the hook must not start_grad_sync when self._sync "
                         "is False)" if inside else
                         "a bucket launched twice in one step, none inside no_sync(): pending was not refilled once the "
                         "bucket was full, so the next backward launches it at its first gradient (and again)"})
    for rank, r in results.items():
        _grads_close(r["accumulate"]["grads"], r["expected"], f"rank {rank}, 2 micro-batches accumulated (no_sync)",
                     mistakes={"copied param.grad into the buffer instead of adding it (accumulation lost)":
                               r["last micro-batch only"],
                               "param.grad kept after adding it to the buffer: autograd adds the next micro-batch onto "
                               "it, so the first micro-batch is counted twice (set param.grad = None)":
                               r["first micro-batch twice"]})


@pytest.mark.exercise("data_parallel.finish_grad_sync")
def test_quick_finish_grad_sync_waits_and_launches_the_rest(quick):
    results = quick_results(quick, "data_parallel.finish_grad_sync", "overlap", known={
        "reduced twice": "bucket.handle not reset to None after the wait (the next step sees a stale handle)"})
    for rank, r in results.items():
        ov = r["overlap"]
        if ov["unwaited"]:
            require(mistake("forgot to wait() on the buckets' handles (the async all-reduce never lands)",
                            f"rank {rank}: {ov['unwaited']} reduction(s) launched and never waited for"))
        _grads_close(ov["grads"], r["expected"], f"rank {rank}, one DDP step (2 buckets, overlap on)")
        _grads_close(ov["second step"], r["expected"], f"rank {rank}, a second DDP step")
    results = quick_results(quick, "data_parallel.finish_grad_sync", "no overlap", known={
        "'NoneType' object has no attribute 'wait'": "did not launch the buckets the hooks did not launch "
                                                     "(start_grad_sync for each bucket without a handle)"})
    for rank, r in results.items():
        if any(g is None for g in r["no overlap"]["grads"]):  # set with overlap on (checked above), None with it off
            require(mistake("skipped the buckets the hooks did not launch (overlap off): launch each bucket without a "
                            "handle (start_grad_sync), wait, then set p.grad", f"rank {rank}: with overlap on p.grad "
                            "is set; with overlap_grad_reduce=False it stays None"))
        _grads_close(r["no overlap"]["grads"], r["expected"], f"rank {rank}, overlap_grad_reduce=False",
                     mistakes={"did not launch the buckets the hooks did not launch (start_grad_sync for each bucket "
                               "without a handle)": r["local"]})


@pytest.mark.exercise("data_parallel.reduce_scatter")
def test_quick_reduce_scatter_keeps_each_ranks_shard(quick):
    known = {"'bool' object has no attribute": "called reduce_scatter without async_op=True (bucket.handle "
                                                      "must be the work to wait for)",
             "'NoneType' object has no attribute 'wait'": "bucket.handle left None: keep the work that "
                                                          "reduce_scatter(..., async_op=True) returns in bucket.handle "
                                                          "(finish_grad_sync waits on it)",
             "'NoneType' object has no attribute": "stage 1 has no grad_shard: its shard is the view "
                                                   "grad_data[bucket.shard] of the full buffer"}
    for stage in (1, 2):
        results = quick_results(quick, "data_parallel.reduce_scatter", stage, known)
        for rank, r in results.items():
            for k, (got, exp) in enumerate(zip(r[stage]["shards"], r[stage]["expected"])):
                require(close(got, exp, f"rank {rank}, ZeRO-{stage}, bucket {k}: the reduced gradient shard",
                              mistakes={"stage 2's reduced shard not written into bucket.grad_shard (it stayed in "
                                        "grad_data, which stage 2 frees)": torch.zeros_like(exp)}))


@pytest.mark.exercise("data_parallel.zero_step")
def test_quick_zero_step_updates_and_gathers(quick):
    for stage in (1, 2):
        results = quick_results(quick, "data_parallel.zero_step", stage)
        for rank, r in results.items():
            s = r[stage]
            if s["unwaited"]:
                require(mistake("forgot to wait() for the all-gathers of the updated parameters",
                                f"rank {rank}, ZeRO-{stage}: {s['unwaited']} collective(s) launched, never waited"))
            for k, (got, exp, stale) in enumerate(zip(s["params"], s["expected"], s["own shard only"])):
                require(close(got, exp, f"rank {rank}, ZeRO-{stage}, bucket {k}: the parameters after one SGD step",
                              mistakes={"forgot the all-gather after the step (only this rank's shard is updated)":
                                        stale}))
    stage3 = {"out of bounds for storage of size 0": "all-gathered at stage 3 too: stage 3 frees the parameters "
                                                     "between steps and gathers them on demand, before forward (the "
                                                     "step all-gathers below stage 3 only)"}
    for rank, r in quick_results(quick, "data_parallel.zero_step", 3, stage3).items():
        for name, got, exp in zip(NAMES, r[3]["params"], r[3]["expected"]):
            require(close(got, exp, f"rank {rank}, ZeRO-3: parameter {name} after one SGD step (gathered after it)"))
    for rank, r in quick_results(quick, "data_parallel.zero_step", "bf16").items():
        for k, (got, exp, old) in enumerate(zip(r["bf16"]["params"], r["bf16"]["expected"], r["bf16"]["not copied back"])):
            require(close(got, exp, f"rank {rank}, a bf16 model, ZeRO-1, bucket {k}: the bf16 parameters after one SGD "
                                    "step of the fp32 main params", rtol=2**-7, atol=1e-6, mistakes={
                "forgot to copy the updated fp32 main params back into the model's shard "
                "(self._copy_main_params_to_model_params) before the all-gather": old}))


@pytest.mark.exercise("data_parallel.zero3_gather")
def test_quick_zero3_gather_rebuilds_full_parameters(quick):
    known = {"storage of size 0": "all-gathered into param_data without re-allocating its storage first "
                                  "(untyped_storage().resize_)",
             "are out of bounds for storage of size": "param_data's storage re-allocated too small: resize_ takes "
                                                      "BYTES, numel * element_size()",
             UNBACKED: "the parameters' storage stays freed: they are views of param_data's own storage, so gathering "
                       "into a new tensor (or a new param_data) leaves them empty; resize that storage, then all-gather "
                       "into param_data"}
    results = quick_results(quick, "data_parallel.zero3_gather", "shards changed", known)
    for rank, r in results.items():
        c = r["shards changed"]
        for name, got, exp in zip(NAMES, c["params"], c["expected"]):
            own = c["own"][name]
            if not close(got, exp, "").ok and close(got[own], exp[own], "").ok:
                require(mistake("copied only this rank's shard into param_data (no all-gather of the other ranks' "
                                "shards)", f"rank {rank}: parameter {name} is right only in this rank's shard"))
            require(close(got, exp, f"rank {rank}, ZeRO-3: parameter {name} gathered after every rank added 1 to its "
                                    "shard"))
    results = quick_results(quick, "data_parallel.zero3_gather", "one step", known)
    for rank, r in results.items():
        for name, got, exp in zip(NAMES, r["one step"]["params"], r["one step"]["expected"]):
            require(close(got, exp, f"rank {rank}, ZeRO-3: parameter {name} gathered after one SGD step"))


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
@pytest.mark.exercise("data_parallel.grad_hook")
@pytest.mark.exercise("data_parallel.reduce_scatter")
@pytest.mark.exercise("data_parallel.zero_step")
def test_zero_1_2_match_unsharded_training(dp_report):
    world, zero = _part(dp_report, "zero")
    for (stage, opt, accum), diffs in zero.items():
        if stage in (1, 2):
            _params_close(diffs, 1e-5, f"{world} ranks, ZeRO-{stage}, {opt}, {accum} micro-batch(es) per step: the "
                          f"parameters after {STEPS} steps", "unsharded single-process training's")


@pytest.mark.integration
@pytest.mark.exercise("data_parallel.reduce_scatter")
@pytest.mark.exercise("data_parallel.zero_step")
@pytest.mark.exercise("data_parallel.zero3_gather")
def test_zero_3_matches_unsharded_training(dp_report):
    world, zero = _part(dp_report, "zero")
    for (stage, opt, accum), diffs in zero.items():
        if stage == 3:
            _params_close(diffs, 1e-5, f"{world} ranks, ZeRO-3, {opt}, {accum} micro-batch(es) per step: the "
                          f"parameters after {STEPS} steps", "unsharded single-process training's")


@pytest.mark.integration
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
