"""LLaMA as a GPT: the same GPTModel and layer spec, six config switches apart.

    GPT-2/3 (chapter 02)              LLaMA (Touvron et al. 2023)            field
    LayerNorm (centre, scale, bias)   RMSNorm (scale only)                   normalization
    GeLU MLP, ffn = 4h                SwiGLU: silu(x Wg) * (x Wu), ffn~8h/3  activation_func, gated_linear_unit
    learned absolute positions        RoPE inside attention                  position_embedding_type
    biases in every linear            no biases                              add_bias_linear
    output tied to embeddings         separate output layer                  share_embeddings_and_output_weights
    MHA                               GQA (LLaMA-2 70B, LLaMA-3)             num_query_groups

Megatron trains LLaMA with pretrain_gpt.py and exactly these flags (--normalization RMSNorm
--swiglu --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups); the layer spec (get_gpt_layer_local_spec) is unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from megalab.core.transformer.transformer_config import TransformerConfig

LLAMA_SWITCHES = dict(
    normalization="RMSNorm", activation_func="silu", gated_linear_unit=True, position_embedding_type="rope",
    add_bias_linear=False, share_embeddings_and_output_weights=False,
)

# Published architectures (the model cards / params.json): sizes only, no weights.
LLAMA_PRESETS = {
    "llama2-7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                      ffn_hidden_size=11008, vocab_size=32000, seq_length=4096, rotary_base=10000),
    "llama2-70b": dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672, vocab_size=32000, seq_length=4096, rotary_base=10000),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, rotary_base=500000),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, rotary_base=500000),
}


def llama_config(*, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 **sizes) -> TransformerConfig:
    """A TransformerConfig with LLaMA's switches; `sizes` are TransformerConfig fields (a preset or your own)."""
    clash = sorted(set(sizes) & set(LLAMA_SWITCHES))
    if clash:
        raise ValueError(f"{clash} are fixed by llama_config; build TransformerConfig directly to change them")
    return TransformerConfig(**LLAMA_SWITCHES, **sizes, layernorm_epsilon=layernorm_epsilon,
                             hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)


def llama_preset(name: str, **overrides) -> TransformerConfig:
    """llama_config of a published size, e.g. llama_preset("llama3-8b")."""
    if name not in LLAMA_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(LLAMA_PRESETS)}")
    return llama_config(**{**LLAMA_PRESETS[name], **overrides})


def gpt_to_llama(config: TransformerConfig, num_query_groups: int | None = None,
                 ffn_hidden_size: int | None = None) -> TransformerConfig:
    """The LLaMA of a GPT config: the same sizes with the six switches flipped (dropout kept)."""
    return replace(config, **LLAMA_SWITCHES, num_query_groups=num_query_groups or config.num_attention_heads,
                   ffn_hidden_size=ffn_hidden_size or config.ffn_hidden_size)


MIXTRAL_PRESETS = {
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, vocab_size=32000, seq_length=32768, rotary_base=1000000,
                         num_moe_experts=8, moe_router_topk=2),
    "mixtral-8x22b": dict(num_layers=56, hidden_size=6144, num_attention_heads=48, num_query_groups=8,
                          ffn_hidden_size=16384, vocab_size=32768, seq_length=65536, rotary_base=1000000,
                          num_moe_experts=8, moe_router_topk=2),
}


def mixtral_config(*, num_moe_experts: int = 8, moe_router_topk: int = 2, **sizes) -> TransformerConfig:
    """LLaMA + a softmax top-k MoE in every layer (Mixtral). `sizes` as for llama_config."""
    return llama_config(num_moe_experts=num_moe_experts, moe_router_topk=moe_router_topk,
                        moe_router_score_function="softmax", **sizes)


def mixtral_preset(name: str, **overrides) -> TransformerConfig:
    if name not in MIXTRAL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MIXTRAL_PRESETS)}")
    return mixtral_config(**{**MIXTRAL_PRESETS[name], **overrides})


def deepseek_v3_style_config(*, num_moe_experts: int = 16, moe_router_topk: int = 4,
                             moe_ffn_hidden_size: int | None = None,
                             moe_shared_expert_intermediate_size: int | None = None, **sizes) -> TransformerConfig:
    """LLaMA + DeepSeek-V3's MoE: many small experts (default ffn_hidden_size / topk each, so the active
    expert FLOPs match one dense MLP), sigmoid scores with the aux-loss-free expert bias, one shared expert."""
    ffn = sizes.get("ffn_hidden_size") or 4 * sizes["hidden_size"]
    expert_ffn = moe_ffn_hidden_size or max(1, ffn // moe_router_topk)
    return llama_config(
        num_moe_experts=num_moe_experts, moe_router_topk=moe_router_topk, moe_ffn_hidden_size=expert_ffn,
        moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size or expert_ffn,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, **sizes)
