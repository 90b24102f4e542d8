"""TransformerConfig: every size and switch of a transformer in one validated dataclass.

Megatron Core passes one `TransformerConfig` (megatron/core/transformer/transformer_config.py)
to every module instead of long argument lists; the field names here are Megatron's, so a
reader can move between the two (vocab_size, seq_length, position_embedding_type, rotary_base, rotary_percent and
share_embeddings_and_output_weights are GPTModel's arguments there, seq_length as max_sequence_length: megalab
keeps them here to build a model from one config). Derived sizes are filled in after construction:

    ffn_hidden_size  = 4 * hidden_size                 (if not given)
    kv_channels      = hidden_size // num_attention_heads   (head dim)
    num_query_groups = num_attention_heads             (MHA; fewer groups = GQA, 1 = MQA)
"""

from __future__ import annotations

from dataclasses import dataclass

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "relu", "silu", "squared_relu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
ATTENTION_BACKENDS = ("unfused", "sdpa", "triton", "flash_attn", "auto")  # the last 3: megalab/kernels
MOE_ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_TOKEN_DISPATCHER_TYPES = ("alltoall", "allgather")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")  # Megatron's, less sinkhorn


@dataclass
class TransformerConfig:
    # sizes
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int  # longest sequence; also the number of learned position embeddings
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    # architecture
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation_func: str = "gelu"
    gated_linear_unit: bool = False  # True with "silu" is SwiGLU (LLaMA)
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000  # RoPE's base (rope_theta); fractional bases are kept
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False  # rotate pairs (x0, x1), (x2, x3)... (Meta's LLaMA) instead of halves (HF)
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # only read when add_bias_linear is False (Megatron's rule)
    share_embeddings_and_output_weights: bool = True  # tie the output layer to the word embeddings
    attention_backend: str = "sdpa"  # "unfused" writes the math out; "sdpa" calls F.scaled_dot_product_attention
    # parallelism (Megatron's ModelParallelConfig)
    sequence_parallel: bool = False  # split norms/dropout/residual along the sequence across TP ranks
    # regularization and initialization
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # activation recomputation
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # mixture of experts (megalab/core/transformer/moe/moe_layer.py; Megatron's names): None experts = the dense MLP
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # "sigmoid": DeepSeek-V3 scores, usually with the expert bias
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias steers the top-k
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str | list[str] = "aux_loss"  # or seq_aux_loss, global_aux_loss, none; or a list
    moe_aux_loss_coeff: float | list[float] = 0.0  # Switch/GShard load-balancing loss (one per type when a list)
    moe_z_loss_coeff: float | None = None  # ST-MoE router z-loss
    moe_expert_capacity_factor: float | None = None  # None: no token is dropped
    moe_pad_expert_input_to_capacity: bool = False  # every expert gets exactly `capacity` tokens
    moe_token_dispatcher_type: str = "allgather"
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size (default ffn_hidden_size)
    moe_shared_expert_intermediate_size: int | None = None  # None: no shared expert
    moe_grouped_gemm: bool = False  # experts as one batched matmul instead of a loop of MLPs

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; change one, or set kv_channels (the head dim) explicitly"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_query_groups "
                f"{self.num_query_groups} (each key/value group serves the same number of query heads)"
            )
        self._check_choice("normalization", NORMALIZATIONS)
        self._check_choice("activation_func", ACTIVATIONS)
        self._check_choice("position_embedding_type", POSITION_EMBEDDINGS)
        self._check_choice("attention_backend", ATTENTION_BACKENDS)
        self._check_choice("recompute_granularity", RECOMPUTE_GRANULARITIES)
        self._check_choice("recompute_method", RECOMPUTE_METHODS)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.position_embedding_type == "rope":
            rotary_dim = int(self.kv_channels * self.rotary_percent)
            if not 0.0 < self.rotary_percent <= 1.0 or rotary_dim % 2:
                raise ValueError(
                    f"rotary_percent {self.rotary_percent} of kv_channels {self.kv_channels} gives {rotary_dim} "
                    "rotated channels; it must be a positive even number"
                )
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                raise ValueError('recompute_granularity="full" needs recompute_method ("uniform" or "block")')
            n = self.recompute_num_layers
            if not isinstance(n, int) or not 1 <= n <= self.num_layers:
                raise ValueError(f"recompute_num_layers must be in 1..num_layers={self.num_layers}, got {n!r}")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError(
                'recompute_method and recompute_num_layers only apply to recompute_granularity="full" '
                f"(got granularity {self.recompute_granularity!r})"
            )

        if self.num_moe_experts is not None:
            self._check_moe()

    def _check_moe(self) -> None:
        e, k = self.num_moe_experts, self.moe_router_topk
        if not isinstance(e, int) or e < 1:
            raise ValueError(f"num_moe_experts must be a positive integer (or None for a dense MLP), got {e!r}")
        if not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(f"moe_router_topk {k!r} must be in 1..num_moe_experts={e}: "
                             "each token picks k distinct experts")
        self._check_choice("moe_router_score_function", MOE_ROUTER_SCORE_FUNCTIONS)
        self._check_choice("moe_token_dispatcher_type", MOE_TOKEN_DISPATCHER_TYPES)
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError('moe_router_enable_expert_bias needs moe_router_score_function="sigmoid" '
                             "(DeepSeek-V3's aux-loss-free balancing; Megatron also accepts \"sqrtsoftplus\", "
                             "not implemented here)")
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(types, str) != (not isinstance(coeffs, (list, tuple))) or (
                not isinstance(types, str) and len(types) != len(coeffs)):
            raise ValueError(f"moe_router_load_balancing_type {types!r} and moe_aux_loss_coeff {coeffs!r}: give one "
                             "type and one coefficient, or lists of the same length (Megatron's rule)")
        for t in [types] if isinstance(types, str) else types:
            if t not in MOE_LOAD_BALANCING_TYPES:
                raise ValueError(f"moe_router_load_balancing_type must be among {MOE_LOAD_BALANCING_TYPES} "
                                 f"(sinkhorn is not implemented here), got {t!r}")
        if any(c < 0 for c in ([coeffs] if not isinstance(coeffs, (list, tuple)) else coeffs)):
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {coeffs}")
        for name in ("moe_z_loss_coeff", "moe_router_bias_update_rate"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        cf = self.moe_expert_capacity_factor
        if cf is not None and cf <= 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0 (or None for no dropping), got {cf}")
        if self.moe_pad_expert_input_to_capacity and cf is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (the capacity to pad to)")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def _check_choice(self, name: str, choices: tuple) -> None:
        if getattr(self, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
