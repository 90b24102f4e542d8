"""Chapter 07, projects 2 and 3: a sliding-window attention through the layer spec (megalab/model/sliding_window.py)
and a profiled training step made faster (megalab/speedup.py).

References: a per-query loop written here (each query's softmax over its last W keys), PyTorch's causal SDPA
(the window covering the whole sequence), the single-device model against the tensor-parallel one, and a fake
clock for the timing function (no test here is timed).
"""

import math
import traceback
from functools import partial

import pytest
import torch

from megalab import launch
from megalab import parallel_state as ps
from megalab import tensor_parallel as tp
from megalab.config import TransformerConfig
from megalab.model import CoreAttention, GPTModel, LayerSpec
from megalab.model.sliding_window import (
    SlidingWindowAttention,
    blocked_sliding_window_attention,
    masked_sliding_window_attention,
    sliding_window_mask,
    sliding_window_spec,
)
from megalab.profiling import profile_step
from megalab.speedup import (
    LoopedAttention,
    interleaved_speedup,
    make_train_step,
    op_calls,
    remove_hotspots,
    slow_step_setup,
)

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=24,
             hidden_dropout=0.0, attention_dropout=0.0)


def loop_reference(q, k, v, window):
    """[b, h, s, d]: query i's softmax over keys max(0, i - W + 1) .. i, one query at a time."""
    out = []
    for i in range(q.shape[2]):
        lo = max(0, i - window + 1)
        scores = q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out.append(scores.softmax(-1) @ v[:, :, lo:i + 1])
    return torch.cat(out, dim=2)


def _qkv(*shape, seed=0, grad=False, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(n)]


def _grads(fn, tensors, seed=9):
    out = fn(*tensors)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


# ------------------------------------------------------------------ sliding window: the mask and the kernels
@pytest.mark.exercise("sliding_window.mask")
@pytest.mark.parametrize("s, window", [(6, 3), (5, 1), (4, 9), (9, 4)])
def test_sliding_window_mask_matches_loops(s, window):
    expected = torch.zeros(s, s, dtype=torch.bool)
    for i in range(s):
        for j in range(max(0, i - window + 1), i + 1):
            expected[i, j] = True
    assert torch.equal(sliding_window_mask(s, window), expected)


@pytest.mark.exercise("sliding_window.mask")
def test_masked_attention_equals_loop_reference_values_and_grads():
    q, k, v = _qkv(2, 3, 13, 8, grad=True)
    for window in (1, 4, 13):
        out, grads = _grads(partial(masked_sliding_window_attention, window=window), [q, k, v])
        ref, ref_grads = _grads(partial(loop_reference, window=window), [q, k, v])
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)


@pytest.mark.exercise("sliding_window.blocked")
@pytest.mark.parametrize("s, window", [(16, 4), (17, 4), (7, 3), (9, 1), (5, 8)])
def test_blocked_attention_equals_loop_reference_values_and_grads(s, window):
    q, k, v = _qkv(2, 3, s, 8, seed=s, grad=True)
    out, grads = _grads(partial(blocked_sliding_window_attention, window=window), [q, k, v])
    ref, ref_grads = _grads(partial(loop_reference, window=window), [q, k, v])
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_bad_window_is_a_clear_error():
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="window_size must be a positive integer"):
            sliding_window_spec(bad)
    with pytest.raises(ValueError, match="window_size must be a positive integer"):
        SlidingWindowAttention(TransformerConfig(**SMALL), window_size=0)


# ------------------------------------------------------------------ sliding window: the core attention and the spec
@pytest.mark.exercise("sliding_window.blocked")
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_core_attention_with_gqa_equals_loop_reference(groups):
    attention = SlidingWindowAttention(TransformerConfig(**SMALL), window_size=5)  # s = 24 > 2W: the blocked path
    s, b, np_, hn = 24, 2, 4, 8
    query = torch.randn(s, b, np_, hn, generator=torch.Generator().manual_seed(1))
    key, value = _qkv(s, b, groups, hn, seed=2, n=2)
    rep = np_ // groups
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2)))
    expected = loop_reference(q, k, v, 5).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
    torch.testing.assert_close(attention(query, key, value), expected)


@pytest.mark.exercise("sliding_window.mask")
def test_window_covering_the_sequence_is_causal_attention():
    config = TransformerConfig(**SMALL)
    query, key, value = _qkv(24, 2, 4, 8, seed=3)
    torch.testing.assert_close(SlidingWindowAttention(config, 24)(query, key, value), CoreAttention(config)(query, key, value))
    torch.manual_seed(0)
    causal = GPTModel(config)
    torch.manual_seed(0)
    windowed = GPTModel(config, sliding_window_spec(100))
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(windowed(ids), causal(ids))


@pytest.mark.exercise("sliding_window.blocked")
def test_gpt_through_the_spec_equals_a_loop_reference_model_and_has_the_receptive_field():
    class LoopCoreAttention(torch.nn.Module):
        def __init__(self, config, window_size):
            super().__init__()
            self.window = window_size

        def forward(self, query, key, value):
            s, b, np_, hn = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            return loop_reference(q, k, v, self.window).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)

    config, window = TransformerConfig(**SMALL), 4
    torch.manual_seed(0)
    model = GPTModel(config, sliding_window_spec(window))
    torch.manual_seed(0)
    reference = GPTModel(config, LayerSpec(core_attention=partial(LoopCoreAttention, window_size=window)))
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    labels = torch.roll(ids, -1, 1)
    model(ids, labels=labels).mean().backward()
    reference(ids, labels=labels).mean().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=name)
    # two layers of window 4 see 2 * 3 + 1 = 7 tokens back: changing token 0 changes positions 0..6 only
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 64
    with torch.no_grad():
        moved = (model(changed) - model(ids)).abs().amax(dim=(0, 2)) > 1e-6
    assert moved.tolist() == [i <= config.num_layers * (window - 1) for i in range(24)]


# ------------------------------------------------------------------ sliding window under tensor parallelism
def _tp_worker(window):
    from megalab import dist as mdist

    rank, world = mdist.init()
    out = {}
    config = TransformerConfig(**{**SMALL, "num_query_groups": 2, "position_embedding_type": "rope",
                                  "normalization": "RMSNorm", "share_embeddings_and_output_weights": False})
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    ref = GPTModel(config, sliding_window_spec(window))
    ref_loss = ref(ids, labels=torch.roll(ids, -1, 1))
    ref_loss.mean().backward()
    ref_params = dict(ref.named_parameters())
    for t in (1, world):
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=t)
            torch.manual_seed(0)
            model = tp.TensorParallelGPTModel(config, core_attention=sliding_window_spec(window).core_attention)
            loss = model(ids, labels=torch.roll(ids, -1, 1))
            loss.mean().backward()
            worst = (loss - ref_loss).abs().max().item()
            for name, p in model.named_parameters():
                r = ps.get_tensor_model_parallel_rank()
                worst = max(worst, (p.grad - tp.full_shard_of(ref_params[name].grad, p, r)).abs().max().item())
            out[t] = worst
        except Exception:
            out[t] = traceback.format_exc(limit=-3)
        finally:
            ps.destroy_model_parallel()
    torch.distributed.barrier()
    return out


@pytest.mark.exercise("sliding_window.blocked")
def test_sliding_window_spec_under_tensor_parallelism_equals_one_device():
    returns = launch.run_function(_tp_worker, 2, 4, launch=dict(timeout=300)).returns
    for rank, worst in returns.items():
        for t, diff in worst.items():
            assert isinstance(diff, float) and diff < 1e-5, (rank, t, diff)


# ------------------------------------------------------------------ project 3: the slow step and its fix
SPEED = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)


def _tokens():
    return torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(7))


def test_looped_attention_is_correct_causal_attention():
    config = TransformerConfig(**SMALL)
    query = torch.randn(16, 3, 4, 8, generator=torch.Generator().manual_seed(8))
    for groups in (4, 2):
        key, value = _qkv(16, 3, groups, 8, seed=groups, n=2)
        torch.testing.assert_close(LoopedAttention(config)(query, key, value), CoreAttention(config)(query, key, value))


@pytest.mark.exercise("speedup.remove_hotspots")
def test_remove_hotspots_keeps_loss_and_gradients_and_drops_the_extra_ops():
    slow_config, slow_spec = slow_step_setup(**SPEED)
    config, spec = remove_hotspots(slow_config, slow_spec)
    assert config.recompute_granularity is None, "full recompute is one of the hotspots"
    slow_model, slow_step = make_train_step(slow_config, slow_spec, _tokens())
    model, step = make_train_step(config, spec, _tokens())
    assert not any(isinstance(m, LoopedAttention) for m in model.modules()), "the looped attention is still there"
    torch.testing.assert_close(step(), slow_step())
    for (name, p), q in zip(model.named_parameters(), slow_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fast_calls = sum(op_calls(profile_step(step, steps=1), steps=1).values())
    slow_calls = sum(op_calls(profile_step(slow_step, steps=1), steps=1).values())
    assert fast_calls < slow_calls / 3, (fast_calls, slow_calls)


class FakeClock:
    """Time moves only when a step runs: each step advances it by its next duration."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def __call__(self):
        return self.now

    def step(self, name, durations):
        def run():
            self.log.append(name)
            self.now += durations.pop(0)
        return run


@pytest.mark.exercise("speedup.interleaved_speedup")
def test_interleaved_speedup_alternates_skips_warmup_and_takes_medians():
    clock = FakeClock()
    before = clock.step("before", [9.0, 0.030, 0.031, 0.500, 0.029, 0.030])  # a warm-up round, then one outlier
    after = clock.step("after", [5.0, 0.010, 0.011, 0.009, 0.010, 0.200])
    out = interleaved_speedup(before, after, repeats=5, warmup=1, clock=clock)
    assert clock.log == ["before", "after"] * 6
    assert out["times_ms"]["before"] == pytest.approx([30, 31, 500, 29, 30])
    assert out["before_ms"] == pytest.approx(30.0) and out["after_ms"] == pytest.approx(10.0)
    assert out["speedup"] == pytest.approx(3.0)


def test_interleaved_speedup_rejects_bad_repeats():
    with pytest.raises(ValueError, match="repeats >= 1"):
        interleaved_speedup(lambda: None, lambda: None, repeats=0)
