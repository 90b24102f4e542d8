"""Mixture-of-experts GPTs: Mixtral (8 experts, top-2) and a DeepSeek-V3-style variant.

Both are LLaMA (llama.py) with the MLP of every layer replaced by chapter 03's MoELayer
(megalab/core/transformer/moe/moe_layer.py), set by config alone, as Megatron does (--num-experts, --moe-router-topk, ...):

    Mixtral 8x7B (Jiang et al. 2024)        8 experts of ffn 14336, top-2, softmax over the top-2 logits
    DeepSeek-V3 (DeepSeek-AI 2024)          256 fine-grained experts of ffn 2048, top-8, sigmoid scores,
                                            aux-loss-free balancing (an expert bias steers the choice),
                                            1 shared expert that sees every token; the first 3 layers dense

    token ─ router ─ top-k ─┬─ expert e1 ─┐                      total params: every expert
                            └─ expert e2 ─┴─ sum_k p_k E_k(x)    active per token: only k experts
    (+ shared expert ───────────────────────── always)           (+ shared), so FLOPs follow "active"

Not here: DeepSeek's multi-head latent attention (MLA) and its first dense layers (every layer
of our GPTModel has the same MLP type); calc counts them for the published sizes.
"""

from __future__ import annotations

from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.presets import llama_config

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
