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

Mixtral (model_type "mixtral") is the same with block_sparse_moe in place of mlp:

    decoder.layers.{i}.mlp.router.weight                         model.layers.{i}.block_sparse_moe.gate.weight
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1  ...block_sparse_moe.experts.{e}.{w1 (gate), w3 (up)}
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2  ...block_sparse_moe.experts.{e}.w2

Two layouts need care. linear_qkv holds, per key/value group, its query heads then its key and
its value ([ng, (np/ng + 2) hn, h], fuse_qkv). And HF LLaMA runs half-split ("rotate_half") RoPE,
so its q/k rows are in that order; a model with rotary_interleaved=True gets them permuted
(megalab/core/models/common/embeddings/rope_utils.py). Megatron's converters: tools/checkpoint/convert.py with its
loader_*.py and saver_*.py (the HF LLaMA loader, loader_llama_mistral.py, is in older releases only).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from megalab.core.models.common.embeddings.rope_utils import half_split_to_interleaved, interleaved_to_half_split
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.presets import llama_config


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q [np*hn, h], k/v [ng*hn, h] -> linear_qkv.weight [ng * (np/ng + 2) * hn, h], grouped per kv head."""
    # EXERCISE model.hf_qkv: regroup q, k, v rows as [group g: its np/ng query heads, its key, its value] for each g
    ### BEGIN SOLUTION
    # HINT 1: The idea. Megatron's linear_qkv keeps each key/value group together: group g's np/ng query heads, then
    #         key head g, then value head g. HF stores all the q rows, then all the k rows, then all the v rows.
    # HINT 2: The approach. Give q, k and v a leading group dim (q: [ng, np/ng * hn, h], k and v: [ng, hn, h]; group
    #         g's rows are contiguous in each), concatenate along dim 1 in the order q, k, v, flatten back to rows.
    # HINT 3: A pitfall. Group g's query heads are the consecutive heads g * np/ng ... (g + 1) * np/ng - 1, not every
    #         ng-th head; and the key comes before the value.
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
    """A LlamaConfig / MixtralConfig (or its dict) -> our TransformerConfig."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if c.get("model_type") not in ("llama", "mixtral"):
        raise ValueError(f"model_type {c.get('model_type')!r} is not supported; this converter reads llama and mixtral")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias checkpoints are not supported (LLaMA has no biases)")
    if c.get("sliding_window"):
        raise ValueError(f"sliding_window={c['sliding_window']} is not supported (full causal attention only)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported: the LLaMA/Mixtral MLP here is SwiGLU "
                         "(hidden_act 'silu')")
    rope = c.get("rope_parameters") or {}  # transformers 5.x; 4.x had rope_theta and rope_scaling at the top level
    for field, scaling in (("rope_parameters", rope), ("rope_scaling", c.get("rope_scaling") or {})):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{field} has rope_type {kind!r} (RoPE scaling, e.g. Llama 3.1's 'llama3'), which this "
                             "converter does not implement: only plain RoPE ('default') is converted exactly")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000))
    theta = int(theta) if float(theta).is_integer() else float(theta)  # a fractional base is kept, not truncated
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    moe = {}
    if c["model_type"] == "mixtral":
        moe = dict(num_moe_experts=c["num_local_experts"], moe_router_topk=c["num_experts_per_tok"])
    config = llama_config(
        **moe, num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c.get("num_key_value_heads") or c["num_attention_heads"], kv_channels=head_dim,
        ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"], seq_length=c["max_position_embeddings"],
        rotary_base=theta, layernorm_epsilon=c["rms_norm_eps"],
    )
    return replace(config, share_embeddings_and_output_weights=bool(c.get("tie_word_embeddings")))


def hf_config_dict(config: TransformerConfig) -> dict:
    """Our config -> the config.json of an HF LlamaForCausalLM (MixtralForCausalLM with experts)."""
    _check_llama(config)
    moe = {}
    if config.num_moe_experts is not None:
        moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
               "num_local_experts": config.num_moe_experts, "num_experts_per_tok": config.moe_router_topk,
               "router_jitter_noise": 0.0, "sliding_window": None}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels, "hidden_act": "silu", "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.layernorm_epsilon, "rope_parameters": {"rope_type": "default",
                                                                     "rope_theta": float(config.rotary_base)},
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32", **moe,
    }


def _check_llama(config: TransformerConfig) -> None:
    want = dict(normalization="RMSNorm", activation_func="silu", gated_linear_unit=True,
                position_embedding_type="rope", add_bias_linear=False, rotary_percent=1.0)
    if config.num_moe_experts is not None:  # Mixtral: softmax top-k, every expert the same size, no shared one
        want.update(moe_router_score_function="softmax", moe_ffn_hidden_size=config.ffn_hidden_size,
                    moe_shared_expert_intermediate_size=None, moe_grouped_gemm=False,
                    moe_router_enable_expert_bias=False, moe_expert_capacity_factor=None)
    wrong = {k: getattr(config, k) for k, v in want.items() if getattr(config, k) != v}
    if wrong or config.add_qkv_bias:
        raise ValueError(f"the HF LLaMA/Mixtral layout needs {want} and no qkv bias; this config has "
                         f"{wrong or 'qkv bias'} (build it with megalab.extras.presets.llama_config or mixtral_config)")


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
        out.update(_mlp_to_hf(ours, src + "mlp.", dst, config))
        out.update({
            dst + "input_layernorm.weight": ours[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k, dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": ours[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "pre_mlp_layernorm.weight"],
        })
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def _mlp_to_hf(ours: dict, src: str, dst: str, config: TransformerConfig) -> dict:
    """One layer's dense MLP (mlp.{gate,up,down}_proj) or Mixtral experts (block_sparse_moe.*) in HF names."""
    if config.num_moe_experts is None:
        gate, up = ours[src + "linear_fc1.weight"].chunk(2, dim=0)
        return {dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": ours[src + "linear_fc2.weight"]}
    out = {dst + "block_sparse_moe.gate.weight": ours[src + "router.weight"]}
    for e in range(config.num_moe_experts):
        expert, hf = f"{src}experts.local_experts.{e}.", f"{dst}block_sparse_moe.experts.{e}."
        w1, w3 = ours[expert + "linear_fc1.weight"].chunk(2, dim=0)
        out.update({hf + "w1.weight": w1, hf + "w3.weight": w3, hf + "w2.weight": ours[expert + "linear_fc2.weight"]})
    return out


def _mlp_from_hf(sd: dict, src: str, dst: str, config: TransformerConfig) -> dict:
    """The inverse of _mlp_to_hf; pops what it uses from sd."""
    if config.num_moe_experts is None:
        return {dst + "linear_fc1.weight": torch.cat([sd.pop(src + "mlp.gate_proj.weight"),
                                                      sd.pop(src + "mlp.up_proj.weight")], dim=0),
                dst + "linear_fc2.weight": sd.pop(src + "mlp.down_proj.weight")}
    if src + "mlp.experts.gate_up_proj" in sd:  # transformers' in-memory layout: each expert a slice of one tensor
        out = {dst + "router.weight": sd.pop(src + "mlp.gate.weight")}
        gate_up, down = sd.pop(src + "mlp.experts.gate_up_proj"), sd.pop(src + "mlp.experts.down_proj")  # [E, 2f, h], [E, h, f]
        for e in range(config.num_moe_experts):
            expert = f"{dst}experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = gate_up[e]  # [gate; up], as our linear_fc1
            out[expert + "linear_fc2.weight"] = down[e]
        return out
    if src + "block_sparse_moe.gate.weight" not in sd:
        raise ValueError(f"{src}: neither Mixtral layout (checkpoint: block_sparse_moe.experts.<e>.w1/w2/w3; "
                         f"in memory: mlp.experts.gate_up_proj/down_proj) is in this state dict, e.g. "
                         f"{sorted(k for k in sd if k.startswith(src))[:3]}")
    out = {dst + "router.weight": sd.pop(src + "block_sparse_moe.gate.weight")}
    for e in range(config.num_moe_experts):
        hf, expert = f"{src}block_sparse_moe.experts.{e}.", f"{dst}experts.local_experts.{e}."
        out[expert + "linear_fc1.weight"] = torch.cat([sd.pop(hf + "w1.weight"), sd.pop(hf + "w3.weight")], dim=0)
        out[expert + "linear_fc2.weight"] = sd.pop(hf + "w2.weight")
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF LLaMA/Mixtral weights (checkpoint layout) -> our state dict for GPTModel(config) (load_state_dict)."""
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
        })
        out.update(_mlp_from_hf(sd, src, dst + "mlp.", config))
    leftover = sorted(k for k in sd if "rotary_emb" not in k)
    if leftover:
        raise ValueError(f"{len(leftover)} checkpoint tensors were not used, e.g. {leftover[:3]}; "
                         "is the config's num_layers right?")
    return out


def save_hf(model: GPTModel, directory: str | Path) -> Path:
    """Write config.json + model.safetensors in the HF layout: {Llama,Mixtral}ForCausalLM.from_pretrained loads it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    save_file(to_hf_state_dict(model), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def load_hf(directory: str | Path, **config_overrides) -> GPTModel:
    """A GPTModel from an HF LLaMA/Mixtral directory (config.json + *.safetensors), e.g. one save_pretrained wrote."""
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
