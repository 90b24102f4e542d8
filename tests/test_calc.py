"""calc against the papers' own numbers and against the formulas' component counts."""

import pytest

from megalab.extras import calc

# Narayanan et al. 2021, Table 1: (billions of parameters, heads, hidden size, layers); V=51200, s=2048.
NARAYANAN_TABLE_1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
                     (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
                     (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("billions, heads, hidden, layers", NARAYANAN_TABLE_1)
def test_num_parameters_reproduces_narayanan_table_1(billions, heads, hidden, layers):
    assert round(calc.num_parameters(layers, hidden, 51200, 2048) / 1e9, 1) == billions


def test_num_parameters_is_the_sum_of_its_parts():
    l, h, V, s = 3, 64, 1000, 128  # noqa: E741 (the paper's symbols)
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    assert calc.num_parameters(l, h, V, s) == pytest.approx(l * per_layer + V * h + s * h, rel=1e-12)


def test_flops_per_iteration_counts_matmuls():
    B, s, l, h, V = 8, 256, 4, 128, 5000  # noqa: E741 (the paper's symbols)
    forward_layer = 24 * B * s * h * h + 4 * B * s * s * h
    logits = 2 * B * s * h * V
    model = 3 * (l * forward_layer + logits)  # forward + backward (twice the forward)
    assert calc.flops_per_iteration(B, s, l, h, V, recompute=False) == pytest.approx(model, rel=1e-12)
    with_recompute = model + l * forward_layer  # one more forward of every layer
    assert calc.flops_per_iteration(B, s, l, h, V, recompute=True) == pytest.approx(with_recompute, rel=1e-12)


def test_training_days_narayanan_examples():
    # Section 5.1: GPT-3 (175B, 300B tokens, 1024 GPUs at 140 TFLOP/s) "34 days";
    # 1T model (450B tokens, 3072 GPUs at 163 TFLOP/s) "84 days".
    assert round(calc.training_days(300e9, 175e9, 1024, 140e12)) == 34
    assert round(calc.training_days(450e9, 1008e9, 3072, 163e12)) == 84


def test_activation_memory_table_2():
    s, b, h, a = 2048, 4, 1024, 16
    none = calc.activation_memory_per_layer(s, b, h, a)
    assert none == 34 * s * b * h + 5 * a * s * s * b  # Korthikanti Eq. 1
    t = 4
    assert calc.activation_memory_per_layer(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert calc.activation_memory_per_layer(s, b, h, a, t, sequence_parallel=True) == pytest.approx(none / t)
    assert calc.activation_memory_per_layer(s, b, h, a, t, recompute="selective") == pytest.approx(s * b * h * (10 + 24 / t))
    assert calc.activation_memory_per_layer(s, b, h, a, t, True, "selective") == pytest.approx(34 * s * b * h / t)
    assert calc.activation_memory_per_layer(s, b, h, a, t, True, "full") == 2 * s * b * h
    with pytest.raises(ValueError, match="selective"):
        calc.activation_memory_per_layer(s, b, h, a, recompute="partial")


def test_korthikanti_gpt3_selective_recompute_saving():
    # GPT-3 175B, t=8: 5as/h = 80 (the paper's number); with sequence parallelism, selective
    # recompute removes 70% of the activations, and together they cut tensor parallelism's by 5x.
    s, h, a, t = 2048, 12288, 96, 8
    assert 5 * a * s / h == 80
    sp = calc.activation_memory_per_layer(s, 1, h, a, t, sequence_parallel=True)
    sp_sel = calc.activation_memory_per_layer(s, 1, h, a, t, sequence_parallel=True, recompute="selective")
    tp_only = calc.activation_memory_per_layer(s, 1, h, a, t)
    assert round(1 - sp_sel / sp, 2) == 0.70
    assert round(tp_only / sp_sel) == 5


def test_korthikanti_hardware_flops_add_the_recomputed_attention():
    B, s, l, h, V = 8, 256, 4, 128, 5000  # noqa: E741 (the paper's symbols)
    model = calc.flops_per_iteration(B, s, l, h, V, recompute=False)
    # the paper's HFU counts 12 B s^2 h per layer more: 3x the 4 B s^2 h of the attention core's forward
    assert calc.korthikanti_hardware_flops(B, s, l, h, V) == pytest.approx(model + 12 * B * s * s * h * l, rel=1e-12)
