"""Hugging Face checkpoints <-> our GPTModel: config, weights, and safetensors files.

Our names are Megatron's; the Hugging Face (HF) LLaMA layout is the one its checkpoints use:

    ours (Megatron)                                 HF LLaMA (model.safetensors)
    embedding.word_embeddings.weight                model.embed_tokens.weight
    decoder.layers.{i}.input_layernorm.weight       model.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv    model.layers.{i}.self_attn.{q,k,v}_proj   (fused, grouped)
    decoder.layers.{i}.self_attention.linear_proj   model.layers.{i}.self_attn.o_proj
    decoder.layers.{i}.pre_mlp_layernorm.weight     model.layers.{i}.post_attention_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1  [gate; up]   model.layers.{i}.mlp.{gate,up}_proj
    decoder.layers.{i}.mlp.linear_fc2               model.layers.{i}.mlp.down_proj
    decoder.final_layernorm.weight                  model.norm.weight
    output_layer.weight                             lm_head.weight

Two layouts need care. linear_qkv holds, per key/value group, its query heads then its key and
its value ([ng, (np/ng + 2) hn, h], fuse_qkv). And HF LLaMA runs half-split ("rotate_half") RoPE,
so its q/k rows are in that order; a model with rotary_interleaved=True gets them permuted
(rope.py). Megatron's converters: tools/checkpoint/loader_llama_mistral.py and saver_*.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from megalab.config import TransformerConfig
from megalab.model.gpt import GPTModel
from megalab.model.llama import llama_config
from megalab.model.rope import half_split_to_interleaved, interleaved_to_half_split


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q [np*hn, h], k/v [ng*hn, h] -> linear_qkv.weight [ng * (np/ng + 2) * hn, h], grouped per kv head."""
    # EXERCISE model.hf_qkv: regroup q, k, v rows as [group g: its np/ng query heads, its key, its value] for each g
    ### BEGIN SOLUTION
    ng, h = num_query_groups, q.shape[1]
    q, k, v = q.view(ng, -1, h), k.view(ng, -1, h), v.view(ng, -1, h)  # [ng, np/ng*hn, h], [ng, hn, h]
    return torch.cat([q, k, v], dim=1).reshape(-1, h)
    ### END SOLUTION


def split_qkv(qkv: torch.Tensor, config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv: linear_qkv.weight -> HF q, k, v."""
    ng, hn, h = config.num_query_groups, config.kv_channels, qkv.shape[1]
    per_group = config.num_attention_heads // ng * hn
    q, k, v = qkv.view(ng, per_group + 2 * hn, h).split([per_group, hn, hn], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def config_from_hf(hf_config) -> TransformerConfig:
    """A LlamaConfig (or its dict) -> our TransformerConfig."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if c.get("model_type") not in ("llama", None):
        raise ValueError(f"model_type {c.get('model_type')!r} is not supported; this converter reads LLaMA configs")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias checkpoints are not supported (LLaMA has no biases)")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} (RoPE scaling) is not supported; only 'default'")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    config = llama_config(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c.get("num_key_value_heads") or c["num_attention_heads"], kv_channels=head_dim,
        ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"], seq_length=c["max_position_embeddings"],
        rotary_base=int(rope.get("rope_theta", c.get("rope_theta", 10000))), layernorm_epsilon=c["rms_norm_eps"],
    )
    return replace(config, share_embeddings_and_output_weights=bool(c.get("tie_word_embeddings")))


def hf_config_dict(config: TransformerConfig) -> dict:
    """Our config -> the config.json of an HF LlamaForCausalLM."""
    _check_llama(config)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels, "hidden_act": "silu", "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.layernorm_epsilon, "rope_parameters": {"rope_type": "default",
                                                                     "rope_theta": float(config.rotary_base)},
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def _check_llama(config: TransformerConfig) -> None:
    want = dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True,
                position_embedding_type="rope", add_bias_linear=False, rotary_percent=1.0)
    wrong = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
    if wrong or config.add_qkv_bias:
        raise ValueError(f"the HF LLaMA layout needs {want} and no qkv bias; this config has {wrong or 'qkv bias'} "
                         "(build it with megalab.model.llama.llama_config)")


def to_hf_state_dict(model: GPTModel) -> dict[str, torch.Tensor]:
    """Our weights under HF LLaMA names (copies, contiguous: ready for safetensors)."""
    config = model.config
    _check_llama(config)
    ours = model.state_dict()
    out = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
           "model.norm.weight": ours["decoder.final_layernorm.weight"]}
    if not config.share_embeddings_and_output_weights:
        out["lm_head.weight"] = ours["output_layer.weight"]
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(ours[src + "self_attention.linear_qkv.weight"], config)
        if config.rotary_interleaved:
            q = interleaved_to_half_split(q, config.num_attention_heads)
            k = interleaved_to_half_split(k, config.num_query_groups)
        gate, up = ours[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({
            dst + "input_layernorm.weight": ours[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k, dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": ours[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": ours[src + "mlp.linear_fc2.weight"],
        })
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF LLaMA weights -> our state dict for GPTModel(config) (load it with load_state_dict)."""
    _check_llama(config)
    sd = dict(state_dict)
    out = {"embedding.word_embeddings.weight": sd.pop("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": sd.pop("model.norm.weight")}
    lm_head = sd.pop("lm_head.weight", None)
    if not config.share_embeddings_and_output_weights:
        if lm_head is None:
            raise ValueError("the checkpoint has no lm_head.weight (tied embeddings); "
                             "use share_embeddings_and_output_weights=True")
        out["output_layer.weight"] = lm_head
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k = sd.pop(src + "self_attn.q_proj.weight"), sd.pop(src + "self_attn.k_proj.weight")
        if config.rotary_interleaved:
            q = half_split_to_interleaved(q, config.num_attention_heads)
            k = half_split_to_interleaved(k, config.num_query_groups)
        out.update({
            dst + "input_layernorm.weight": sd.pop(src + "input_layernorm.weight"),
            dst + "self_attention.linear_qkv.weight": fuse_qkv(q, k, sd.pop(src + "self_attn.v_proj.weight"),
                                                               config.num_query_groups),
            dst + "self_attention.linear_proj.weight": sd.pop(src + "self_attn.o_proj.weight"),
            dst + "pre_mlp_layernorm.weight": sd.pop(src + "post_attention_layernorm.weight"),
            dst + "mlp.linear_fc1.weight": torch.cat([sd.pop(src + "mlp.gate_proj.weight"),
                                                      sd.pop(src + "mlp.up_proj.weight")], dim=0),
            dst + "mlp.linear_fc2.weight": sd.pop(src + "mlp.down_proj.weight"),
        })
    leftover = sorted(k for k in sd if "rotary_emb" not in k)
    if leftover:
        raise ValueError(f"{len(leftover)} checkpoint tensors were not used, e.g. {leftover[:3]}; "
                         "is the config's num_layers right?")
    return out


def save_hf(model: GPTModel, directory: str | Path) -> Path:
    """Write config.json + model.safetensors in the HF layout: LlamaForCausalLM.from_pretrained(directory) loads it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    save_file(to_hf_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def load_hf(directory: str | Path, **config_overrides) -> GPTModel:
    """A GPTModel from an HF LLaMA directory (config.json + *.safetensors), e.g. one save_pretrained wrote."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").exists() or not files:
        raise FileNotFoundError(f"{directory} needs config.json and *.safetensors (an HF model directory)")
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    config = replace(config, **config_overrides)
    state_dict = {}
    for f in files:
        state_dict.update(load_file(f))
    model = GPTModel(config)
    model.load_state_dict(from_hf_state_dict(state_dict, config))
    return model
