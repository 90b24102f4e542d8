"""Chapter 07, projects 2 and 3: a sliding-window attention through the layer spec (megalab/extras/sliding_window.py)
and a profiled training step made faster (megalab/extras/speedup.py).

References: a per-query loop written here (each query's softmax over its last W keys), PyTorch's causal SDPA
(the window covering the whole sequence), the single-device model against the tensor-parallel one, and a fake
clock for the timing function (no test here is timed).
"""

import dataclasses
import math
import traceback
from functools import partial

import pytest
import torch

from megalab.core import parallel_state as ps
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.tensor_parallel import layers as tp
from megalab.core.transformer.dot_product_attention import CoreAttention
from megalab.core.transformer.spec_utils import LayerSpec
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.profiling import profile_step
from megalab.extras.sliding_window import (
    SlidingWindowAttention,
    blocked_sliding_window_attention,
    masked_sliding_window_attention,
    sliding_window_mask,
    sliding_window_spec,
)
from megalab.extras.speedup import (
    LoopedAttention,
    interleaved_speedup,
    make_train_step,
    op_calls,
    remove_hotspots,
    slow_step_setup,
)
from megalab.lab import launch
from megalab.lab.checks import mistake
from tests.feedback import close, equal, max_error, require, require_no_error, require_within

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
def _band(s, lo, hi):
    """[s, s] bool: True where lo <= query - key <= hi."""
    distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    return (distance >= lo) & (distance <= hi)


@pytest.mark.exercise("sliding_window.mask")
def test_sliding_window_mask_names_the_mistake():
    s, window = 7, 3
    require(close(sliding_window_mask(s, window).int(), _band(s, 0, window - 1).int(),
                  "sliding_window_mask(s=7, window=3) (1: query i may attend key j, where 0 <= i - j < 3)",
                  rtol=0, atol=0, mistakes={
                      "window off by one: W + 1 keys visible (i - j <= window; the window counts the query itself)":
                          _band(s, 0, window).int(),
                      "window off by one: only W - 1 keys visible (i - j < window - 1)": _band(s, 0, window - 2).int(),
                      "no causal part: keys up to window - 1 AHEAD are visible too (|i - j| < window)":
                          _band(s, -(window - 1), window - 1).int(),
                      "the band points the wrong way (j - i instead of i - j): queries see later keys":
                          _band(s, -(window - 1), 0).int(),
                      "the diagonal is hidden: query i does not see its own key (0 < i - j; the window counts the "
                      "query itself)": _band(s, 1, window - 1).int(),
                      "the band is shifted one back: query i sees keys i - 1 .. i - W, not its own (0 <= i - j < W)":
                          _band(s, 1, window).int(),
                  }))


def _band_attention(q, k, v, visible, zero_keys=None):
    """[b, h, s, d]: each query's softmax over its visible keys, plus zero_keys[i] keys of score 0 and value 0
    (padding that a wrong mask lets in)."""
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    extra = torch.zeros(q.shape[2]) if zero_keys is None else torch.as_tensor(zero_keys, dtype=q.dtype)
    top = torch.maximum(scores.amax(-1), torch.where(extra > 0, 0.0, float("-inf")))  # [b, h, s]
    weights = torch.exp(scores - top[..., None])
    total = weights.sum(-1) + extra * torch.exp(-top)
    return (weights @ v) / total[..., None]


@pytest.mark.exercise("sliding_window.blocked")
def test_blocked_attention_names_the_mistake():
    s, window = 11, 4  # 3 blocks, the last one ragged
    q, k, v = _qkv(1, 2, s, 8, seed=21)
    expected = _band_attention(q, k, v, _band(s, 0, window - 1))
    same_block = (torch.arange(s)[:, None] // window) == (torch.arange(s)[None, :] // window)
    require(close(blocked_sliding_window_attention(q, k, v, window), expected,
                  "blocked_sliding_window_attention(s=11, window=4) vs each query's softmax over its last 4 keys",
                  mistakes={
                      "block 0's previous block (zero padding) left visible: its zero keys join the softmax":
                          lambda: _band_attention(q, k, v, _band(s, 0, window - 1),
                                                  [max(window - 1 - i, 0) for i in range(s)]),
                      "band off by one: W + 1 keys visible (key offset t in [r, r + W] instead of (r, r + W])":
                          lambda: _band_attention(q, k, v, _band(s, 0, window)),
                      "queries see only their own block (the previous block's keys are never visible)":
                          lambda: _band_attention(q, k, v, _band(s, 0, window - 1) & same_block),
                      "each block got the NEXT block's keys (later positions) instead of the previous block's":
                          lambda: _next_block_attention(q, k, v, window),
                  }))


def _next_block_attention(q, k, v, window):
    """Blocked attention over [next block; own block] with the band mask: own keys up to the query, the next
    block's keys after the query's offset (block 0's masked off; past the end: zero padding keys)."""
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    block, offset = i // window, i % window
    visible = ((j // window == block) & (j <= i)) | ((block >= 1) & (j // window == block + 1) & (j % window > offset))
    padding = [sum((p // window + 1) * window + t >= s for t in range(p % window + 1, window)) if p >= window else 0
               for p in range(s)]
    return _band_attention(q, k, v, visible, padding)


@pytest.mark.exercise("sliding_window.mask")
@pytest.mark.parametrize("s, window", [(6, 3), (5, 1), (4, 9), (9, 4)])
def test_sliding_window_mask_matches_loops(s, window):
    expected = torch.zeros(s, s, dtype=torch.bool)
    for i in range(s):
        for j in range(max(0, i - window + 1), i + 1):
            expected[i, j] = True
    got = sliding_window_mask(s, window)
    require(equal(tuple(got.shape), (s, s), f"the shape of sliding_window_mask(s={s}, window={window})"))
    wrong = (got != expected).nonzero().tolist()
    assert not wrong, (f"sliding_window_mask(s={s}, window={window}): {len(wrong)} (query, key) entries wrong; the "
                       f"first, query {wrong[0][0]} key {wrong[0][1]}, is {bool(got[tuple(wrong[0])])}, expected "
                       f"{bool(expected[tuple(wrong[0])])} (True where 0 <= query - key < window)")


@pytest.mark.exercise("sliding_window.mask")
def test_masked_attention_equals_loop_reference_values_and_grads():
    q, k, v = _qkv(2, 3, 13, 8, grad=True)
    for window in (1, 4, 13):
        out, grads = _grads(partial(masked_sliding_window_attention, window=window), [q, k, v])
        ref, ref_grads = _grads(partial(loop_reference, window=window), [q, k, v])
        where = f"masked_sliding_window_attention(13 tokens, window={window})"
        require(close(out, ref, f"{where}: the output vs a loop over the queries"))
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            require(close(g, r, f"{where}: {name} vs the loop reference's"))


@pytest.mark.exercise("sliding_window.blocked")
@pytest.mark.parametrize("s, window", [(16, 4), (17, 4), (7, 3), (9, 1), (5, 8)])
def test_blocked_attention_equals_loop_reference_values_and_grads(s, window):
    q, k, v = _qkv(2, 3, s, 8, seed=s, grad=True)
    out, grads = _grads(partial(blocked_sliding_window_attention, window=window), [q, k, v])
    ref, ref_grads = _grads(partial(loop_reference, window=window), [q, k, v])
    where = f"blocked_sliding_window_attention(s={s}, window={window})"
    require(close(out, ref, f"{where}: the output vs a loop over the queries"))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        require(close(g, r, f"{where}: {name} vs the loop reference's"))


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
    require(close(attention(query, key, value), expected,
                  f"SlidingWindowAttention(window 5, 24 tokens: the blocked path, {np_} query heads, {groups} key/value "
                  "groups) vs the loop reference"))


@pytest.mark.exercise("sliding_window.mask")
def test_window_covering_the_sequence_is_causal_attention():
    config = TransformerConfig(**SMALL)
    query, key, value = _qkv(24, 2, 4, 8, seed=3)
    require(close(SlidingWindowAttention(config, 24)(query, key, value), CoreAttention(config)(query, key, value),
                  "SlidingWindowAttention with a window of the whole sequence (24) vs causal CoreAttention"))
    torch.manual_seed(0)
    causal = GPTModel(config)
    torch.manual_seed(0)
    windowed = GPTModel(config, sliding_window_spec(100))
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    require(close(windowed(ids), causal(ids), "the logits of a GPT with sliding_window_spec(100) over 24 tokens vs the "
                                              "causal GPT's"))


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
        require(close(p.grad, r.grad, f"GPT with sliding_window_spec(4): the gradient of {name} vs a GPT with a loop "
                                      "reference attention"))
    # two layers of window 4 see 2 * 3 + 1 = 7 tokens back: changing token 0 changes positions 0..6 only
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 64
    with torch.no_grad():
        moved = (model(changed) - model(ids)).abs().amax(dim=(0, 2)) > 1e-6
    require(equal([i for i, m in enumerate(moved.tolist()) if m], list(range(config.num_layers * (window - 1) + 1)),
                  f"the positions whose logits change when token 0 changes ({config.num_layers} layers of window "
                  f"{window}: the receptive field reaches {config.num_layers} * {window - 1} tokens back)"))


# ------------------------------------------------------------------ sliding window under tensor parallelism
def _tp_worker(window):
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    out = {}
    config = TransformerConfig(**{**SMALL, "num_query_groups": 2, "position_embedding_type": "rope",
                                  "normalization": "RMSNorm", "share_embeddings_and_output_weights": False})
    dev = mdist.device()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(6)).to(dev)
    torch.manual_seed(0)
    ref = GPTModel(config, sliding_window_spec(window)).to(dev)
    ref_loss = ref(ids, labels=torch.roll(ids, -1, 1))
    ref_loss.mean().backward()
    ref_params = dict(ref.named_parameters())
    for t in (1, world):
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=t)
            torch.manual_seed(0)
            model = GPTModel(config, tensor_parallel_layer_spec(core_attention=sliding_window_spec(window).core_attention))
            model.to(dev)
            loss = model(ids, labels=torch.roll(ids, -1, 1))
            loss.mean().backward()
            errors = {"the per-token loss": max_error(loss, ref_loss)}
            for name, p in model.named_parameters():
                r = ps.get_tensor_model_parallel_rank()
                errors[f"the gradient of {name}"] = max_error(p.grad, tp.full_shard_of(ref_params[name].grad, p, r))
            out[t] = errors
        except Exception:
            out[t] = traceback.format_exc(limit=-3)
        finally:
            ps.destroy_model_parallel()
    torch.distributed.barrier()
    return out


@pytest.mark.integration
@pytest.mark.exercise("sliding_window.blocked")
def test_sliding_window_spec_under_tensor_parallelism_equals_one_device():
    returns = launch.run_function(_tp_worker, 2, 4, launch=dict(timeout=300)).returns
    for rank, results in returns.items():
        for t, errors in results.items():
            where = f"tp={t}, rank {rank}, a GPT with sliding_window_spec(4)"
            require_no_error(where, errors if isinstance(errors, str) else None)
            require_within(errors, 1e-5, where=where, against="the single-device model's")


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
def test_remove_hotspots_removes_both_and_names_the_mistake():
    slow_config, slow_spec = slow_step_setup(**SPEED)
    config, spec = remove_hotspots(slow_config, slow_spec)
    attention = sorted({type(m).__name__ for m in GPTModel(config, spec).modules()
                        if isinstance(m, (LoopedAttention, CoreAttention))})
    if config.recompute_granularity == "full":
        require(mistake("kept full activation recompute (set recompute_granularity, recompute_method and "
                        "recompute_num_layers to None)"))
    if config.recompute_granularity == "selective":
        require(mistake("switched to selective recompute instead of none (the memory budget needs no recompute)"))
    if "LoopedAttention" in attention:
        require(mistake("kept the LoopedAttention of the slow spec (return a LayerSpec with the default core "
                        "attention, CoreAttention)"))
    require(equal((config.recompute_granularity, attention, config.attention_backend), (None, ["CoreAttention"], "sdpa"),
                  "remove_hotspots' (recompute_granularity, core attention classes of the model, attention_backend)"))
    changed = [f.name for f in dataclasses.fields(config) if not f.name.startswith(("recompute", "attention_backend"))
               and getattr(config, f.name) != getattr(slow_config, f.name)]
    require(equal(changed, [], "the config fields remove_hotspots changed besides recompute and the attention backend"))


@pytest.mark.exercise("speedup.remove_hotspots")
def test_remove_hotspots_keeps_loss_and_gradients_and_drops_the_extra_ops():
    slow_config, slow_spec = slow_step_setup(**SPEED)
    config, spec = remove_hotspots(slow_config, slow_spec)
    assert config.recompute_granularity is None, (
        f"remove_hotspots kept recompute_granularity={config.recompute_granularity!r}: full recompute is one of the "
        "hotspots")
    slow_model, slow_step = make_train_step(slow_config, slow_spec, _tokens())
    model, step = make_train_step(config, spec, _tokens())
    assert not any(isinstance(m, LoopedAttention) for m in model.modules()), (
        "the model built from remove_hotspots' spec still has a LoopedAttention: use CoreAttention (sdpa)")
    require(close(step(), slow_step(), "the loss of a training step after remove_hotspots vs before"))
    for (name, p), q in zip(model.named_parameters(), slow_model.parameters()):
        require(close(p.grad, q.grad, f"the gradient of {name} after remove_hotspots vs before"))
    fast_calls = sum(op_calls(profile_step(step, steps=1), steps=1).values())
    slow_calls = sum(op_calls(profile_step(slow_step, steps=1), steps=1).values())
    assert fast_calls < slow_calls / 3, (
        f"a training step after remove_hotspots runs {fast_calls} operator calls, before {slow_calls}: expected fewer "
        "than a third")


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
    where = "interleaved_speedup(repeats=5, warmup=1) on a fake clock"
    calls = [int(name == "after") for name in clock.log]  # 0 before, 1 after
    require(close(calls, [0, 1] * 6, f"{where}: the calls in order (0: before, 1: after)", rtol=0, atol=0, mistakes={
        "ran every before call, then every after call (not interleaved: alternate them round by round)":
            [0] * 6 + [1] * 6,
    }))
    got = out["times_ms"]["before"] + out["times_ms"]["after"]
    require(close(got, [30, 31, 500, 29, 30] + [10, 11, 9, 10, 200],
                  f"{where}: times_ms['before'] + times_ms['after'] (ms, the warm-up round dropped)", rtol=1e-9, mistakes={
                      "kept the warm-up round in the timings": [9000, 30, 31, 500, 29, 30] + [5000, 10, 11, 9, 10, 200],
                      "recorded seconds, not milliseconds": [0.030, 0.031, 0.500, 0.029, 0.030]
                                                            + [0.010, 0.011, 0.009, 0.010, 0.200],
                      "one clock reading per round: after's time includes before's (read the clock around each call)":
                          [30, 31, 500, 29, 30] + [40, 42, 509, 39, 230],
                  }))
    require(equal(clock.log, ["before", "after"] * 6, f"{where}: the order of the calls (alternating, 1 warm-up + 5 "
                                                      "rounds)"))
    times = out["times_ms"]["before"]
    assert times == pytest.approx([30, 31, 500, 29, 30]), (
        f"{where}: times_ms['before'] is {times}, expected [30, 31, 500, 29, 30] (ms, the warm-up round dropped)")
    for key, want in (("before_ms", 30.0), ("after_ms", 10.0), ("speedup", 3.0)):
        assert out[key] == pytest.approx(want), (
            f"{where}: {key} is {out[key]!r}, expected {want} (medians, so the outlier does not count)")


def test_interleaved_speedup_rejects_bad_repeats():
    with pytest.raises(ValueError, match="repeats >= 1"):
        interleaved_speedup(lambda: None, lambda: None, repeats=0)
