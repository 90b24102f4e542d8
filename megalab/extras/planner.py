"""Parallelism planner: which tp·pp·cp·ep·dp layouts fit a model on N GPUs, and what each costs.

For one model and one cluster it enumerates every valid layout and, for the most loaded GPU (the
first pipeline stage, which holds the embedding and the most in-flight micro-batches), adds up

    weights + grads + optimizer   bf16 params (2 B), fp32 main grads (4 B), Adam in fp32 (12 B):
                                  18 B per parameter held, or 6 + 12/d with the distributed
                                  optimizer (Megatron's theoretical_memory_usage.py);
                                  dense params split by tp (and pp), expert params by ep·etp (and pp)
    activations                   Korthikanti Table 2 per layer and micro-batch (calc), times the
                                  layers of a stage, times the micro-batches in flight
    bubble                        (p - 1) / (v m)                      (pipeline_parallel)
    communication                 bytes each GPU sends per step, per kind of parallelism
    step time                     step_time.step_time: GEMMs at a shape-dependent efficiency, attention,
                                  memory-bound ops, recomputation, the bubble and each kind's exposed
                                  communication on NVLink or the network (checked against published runs)

and flags the layouts that do not fit. `plan(...)` returns them best first: fitting layouts, then
the shortest estimated step. Training also takes today's Megatron flags: fp8_recipe (fp8 weight copies
in memory, fp8 GEMMs in time), cp_comm_type, overlap_moe_expert_parallel_comm, moe_imbalance; Layout
takes uneven stages (pipeline_layout, or parse_pipeline_layout of Megatron's layout string). With
FlashAttention (the default) no s x s attention scores are kept, with or without recomputation.

    model ─┐                      ┌─ Layout(tp, pp, cp, ep, dp, vpp) ── valid? ── memory, bubble, bytes, time
    GPUs  ─┴─ enumerate_layouts ──┤─ ...
                                  └─ ...
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megalab.core.transformer.pipeline_parallel_layer_layout import (
    CHAR_TO_LAYER_TYPE,
    LayerType,
    PipelineParallelLayerLayout,
)
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras import calc, step_time
from megalab.extras.pipeline_sim import bubble_fraction
from megalab.extras.presets import llama_preset, mixtral_preset

GB = 1e9
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class ModelSpec:
    """The sizes the planner needs, with Megatron's argument names."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_query_groups: int | None = None  # None: MHA
    kv_channels: int | None = None  # None: hidden_size / heads
    swiglu: bool = True
    normalization: str = "RMSNorm"
    untie_embeddings_and_output_weights: bool = True
    position_embedding_type: str = "rope"  # "rope": rotated q and k in every layer; "learned_absolute": GPT's table
    qk_layernorm: bool = False  # a norm over q and k of every head (Qwen3)
    # MoE (num_experts None: dense)
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_first_dense_layers: int = 0  # DeepSeek-V3: the first 3 layers are dense
    # Multi-latent attention (DeepSeek-V2/V3); None: standard attention
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int = 0  # multi-token prediction modules on the last stage (DeepSeek-V3: 1); not in the counts

    @classmethod
    def from_config(cls, name: str, config: TransformerConfig) -> ModelSpec:
        """The sizes of a TransformerConfig (e.g. chapter 04's presets)."""
        return cls(name, config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size,
                   config.vocab_size, num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
                   swiglu=config.gated_linear_unit, normalization=config.normalization,
                   untie_embeddings_and_output_weights=not config.share_embeddings_and_output_weights,
                   position_embedding_type=config.position_embedding_type,
                   qk_layernorm=getattr(config, "qk_layernorm", False),
                   num_experts=config.num_moe_experts, moe_router_topk=config.moe_router_topk,
                   moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                   moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.num_experts is None else self.num_layers - self.moe_first_dense_layers

    def attention_params(self) -> float:
        """Weights of one attention block (no biases). MLA as in Megatron's multi_latent_attention."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank is not None:
            norm = 1 if self.normalization == "RMSNorm" else 2
            q = (h * n * (self.qk_head_dim + self.qk_pos_emb_head_dim) if self.q_lora_rank is None else
                 self.q_lora_rank * (h + n * (self.qk_head_dim + self.qk_pos_emb_head_dim) + norm))
            kv = self.kv_lora_rank * (h + n * (self.qk_head_dim + self.v_head_dim) + norm)
            return q + kv + h * self.qk_pos_emb_head_dim + n * self.v_head_dim * h
        q = n * self.head_dim
        return 2 * h * q * (1 + self.groups / n)  # qkv (q + 2 kv) and the output projection

    def mlp_params(self, ffn: int) -> float:
        return (3 if self.swiglu else 2) * self.hidden_size * ffn

    def layer_params(self) -> dict[str, float]:
        """Per layer: replicated-by-ep ("dense") and per-expert-shard ("expert") weights, averaged over layers."""
        h, norm = self.hidden_size, (1 if self.normalization == "RMSNorm" else 2) * 2 * self.hidden_size
        dense = self.attention_params() + norm
        dense_layers, moe_layers = self.num_layers - self.num_moe_layers, self.num_moe_layers
        dense_mlp = self.mlp_params(self.ffn_hidden_size)
        expert = 0.0
        if moe_layers:
            shared = self.mlp_params(self.moe_shared_expert_intermediate_size or 0)
            router = self.num_experts * h
            expert = self.num_experts * self.mlp_params(self.moe_ffn_hidden_size)
            dense_mlp = (dense_layers * dense_mlp + moe_layers * (shared + router)) / self.num_layers
            expert = expert * moe_layers / self.num_layers
        return {"dense": dense + dense_mlp, "expert": expert}

    def embedding_params(self) -> float:
        return self.vocab_size * self.hidden_size

    def final_norm_params(self) -> float:
        return (1 if self.normalization == "RMSNorm" else 2) * self.hidden_size

    def num_parameters(self) -> float:
        per_layer = self.layer_params()
        embeddings = self.embedding_params() * (2 if self.untie_embeddings_and_output_weights else 1)
        return self.num_layers * (per_layer["dense"] + per_layer["expert"]) + embeddings + self.final_norm_params()

    def num_active_parameters(self) -> float:
        """Parameters one token passes through: top-k (plus shared) experts instead of all of them."""
        if self.num_experts is None:
            return self.num_parameters()
        per_expert = self.mlp_params(self.moe_ffn_hidden_size) * self.num_moe_layers
        return self.num_parameters() - (self.num_experts - self.moe_router_topk) * per_expert


# Published configurations: chapter 04's presets, and DeepSeek-V3 (MLA, 3 dense layers first) from its report.
LLAMA3_8B = ModelSpec.from_config("LLaMA-3 8B", llama_preset("llama3-8b"))
LLAMA3_70B = ModelSpec.from_config("LLaMA-3 70B", llama_preset("llama3-70b"))
MIXTRAL_8X7B = ModelSpec.from_config("Mixtral 8x7B", mixtral_preset("mixtral-8x7b"))
DEEPSEEK_V3 = ModelSpec("DeepSeek-V3", 61, 7168, 128, 18432, 129280, num_experts=256, moe_router_topk=8,
                        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_first_dense_layers=3,
                        q_lora_rank=1536, kv_lora_rank=512, mtp_num_layers=1)
MODELS = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B, MIXTRAL_8X7B, DEEPSEEK_V3)}


@dataclass(frozen=True)
class Training:
    """What the step looks like, independent of the layout."""

    seq_length: int = 8192
    global_batch_size: int = 512  # sequences per optimizer step
    micro_batch_size: int = 1
    sequence_parallel: bool = True
    recompute: str = "selective"  # "selective" (= FlashAttention: no s^2 scores), "none", "full"
    use_distributed_optimizer: bool = True
    # bytes per parameter: Megatron keeps bf16 params, fp32 main grads and fp32 Adam (master, m, v):
    # 2 + 4 + 12 = 18. The Ultra-Scale Playbook counts bf16 grads (2: 16 in all) plus an fp32
    # accumulation copy (2 + 4: 20 in all).
    param_bytes: float = BF16
    grad_bytes: float = FP32
    optimizer_bytes: float = 12
    gpu_memory_gb: float | None = None  # None: the hardware's (80 GB on H100, 141 on H200, 180 on B200)
    memory_headroom: float = 0.1  # kept free: allocator fragmentation, NCCL buffers, the CUDA context
    # for the step time (step_time.py): the cluster, and what Megatron's flags let overlap
    hardware: str | step_time.Hardware = "H100-SXM (DGX H100)"
    flash_attention: bool = True  # FlashAttention / cuDNN fused attention (the 2021-22 papers: unfused)
    overlap_grad_reduce: bool = True  # --overlap-grad-reduce
    overlap_param_gather: bool = True  # --overlap-param-gather (with the distributed optimizer)
    tp_comm_overlap: bool = False  # --tp-comm-overlap (Transformer Engine userbuffers)
    zero_stage: int = 0  # 3: DeepSpeed ZeRO-3 / FSDP (params gathered per micro-batch): step time only, for comparison
    # what today's Megatron adds (issue 39)
    fp8_recipe: str | None = None  # --fp8-recipe: None (bf16), "delayed", "tensorwise", "mxfp8", "blockwise"
    cp_comm_type: str = "p2p"  # --cp-comm-type: "p2p" (ring), "all_gather", "a2a" (Ulysses), "a2a+p2p"
    hierarchical_context_parallel_sizes: tuple[int, int] | None = None  # (a2a, p2p) for "a2a+p2p"
    overlap_moe_expert_parallel_comm: bool = False  # --overlap-moe-expert-parallel-comm
    moe_imbalance: float = 1.0  # tokens on the most loaded expert-parallel rank / the mean (1: balanced)

    @property
    def memory_gb(self) -> float:
        """The GPU's memory: gpu_memory_gb, or the hardware's datasheet figure when it is None."""
        return self.gpu_memory_gb if self.gpu_memory_gb is not None else step_time.hardware(self.hardware).gpu.memory_gb

    @property
    def gpus_per_node(self) -> int:
        return step_time.hardware(self.hardware).gpus_per_node


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel (Megatron recommends 1 with EP)
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved 1F1B)
    # transformer layers on each pipeline rank (its virtual chunks together), for uneven stages; None: L/pp
    # each. parse_pipeline_layout reads Megatron's --pipeline-model-parallel-layout string into it.
    pipeline_layout: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep),
                                           ("dp", self.dp)) if v > 1 or k == "dp"]
        return "·".join(parts) + (f" (vpp {self.vpp})" if self.vpp > 1 else "") + (
            f" [{_runs(self.pipeline_layout)}]" if self.pipeline_layout else "")


def _runs(counts) -> str:
    """(15, 16, 16, 16, 15) -> "15,16x3,15": layers per rank, repeats folded."""
    out: list[list] = []
    for c in counts:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return ",".join(f"{c}x{n}" if n > 1 else f"{c}" for c, n in out)


def embedding_and_loss_layout(num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...] | None:
    """Layers on each pipeline rank when the embedding and the loss each take one layer's slot of the pp·vpp
    virtual stages (Megatron's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split;
    e.g. LLaMA-3.1 405B: 126 + 2 = 128 slots over 8 x 8 stages). None when that does not divide either."""
    per_stage, rest = divmod(num_layers + 2, pp * vpp)
    if rest or per_stage < 1:
        return None
    stages = [per_stage] * (pp * vpp)
    stages[0] -= 1  # E
    stages[-1] -= 1  # L
    return tuple(sum(stages[c * pp + r] for c in range(vpp)) for r in range(pp))


def parse_pipeline_layout(layout: str, pp: int, num_layers: int | None = None) -> tuple[tuple[int, ...], int]:
    """Megatron's --pipeline-model-parallel-layout (e.g. "Et|(tt|)*30,tL" or "E|t*8|...|L") read as
    (transformer layers on each of the pp ranks, vpp). Stages are separated by "|" in virtual order
    (stage i runs on rank i % pp, chunk i // pp); "E" embedding, "L" loss, "t" a transformer layer,
    "m" an MTP layer (not counted); "x*n" and "(...)*n" repeat, commas are cosmetic. With `num_layers`, a
    layout that does not place exactly that many "t" is refused. Parsed by
    core/transformer/pipeline_parallel_layer_layout.py's PipelineParallelLayerLayout (Megatron's parser) with
    the planner's checks: MTP layers are not checked against a model here."""
    text = PipelineParallelLayerLayout.unroll_str(layout)
    bad = sorted(set(text) - set(CHAR_TO_LAYER_TYPE) - {"|"})
    if bad:
        raise ValueError(f"pipeline layout {layout!r}: unknown characters {bad}; use E (embedding), L (loss), "
                         "t (transformer layer), m (MTP layer), | between stages, x*n and (...)*n to repeat")
    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)  # [virtual stage][layer]: LayerTypes
    if len(stages) % pp:
        raise ValueError(f"pipeline layout {layout!r} has {len(stages)} stages, not a multiple of pp={pp}: "
                         "give pp x vpp stages separated by |")
    parsed = PipelineParallelLayerLayout(stages, pp)
    count = parsed.flatten_layout.count
    if (count(LayerType.embedding) != 1 or stages[0][:1] != [LayerType.embedding] or count(LayerType.loss) != 1
            or stages[-1][-1:] != [LayerType.loss]):
        raise ValueError(f"pipeline layout {layout!r}: the first stage must start with E (embedding) and the last "
                         "end with L (loss), each once")
    if num_layers is not None and count(LayerType.decoder) != num_layers:
        raise ValueError(f"pipeline layout {layout!r} places {count(LayerType.decoder)} transformer layers (t), the "
                         f"model has {num_layers}: add or remove t's so that the stages cover every layer once")
    per_rank = tuple(sum(parsed.get_num_layers_to_build(LayerType.decoder, vp, rank)
                         for vp in range(parsed.virtual_pipeline_model_parallel_size)) for rank in range(pp))
    return per_rank, parsed.virtual_pipeline_model_parallel_size


@dataclass
class Plan:
    layout: Layout
    num_microbatches: int
    memory: dict[str, float]  # bytes on the most loaded GPU: params, grads, optimizer, activations, total
    bubble: float  # (p - 1) / (v m)
    communication: dict[str, float] = field(default_factory=dict)  # bytes sent per GPU per step
    fits: bool = True
    time: step_time.StepTime | None = None  # the step's seconds by piece (step_time.step_time)

    @property
    def step_time(self) -> float:
        return self.time.total if self.time is not None else 0.0

    def row(self) -> str:
        gb = {k: v / GB for k, v in self.memory.items()}
        mfu = f"{self.time.mfu:>6.1%}" if self.time is not None else f"{'':>6}"
        return (f"{str(self.layout):<24} {self.num_microbatches:>4} {gb['params'] + gb['grads'] + gb['optimizer']:>8.1f} "
                f"{gb['activations']:>8.1f} {gb['total']:>8.1f} {self.bubble:>7.1%} "
                f"{sum(self.communication.values()) / GB:>8.1f} {self.step_time:>7.2f} {mfu}  {'yes' if self.fits else 'NO'}")


HEADER = (f"{'layout':<24} {'m':>4} {'W+G+O':>8} {'act':>8} {'total':>8} {'bubble':>7} {'comm':>8} {'step':>7} "
          f"{'MFU':>6}  fits")
UNITS = f"{'':<24} {'':>4} {'GB':>8} {'GB':>8} {'GB':>8} {'':>7} {'GB':>8} {'s':>7} {'':>6}"


def check_layout(model: ModelSpec, layout: Layout, train: Training) -> int:
    """Raise ValueError (saying what to change) if `layout` cannot run; return the micro-batch count."""
    t, p, c, d, e = layout.tp, layout.pp, layout.cp, layout.dp, layout.ep
    problems = []
    if t > train.gpus_per_node:
        problems.append(f"tp={t} spans nodes (gpus_per_node={train.gpus_per_node}): keep tensor parallel inside a node")
    if model.num_attention_heads % t or (model.kv_lora_rank is None and model.groups % t):
        problems.append(f"tp={t} must divide the {model.num_attention_heads} heads and {model.groups} query groups")
    stages = layout.pipeline_layout
    if stages is None and model.num_layers % (p * layout.vpp):
        problems.append(f"pp·vpp={p * layout.vpp} must divide the {model.num_layers} layers (or give uneven stages: "
                        "Layout(pipeline_layout=...), e.g. from parse_pipeline_layout)")
    if stages is not None and (len(stages) != p or sum(stages) != model.num_layers or min(stages) < 0):
        problems.append(f"pipeline_layout {tuple(stages)} must give the layers of each of the pp={p} ranks and add up "
                        f"to the model's {model.num_layers} layers (it has {len(stages)} ranks, {sum(stages)} layers)")
    if c > 1 and train.seq_length % (2 * c):
        problems.append(f"seq_length {train.seq_length} must be divisible by 2·cp={2 * c} (zigzag split)")
    if train.cp_comm_type not in step_time.CP_COMM_TYPES:
        problems.append(f"cp_comm_type {train.cp_comm_type!r} is unknown: use one of {', '.join(step_time.CP_COMM_TYPES)}")
    elif c > 1 and train.cp_comm_type in ("a2a", "a2a+p2p"):
        a = c if train.cp_comm_type == "a2a" else (train.hierarchical_context_parallel_sizes or (0, 0))[0]
        if train.cp_comm_type == "a2a+p2p" and (train.hierarchical_context_parallel_sizes is None
                                                or math.prod(train.hierarchical_context_parallel_sizes) != c):
            problems.append(f"cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes=(a2a, p2p) multiplying "
                            f"to cp={c}, got {train.hierarchical_context_parallel_sizes}")
        elif a and (model.num_attention_heads // t % a or max(1, model.groups // t) % a):
            problems.append(f"the a2a group of {a} must divide the {model.num_attention_heads // t} heads and "
                            f"{max(1, model.groups // t)} key/value groups per tp rank (all-to-all scatters heads): "
                            "choose a smaller a2a size, or p2p")
    try:
        step_time.fp8_recipe(train.fp8_recipe, step_time.hardware(train.hardware).gpu)
    except ValueError as err:
        problems.append(str(err))
    if model.num_experts is None and e > 1:
        problems.append(f"ep={e} needs a MoE model")
    if model.num_experts is not None and model.num_experts % e:
        problems.append(f"ep={e} must divide the {model.num_experts} experts")
    if (t * c * d) % (e * layout.etp):
        problems.append(f"ep·etp={e * layout.etp} must divide tp·cp·dp={t * c * d} (expert layers re-slice those ranks)")
    if train.global_batch_size % (train.micro_batch_size * d):
        problems.append(f"global batch {train.global_batch_size} must be divisible by micro batch × dp "
                        f"= {train.micro_batch_size * d}")
    if problems:
        raise ValueError(f"layout {layout} is not valid: " + "; ".join(problems))
    m = train.global_batch_size // (train.micro_batch_size * d)
    if layout.vpp > 1 and m % p:
        raise ValueError(f"layout {layout}: the interleaved schedule needs the {m} micro-batches to be a multiple of pp={p}")
    return m


def weight_memory(model: ModelSpec, layout: Layout, train: Training) -> dict[str, float]:
    """Bytes of params, grads and optimizer state on the first pipeline stage's GPU."""
    per_layer = model.layer_params()
    # EXERCISE planner.weight_memory: params held (dense / tp, experts / (ep·etp), embeddings / tp), then param, grad and optimizer bytes (optimizer sharded over its DP group with the distributed optimizer)
    ### BEGIN SOLUTION
    # HINT 1: The idea. Megatron keeps param_bytes (bf16), grad_bytes (fp32 main grads) and optimizer_bytes (Adam's
    #         fp32 copy, momentum, variance) for every parameter a GPU holds. The first stage holds its share of the
    #         layers, cut by tensor parallelism (dense weights) or expert parallelism (experts), and the embedding.
    # HINT 2: The approach. Count the parameters held: dense ÷ tp, experts ÷ (ep·etp), the embedding ÷ tp (and with a
    #         single stage also the final norm and an untied output layer). Params and grads: count × bytes. With
    #         the distributed optimizer, divide each kind's optimizer bytes by the group it is sharded over.
    # HINT 3: A pitfall: dense parameters are sharded over dp·cp, but experts over the expert-data-parallel group,
    #         tp·cp·dp / (ep·etp): the same GPUs, sliced differently.
    layers = model.num_layers / layout.pp
    dense = layers * per_layer["dense"] / layout.tp + model.embedding_params() / layout.tp
    if layout.pp == 1:  # the first stage is also the last: final norm (replicated) and an untied output layer
        dense += model.final_norm_params()
        if model.untie_embeddings_and_output_weights:
            dense += model.embedding_params() / layout.tp
    expert = layers * per_layer["expert"] / (layout.ep * layout.etp)
    dense_dp = layout.dp * layout.cp  # dense grads are reduced (and the optimizer sharded) over dp-cp
    expert_dp = layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)  # expert data parallel
    shard = (lambda n: 1) if not train.use_distributed_optimizer else (lambda n: n)
    params = dense + expert
    optimizer = train.optimizer_bytes * (dense / shard(dense_dp) + expert / shard(expert_dp))
    return {"params": train.param_bytes * params, "grads": train.grad_bytes * params, "optimizer": optimizer}
    ### END SOLUTION


def in_flight_microbatches(layout: Layout, num_microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (1F1B warmup depth).

    1F1B: min(m, p). Interleaved: p (1 + (p - 1)/(p v)), Megatron's interleaving penalty.
    """
    p, v = layout.pp, layout.vpp
    if v > 1:
        return p * (1 + (p - 1) / (p * v))
    return min(num_microbatches, p)


def activation_memory(model: ModelSpec, layout: Layout, train: Training, num_microbatches: int) -> float:
    """Bytes of activations on the first stage's GPU at its peak (Korthikanti Table 2 per layer)."""
    s, b, h, t = train.seq_length, train.micro_batch_size, model.hidden_size, layout.tp
    sp = train.sequence_parallel and t > 1
    if train.flash_attention and train.recompute == "none":
        # FlashAttention (and cuDNN's fused attention) never stores the s x s scores: without recomputation a layer
        # keeps what selective recomputation keeps (Korthikanti's Table 2 without its 5as²b term)
        train = dataclasses.replace(train, recompute="selective")
    # tokens go through topk (+ shared) experts: the MLP's ffn-wide tensors grow by that much
    ffn = model.ffn_hidden_size
    if model.num_experts is not None:
        moe_ffn = model.moe_router_topk * model.moe_ffn_hidden_size + (model.moe_shared_expert_intermediate_size or 0)
        ffn = (model.moe_first_dense_layers * ffn + model.num_moe_layers * moe_ffn) / model.num_layers
    # EXERCISE planner.activation_memory: layer bytes (calc, s/cp tokens) x layers of a stage x micro-batches in flight, plus the embedding's 8sb + sbh per micro-batch in flight
    ### BEGIN SOLUTION
    # HINT 1: The idea. The first stage keeps, for every micro-batch whose backward has not run yet, the activations
    #         of each of its layers (Korthikanti's Table 2, for the s/cp tokens this rank sees) and of the embedding
    #         (the int64 token ids and the dropout output).
    # HINT 2: The approach. calc.activation_memory_per_layer gives one layer's bytes (pass the context-parallel
    #         size); multiply by the stage's layers and by in_flight_microbatches; add 8 bytes + h elements per
    #         token for the embedding, per micro-batch in flight, split by tp under sequence parallelism.
    # HINT 3: A pitfall: 1F1B holds at most p micro-batches at once, not all m of the step.
    per_layer = calc.activation_memory_per_layer(s, b, h, model.num_attention_heads, t, sp, train.recompute,
                                                 ffn_hidden_size=ffn, context_parallel_size=layout.cp)
    in_flight = in_flight_microbatches(layout, num_microbatches)
    tokens = s / layout.cp * b
    embedding = (8 * tokens + tokens * h) * in_flight  # input ids (int64) and the embedding dropout mask
    total = per_layer * model.num_layers / layout.pp * in_flight + embedding / (t if sp else 1)
    ### END SOLUTION
    if layout.pp == 1:  # the output layer's input and the logits for the loss (Megatron's two forms)
        total += (4 * tokens * h * (1 + model.vocab_size / h) / t if sp
                  else 2 * (tokens * model.vocab_size / t + tokens * h))
    return total


def communication(model: ModelSpec, layout: Layout, train: Training, num_microbatches: int) -> dict[str, float]:
    """Bytes each GPU sends in one step, per kind of parallelism (ring algorithms, bf16 payloads).

        dp  gradient reduction (all-reduce, or reduce-scatter + param all-gather): 2 (d-1)/d x bytes
        tp  8 b s h (t-1)/t per layer and micro-batch (calc; the same with SP)
        cp  by cp_comm_type (calc.context_parallel_communication_per_layer): ring, all-gather, a2a, a2a+p2p
        ep  dispatch + combine all-to-all, forward and backward: 4 (ep-1)/ep x routed tokens x h
            (x moe_imbalance on the most loaded rank)
        pp  one activation forward and one gradient backward per micro-batch
    """
    s, b, h, m = train.seq_length / layout.cp, train.micro_batch_size, model.hidden_size, num_microbatches
    t, layers = layout.tp, model.num_layers / layout.pp
    per_layer = model.layer_params()
    ring = lambda n: 2 * (n - 1) / n
    dense_dp, expert_dp = layout.dp * layout.cp, layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)
    out = {
        "dp": BF16 * layers * (ring(dense_dp) * per_layer["dense"] / t
                               + ring(expert_dp) * per_layer["expert"] / (layout.ep * layout.etp)),
        "tp": calc.tensor_parallel_communication_per_layer(s, b, h, t) * layers * m,
        "cp": calc.context_parallel_communication_per_layer(
            train.seq_length, b, max(1, model.groups // t), model.head_dim, layout.cp,
            variant=train.cp_comm_type if layout.cp > 1 else "p2p", bytes_per_element=BF16, num_attention_heads=model.num_attention_heads // t,
            hierarchical_sizes=train.hierarchical_context_parallel_sizes)["total"] * layers * m,
        "ep": 0.0,
        "pp": 2 * s * b * h * BF16 / (t if train.sequence_parallel else 1) * m if layout.pp > 1 else 0.0,
    }
    if model.num_experts is not None:
        moe_layers = model.num_moe_layers / layout.pp
        routed = s * b / t * model.moe_router_topk * train.moe_imbalance  # SP: each tp rank routes its share
        out["ep"] = 4 * (layout.ep - 1) / layout.ep * routed * h * BF16 * moe_layers * m
    return out


def crosses_nodes(layout: Layout, train: Training) -> dict[str, bool]:
    """Whether each kind's groups span nodes, with Megatron's order tp-cp-ep-dp-pp (tp fastest):
    a group of size n whose ranks are `stride` apart spans stride * n consecutive ranks."""
    return step_time.spans_nodes(layout, train.gpus_per_node)


def fp8_weight_memory(model: ModelSpec, layout: Layout, train: Training) -> float:
    """Bytes of the fp8 weight copies (both layouts and their scales, step_time.FP8_RECIPES) that Transformer
    Engine keeps beside the bf16 params on the first stage's GPU: the layers' weights (the embedding, output
    layer, norms and router stay bf16). 0 without fp8."""
    recipe = step_time.fp8_recipe(train.fp8_recipe)
    if recipe is None:
        return 0.0
    per_layer = model.layer_params()
    layers = model.num_layers / layout.pp
    return recipe.weight_bytes * layers * (per_layer["dense"] / layout.tp + per_layer["expert"] / (layout.ep * layout.etp))


def first_stage_model(model: ModelSpec, layout: Layout) -> ModelSpec:
    """The model as the first pipeline rank sees it: with uneven stages (layout.pipeline_layout) its layer count
    made pp x the first rank's, so that the L/pp of the memory formulas is that rank's layers (a first rank with
    only the embedding is shown with the most layers any rank holds: an upper bound)."""
    if layout.pipeline_layout is None:
        return model
    first = layout.pipeline_layout[0] or max(layout.pipeline_layout)
    dense_share = model.moe_first_dense_layers / model.num_layers
    return dataclasses.replace(model, num_layers=first * layout.pp,
                               moe_first_dense_layers=round(dense_share * first * layout.pp))


def evaluate(model: ModelSpec, layout: Layout, train: Training) -> Plan:
    m = check_layout(model, layout, train)
    staged = first_stage_model(model, layout)
    memory = weight_memory(staged, layout, train)
    memory["fp8 weights"] = fp8_weight_memory(staged, layout, train)
    memory["activations"] = activation_memory(staged, layout, train, m)
    memory["total"] = sum(memory.values())
    bubble = bubble_fraction(layout.pp, m, layout.vpp) if layout.pp > 1 else 0.0
    comm = communication(model, layout, train, m)
    usable = train.memory_gb * GB * (1 - train.memory_headroom)
    return Plan(layout, m, memory, bubble, comm, fits=memory["total"] <= usable,
                time=step_time.step_time(model, layout, train))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(model: ModelSpec, num_gpus: int, train: Training, max_vpp: int = 1) -> list[Plan]:
    """Every valid layout of `num_gpus` (tp·pp·cp·dp = N; ep re-slices tp·cp·dp for expert layers); where the
    layers do not divide into pp·vpp stages, the uneven embedding_and_loss_layout when it exists."""
    plans = []
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            for cp in _divisors(num_gpus // (tp * pp)):
                dp = num_gpus // (tp * pp * cp)
                eps = [1] if model.num_experts is None else _divisors(model.num_experts)
                for ep in eps:
                    for vpp in range(1, max_vpp + 1) if pp > 1 else [1]:
                        # layers that do not divide into pp·vpp stages: the embedding and loss take a slot each
                        stages = (None if model.num_layers % (pp * vpp) == 0
                                  else embedding_and_loss_layout(model.num_layers, pp, vpp))
                        try:
                            plans.append(evaluate(model, Layout(tp, pp, cp, dp, ep, vpp=vpp, pipeline_layout=stages), train))
                        except ValueError:
                            continue
    return plans


def plan(model: ModelSpec, num_gpus: int, train: Training | None = None, max_vpp: int = 1) -> list[Plan]:
    """Valid layouts, best first: those that fit, then the shortest estimated step."""
    train = train or Training()
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive integer, got {num_gpus}")
    plans = enumerate_layouts(model, num_gpus, train, max_vpp)
    return sorted(plans, key=lambda p: (not p.fits, p.step_time))


def table(plans: list[Plan], top: int = 10) -> str:
    rows = [p.row() for p in plans[:top]]
    return "\n".join([HEADER, UNITS, "-" * len(HEADER), *rows])


def llama3_70b_on_64_gpus() -> tuple[Layout, Training]:
    """The course's exercise: a layout for LLaMA-3 70B on 64 GPUs of 80 GB (seq 8192, 512 sequences a step)."""
    train = Training(seq_length=8192, global_batch_size=512, micro_batch_size=1, gpu_memory_gb=80.0)
    # EXERCISE planner.llama3_70b_layout: choose tp, pp, cp, dp (product 64) that fits in 80 GB with a small bubble and a short step; justify it in a comment
    ### BEGIN SOLUTION
    # HINT 1: The idea. 70B parameters at 18 bytes each (fewer with the distributed optimizer) and 8k-token
    #         activations must be split until they fit in 80 GB, while the chattiest group, tensor parallel,
    #         stays inside one 8-GPU node and the pipeline bubble stays small.
    # HINT 2: The approach. Run planner.plan(LLAMA3_70B, 64, train) and read the step-time pieces of the best
    #         rows (planner.table, Plan.time.parts()): how much each layout loses to exposed TP communication,
    #         to the bubble, to data-parallel traffic. Check that tp·pp·cp·dp = 64.
    # HINT 3: A pitfall: tensor parallelism of 8 fits best but exposes four collectives per layer; context
    #         parallelism halves the activations with traffic that hides behind attention.
    # Re-derived with the step-time model (H100 DGX, SP, selective recomputation, overlapped DP): tp=4 keeps the
    # sequence-parallel all-gathers/reduce-scatters on NVLink and exposes half of tp=8's; cp=2 puts the pair of
    # tp groups of one node on one sequence (ring traffic hidden behind attention) and halves the activations;
    # pp=4 stages across nodes (only one activation per micro-batch crosses the network); dp=2 leaves m = 256
    # micro-batches, a 1F1B bubble of (p-1)/m = 1.2%. ~62 GB per GPU; NeMo's LLaMA-3 70B recipe uses the same
    # tp4·pp4·cp2 (with vpp 5).
    layout = Layout(tp=4, pp=4, cp=2, dp=2)
    ### END SOLUTION
    return layout, train
