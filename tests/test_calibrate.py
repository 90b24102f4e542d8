"""extras/calibrate.py: the laptop calibration (fitted from fake measurements here) and its predictions."""

import math

import pytest

from megalab.extras import calibrate, comm
from megalab.extras import step_time as st
from megalab.extras.calibrate import Calibration, CalibrationError, Link

RATE, OVERHEAD = 50e9, 5e-6  # a fake machine: 50 GFLOP/s per thread, 5 µs per matmul call
ALPHA, BETA = 300e-6, 1 / 1e9  # gloo: 300 µs, 1 GB/s


def fake_matmul(threads=(1, 2)):
    return [{"threads": t, "m": m, "n": n, "k": k, "seconds": OVERHEAD + 2 * m * n * k / (RATE * t)}
            for t in threads for m, n, k in calibrate.MATMUL_SHAPES]


def fake_gloo(world_sizes=(2, 4)):
    sizes = [4.0 * n for n in calibrate.GLOO_NUMELS]
    return {n: {"nbytes": sizes, "seconds": [comm.all_reduce_time(n, s, ALPHA * n / 2, BETA, "ring") for s in sizes]}
            for n in world_sizes}  # latency grows with the ranks sharing the cores


@pytest.fixture
def cal():
    return Calibration.from_measurements(fake_matmul(), fake_gloo(), cpus=2, elementwise=1e-9)


def test_fit_recovers_the_fake_machine(cal):
    assert set(cal.matmul) == {1, 2} and set(cal.links) == {2, 4}
    for t in (1, 2):
        overhead, rate = cal.matmul[t]
        assert math.isclose(rate, RATE * t, rel_tol=1e-6) and math.isclose(overhead, OVERHEAD, rel_tol=1e-4)
    assert math.isclose(cal.links[2].alpha, ALPHA, rel_tol=1e-6) and math.isclose(cal.links[4].alpha, 2 * ALPHA, rel_tol=1e-6)
    assert math.isclose(cal.links[4].bandwidth, 1e9, rel_tol=1e-6)
    assert "GFLOP/s" in cal.summary() and "alpha" in cal.summary()


def gemm(cal, ranks, size=512, **kw):
    return st.gemm_time(size, size, size, cal.hardware(ranks, **kw).gpu, dtype_bytes=4)


def test_noisy_fit_keeps_a_positive_latency_and_rate():
    sizes = [1e3, 1e4, 1e5, 1e6]
    seconds = [1e-7, 1e-5, 3e-4, 3e-3]  # faster than linear at the small end: the line would need alpha < 0
    alpha, beta = calibrate._fit(sizes, seconds, what="gloo")
    assert comm.fit_alpha_beta(sizes, seconds)[0] < 0 < beta
    assert alpha == 0.0 and beta == pytest.approx(3e-3 / 1e6)  # the largest size's rate
    cal = Calibration.from_measurements(fake_matmul(), {2: {"nbytes": sizes, "seconds": seconds}}, cpus=2)
    assert cal.links[2].alpha == 0.0 and cal.links[2].beta > 0


def test_ranks_share_the_cores(cal):
    assert cal.threads_per_rank(1) == 2 and cal.threads_per_rank(4) == 1
    assert cal.rank_share(1) == 1.0 and cal.rank_share(2) == 1.0 and cal.rank_share(4) == 0.5
    one = gemm(cal, 2)  # 1 thread each, a core each
    assert math.isclose(one, OVERHEAD + 2 * 512**3 / RATE, rel_tol=1e-4)
    assert math.isclose(gemm(cal, 4), 2 * one, rel_tol=1e-6)  # 4 ranks on 2 cores: half a core each
    assert gemm(cal, 1) < one  # 2 threads
    assert gemm(cal, 1, threads=1) == pytest.approx(one)
    assert gemm(cal, 1, size=8) < 2 * OVERHEAD  # small matmuls: the call's overhead


def test_hardware_is_the_step_time_models(cal):
    hw = cal.hardware(4)
    assert isinstance(hw, st.Hardware) and st.hardware(hw) is hw
    assert hw.gpu.peak_flops == pytest.approx(RATE * 0.5)  # one thread, half a core
    assert hw.intra_node.latency == pytest.approx(2 * ALPHA) and hw.intra_node.bandwidth == pytest.approx(1e9)
    assert st.collective_time("all_reduce", 1e6, 4, hw.intra_node) == pytest.approx(
        comm.all_reduce_time(4, 1e6, 2 * ALPHA, BETA))  # chapter 01's ring, through the planner's piece
    assert hw.gpu.overlap_slowdown == 1.0  # no core to spare for gloo
    roomy = Calibration.from_measurements(fake_matmul(), fake_gloo(), cpus=8, elementwise=1e-9)
    assert roomy.hardware(4).gpu.overlap_slowdown == 0.0


def test_predictions_are_monotone(cal):
    sizes = [2**k for k in range(8, 26, 2)]
    times = [calibrate.predict_all_reduce(cal, 4, s) for s in sizes]
    assert times == sorted(times) and times[0] > 0
    assert calibrate.predict_all_reduce(cal, 1, 1e6) == 0.0
    ddp = dict(layers=8, width=512, batch=256, ranks=4)
    naive, bucketed = calibrate.predict_ddp_step(cal, **ddp), calibrate.predict_ddp_step(cal, **ddp, bucket_size=2 * 512 * 513)
    assert naive["messages"] == 16 and bucketed["messages"] == 4
    assert naive["total"] > bucketed["total"]  # fewer messages, fewer alphas
    assert math.isclose(naive["compute"], bucketed["compute"])
    bigger = calibrate.predict_ddp_step(cal, layers=8, width=512, batch=512, ranks=4)
    assert bigger["compute"] > naive["compute"]
    # on 2 cores 4 ranks leave no core for gloo: overlap hides nothing; on 8 cores it does
    assert calibrate.predict_ddp_step(cal, **ddp, bucket_size=2 * 512 * 513, overlap_grad_reduce=True)["total"] == bucketed["total"]
    roomy = Calibration.from_measurements(fake_matmul(), fake_gloo(), cpus=8, elementwise=1e-9)
    plain = calibrate.predict_ddp_step(roomy, **ddp, bucket_size=2 * 512 * 513)
    hidden = calibrate.predict_ddp_step(roomy, **ddp, bucket_size=2 * 512 * 513, overlap_grad_reduce=True)
    assert hidden["total"] < plain["total"]


def test_pipeline_prediction_follows_the_bubble(cal):
    one = [calibrate.predict_pipeline(cal, 4, m)["total"] / m for m in (4, 8, 16, 32)]
    assert one == sorted(one, reverse=True)  # more micro-batches, smaller bubble per micro-batch
    plain, inter = calibrate.predict_pipeline(cal, 4, 8), calibrate.predict_pipeline(cal, 4, 8, 2)
    assert inter["bubble"] == pytest.approx(plain["bubble"] / 2)
    assert inter["messages"] == 2 * plain["messages"]
    assert plain["compute"] == pytest.approx(8 * 0.06 * (1 + 3 / 8))


def test_cp_prediction_zigzag_balances(cal):
    plain = [calibrate.predict_cp_attention(cal, 1024, 4, r, zigzag=False)["thread time"] for r in range(4)]
    zigzag = [calibrate.predict_cp_attention(cal, 1024, 4, r)["thread time"] for r in range(4)]
    assert plain == sorted(plain) and plain[-1] > 3 * plain[0]  # the last rank sees the most keys
    assert max(zigzag) == pytest.approx(min(zigzag))
    assert calibrate.predict_cp_attention(cal, 2048, 4, 0)["thread time"] > 3 * zigzag[0]  # s^2


def test_moe_and_traced_and_recompute(cal):
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.extras.comm_tracer import Collective

    small, big = (calibrate.predict_moe_all_to_all(cal, 4, b)["total"] for b in (1e3, 1e7))
    assert 0 < small < big
    records = [Collective("all_reduce", 4096, 4, 6144.0)] * 3
    step = calibrate.predict_traced_step(cal, records, 1e9, 4)
    assert step["communication"] == pytest.approx(3 * comm.all_reduce_time(4, 4096, 2 * ALPHA, BETA))
    assert step["compute"] == pytest.approx(1e9 / (RATE * 0.5))
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=128)
    r = calibrate.predict_recompute(cal, config, 4, 128)
    assert r["none"] < r["selective"] < r["full"] < 4 / 3 * r["none"]


def test_bad_input_says_what_to_provide(cal):
    from megalab.extras.comm_tracer import Collective

    with pytest.raises(CalibrationError, match="measure_matmul"):
        Calibration.from_measurements([], fake_gloo(), cpus=2)
    with pytest.raises(CalibrationError, match="measure_gloo"):
        Calibration.from_measurements(fake_matmul(), {}, cpus=2)
    with pytest.raises(CalibrationError, match="zero or infinite bandwidth"):
        Calibration(2, {1: (0.0, RATE)}, {2: Link(ALPHA, 0.0, 2)})
    with pytest.raises(CalibrationError, match="FLOP/s > 0"):
        Calibration(2, {1: (0.0, 0.0)}, {2: Link(ALPHA, BETA, 2)})
    with pytest.raises(CalibrationError, match="two measured sizes"):
        Calibration.from_measurements(fake_matmul(), {2: {"nbytes": [4.0], "seconds": [1e-3]}}, cpus=2)
    with pytest.raises(CalibrationError, match="2 or more"):
        Calibration.from_measurements(fake_matmul(), {1: fake_gloo()[2]}, cpus=2)
    with pytest.raises(CalibrationError, match="elementwise"):
        Calibration(2, {1: (0.0, RATE)}, {2: Link(ALPHA, BETA, 2)}).hardware(2)
    with pytest.raises(ValueError, match="no cost model"):
        calibrate.traced_time(cal, [Collective("gossip", 100, 4, 100.0)], 4)


def test_cache_round_trip(cal, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "cache_path", lambda: tmp_path / "calibration" / calibrate.CACHE_FILE)
    assert calibrate.load() is None
    calibrate.save(cal)
    back = calibrate.load()
    assert back == cal and back.points["gloo"][4]["nbytes"] == cal.points["gloo"][4]["nbytes"]
    measured = []
    monkeypatch.setattr(Calibration, "measure", classmethod(lambda cls: measured.append(1) or cal))
    assert calibrate.calibration() == cal and not measured  # cached: nothing measured
    assert calibrate.calibration(refresh=True) == cal and measured == [1]


def test_measure_matmul_and_elementwise_are_quick():
    points = calibrate.measure_matmul(shapes=((64, 64, 64), (256, 256, 256)), threads=(1,), repeats=2)
    assert len(points) == 2 and all(p["seconds"] > 0 for p in points)
    assert 0 < calibrate.measure_elementwise(numel=4096, repeats=2) < 1e-6


def test_measure_gloo_on_real_ranks():
    """Two gloo ranks through megalab's launcher: times that grow with the size, and a link fitted from them."""
    points = calibrate.measure_gloo(world_sizes=(2,), numels=(256, 2**18), repeats=3)
    assert points[2]["nbytes"] == [1024, 2**20] and all(s > 0 for s in points[2]["seconds"])
    cal = Calibration.from_measurements(fake_matmul(), points, cpus=2, elementwise=1e-9)
    assert cal.links[2].beta > 0 and cal.links[2].alpha >= 0
