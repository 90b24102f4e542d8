"""megalab.extras.comm: collectives from send/recv checked against torch.distributed's own; the cost model
against hand-computed values.

One launch per world size (2, 3, 4) runs every collective on every length and dtype (and, on 4
ranks, on the even/odd subgroups); each exercise's test then reads its own part of the report.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megalab.extras import comm
from megalab.lab import dist as mdist
from megalab.lab import launch
from megalab.lab.checks import close, mistake, require
from megalab.lab.dist import shard_bounds

LENGTHS = (0, 1, 2, 3, 5, 7, 10, 13, 64, 1001)  # below, at, and not divisible by the world size
DTYPES = (torch.float32, torch.int64)


def _data(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU (same values on any device), then on the rank's
    if dtype.is_floating_point:
        return torch.randn(length, generator=g, dtype=dtype).to(mdist.device())
    return torch.randint(-1000, 1000, (length,), generator=g, dtype=dtype).to(mdist.device())


def _mismatch(ours: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None if ours is torch.distributed's result (floats within 1e-5), else what differs, in words."""
    if not isinstance(ours, torch.Tensor):
        return f"returned {type(ours).__name__}, not a tensor"
    if ours.shape != ref.shape:
        return f"the result has shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    if ours.dtype != ref.dtype:
        return f"the result is {ours.dtype}, expected {ref.dtype} (the input's)"
    if ours.dtype.is_floating_point:  # a ring adds in another order than gloo does
        bad = ~torch.isclose(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        bad = ours != ref
    if not bad.any():
        return None
    i = tuple(int(j) for j in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {ref.numel()} elements differ from torch.distributed's, the first at index "
            f"{i[0] if len(i) == 1 else i}: got {ours[i].item():.6g}, expected {ref[i].item():.6g}")


def _padded_chunks(flat: torch.Tensor, world: int) -> torch.Tensor:
    """[world * max_chunk]: chunk r of `flat` at r * max_chunk, zero-padded (torch wants equal chunks)."""
    width = shard_bounds(flat.numel(), world, 0)[1]
    out = flat.new_zeros(world * width)
    for r in range(world):
        start, stop = shard_bounds(flat.numel(), world, r)
        out[r * width : r * width + stop - start] = flat[start:stop]
    return out


def _check_broadcast(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            for src in range(world):
                data = _data(length, dtype, seed=length) if rank == src else torch.zeros(length, dtype=dtype, device=mdist.device())
                ref = data.clone()
                dist.broadcast(ref, src=global_rank(src), group=group)
                ours = comm.broadcast(data, src=src, group=group)
                if why := _mismatch(ours, ref):
                    bad.append(f"length {length}, {dtype}, src {src}: {why}")
    matrix = torch.arange(12.0, device=mdist.device()).reshape(3, 4) * (rank == 0)  # any contiguous shape
    if why := _mismatch(comm.broadcast(matrix, src=0, group=group), torch.arange(12.0, device=mdist.device()).reshape(3, 4)):
        bad.append(f"a 3x4 matrix from src 0: {why}")
    return bad


def _check_all_gather(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            start, stop = shard_bounds(length, world, rank)
            shard = _data(stop - start, dtype, seed=1000 * length + rank)
            width = shard_bounds(length, world, 0)[1]
            padded = shard.new_zeros(width)
            padded[: shard.numel()] = shard
            gathered = shard.new_zeros(world * width)
            dist.all_gather_single(gathered, padded, group=group)
            ref = torch.cat([gathered[r * width : r * width + b - a] for r, (a, b) in
                             enumerate(shard_bounds(length, world, r) for r in range(world))])
            ours = comm.all_gather(torch.full((length,), -7, dtype=dtype, device=mdist.device()), shard, group=group)
            if why := _mismatch(ours, ref):
                bad.append(f"length {length}, {dtype}: {why}")
    try:
        comm.all_gather(torch.zeros(10, device=mdist.device()), torch.zeros(11, device=mdist.device()), group=group)
        bad.append("a wrongly sized shard was accepted")
    except ValueError:
        pass
    return bad


def _check_reduce_scatter(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            data = _data(length, dtype, seed=1000 * length + rank)
            kept = data.clone()
            start, stop = shard_bounds(length, world, rank)
            padded = _padded_chunks(data, world)
            reduced = data.new_zeros(padded.numel() // world)
            dist.reduce_scatter_single(reduced, padded, group=group)
            ours = comm.reduce_scatter(data.new_zeros(stop - start), data, group=group)
            if why := _mismatch(ours, reduced[: stop - start]):
                bad.append(f"length {length}, {dtype}: {why}")
            if not torch.equal(data, kept):
                bad.append(f"length {length}, {dtype}: the input was modified (work on a copy)")
    return bad


def _check_ring_all_reduce(rank, world, group, global_rank):
    bad = []
    for length in LENGTHS:
        for dtype in DTYPES:
            data = _data(length, dtype, seed=1000 * length + rank)
            ref = data.clone()
            dist.all_reduce(ref, group=group)
            if why := _mismatch(comm.ring_all_reduce(data, group=group), ref):
                bad.append(f"length {length}, {dtype}: {why}")
    matrix = torch.full((3, 5), float(rank + 1), device=mdist.device())
    if why := _mismatch(comm.ring_all_reduce(matrix, group=group), torch.full((3, 5), float(sum(range(1, world + 1))), device=mdist.device())):
        bad.append(f"a 3x5 matrix: {why}")
    return bad


CHECKS = {
    "comm.broadcast": _check_broadcast,
    "comm.all_gather": _check_all_gather,
    "comm.reduce_scatter": _check_reduce_scatter,
    "comm.ring_all_reduce": _check_ring_all_reduce,
}


def _collectives_worker() -> dict[str, list[str]]:
    """On every rank: run each check on the world group (and on 4 ranks, the even/odd groups)."""
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    groups = {"world": None}
    if world == 4:
        even, odd = dist.new_group([0, 2]), dist.new_group([1, 3])
        groups["even/odd"] = even if rank % 2 == 0 else odd
    report = {}
    for exercise, check in CHECKS.items():
        problems = []
        for name, group in groups.items():
            def global_rank(r, group=group):
                return r if group is None else dist.get_global_rank(group, r)

            try:
                problems += [f"{name} group: {p}" for p in check(dist.get_rank(group), dist.get_world_size(group), group, global_rank)]
            except Exception as exc:  # e.g. the exercise's NotImplementedError: report it, go on
                problems.append(f"{name} group: raised {type(exc).__name__}: {exc}")
                break
        report[exercise] = problems
    report["world"] = world
    return report


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}ranks")
def collectives_report(request):
    result = launch.run_function(_collectives_worker, request.param, launch=dict(timeout=180))
    return result.returns


def _assert_ok(report, exercise):
    problems = {rank: r[exercise] for rank, r in report.items() if r[exercise]}
    name = exercise.removeprefix("comm.")
    assert not problems, "\n".join(
        f"{report[rank]['world']} ranks, rank {rank}: comm.{name} is wrong in {len(p)} case(s); first, on the {p[0]}"
        for rank, p in problems.items())


@pytest.mark.exercise("comm.broadcast")
def test_broadcast_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.broadcast")


@pytest.mark.exercise("comm.all_gather")
def test_all_gather_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.all_gather")


@pytest.mark.exercise("comm.reduce_scatter")
def test_reduce_scatter_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.reduce_scatter")


@pytest.mark.exercise("comm.ring_all_reduce")
def test_ring_all_reduce_matches_dist(collectives_report):
    _assert_ok(collectives_report, "comm.ring_all_reduce")


# --------------------------------------------------------------------------- cost model

ALPHA, BETA = 1e-5, 1e-9  # 10 µs per message, 1 GB/s


def _approx(got, expected, what, rel=None):
    assert got == pytest.approx(expected, rel=rel), f"{what} is {got:.6g}, expected {expected:.6g}"


def _close64(got, expected, what, mistakes, rel=1e-6):
    """close() of plain floats in float64 (as_tensor would round them to float32), naming the typical mistakes."""
    as64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return close(as64(got), as64(expected), what, rtol=rel, atol=0.0,
                 mistakes={name: as64(value) for name, value in mistakes.items()})


def _all_reduce_time_mistakes(n, m, algorithm):
    """What the typical wrong formulas give for all_reduce_time(n, m, ALPHA, BETA, algorithm)."""
    rounds = {"naive": n - 1, "tree": math.ceil(math.log2(n)) if n > 1 else 0, "ring": n - 1}[algorithm]
    per_round = ALPHA + (m / n if algorithm == "ring" else m) * BETA
    mistakes = {"counted one phase only (reduce, then broadcast: the factor 2)": rounds * per_round}
    if algorithm == "ring":
        mistakes["each ring step moves nbytes / n, not the whole message"] = 2 * rounds * (ALPHA + m * BETA)
    if algorithm == "tree":
        mistakes["log2(n) must be rounded up with ceil (a partial round is a whole round)"] = \
            2 * math.log2(n) * (ALPHA + m * BETA)
    return mistakes


@pytest.mark.exercise("comm.all_reduce_time")
def test_all_reduce_time_formulas():
    m = 1e6
    call = "all_reduce_time(n={}, m=1e6 bytes, alpha=1e-5, beta=1e-9, {!r})"
    # n = 4: ring 2*3*alpha + 2*3/4*m*beta; naive 2*3*(alpha + m*beta); tree 2*log2(4)*(alpha + m*beta)
    cases = [(4, "ring", 6e-5 + 1.5e-3, " (2(n-1) alpha + 2(n-1)/n m beta)"),
             (4, "naive", 6 * 1.01e-3, " (2(n-1) (alpha + m beta))"),
             (4, "tree", 4 * 1.01e-3, " (2 ceil(log2 n) (alpha + m beta))"),
             (5, "tree", 6 * 1.01e-3, " (ceil(log2 5) = 3)"),
             (1024, "ring", 2046e-5 + 2 * 1023 / 1024 * 1e-3, "")]
    for n, algorithm, expected, formula in cases:
        require(_close64(comm.all_reduce_time(n, m, ALPHA, BETA, algorithm), expected,
                         call.format(n, algorithm) + formula, _all_reduce_time_mistakes(n, m, algorithm)))
    for algorithm in comm.ALL_REDUCE_ALGORITHMS:
        _approx(comm.all_reduce_time(1, m, ALPHA, BETA, algorithm), 0, call.format(1, algorithm) + " (one rank: no "
                                                                                          "communication)")
    with pytest.raises(ValueError, match="ring"):
        comm.all_reduce_time(4, m, ALPHA, BETA, "butterfly")


BUSBW_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                 "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def _busbw_mistakes(nbytes, seconds, n, collective):
    """What the typical wrong factors give for busbw(nbytes, seconds, n, collective)."""
    algbw, factor = nbytes / seconds, BUSBW_FACTORS[collective](n)
    mistakes = {"divided algbw by the factor instead of multiplying": algbw / factor}
    if collective == "all_reduce":
        mistakes["an all-reduce's factor is 2(n-1)/n (reduce-scatter + all-gather), not (n-1)/n"] = \
            algbw * (n - 1) / n
    return mistakes


@pytest.mark.exercise("comm.busbw")
def test_busbw_factors():
    _approx(comm.algbw(1e9, 0.1), 1e10, "algbw(1e9 bytes, 0.1 s)")
    call = "busbw(1e9 bytes, 0.1 s, n={}, {!r})"
    for n, collective, expected, why in [(8, "all_reduce", 1e10 * 14 / 8, " (algbw x 2(n-1)/n)"),
                                         (8, "all_gather", 1e10 * 7 / 8, " (algbw x (n-1)/n)"),
                                         (8, "reduce_scatter", 1e10 * 7 / 8, " (algbw x (n-1)/n)"),
                                         (8, "broadcast", 1e10, " (algbw x 1)"),
                                         (2, "all_reduce", 1e10, " (2(n-1)/n = 1 on 2 ranks)")]:
        require(_close64(comm.busbw(1e9, 0.1, n, collective), expected, call.format(n, collective) + why,
                         _busbw_mistakes(1e9, 0.1, n, collective)))
    # a ring all-reduce in the model runs at busbw = 1/beta for large messages, whatever n is
    for n in (2, 8, 64):
        t = 2 * (n - 1) / n * 1e12 * BETA  # the ring's bandwidth term
        _approx(comm.busbw(1e12, t, n), 1 / BETA, f"busbw(1e12 bytes, the ring's time {t:.4g} s, n={n}) (the link's "
                                                  "bandwidth 1/beta, whatever n)")
    with pytest.raises(ValueError, match="all_reduce"):
        comm.busbw(1e9, 0.1, 8, "all_to_all")


def _absolute_fit(sizes, seconds, latency_steps, bytes_factor):
    """The fit a learner gets by forgetting to weight the rows: least squares in absolute seconds."""
    design = torch.tensor([[latency_steps, bytes_factor * s] for s in sizes], dtype=torch.float64)
    return torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64)[:, None]).solution.flatten().tolist()


@pytest.mark.exercise("comm.fit_alpha_beta")
def test_fit_alpha_beta_recovers_parameters():
    sizes = [2.0**k for k in range(2, 26, 2)]
    exact = [ALPHA + s * BETA for s in sizes]
    fit = comm.fit_alpha_beta(sizes, exact)
    where = "fit_alpha_beta on exact times alpha + m beta: (alpha, beta)"
    require(_close64(fit, (ALPHA, BETA), where, {"returned (beta, alpha): swapped": (BETA, ALPHA)}, rel=1e-9))
    # a ring all-reduce on 4 ranks: t = 6 alpha + 1.5 beta m; 3% multiplicative noise
    noise = torch.Generator().manual_seed(0)
    measured = [(6 * ALPHA + 1.5 * s * BETA) * math.exp(0.03 * torch.randn(1, generator=noise).item()) for s in sizes]
    fit = comm.fit_alpha_beta(sizes, measured, latency_steps=6, bytes_factor=1.5)
    where = "fit_alpha_beta(latency_steps=6, bytes_factor=1.5) on 4-rank ring times with 3% noise: (alpha, beta)"
    require(_close64(fit, (ALPHA, BETA), f"{where} (within 10%)", {
        "fitted absolute errors (divide each row by its time: the fit must weigh relative errors)":
            _absolute_fit(sizes, measured, 6, 1.5),
        "ignored latency_steps and bytes_factor (fitted one message: alpha 6x, beta 1.5x too large)":
            (6 * ALPHA, 1.5 * BETA),
        "returned (beta, alpha): swapped": (BETA, ALPHA)}, rel=0.1))
    with pytest.raises(ValueError, match="at least two"):
        comm.fit_alpha_beta([1.0], [1.0])
