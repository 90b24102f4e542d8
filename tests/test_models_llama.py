"""Chapter 04: LLaMA as config switches of the GPT, RoPE conventions, GQA, and calc's counts.

References: Meta's complex-number RoPE (llama/model.py apply_rotary_emb), PyTorch's
scaled_dot_product_attention(enable_gqa=True), FlopCounterMode, the published model sizes.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megalab.core.models.common.embeddings.rope_utils import (
    apply_rotary_pos_emb,
    half_split_to_interleaved,
    interleaved_to_half_split,
    rotate_interleaved,
)
from megalab.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megalab.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras import calc
from megalab.extras.gqa import grouped_query_attention, repeat_kv
from megalab.extras.presets import (
    deepseek_v3_style_config,
    gpt_to_llama,
    llama_config,
    llama_preset,
    mixtral_config,
    mixtral_preset,
)
from megalab.lab.checks import mistake
from megalab.training.pretrain_gpt import model_provider
from tests.feedback import close, equal, require

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, seq_length=16)


def meta_rope(x, base=10000.0):
    """Meta's LLaMA: pairs (x_{2i}, x_{2i+1}) as complex numbers times e^{i pos theta_i}. x [s, b, n, d]."""
    s, d = x.shape[0], x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    rot = torch.polar(torch.ones(s, d // 2), torch.outer(torch.arange(s).float(), theta))  # [s, d/2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2))
    return torch.view_as_real(xc * rot[:, None, None, :]).flatten(-2)


# ------------------------------------------------------------------ RoPE
@pytest.mark.exercise("model.rope_interleaved")
def test_rotate_interleaved_turns_each_pair():
    x = torch.arange(1.0, 7.0)
    require(close(rotate_interleaved(x), [-2.0, 1.0, -4.0, 3.0, -6.0, 5.0],
                  "rotate_interleaved([1, 2, 3, 4, 5, 6]) (each pair (a, b) -> (-b, a))", rtol=0, atol=0, mistakes={
                      "rotated the two halves instead of interleaved pairs (that is rotate_half, the half-split "
                      "convention): pair channel 2i with 2i + 1": [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0],
                      "wrong sign of the sine term: each pair turned the other way, (a, b) -> (b, -a)":
                          [2.0, -1.0, 4.0, -3.0, 6.0, -5.0],
                      "concatenated instead of interleaved: the turned pair (-b, a) must stay side by side "
                      "(stack on a new last dim, then flatten)": [-2.0, -4.0, -6.0, 1.0, 3.0, 5.0],
                      "swapped each pair without the minus sign: (a, b) -> (b, a)": [2.0, 1.0, 4.0, 3.0, 6.0, 5.0],
                  }))


@pytest.mark.exercise("model.rope_interleaved")
def test_interleaved_rope_matches_meta_complex_rope():
    torch.manual_seed(0)
    x = torch.randn(10, 2, 3, 8)
    freqs = RotaryEmbedding(8, rotary_interleaved=True)(10)
    require(close(apply_rotary_pos_emb(x, freqs, interleaved=True), meta_rope(x),
                  "interleaved RoPE (apply_rotary_pos_emb with rotate_interleaved) vs Meta's complex-number RoPE",
                  atol=1e-5, rtol=1e-5))


@pytest.mark.exercise("model.rope_interleaved")
def test_permuted_weights_give_the_same_scores_in_both_conventions():
    """Meta's wq/wk with interleaved RoPE == HF's permuted wq/wk with half-split RoPE (same q.k)."""
    torch.manual_seed(0)
    heads, d, h, s = 2, 8, 16, 9
    wq, wk, x = torch.randn(heads * d, h), torch.randn(heads * d, h), torch.randn(s, 1, h)

    def scores(wq, wk, interleaved):
        freqs = RotaryEmbedding(d, rotary_interleaved=interleaved)(s)
        q = apply_rotary_pos_emb((x @ wq.T).view(s, 1, heads, d), freqs, interleaved)
        k = apply_rotary_pos_emb((x @ wk.T).view(s, 1, heads, d), freqs, interleaved)
        return torch.einsum("sbnd,tbnd->nst", q, k)

    meta = scores(wq, wk, interleaved=True)
    hf = scores(interleaved_to_half_split(wq, heads), interleaved_to_half_split(wk, heads), interleaved=False)
    require(close(meta, hf, "the attention scores q.k with Meta's wq/wk and interleaved RoPE vs HF's permuted wq/wk "
                            "with half-split RoPE", atol=1e-4, rtol=1e-4))
    assert not torch.allclose(meta, scores(wq, wk, interleaved=False), atol=1e-2), (  # the convention matters
        "interleaved RoPE gives the same scores as half-split RoPE on the same weights: it should rotate other pairs")


def test_permutation_round_trip_and_bad_shape():
    w = torch.randn(4 * 6, 5)
    assert torch.equal(half_split_to_interleaved(interleaved_to_half_split(w, 4), 4), w)
    assert torch.equal(interleaved_to_half_split(torch.arange(8.0)[:, None], 1).flatten(),
                       torch.tensor([0.0, 2, 4, 6, 1, 3, 5, 7]))
    with pytest.raises(ValueError, match="even head dim"):
        interleaved_to_half_split(torch.randn(9, 2), 3)


# ------------------------------------------------------------------ GQA
@pytest.mark.exercise("model.gqa_repeat")
def test_repeat_kv_keeps_each_groups_copies_adjacent():
    kv = torch.arange(4.0).view(1, 1, 2, 2)  # [s, b, ng, hn]: kv heads k0 = [0, 1], k1 = [2, 3]
    out, what = repeat_kv(kv, 3), "repeat_kv(kv heads k0 = [0, 1], k1 = [2, 3] of shape [1, 1, 2, 2], n_rep=3)"
    if tuple(out.shape) == (1, 1, 2, 6):
        require(mistake("repeated along the head dim hn (the last dim) instead of the heads dim (dim 2)",
                        f"{what} has shape (1, 1, 2, 6), expected (1, 1, 6, 2): 6 heads of hn = 2"))
    require(close(out, kv[:, :, [0, 0, 0, 1, 1, 1]], f"{what} (each head's copies adjacent: k0 k0 k0 k1 k1 k1)",
                  rtol=0, atol=0, mistakes={
                      "tiled the kv heads (k0 k1 k0 k1 ..., Tensor.repeat): query head j would use kv head j % ng, "
                      "not j // n_rep (repeat each head, adjacent)": kv[:, :, [0, 1, 0, 1, 0, 1]]}))
    x = torch.arange(2.0).view(1, 1, 2, 1)  # kv heads k0, k1
    require(equal(repeat_kv(x, 3).flatten().tolist(), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0],
                  "repeat_kv(kv heads [k0, k1], n_rep=3) (each head's copies adjacent: k0 k0 k0 k1 k1 k1)"))
    require(close(repeat_kv(x, 1), x, "repeat_kv(x, n_rep=1) vs x (unchanged)", rtol=0, atol=0))


@pytest.mark.exercise("model.gqa_repeat")
def test_grouped_query_attention_matches_sdpa_enable_gqa():
    torch.manual_seed(0)
    s, b, np_, ng, hn = 7, 2, 8, 2, 4
    q, k, v = torch.randn(s, b, np_, hn), torch.randn(s, b, ng, hn), torch.randn(s, b, ng, hn)
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    require(close(grouped_query_attention(q, k, v), ref.permute(2, 0, 1, 3).reshape(s, b, np_ * hn),
                  f"grouped_query_attention ({np_} query heads, {ng} key/value groups) vs SDPA(enable_gqa=True)"))


def test_repeat_kv_bad_input():
    with pytest.raises(ValueError, match="n_rep must be"):
        repeat_kv(torch.randn(1, 1, 2, 4), 0)
    with pytest.raises(ValueError, match="do not split"):
        grouped_query_attention(torch.randn(3, 1, 5, 4), torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 4))


# ------------------------------------------------------------------ configs and the provider
def test_llama_is_gpt_with_six_switches():
    gpt = TransformerConfig(**TINY)
    llama = gpt_to_llama(gpt, num_query_groups=2)
    changed = {k for k in gpt.__dict__ if getattr(gpt, k) != getattr(llama, k)}
    assert changed == {"normalization", "activation_func", "gated_linear_unit", "position_embedding_type",
                       "add_bias_linear", "share_embeddings_and_output_weights", "num_query_groups"}
    model = model_provider(llama, get_gpt_layer_local_spec())
    assert model.output_layer is not None and model.rotary_pos_emb is not None
    assert not any("bias" in name for name, _ in model.named_parameters())
    assert model(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)


def test_llama_config_bad_input():
    with pytest.raises(ValueError, match="fixed by llama_config"):
        llama_config(**TINY, normalization="LayerNorm")
    with pytest.raises(ValueError, match="unknown preset"):
        llama_preset("llama-9b")
    with pytest.raises(ValueError, match="unknown preset"):
        mixtral_preset("mixtral-2x1b")


def test_interleaved_rope_model_differs_from_half_split():
    torch.manual_seed(0)
    c = llama_config(**TINY)
    a = GPTModel(c)
    b = GPTModel(llama_config(**TINY, rotary_interleaved=True))
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 50, (1, 12))
    assert not torch.allclose(a(ids), b(ids), atol=1e-4)


# ------------------------------------------------------------------ calc: parameters and FLOPs
@pytest.mark.parametrize("name, published", [
    ("llama2-7b", 6_738_415_616), ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
])
def test_llama_parameter_counts_match_published_sizes(name, published):
    """The safetensors index totals of the released checkpoints (LLaMA-2 7B = 6.74B, ...)."""
    p = calc.model_parameters(llama_preset(name))
    assert p["total"] == p["active"] == published


def test_mixtral_total_and_active_parameters():
    """Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024)."""
    p = calc.model_parameters(mixtral_preset("mixtral-8x7b"))
    assert p["total"] == 46_702_792_704
    assert round(p["total"] / 1e9, 1) == 46.7 and round(p["active"] / 1e9, 1) == 12.9


def test_gpt_parameters_agree_with_narayanan_eq2():
    c = TransformerConfig(num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=100, seq_length=32)
    # Eq. 2 leaves out the final LayerNorm (2h)
    assert calc.model_parameters(c)["total"] == calc.num_parameters(3, 48, 100, 32) + 2 * 48
    assert calc.model_flops(c, 4, 32) == pytest.approx(calc.flops_per_iteration(4, 32, 3, 48, 100, recompute=False),
                                                       rel=0.02)  # Eq. 7 has no bias-free/logit subtleties


CONFIGS = {
    "gpt": TransformerConfig(**TINY),
    "gpt-untied-qkvbias": TransformerConfig(**TINY, add_bias_linear=False, add_qkv_bias=True,
                                            share_embeddings_and_output_weights=False),
    "llama-gqa": llama_config(**TINY, num_query_groups=2, ffn_hidden_size=40),
    "mixtral": mixtral_config(**TINY, num_query_groups=2, ffn_hidden_size=40, num_moe_experts=4),
    "deepseek-style": deepseek_v3_style_config(**TINY, num_query_groups=2, num_moe_experts=8, moe_router_topk=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_counts_match_the_model_and_flop_counter(name):
    c = replace(CONFIGS[name], attention_backend="unfused")  # FlopCounterMode counts its bmm's (the CPU SDPA kernel is not counted)
    model = GPTModel(c)
    p = calc.model_parameters(c)
    assert sum(t.numel() for t in model.parameters()) == p["total"]
    if c.num_moe_experts:
        assert p["active"] < p["total"]
    ids = torch.randint(0, c.vocab_size, (3, c.seq_length))
    with FlopCounterMode(display=False) as counter:
        loss = model(ids, labels=ids).sum()
    assert counter.get_total_flops() == calc.model_flops(c, 3, c.seq_length, training=False)
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).sum().backward()
    assert counter.get_total_flops() == calc.model_flops(c, 3, c.seq_length)
    del loss


# ------------------------------------------------------------------ the short training run
def test_pretrain_loss_falls_on_a_learnable_stream_and_rejects_short_data():
    from megalab.extras.pretrain_tiny import pretrain

    torch.manual_seed(0)
    model = GPTModel(llama_config(**{**TINY, "seq_length": 8}))
    tokens = torch.arange(200) % 7  # a period-7 cycle: predictable from one token of context
    losses = pretrain(model, tokens, steps=40, micro_batch_size=4, lr=1e-2)
    assert losses[0] > 3.0 and sum(losses[-5:]) / 5 < 0.5
    with pytest.raises(ValueError, match="too few"):
        pretrain(model, tokens[:9], steps=1)
