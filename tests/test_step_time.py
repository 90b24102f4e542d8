"""The step-time model: its pieces against their formulas, and the whole against published runs
(Narayanan et al. 2021 Tables 1 and 2, Korthikanti et al. 2022 Table 5: every row within 15%)."""

import dataclasses
import math

import pytest

from megalab.extras import calc
from megalab.extras import planner as P
from megalab.extras import published_runs as R
from megalab.extras import step_time as S

A100 = S.A100_80GB
CASES = [(run, metric) for run in R.all_runs() for metric in run.published]


@pytest.mark.parametrize("run, metric", CASES, ids=[f"{r.source} {m}" for r, m in CASES])
def test_reproduces_published_run_within_15_percent(run, metric):
    published, predicted = run.published[metric], R.predict(run)[metric]
    parts = S.step_time(run.model, run.layout, run.train).parts()
    assert predicted == pytest.approx(published, rel=0.15), (
        f"{run.source}: {run.model.name} as {run.layout} ({run.train.global_batch_size} sequences, micro-batch "
        f"{run.train.micro_batch_size}, recompute {run.train.recompute}): predicted {metric} {predicted:.1f}, "
        f"published {published:g} ({predicted / published - 1:+.1%}); step pieces in s: "
        + ", ".join(f"{k} {v:.3g}" for k, v in parts.items() if v))


def test_published_runs_cover_the_three_tables():
    sources = [r.source for r in R.all_runs()]
    assert sum("Table 1" in s for s in sources) == 10
    assert sum("Table 2" in s for s in sources) == 12
    assert sum("Korthikanti" in s for s in sources) == 4
    # Table 1's model sizes are the ones Eq. 2 gives (a check on the transcribed shapes)
    for run in R.narayanan_table_1():
        m = run.model
        assert round(calc.num_parameters(m.num_layers, m.hidden_size, R.VOCAB, R.SEQ) / 1e9, 1) == float(m.name.split()[1][:-1])


def test_korthikanti_hfu_counts_the_recomputed_attention_twice_over():
    """Table 5's HFU/MFU ratios equal korthikanti_hardware_flops / model FLOPs (to 0.2%) for all four models."""
    for run in R.korthikanti_table_5():
        m, t = run.model, run.train
        args = (t.global_batch_size, t.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
        ratio = calc.korthikanti_hardware_flops(*args) / calc.flops_per_iteration(*args, recompute=False)
        assert run.published["HFU %"] / run.published["MFU %"] == pytest.approx(ratio, rel=2e-3), run.source


def test_model_flops_are_megatrons_and_eq3_adds_the_recomputed_forward():
    run = R.narayanan_table_1()[6]  # 145.6B
    m, t = run.model, run.train
    args = (t.global_batch_size, t.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
    assert S.model_flops(m, t, t.global_batch_size) == pytest.approx(calc.flops_per_iteration(*args, recompute=False))
    full = S.model_flops(m, t, t.global_batch_size) + S.recomputed_flops(m, t, t.global_batch_size)
    assert full == pytest.approx(calc.flops_per_iteration(*args, recompute=True))


def test_gemm_time_is_a_roofline_with_wave_quantisation():
    m, n, k = 6912, 16384, 2048  # the shape of the published best A100 GEMM: whole waves, no waste
    best = 2 * m * n * k / (A100.peak_flops * A100.matmul_efficiency * A100.sustained)
    assert S.gemm_time(m, n, k, A100) == pytest.approx(best + A100.kernel_overhead)
    # one 256x128 tile more than the 108 SMs hold needs a second, nearly empty wave
    one_tile = dataclasses.replace(A100, tiles=((256, 128),))
    assert S.matmul_efficiency(256, 128 * 109, 4096, one_tile) == pytest.approx(
        A100.matmul_efficiency * A100.sustained * 109 / 216)
    # cuBLAS picks the tile that wastes least: 128x128 tiles, 218 of them in 3 waves of 108
    assert S.matmul_efficiency(256, 128 * 109, 4096, A100) == pytest.approx(
        A100.matmul_efficiency * A100.sustained * 218 / 324)
    # q kᵀ with head_dim 64: 64 FLOPs per element written, under A100's ~150 FLOP/byte ridge: memory-bound
    s, d, heads = 4096, 64, 32
    memory = 2 * heads * (s * d + d * s + s * s) / A100.achievable_bandwidth
    assert S.gemm_time(s, s, d, A100, batch=heads) == pytest.approx(memory + A100.kernel_overhead)


def test_collective_times_follow_the_ring_formulas():
    link = S.Link("test", bandwidth=100e9, latency=1e-5, efficiency=0.5)
    nbytes, n = 1e9, 8
    gather = (n - 1) / n * nbytes / 50e9 + (n - 1) * 1e-5
    assert S.collective_time("all_gather", nbytes, n, link) == pytest.approx(gather)
    assert S.collective_time("reduce_scatter", nbytes, n, link) == pytest.approx(gather)
    assert S.collective_time("all_reduce", nbytes, n, link) == pytest.approx(2 * gather)
    assert S.collective_time("send_recv", nbytes, 2, link) == pytest.approx(nbytes / 50e9 + 1e-5)
    assert S.collective_time("all_reduce", nbytes, 1, link) == 0.0
    assert S.collective_time("all_to_all", nbytes, n, link) == pytest.approx((n - 1) / n * nbytes / 50e9 + 1e-5)
    with pytest.raises(ValueError, match="all_reduce, all_gather"):
        S.collective_time("broadcast", nbytes, n, link)


def test_overlap_hides_communication_but_slows_compute():
    gpu = dataclasses.replace(A100, overlap_slowdown=0.0)
    assert S.overlapped(3.0, 5.0, gpu) == 0.0 and S.overlapped(7.0, 5.0, gpu) == 2.0
    assert S.overlapped(3.0, 5.0, A100) == pytest.approx(A100.overlap_slowdown * 3.0)
    assert S.overlapped(12.0, 5.0, A100) == pytest.approx(7.0)  # far longer than compute: the rest is exposed


def test_bubble_and_interleaving():
    assert S.bubble(8, 64) == pytest.approx(7 / 64)
    assert S.bubble(8, 64, vpp=2) == pytest.approx(7 / 128)
    assert S.bubble(1, 64) == 0.0
    model, train = P.LLAMA3_70B, P.Training(global_batch_size=64)
    plain = S.step_time(model, P.Layout(tp=8, pp=8, dp=1), train)
    interleaved = S.step_time(model, P.Layout(tp=8, pp=8, dp=1, vpp=2), train)
    assert interleaved.bubble == pytest.approx(plain.bubble / 2, rel=0.05)
    assert plain.bubble == pytest.approx(7 / 64 * (plain.compute + plain.recompute + sum(
        plain.comm[k] for k in ("tp", "cp", "ep"))), rel=1e-9)


def test_groups_that_leave_the_node_use_the_network():
    model = P.LLAMA3_8B
    train = P.Training(global_batch_size=64, overlap_grad_reduce=False, overlap_param_gather=False)
    inside = S.step_time(model, P.Layout(dp=8), train).comm["dp"]  # 8 data-parallel ranks on one node
    hw = S.hardware(train.hardware)
    four_per_node = dataclasses.replace(hw, gpus_per_node=4)  # the same group now spans two nodes
    across = S.step_time(model, P.Layout(dp=8), dataclasses.replace(train, hardware=four_per_node)).comm["dp"]
    ratio = hw.intra_node.achievable_bandwidth / hw.inter_node.achievable_bandwidth
    assert across / inside == pytest.approx(ratio, rel=0.02)


def test_zero3_is_bound_by_the_network_as_gpus_grow():
    """Table 2's lesson: at a fixed batch, ZeRO-3's time per step stops falling once its parameter
    traffic (the same on every GPU count) outlasts the compute; PTD-P keeps scaling."""
    zero = [r for r in R.narayanan_table_2() if r.train.zero_stage == 3][:3]
    times = [S.step_time(r.model, r.layout, r.train).total for r in zero]
    assert times[2] > 0.9 * times[1]  # doubling the GPUs barely helps
    ptdp = [r for r in R.narayanan_table_2() if r.train.zero_stage == 0][:3]
    times = [S.step_time(r.model, r.layout, r.train).total for r in ptdp]
    assert times[2] < 0.6 * times[1]


def test_unknown_hardware_says_what_to_provide():
    with pytest.raises(ValueError, match=r"no calibration for hardware 'MI300X'.*known: A100-80GB.*GPU\(name, peak_flops"):
        S.hardware("MI300X")
    with pytest.raises(ValueError, match="no calibration"):
        P.evaluate(P.LLAMA3_8B, P.Layout(dp=8), P.Training(hardware="B200"))


def test_a_measured_curve_replaces_the_wave_model():
    laptop = dataclasses.replace(A100, efficiency_curve=lambda m, n, k: 0.5, sustained=1.0)
    assert S.matmul_efficiency(100, 100, 100, laptop) == 0.5
    big = 2 * 4096**3 / (laptop.peak_flops * 0.5)
    assert S.gemm_time(4096, 4096, 4096, laptop) == pytest.approx(big + laptop.kernel_overhead)


def test_mfu_hfu_and_parts_add_up():
    t = S.step_time(P.LLAMA3_8B, P.Layout(tp=2, pp=2, dp=2), P.Training(global_batch_size=64, recompute="full"))
    assert sum(t.parts().values()) == pytest.approx(t.total)
    assert t.hfu == pytest.approx(t.mfu * t.hardware_flops / t.model_flops)
    assert t.recompute > 0 and math.isclose(t.hardware_flops / t.model_flops, 4 / 3, rel_tol=0.05)


def test_flash_attention_counts_half_the_square_at_the_fused_kernels_rate():
    b, heads, s, d = 1, 8, 4096, 128
    flops = 2 * b * heads * s * s * (d + d) / 2  # q kᵀ and probabilities x v, the causal half
    expected = flops / (A100.peak_flops * A100.attention_efficiency * A100.sustained) + A100.kernel_overhead
    assert S.attention_time(b, heads, s, s, d, A100, flash=True) == pytest.approx(expected)
    unfused = S.attention_time(b, heads, s, s, d, A100, flash=False)  # the s x s scores through HBM
    assert unfused > S.elementwise_time(S.SOFTMAX_DROPOUT_BYTES * b * heads * s * s, A100)
