"""The papers' formulas for parameters, FLOPs, activation memory and training time.

Symbols follow the papers: l layers, h hidden size, a attention heads, s sequence length,
b micro-batch size, B global batch size, V vocabulary size, t tensor-parallel size.

    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
        Using Megatron-LM" (SC'21), Section 5.1: Eq. 2 parameters, Eq. 3 FLOPs, Eq. 4 time.
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
        (MLSys'23): Section 4 and Table 2 activation memory, Eq. 7 model FLOPs.

Where the counts come from (one transformer layer, forward, matmuls only, 2 FLOPs per MAC):

    QKV 6Bsh^2 + scores 2Bs^2h + attention-over-values 2Bs^2h + projection 2Bsh^2
    + MLP 16Bsh^2  =  24Bsh^2 + 4Bs^2h;   the logit layer adds 2BshV.
    Backward costs twice the forward; full recomputation adds one more forward.
"""

from __future__ import annotations

SECONDS_PER_DAY = 86400


def num_parameters(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int) -> float:
    """Parameters of a GPT model: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)). Narayanan 2021, Eq. 2.

    Per layer 12h^2 weights and 13h biases/norm gains; V*h word and s*h position embeddings
    (the output layer shares the word embeddings; the final norm's 2h is left out).
    """
    l, h, V, s = num_layers, hidden_size, vocab_size, seq_length  # noqa: E741 (the paper's symbols)
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def flops_per_iteration(batch_size: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int,
                        recompute: bool = True) -> float:
    """FLOPs of one training iteration (forward + backward) over a global batch of B sequences.

    recompute=True:  96 B s l h^2 (1 + s/(6h) + V/(16 l h))  -- Narayanan 2021, Eq. 3, which
                     counts the extra forward pass of full activation recomputation;
    recompute=False: 72 B s l h^2 (1 + s/(6h) + V/(12 h l))  -- the model FLOPs of Korthikanti
                     2022, Eq. 7 (what the model needs, whatever the implementation recomputes).
    """
    B, s, l, h, V = batch_size, seq_length, num_layers, hidden_size, vocab_size  # noqa: E741 (the paper's symbols)
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * h * l))


def activation_memory_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                                tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                                recompute: str = "none", ffn_hidden_size: int | None = None,
                                context_parallel_size: int = 1, flash_attention: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for backward. Korthikanti 2022, Table 2.

    16-bit activations, 1-byte dropout masks. Without parallelism a layer keeps
    34 s b h + 5 a s^2 b bytes: attention 11sbh + 5as^2b (the 5as^2b is the softmax output,
    its dropout mask and the dropped-out probabilities), MLP 19sbh, two LayerNorms 4sbh.

        recompute   sequence_parallel   bytes
        "none"      False               s b h (10 + 24/t + 5 a s / (h t))
        "none"      True                s b h / t * (34 + 5 a s / h)
        "selective" False               s b h (10 + 24/t)      (core attention recomputed)
        "selective" True                s b h / t * 34
        "full"      either              2 s b h                (only the layer's input)

    The 24 (split by t) is 8 for attention and 16 = 4 ffn/h for the MLP's two ffn-wide tensors:
    with `ffn_hidden_size` f it becomes 8 + 4 f/h (Megatron's theoretical_memory_usage writes
    the SP case as 18 + 4 f/h). Context parallelism gives each rank s/cp tokens: every s b h
    term shrinks by cp, and the scores of s/cp queries against all s keys by cp too.
    flash_attention=True: FlashAttention / cuDNN fused attention never stores the 5as²b scores, whatever
    the recomputation (the backward recomputes them block by block on chip).
    """
    s, b, h, a, t = seq_length / context_parallel_size, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel_size
    split = 8 + 4 * (4 * h if ffn_hidden_size is None else ffn_hidden_size) / h
    if recompute == "full":
        return 2 * s * b * h
    if recompute not in ("none", "selective"):
        raise ValueError(f'recompute must be "none", "selective" or "full", got {recompute!r}')
    attention_scores = 5 * a * seq_length / h if recompute == "none" and not flash_attention else 0.0  # s/cp x s
    if sequence_parallel:
        return s * b * h / t * (10 + split + attention_scores)
    return s * b * h * (10 + split / t + attention_scores / t)


def tensor_parallel_communication_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int,
                                            tensor_parallel_size: int, bytes_per_element: int = 2) -> float:
    """Bytes each device sends for one layer's forward + backward of one micro-batch under tensor
    parallelism: 8 b s h (t-1)/t elements. Narayanan 2021, Section 3.2.

    A layer all-reduces a [s, b, h] tensor twice forward (after attention, after the MLP) and
    twice backward (the inputs of both blocks); a ring all-reduce sends 2 (t-1)/t of its payload
    from each device: 4 * 2 (t-1)/t b s h. Sequence parallelism replaces each all-reduce with an
    all-gather plus a reduce-scatter, (t-1)/t each: the same volume (Korthikanti 2022, Section 4.2.2).
    """
    s, b, h, t = seq_length, micro_batch_size, hidden_size, tensor_parallel_size
    return 8 * b * s * h * (t - 1) / t * bytes_per_element


def training_days(num_tokens: float, num_parameters: float, num_gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time 8 T P / (n X), in days. Narayanan 2021, Eq. 4.

    T tokens, P parameters, n GPUs each sustaining X FLOP/s; the 8 is Eq. 3's 96 B s l h^2
    over the 12 l h^2 parameters (with recomputation), per token.
    """
    return 8 * num_tokens * num_parameters / (num_gpus * flops_per_gpu) / SECONDS_PER_DAY


def zero_memory_per_device(num_parameters: float, data_parallel_size: int, stage: int,
                           optimizer_bytes_per_param: float = 12, param_bytes: float = 2,
                           grad_bytes: float = 2) -> dict[str, float]:
    """Bytes per device for model states under ZeRO stage 0-3. Rajbhandari et al. 2020, Section 5.

    Psi parameters, N_d data-parallel ranks, K optimizer bytes per parameter (mixed-precision Adam:
    fp32 master weights, momentum and variance, K = 12; fp16 params and grads, 2 bytes each):

        stage 0  (2 + 2 + K) Psi               stage 2 (P_os+g)  2 Psi + (2 + K) Psi / N_d
        stage 1  (P_os)  4 Psi + K Psi / N_d   stage 3 (P_os+g+p)  (2 + 2 + K) Psi / N_d

    Returns {"params", "grads", "optimizer", "total"} in bytes. (Paper, Figure 1: Psi = 7.5e9,
    N_d = 64 gives 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.)
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    psi, nd = num_parameters, data_parallel_size
    out = {
        "params": param_bytes * psi / (nd if stage >= 3 else 1),
        "grads": grad_bytes * psi / (nd if stage >= 2 else 1),
        "optimizer": optimizer_bytes_per_param * psi / (nd if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------ context parallelism
def context_parallel_attention_memory(seq_length: int, micro_batch_size: int, num_attention_heads: int,
                                      num_query_groups: int, kv_channels: int, context_parallel_size: int,
                                      variant: str = "p2p", bytes_per_element: int = 4) -> float:
    """Bytes one rank's core attention keeps for backward, one layer, under context parallelism.

    s/cp tokens per rank, np heads, ng key/value groups, hn = kv_channels:
        "p2p" (ring)   q, out  b (s/cp) np hn   +  k, v  b (s/cp) ng hn   +  lse  b np (s/cp) (fp32)
        "all_gather"   q, out  b (s/cp) np hn   +  k, v  b s ng hn (the gathered sequence)
                       +  lse  +  the [s/cp, s] boolean causal mask (1 byte each)
    No s x s scores are kept (as FlashAttention): backward recomputes them block by block.
    """
    s, b, np_, ng, hn, cp = (seq_length, micro_batch_size, num_attention_heads, num_query_groups, kv_channels,
                             context_parallel_size)
    local = s // cp
    q_out_lse = 2 * b * local * np_ * hn * bytes_per_element + 4 * b * np_ * local
    if variant == "p2p":
        return q_out_lse + 2 * b * local * ng * hn * bytes_per_element
    if variant == "all_gather":
        return q_out_lse + 2 * b * s * ng * hn * bytes_per_element + local * s
    raise ValueError(f'variant must be "p2p" or "all_gather", got {variant!r}')


def context_parallel_communication_per_layer(seq_length: int, micro_batch_size: int, num_query_groups: int,
                                             kv_channels: int, context_parallel_size: int, variant: str = "p2p",
                                             bytes_per_element: int = 4, num_attention_heads: int | None = None,
                                             hierarchical_sizes: tuple[int, int] | None = None) -> dict[str, float]:
    """Bytes each rank sends for one layer's attention, forward and backward, one micro-batch.

    A K/V block is this rank's keys and values, 2 b (s/cp) ng hn elements. Ring ("p2p", TE's
    AttnFuncWithCPAndKVP2P): forward passes cp-1 blocks; backward passes the K/V again (cp-1) and
    the dK/dV that travel with them back to their owner (cp hops). All-gather (TE's
    AttnFuncWithCPAndKVAllGather keeps only its local K/V): an all-gather forward, the same all-gather
    again backward and a reduce-scatter of dK/dV, (cp-1) blocks each. "a2a" (Ulysses, TE's
    AttnFuncWithCPAndQKVOA2A): all-to-alls of q, k, v and the output forward, of dO, dQ, dK, dV backward, each
    sending (cp-1)/cp of this rank's b (s/cp) (np or ng) hn elements (needs num_attention_heads).
    "a2a+p2p" (hierarchical_sizes = (a, p), a·p = cp): a2a inside groups of a, then a ring over p ranks of
    K/V blocks of s/p tokens and ng/a groups. Returns {"forward", "backward", "total"}.
    """
    cp, b, s, ng, hn, e = (context_parallel_size, micro_batch_size, seq_length, num_query_groups, kv_channels,
                           bytes_per_element)

    def ring(n: int, tokens: int, groups: float) -> tuple[float, float]:
        block = 2 * b * tokens * groups * hn * e
        return (n - 1) * block, ((n - 1) + (n if n > 1 else 0)) * block

    def ulysses(n: int, tokens: int, groups: float) -> tuple[float, float]:
        if num_attention_heads is None:
            raise ValueError(f'variant "{variant}" needs num_attention_heads (q and the output travel too)')
        one = (n - 1) / n * b * tokens * (2 * num_attention_heads + 2 * groups) * hn * e
        return one, one

    if variant == "p2p":
        forward, backward = ring(cp, s // cp, ng)
    elif variant == "all_gather":
        block = 2 * b * (s // cp) * ng * hn * e
        forward, backward = (cp - 1) * block, 2 * (cp - 1) * block
    elif variant == "a2a":
        forward, backward = ulysses(cp, s // cp, ng)
    elif variant == "a2a+p2p":
        if hierarchical_sizes is None or hierarchical_sizes[0] * hierarchical_sizes[1] != cp:
            raise ValueError(f'variant "a2a+p2p" needs hierarchical_sizes=(a2a, p2p) with a2a·p2p = cp = {cp}, '
                             f"got {hierarchical_sizes!r}")
        a, p = hierarchical_sizes
        f1, b1 = ulysses(a, s // cp, ng) if a > 1 else (0.0, 0.0)
        f2, b2 = ring(p, s // p, max(1.0, ng / a))
        forward, backward = f1 + f2, b1 + b2
    else:
        raise ValueError(f'variant must be "p2p", "all_gather", "a2a" or "a2a+p2p", got {variant!r}')
    return {"forward": forward, "backward": backward, "total": forward + backward}


# ---------------------------------------------------------------- mixed precision (chapter 06)
def mixed_precision_bytes_per_parameter(precision: str) -> dict[str, int]:
    """Bytes per parameter of model states with Adam, Megatron's table (docs/user-guide/
    features/dist_optimizer.md; ZeRO's 16 Psi for mixed precision counts fp16 grads without the fp32 copy):

        "fp16": fp16 params 2 + fp16 grads 2 + fp32 main params 4 + fp32 main grads 4 + Adam 8 = 20
        "bf16": bf16 params 2 + fp32 grads 4 (main_grad, shared by the main params) + 4 + 8  = 18
        "fp32": params 4 + grads 4 + Adam 8                                                  = 16
    """
    table = {
        "fp16": dict(params=2, grads=2, main_params=4, main_grads=4, optimizer_state=8),
        "bf16": dict(params=2, grads=4, main_params=4, main_grads=0, optimizer_state=8),
        "fp32": dict(params=4, grads=4, main_params=0, main_grads=0, optimizer_state=8),
    }
    if precision not in table:
        raise ValueError(f'precision must be "fp16", "bf16" or "fp32", got {precision!r}')
    out = dict(table[precision])
    out["total"] = sum(out.values())
    return out


def moe_all_to_all_bytes(num_tokens: int, topk: int, hidden_size: int, expert_parallel_size: int,
                         bytes_per_element: int = 2) -> float:
    """Bytes one rank sends in the all-to-alls of one MoE layer's forward (dispatch + combine),
    with the load spread evenly: each of its T k token copies goes to a random expert, (ep-1)/ep
    of them on another rank, h elements each, and comes back: 2 T k h (ep-1)/ep elements.
    Backward sends the same again. (Megatron's MoEAlltoAllTokenDispatcher; DeepSpeed-MoE, Rajbhandari 2022.)
    """
    ep = expert_parallel_size
    return 2 * num_tokens * topk * hidden_size * (ep - 1) / ep * bytes_per_element


# ---------------------------------------------------------------- chapter 04: counts of a configured model
# Exact counts for any TransformerConfig (GPT, LLaMA: gated MLP, GQA, untied output; MoE: experts,
# shared experts), so they can be checked against the published sizes and against
# torch.utils.flop_counter.FlopCounterMode on the real GPTModel. "active" is what one token uses:
# a MoE token passes through moe_router_topk experts (and the shared ones), not all of them.


def _mlp_parameters(hidden_size: int, ffn_hidden_size: int, gated: bool, bias: bool) -> int:
    fc1 = ffn_hidden_size * (2 if gated else 1)
    return hidden_size * fc1 + ffn_hidden_size * hidden_size + ((fc1 + hidden_size) if bias else 0)


def model_parameters(config) -> dict[str, int]:
    """Parameters of GPTModel(config), by part: embedding, attention, mlp (dense, or router + experts +
    shared experts), norms, output (0 when tied); "total" and "active" (used by one token)."""
    h, V, L = config.hidden_size, config.vocab_size, config.num_layers
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    bias = config.add_bias_linear
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    qkv = h * (np_ + 2 * ng) * hn + ((np_ + 2 * ng) * hn if bias or config.add_qkv_bias else 0)
    attention = qkv + np_ * hn * h + (h if bias else 0)
    gated = config.gated_linear_unit
    if getattr(config, "num_moe_experts", None) is None:
        mlp = active_mlp = _mlp_parameters(h, config.ffn_hidden_size, gated, bias)
    else:
        E, k = config.num_moe_experts, config.moe_router_topk
        expert = _mlp_parameters(h, config.moe_ffn_hidden_size, gated, bias)
        shared = config.moe_shared_expert_intermediate_size
        shared = _mlp_parameters(h, shared, gated, bias) if shared else 0
        mlp, active_mlp = E * h + E * expert + shared, E * h + k * expert + shared
    counts = {
        "embedding": V * h + (config.seq_length * h if config.position_embedding_type == "learned_absolute" else 0),
        "attention": L * attention,
        "mlp": L * mlp,
        "norms": (2 * L + 1) * norm,
        "output": 0 if config.share_embeddings_and_output_weights else V * h,
    }
    counts["total"] = sum(counts.values())
    counts["active"] = counts["total"] - L * (mlp - active_mlp)
    return counts


def model_flops(config, batch_size: int, seq_length: int, training: bool = True) -> float:
    """Matmul FLOPs of one forward (training=False) or forward + backward (3x) over batch_size sequences.

    Per token, 2 FLOPs per active matmul weight (attention projections, the active MLP or experts and
    router, the logit layer; not the embedding lookup, norms or biases), plus attention 2 * 2 s np hn
    per layer for q k^T and probs v over the full s x s square, as the unfused kernel computes it (Megatron's
    num_floating_point_operations halves this term for the causal mask).
    A dense GPT reduces to Korthikanti's 72 B s l h^2 (1 + s/(6h) + V/(12 h l)).
    """
    h, L = config.hidden_size, config.num_layers
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    attention_weights = h * (np_ + 2 * ng) * hn + np_ * hn * h
    gated = config.gated_linear_unit
    if getattr(config, "num_moe_experts", None) is None:
        mlp_weights = _mlp_parameters(h, config.ffn_hidden_size, gated, bias=False)
    else:
        shared = config.moe_shared_expert_intermediate_size
        mlp_weights = (config.num_moe_experts * h  # the router sees every expert
                       + config.moe_router_topk * _mlp_parameters(h, config.moe_ffn_hidden_size, gated, bias=False)
                       + (_mlp_parameters(h, shared, gated, bias=False) if shared else 0))
    weights = L * (attention_weights + mlp_weights) + config.vocab_size * h  # + the logit layer, tied or not
    tokens = batch_size * seq_length
    attention = 4 * batch_size * seq_length**2 * np_ * hn * L
    forward = 2 * tokens * weights + attention
    return 3 * forward if training else forward


def korthikanti_hardware_flops(batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                               vocab_size: int) -> float:
    """Hardware FLOPs of one iteration with selective recomputation, as Korthikanti et al. 2022 count
    them for their HFU (Table 5): 72 B s l h^2 (1 + s/(3h) + V/(12 h l)).

    The model FLOPs (Eq. 7) have s/(6h); the recomputed attention core adds as much again. (The paper
    does not print this formula: its HFU/MFU ratios equal this one's for all four models to 0.1%.)
    """
    B, s, l, h, V = batch_size, seq_length, num_layers, hidden_size, vocab_size  # noqa: E741 (the paper's symbols)
    return 72 * B * s * l * h**2 * (1 + s / (3 * h) + V / (12 * h * l))
