"""Chapter 04: our GPTModel against Hugging Face's LlamaForCausalLM / MixtralForCausalLM.

The HF models are built from small configs with random weights (nothing is downloaded); the
converter copies weights both ways, logits agree to 1e-5 in fp32, greedy generations token for
token, and safetensors directories written by either side load in the other.
"""

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.extras.generate import greedy_generate
from megalab.extras.hf import (
    config_from_hf,
    from_hf_state_dict,
    fuse_qkv,
    hf_config_dict,
    load_hf,
    save_hf,
    split_qkv,
    to_hf_state_dict,
)
from megalab.extras.presets import llama_config
from tests.feedback import close, equal, require

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None)  # no early stop


def hf_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides})).eval()


def hf_mixtral(seed=0):
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)).eval()


def hf_greedy(hf, prompt, max_new_tokens):
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like greedy_generate
    return hf.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)


def ids(b=2, s=16, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.exercise("model.hf_qkv")
def test_fuse_qkv_groups_queries_with_their_key_and_value():
    # 4 query heads, 2 groups, head dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1
    q, k, v = torch.arange(4.0)[:, None], 10 + torch.arange(2.0)[:, None], 20 + torch.arange(2.0)[:, None]
    require(close(fuse_qkv(q, k, v, 2).flatten(), [0.0, 1, 10, 20, 2, 3, 11, 21],
                  "fuse_qkv(q rows 0..3, k rows 10, 11, v rows 20, 21, 2 groups) (per group: its query heads, then "
                  "its key, then its value)", rtol=0, atol=0, mistakes={
                      "all q rows, then all k, then all v: fused without the per-group interleave (group g's query "
                      "heads, its key, its value, for each g)": [0.0, 1, 2, 3, 10, 11, 20, 21],
                      "wrong order inside each group: key and value before the query heads (q, then k, then v)":
                          [10.0, 20, 0, 1, 11, 21, 2, 3],
                      "wrong order inside each group: the value before the key (q, then k, then v)":
                          [0.0, 1, 20, 10, 2, 3, 21, 11],
                      "grouped every ng-th query head (heads g, g + ng, ...) instead of consecutive ones (heads "
                      "g * np/ng ... (g + 1) * np/ng - 1)": [0.0, 2, 10, 20, 1, 3, 11, 21],
                  }))


def _llama_from_hf(interleaved):
    """(transformers' small LLaMA, ours loaded from its state dict, where)."""
    hf = hf_llama()
    config = replace(config_from_hf(hf.config), rotary_interleaved=interleaved, attention_backend="unfused")
    ours = GPTModel(config).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    return hf, ours, f"LLaMA from HF weights (rotary_interleaved={interleaved})"


@pytest.mark.exercise("model.hf_qkv")
@pytest.mark.parametrize("interleaved", [False, True])
def test_llama_logits_match_hf_and_convert_back(interleaved):
    hf, ours, where = _llama_from_hf(interleaved)
    x = ids()
    with torch.no_grad():
        require(close(ours(x), hf(x).logits, f"{where}: our logits vs transformers'", atol=1e-5, rtol=0))
    back = to_hf_state_dict(ours)  # and back: bit for bit
    require(equal(sorted(back.keys()), sorted(hf.state_dict().keys()), f"{where}: the keys of to_hf_state_dict, sorted"))
    for name, t in hf.state_dict().items():
        require(close(back[name], t, f"{where}: to_hf_state_dict's {name} vs the original (bit for bit)", rtol=0, atol=0))


@pytest.mark.integration  # whole models through transformers: `megalab grade model.hf_qkv` has the logits above
@pytest.mark.exercise("model.hf_qkv")
@pytest.mark.parametrize("interleaved", [False, True])
def test_llama_greedy_generation_matches_hf(interleaved):
    hf, ours, where = _llama_from_hf(interleaved)
    prompt = ids()[:, :4]
    require(equal(greedy_generate(ours, prompt, 12).tolist(), hf_greedy(hf, prompt, 12).tolist(),
                  f"{where}: our greedy generation of 12 tokens vs transformers'"))


@pytest.mark.integration
@pytest.mark.exercise("model.hf_qkv")
def test_safetensors_round_trip_with_transformers(tmp_path):
    """Our model saved in the HF layout loads in transformers; HF's save_pretrained loads in ours."""
    torch.manual_seed(3)
    ours = GPTModel(llama_config(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                                 ffn_hidden_size=96, vocab_size=97, seq_length=32)).eval()
    save_hf(ours, tmp_path / "ours")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    hf.save_pretrained(tmp_path / "hf")
    again = load_hf(tmp_path / "hf").eval()
    x = ids()
    with torch.no_grad():
        require(close(hf(x).logits, ours(x), "the logits of our model saved with save_hf and loaded in transformers "
                                             "vs ours", atol=1e-5, rtol=0))
        require(close(again(x), ours(x), "the logits after transformers' save_pretrained and our load_hf vs ours",
                      atol=1e-5, rtol=0))


@pytest.mark.integration
@pytest.mark.exercise("model.hf_qkv")
def test_mixtral_matches_hf_through_safetensors(tmp_path):
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / "hf")  # the checkpoint layout: block_sparse_moe.experts.{e}.w1/w2/w3
    ours = load_hf(tmp_path / "hf", attention_backend="unfused").eval()
    require(equal((ours.config.num_moe_experts, ours.config.moe_router_topk), (4, 2),
                  "(num_moe_experts, moe_router_topk) of the Mixtral config read from HF"))
    x = ids()
    with torch.no_grad():
        require(close(ours(x), hf(x).logits, "Mixtral from HF safetensors: our logits vs transformers'", atol=1e-5, rtol=0))
    prompt = x[:, :4]
    require(equal(greedy_generate(ours, prompt, 12).tolist(), hf_greedy(hf, prompt, 12).tolist(),
                  "Mixtral: our greedy generation of 12 tokens vs transformers'"))
    save_hf(ours, tmp_path / "ours")
    back = MixtralForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        require(close(back(x).logits, hf(x).logits, "Mixtral saved with save_hf and loaded in transformers: its logits "
                                                    "vs the original's", atol=1e-5, rtol=0))


def test_split_qkv_inverts_fuse_and_configs_round_trip():
    hf = hf_llama(tie_word_embeddings=True)
    config = config_from_hf(hf.config)
    assert config.share_embeddings_and_output_weights and config.num_query_groups == 2
    assert config_from_hf(hf_config_dict(config)) == config
    q, k, v = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fuse_qkv(q, k, v, 2), config), (q, k, v)))


def test_converter_bad_input(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        config_from_hf({**SMALL, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="HF LLaMA/Mixtral layout needs"):
        to_hf_state_dict(GPTModel(replace(llama_config(num_layers=1, hidden_size=16, num_attention_heads=2,
                                                       vocab_size=10, seq_length=8), normalization="LayerNorm")))
    hf = hf_llama()
    config = config_from_hf(hf.config)
    with pytest.raises(ValueError, match="were not used"):
        from_hf_state_dict(hf.state_dict(), replace(config, num_layers=1))
    with pytest.raises(FileNotFoundError, match="needs config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(tmp_path)


@pytest.mark.parametrize("layout", ["transformers 4.x (top-level rope_theta + rope_scaling)", "transformers 5.x (rope_parameters)"])
@pytest.mark.parametrize("rope_type", ["llama3", "linear"])
def test_rope_scaling_is_refused_in_both_config_layouts(layout, rope_type):
    """A Llama-3.1-style config.json used to load as plain RoPE (max logit difference vs HF 1.83)."""
    scaling = {"rope_type": rope_type, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    c = {"model_type": "llama", **{k: v for k, v in SMALL.items() if k != "rope_parameters"}}
    if layout.startswith("transformers 4"):
        c.update(rope_theta=500000.0, rope_scaling=scaling)
    else:
        c.update(rope_parameters={**scaling, "rope_theta": 500000.0})
    with pytest.raises(ValueError, match=rf"rope_type '{rope_type}' \(RoPE scaling.*only plain RoPE"):
        config_from_hf(c)


def test_hidden_act_other_than_silu_is_refused_and_fractional_rope_base_kept():
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        config_from_hf({**SMALL, "model_type": "llama", "hidden_act": "gelu"})
    c = {"model_type": "llama", **{k: v for k, v in SMALL.items() if k != "rope_parameters"}}
    assert config_from_hf({**c, "rope_theta": 10000.5}).rotary_base == 10000.5  # was truncated to 10000
    assert config_from_hf({**c, "rope_theta": 500000.0}).rotary_base == 500000
    old_layout = config_from_hf({**c, "rope_theta": 1e6, "rope_scaling": None})  # 4.x without scaling: fine
    assert old_layout.rotary_base == 1_000_000


def test_mixtral_in_memory_fused_experts_state_dict_converts_exactly():
    """transformers keeps a Mixtral's experts as two 3-D tensors in memory (mlp.experts.gate_up_proj/down_proj);
    its state_dict() used to fail with a bare KeyError. Now it converts, checked against transformers' logits."""
    hf = hf_mixtral()
    assert any("experts.gate_up_proj" in k for k in hf.state_dict())  # the layout this test is about
    config = replace(config_from_hf(hf.config), attention_backend="unfused")
    ours = GPTModel(config).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    x = ids()
    with torch.no_grad():
        require(close(ours(x), hf(x).logits, "Mixtral from its in-memory state dict: our logits vs transformers'",
                      atol=1e-5, rtol=0))
    broken = {k: v for k, v in hf.state_dict().items() if "experts" not in k}
    with pytest.raises(ValueError, match="neither Mixtral layout"):
        from_hf_state_dict(broken, config)
