"""How long one training step takes, from first principles — and why it is never "FLOPs / peak".

A step on one GPU is a sum of pieces a learner can check one at a time:

    step = m · t_mb                       compute: m micro-batches through the slowest pipeline stage
         + (p − 1)/v · t_mb               the pipeline bubble (interleaved: v model chunks per GPU)
         + exposed communication          what overlap cannot hide: DP grads/params, TP/SP, CP, EP, PP
         + optimizer                      Adam reads and writes every parameter it owns (memory-bound)

    t_mb = forward + backward (+ recompute) of the stage's layers, each layer being
           GEMMs            at a matmul efficiency that depends on the GEMM's shape (gemm_time)
           attention        the s×s scores: two batched GEMMs and the softmax in memory, or FlashAttention
           elementwise      norms, activations, dropout, residual adds: bytes / memory bandwidth
           + TP/SP, CP and EP collectives of that micro-batch that are on the critical path

Calibration is data, one record per GPU type (`GPU`) and per link (`Link`), each with its source;
nothing is tuned per run. A GEMM's efficiency is the GPU's best measured matmul efficiency (a published
benchmark) times the fraction of useful work in whole waves of whole output tiles (wave and tile
quantisation, Anthony et al. 2024, "The Case for Co-Designing Model Architectures with Hardware"),
capped by the memory roofline:

    gemm_time(m, n, k) = max(2mnk / (peak · best · sustained · useful), bytes / HBM bandwidth) + launch

Communication that Megatron overlaps (DP grad reduce and param gather when enabled, the CP ring,
TP with tp_comm_overlap, ZeRO-3's prefetch) is not free: compute beside it slows down, so
overlapped(comm, compute) = max(comm − compute, f · comm) is exposed. Which link a collective uses
follows Megatron's rank order tp-cp-ep-dp-pp (`spans_nodes`): a group inside one node runs on
NVLink, a group that spans nodes is bound by each GPU's own NIC.

What today's Megatron trains with (issue 39): FP8 per recipe (FP8_RECIPES: the weight GEMMs at the fp8
rate, the casts of their inputs, TE's fp8 weight copies), uneven pipeline stages (stage_layers: the slowest
rank sets the pace), CP by cp_comm_type (cp_layer_comm: p2p ring, all_gather, a2a, a2a+p2p), the EP
all-to-all overlapped with another micro-batch's compute and routing imbalance, and A100, H100, H200 and
B200 records, each with its datasheet. What a small-expert MoE layer pays beyond its FLOPs, each from the source
that runs it: the expert GEMMs as Transformer Engine runs them (grouped_gemm_time: one cuBLAS GEMM per expert,
4 streams side by side; fp8 operands, bf16 outputs in the roofline), the memory-bound token permutes (and the
alltoall dispatcher's sort by local expert), the router's fp32 scores, and the dispatcher's all-gather of token
counts and host sync before each all-to-all; every attention also streams RoPE and (Qwen3) q/k norms.

Calibrated on published runs (published_runs.all_runs, tests/test_step_time.py): Narayanan et al. 2021
Tables 1 and 2, Korthikanti et al. 2022 Table 5. Validated out of sample (published_runs.validation_runs,
tests/test_planner.py, benchmarks/planner_validation.py) on NVIDIA's Megatron-Bridge H100 and B200 tables.

API (stable; the laptop calibration builds its own Hardware on it):

    GPU(name, peak_flops, matmul_efficiency, num_sms, memory_bandwidth, memory_gb, memory_efficiency=0.85,
        sustained=0.9, overlap_slowdown=0.45, attention_efficiency=0.6, tiles=..., kernel_overhead=4e-6,
        source="", efficiency_curve=None)                  efficiency_curve: measured (m, n, k) -> fraction of peak
    Link(name, bandwidth, latency, efficiency=1.0, source="")   bytes/s each GPU sends, s per message step
    Hardware(name, gpu, intra_node, inter_node, gpus_per_node=8)
    hardware(name_or_Hardware) -> Hardware      known: HARDWARE; unknown -> ValueError naming the fields
    matmul_efficiency(m, n, k, gpu, batch=1) -> fraction of peak
    gemm_time(m, n, k, gpu, dtype_bytes=2, batch=1, out_bytes=None) -> s
    grouped_gemm_time(m, n, k, gpu, groups, dtype_bytes=2, out_bytes=None) -> s   experts, as TE runs them
    elementwise_time(nbytes, gpu) -> s
    attention_time(b, heads, s_q, s_kv, head_dim, gpu, *, flash, causal=True, value_dim=None) -> s (forward)
    collective_time(kind, nbytes, group_size, link) -> s    kind: all_reduce, all_gather,
                                                            reduce_scatter, all_to_all, send_recv
    overlapped(comm, compute, gpu) -> exposed s
    bubble(pp, num_microbatches, vpp=1) -> (p − 1)/(v m)
    fp8_recipe(name, gpu=None) -> FP8Recipe | None   unknown or unsupported recipe -> ValueError naming the known
    cp_layer_comm(model, layout, train, hw, attention) -> exposed s of one layer's CP traffic
    stage_layers(model, layout) -> layers on each pipeline rank
    step_time(model, layout, train, hw=None) -> StepTime: compute, recompute, bubble, comm{tp,cp,ep,pp,dp},
                                                optimizer, total, mfu, hfu, parts()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

BF16 = 2


# ---------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class GPU:
    """One GPU type: datasheet numbers and the measured fractions of them that training reaches."""

    name: str
    peak_flops: float  # dense 16-bit tensor-core FLOP/s (datasheet)
    matmul_efficiency: float  # the best fraction of peak a large, well-shaped GEMM reaches (measured)
    num_sms: int  # streaming multiprocessors: one wave runs one output tile on each
    memory_bandwidth: float  # HBM bytes/s (datasheet)
    memory_gb: float
    memory_efficiency: float = 0.85  # fraction of HBM bandwidth streaming kernels reach
    sustained: float = 0.9  # fraction of the short benchmark's matmul rate held through a long run (an estimate)
    # compute speed lost while a collective runs beside it: NCCL's thread blocks take SMs (one per
    # channel) and its copies take HBM bandwidth
    overlap_slowdown: float = 0.45
    # fraction of peak a fused (Flash) attention kernel reaches, forward and backward together:
    # FlashAttention-2 (Dao 2023) 50-73% on A100, FlashAttention-3 (Shah et al. 2024) up to 75% on H100
    attention_efficiency: float = 0.6
    tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128))  # cuBLAS output tiles
    kernel_overhead: float = 4e-6  # s between two kernels (launch, tail)
    source: str = ""
    # a measured curve instead of the wave model: (m, n, k) -> fraction of peak (e.g. a CPU's)
    efficiency_curve: Callable[[int, int, int], float] | None = None
    fp8_flops: float | None = None  # dense FP8 tensor-core FLOP/s (datasheet); None: no FP8 tensor cores
    fp8_recipes: tuple[str, ...] = ()  # the FP8 recipes (FP8_RECIPES) its tensor cores run natively

    @property
    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency


@dataclass(frozen=True)
class Link:
    """A path between GPUs: the bytes/s each GPU can send while it receives as much (line rate), the
    fraction of it NCCL's rings reach (their "bus bandwidth"), and the latency of one message step."""

    name: str
    bandwidth: float
    latency: float
    efficiency: float = 1.0
    source: str = ""

    @property
    def achievable_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Hardware:
    """A cluster: GPUs, the link inside a node (NVLink) and each GPU's path between nodes (its NIC)."""

    name: str
    gpu: GPU
    intra_node: Link
    inter_node: Link
    gpus_per_node: int = 8


_FRACTIONS = ("memory_efficiency 0.85 (streaming kernels reach ~85% of HBM), sustained 0.9 and overlap_slowdown "
              "0.45: estimates, chosen once against the published runs (published_runs.py), the same for every run")
A100_80GB = GPU(
    "A100-SXM4-80GB", peak_flops=312e12, matmul_efficiency=267.9 / 312, num_sms=108, memory_bandwidth=2.039e12,
    memory_gb=80.0,
    source="peak and HBM: NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 2,039 GB/s); best GEMM 267.9 TFLOP/s "
           "(85.9%, shape 6912x16384x2048): S. Bekman, ml-engineering, 'Maximum Achievable Matmul FLOPS' table; "
           + _FRACTIONS)
A100_40GB = dataclasses.replace(A100_80GB, name="A100-SXM4-40GB", memory_bandwidth=1.555e12, memory_gb=40.0,
                                source="as A100-80GB, HBM2 1,555 GB/s (NVIDIA A100 datasheet)")
H100_SXM = GPU(
    "H100-SXM5-80GB", peak_flops=989e12, matmul_efficiency=792.1 / 989, num_sms=132, memory_bandwidth=3.35e12,
    memory_gb=80.0, fp8_flops=1979e12, fp8_recipes=("delayed", "tensorwise", "blockwise"),
    source="peak and HBM: NVIDIA H100 datasheet (989 TFLOP/s bf16 dense, 1,979 fp8 dense: the datasheet's 1,979 "
           "and 3,958 'with sparsity', halved; 3.35 TB/s); best GEMM 792.1 TFLOP/s "
           "(80.1%, shape 6144x17920x2816): S. Bekman, ml-engineering, 'Maximum Achievable Matmul FLOPS' table; "
           "the fractions as A100's, the same best fraction for fp8 GEMMs (an assumption: not measured here)")
H200_SXM = dataclasses.replace(
    H100_SXM, name="H200-SXM-141GB", memory_bandwidth=4.8e12, memory_gb=141.0,
    source="NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s, bf16 1,979 and fp8 "
           "3,958 TFLOP/s with sparsity (989 and 1,979 dense), NVLink 900 GB/s; the same GH100 die as H100 (132 SMs), "
           "so H100's measured best GEMM fraction and estimated fractions (not validated on H200 runs)")
B200 = GPU(
    "B200-180GB", peak_flops=2250e12, matmul_efficiency=792.1 / 989, num_sms=148, memory_bandwidth=8.0e12,
    memory_gb=180.0, fp8_flops=4500e12, fp8_recipes=("delayed", "tensorwise", "mxfp8", "blockwise"),
    source="NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 8 GPUs, 1,440 GB HBM3e (180 GB each), "
           "64 TB/s (8 TB/s each), 72 PFLOP/s fp8 training with sparsity (4.5 dense per GPU); HGX B200 dense bf16 2,250 "
           "and fp8 4,500 TFLOP/s per GPU at 1,000 W (NVIDIA HGX B200 specifications); 148 SMs; best GEMM fraction "
           "taken from H100's (an assumption: no published B200 matmul table), the other fractions as A100's")
GPUS: dict[str, GPU] = {}  # filled below: every GPU type with a record

_NCCL = "; NCCL rings reach ~80% of NVLink and ~88% of an InfiniBand NIC's line rate (typical nccl-tests bus bandwidth)"
NVLINK3 = Link("NVLink 3 (A100)", bandwidth=300e9, latency=8e-6, efficiency=0.8,
               source="12 links x 25 GB/s = 300 GB/s per direction per GPU (NVIDIA A100 datasheet)" + _NCCL)
NVLINK4 = Link("NVLink 4 (H100)", bandwidth=450e9, latency=8e-6, efficiency=0.8,
               source="18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA H100 datasheet)" + _NCCL)
HDR_IB = Link("InfiniBand HDR, one 200 Gb/s NIC per GPU", bandwidth=25e9, latency=15e-6, efficiency=0.88,
              source="Selene / DGX A100: 8 x 200 Gb/s HDR compute NICs per node (Narayanan et al. 2021, Section 5)" + _NCCL)
NVLINK5 = Link("NVLink 5 (B200)", bandwidth=900e9, latency=8e-6, efficiency=0.8,
               source="18 links x 50 GB/s = 900 GB/s per direction per GPU, 1.8 TB/s both ways (NVIDIA DGX B200 "
                      "datasheet: 14.4 TB/s aggregate over 8 GPUs)" + _NCCL)
NDR_IB = Link("InfiniBand NDR, one 400 Gb/s NIC per GPU", bandwidth=50e9, latency=15e-6, efficiency=0.88,
              source="DGX H100: 8 x 400 Gb/s NDR ConnectX-7 per node (NVIDIA DGX H100 datasheet)" + _NCCL)

HARDWARE: dict[str, Hardware] = {hw.name: hw for hw in (
    Hardware("A100-80GB (Selene)", A100_80GB, NVLINK3, HDR_IB),
    Hardware("A100-40GB (DGX A100)", A100_40GB, NVLINK3, HDR_IB),
    Hardware("H100-SXM (DGX H100)", H100_SXM, NVLINK4, NDR_IB),
    Hardware("H200-SXM (DGX H200)", H200_SXM, dataclasses.replace(NVLINK4, name="NVLink 4 (H200)"), NDR_IB),
    Hardware("B200 (DGX B200)", B200, NVLINK5, dataclasses.replace(
        NDR_IB, source="DGX B200: 8 x 400 Gb/s ConnectX-7 per node (NVIDIA DGX B200 datasheet)" + _NCCL)),
)}
GPUS.update({hw.gpu.name: hw.gpu for hw in HARDWARE.values()})


def hardware(spec: str | Hardware) -> Hardware:
    """A Hardware from its name in HARDWARE (or itself); a clear error for a GPU type without calibration."""
    if isinstance(spec, Hardware):
        return spec
    if spec in HARDWARE:
        return HARDWARE[spec]
    gpu_fields = ", ".join(f.name for f in fields(GPU) if f.name not in ("name", "source"))
    raise ValueError(
        f"no calibration for hardware {spec!r}; known: {', '.join(HARDWARE)} (GPU types: {', '.join(GPUS)}). "
        f"Pass one of these names as Training(hardware=...), or, to model another GPU, build "
        f"Hardware(name, GPU(name, {gpu_fields}), intra_node=Link(name, bandwidth, latency, efficiency), "
        f"inter_node=Link(...), gpus_per_node) from its datasheet and a measured matmul curve, and pass it instead")


# ------------------------------------------------------------------------------------ compute pieces
def matmul_efficiency(m: int, n: int, k: int, gpu: GPU, batch: int = 1) -> float:
    """Fraction of peak a [m, k] x [k, n] GEMM (`batch` of them) reaches when compute-bound.

    The GPU computes the output in tiles (tm x tn), one per SM per wave; the last wave and the
    tiles hanging over the matrix edge do wasted work. cuBLAS picks the tile that wastes least:

        useful = m n batch / (ceil(tiles / SMs) · SMs · tm · tn),   efficiency = best · useful
    """
    if gpu.efficiency_curve is not None:
        return gpu.efficiency_curve(m, n, k)
    useful = 0.0
    for tm, tn in gpu.tiles:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / gpu.num_sms)
        useful = max(useful, m * n * batch / (waves * gpu.num_sms * tm * tn))
    return gpu.matmul_efficiency * gpu.sustained * useful


def gemm_time(m: int, n: int, k: int, gpu: GPU, dtype_bytes: int = BF16, batch: int = 1,
              out_bytes: int | None = None) -> float:
    """Seconds for `batch` GEMMs [m, k] x [k, n]: compute- or memory-bound (the roofline), plus a launch.
    The inputs are `dtype_bytes` per element, the output `out_bytes` (default the same; an fp8 GEMM writes bf16)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    out = dtype_bytes if out_bytes is None else out_bytes
    compute = 2 * m * n * k * batch / (gpu.peak_flops * matmul_efficiency(m, n, k, gpu, batch))
    memory = batch * (dtype_bytes * (m * k + k * n) + out * m * n) / gpu.achievable_bandwidth
    return max(compute, memory) + gpu.kernel_overhead


# TE's grouped GEMM (nvte_multi_tensor_gemm, transformer_engine/common/gemm/cublaslt_gemm.cu) runs one cuBLAS GEMM
# per expert, spread round-robin over nvte_get_num_compute_streams() = 4 streams (common/util/multi_stream.cpp);
# its CUTLASS grouped kernel is used only on Hopper and only with NVTE_USE_CUTLASS_GROUPED_GEMM=1 (off by default)
TE_COMPUTE_STREAMS = 4


def grouped_gemm_time(m: int, n: int, k: int, gpu: GPU, groups: int, dtype_bytes: int = BF16,
                      out_bytes: int | None = None) -> float:
    """Seconds for `groups` same-shaped expert GEMMs as TE runs them: rounds of TE_COMPUTE_STREAMS GEMMs side by
    side (each round's tiles share the SMs in waves, each GEMM its own launch), the last round partly filled."""
    full, rest = divmod(groups, TE_COMPUTE_STREAMS)
    one = gemm_time(m, n, k, gpu, dtype_bytes, batch=min(groups, TE_COMPUTE_STREAMS), out_bytes=out_bytes)
    return full * one + (gemm_time(m, n, k, gpu, dtype_bytes, batch=rest, out_bytes=out_bytes) if rest and full else
                         one if rest else 0.0)


def elementwise_time(nbytes: float, gpu: GPU) -> float:
    """Seconds to stream `nbytes` through HBM (norms, activations, dropout, softmax: memory-bound)."""
    return nbytes / gpu.achievable_bandwidth


# bytes read + written per element by Megatron's fused memory-bound kernels (16-bit tensors, 1-byte masks)
NORM_BYTES = 4  # read x, write y
BIAS_DROPOUT_ADD_BYTES = 7  # read x and the residual, write y and the dropout mask
ACTIVATION_BYTES = {False: 4, True: 6}  # bias-GeLU: read, write; SwiGLU: read two halves, write
SOFTMAX_DROPOUT_BYTES = 9  # fused scale-mask-softmax (read, write) + attention dropout (read, write, mask)
ROPE_BYTES = 4  # RoPE on q and k: read, write (per element of q and k); the same for q/k layernorm (Qwen3)
# the router's fp32 scores [tokens, experts]: softmax (read, write), top-k (read), aux loss (read the scores and
# the 1-byte routing map) -- moe_router_dtype fp32, Megatron's TopKRouter (moe/router.py)
ROUTER_BYTES = 4 + 4 + 4 + 4 + 1
# each routed copy of a token: permute (gather: read, write), unpermute (read, then weight by its probability and
# sum into the token's output: write), in bf16 -- moe_permute_fusion's fused kernels (moe/moe_utils.py)
PERMUTE_BYTES = 2 * BF16 + 2 * BF16
BACKWARD_FACTOR = 2.0  # backward does twice the forward's matmul work and memory traffic
FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention's backward also recomputes the scores it never stored


def attention_time(b: int, heads: int, s_q: int, s_kv: int, head_dim: int, gpu: GPU, *, flash: bool,
                   causal: bool = True, value_dim: int | None = None) -> float:
    """One forward of the attention core (q kᵀ, softmax, probabilities x v) for `heads` heads on one GPU.

    Unfused (Megatron 2021-22): two batched GEMMs whose [s_q, s_kv] scores go through HBM, and the
    fused softmax + dropout over them; the causal mask is applied, not skipped. FlashAttention keeps
    the scores on chip: its time is the GEMM FLOPs (half of them with a causal mask) at the fraction of
    peak fused attention kernels reach (`attention_efficiency`).
    """
    dv = value_dim or head_dim
    if flash:
        flops = 2 * b * heads * s_q * s_kv * (head_dim + dv) * (0.5 if causal else 1.0)
        return flops / (gpu.peak_flops * gpu.attention_efficiency * gpu.sustained) + gpu.kernel_overhead
    scores = gemm_time(s_q, s_kv, head_dim, gpu, batch=b * heads)  # [s_q, d] x [d, s_kv] per head
    softmax = elementwise_time(SOFTMAX_DROPOUT_BYTES * b * heads * s_q * s_kv, gpu)
    values = gemm_time(s_q, dv, s_kv, gpu, batch=b * heads)  # [s_q, s_kv] x [s_kv, dv] per head
    return scores + softmax + values


# ------------------------------------------------------------------------------------ FP8 training
@dataclass(frozen=True)
class FP8Recipe:
    """What one of Megatron's `--fp8-recipe`s costs: the weight GEMMs (TE's Linear / GroupedLinear layers: qkv,
    proj, fc1, fc2, experts; not the router, the attention core or the output layer, which stay bf16) run at the
    GPU's fp8 rate, and every GEMM input is quantised first.

    cast_bytes     HBM bytes per element to quantise a bf16 tensor: read 2, write the fp8 copy 1 and the
                   transposed / column-wise copy 1 (the backward GEMMs need the other layout), plus the scales;
                   current scaling reads the tensor once more for its amax
    weight_bytes   bytes per parameter of the fp8 copies of the weights TE keeps (both layouts + scales),
                   beside the bf16 params
    gemm_efficiency fraction of the fp8 GEMM rate kept (blockwise: the 1x128 / 128x128 scales are applied inside
                   the GEMM's main loop on Hopper — an estimate, not a measurement)
    """

    name: str
    megatron: str  # the flags
    cast_bytes: float
    weight_bytes: float
    gemm_efficiency: float = 1.0


FP8_RECIPES: dict[str, FP8Recipe] = {r.name: r for r in (
    FP8Recipe("delayed", "--fp8-format hybrid --fp8-recipe delayed", cast_bytes=2 + 1 + 1, weight_bytes=2.0),
    FP8Recipe("tensorwise", "--fp8-format e4m3 --fp8-recipe tensorwise", cast_bytes=2 + 2 + 1 + 1, weight_bytes=2.0),
    FP8Recipe("mxfp8", "--fp8-format e4m3 --fp8-recipe mxfp8", cast_bytes=2 + 1 + 1 + 2 / 32,
              weight_bytes=2 + 2 / 32),  # one E8M0 byte per 32 elements, row-wise and column-wise
    FP8Recipe("blockwise", "--fp8-format e4m3 --fp8-recipe blockwise", cast_bytes=2 + 1 + 1 + 2 * 4 / 128,
              weight_bytes=2 + 2 * 4 / (128 * 128), gemm_efficiency=0.9),  # fp32 scales: 1x128 data, 128x128 weights
)}


def fp8_recipe(name: str | None, gpu: GPU | None = None) -> FP8Recipe | None:
    """The FP8Recipe named `name` (None: bf16 training), refused clearly when unknown or when `gpu` cannot run it."""
    if name is None:
        return None
    if name not in FP8_RECIPES:
        raise ValueError(f"unknown fp8_recipe {name!r}: use one of {', '.join(FP8_RECIPES)} (Megatron's --fp8-recipe), "
                         "or None for bf16")
    if gpu is not None and (gpu.fp8_flops is None or name not in gpu.fp8_recipes):
        runs = f"it runs {', '.join(gpu.fp8_recipes)}" if gpu.fp8_recipes else "it has no fp8 tensor cores"
        raise ValueError(f"fp8_recipe {name!r} does not run on {gpu.name} ({runs}): choose another recipe, another "
                         "GPU (mxfp8 needs Blackwell's block-scaled tensor cores), or fp8_recipe=None")
    return FP8_RECIPES[name]


# ------------------------------------------------------------------------------------ communication
def collective_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective of `nbytes` (the full tensor: the all-reduced tensor, the gathered
    output, the scattered input; for send_recv the message) among `group_size` ranks, ring algorithms:

        all_reduce        2 (n−1)/n · bytes / bw + 2 (n−1) · latency
        all_gather,       (n−1)/n · bytes / bw + (n−1) · latency
        reduce_scatter
        all_to_all        (n−1)/n · bytes / bw + latency      (every pair exchanges at once, one round)
        send_recv         bytes / bw + latency
    """
    n = group_size
    if kind == "send_recv":
        return nbytes / link.achievable_bandwidth + link.latency
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    if kind not in kinds:
        raise ValueError(f"collective kind must be one of {', '.join([*kinds, 'send_recv'])}, got {kind!r}")
    if n <= 1:
        return 0.0
    wire = (n - 1) / n * nbytes / link.achievable_bandwidth
    if kind == "all_to_all":
        return wire + link.latency
    steps = 2 if kind == "all_reduce" else 1
    return steps * (wire + (n - 1) * link.latency)


def overlapped(comm: float, compute: float, gpu: GPU) -> float:
    """Exposed seconds of `comm` launched beside `compute`. While both run, compute loses
    `overlap_slowdown` f of its speed, so the pair takes max(comm, compute + f·comm):

        exposed = max(comm − compute, f · comm)       (f = 0: perfect overlap, max(0, comm − compute))
    """
    return max(comm - compute, gpu.overlap_slowdown * comm)


def bubble(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Pipeline bubble over ideal compute time: (p − 1)/(v·m) (Narayanan et al. 2021, Section 2.2)."""
    return (pp - 1) / (vpp * num_microbatches) if pp > 1 else 0.0


# --------------------------------------------------------------------------------------- the step
@dataclass
class StepTime:
    """One step's seconds on the slowest GPU, by piece, and what they mean for utilisation."""

    compute: float  # forward + backward of all micro-batches (the model's own work)
    recompute: float  # the extra forward work of activation recomputation
    bubble: float  # pipeline fill and drain
    comm: dict[str, float] = field(default_factory=dict)  # exposed (not hidden) seconds per kind
    optimizer: float = 0.0
    model_flops: float = 0.0  # per step, whole model, all GPUs (Megatron's count: no recompute)
    hardware_flops: float = 0.0  # model_flops + recomputed FLOPs
    num_gpus: int = 1
    peak_flops: float = 1.0
    per_microbatch: dict[str, float] = field(default_factory=dict)  # the stage's seconds per micro-batch

    @property
    def exposed_comm(self) -> float:
        return sum(self.comm.values())

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.exposed_comm + self.optimizer

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total * self.num_gpus * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.total * self.num_gpus * self.peak_flops)

    def parts(self) -> dict[str, float]:
        """Seconds per piece, for a stacked bar: compute, recompute, bubble, then each exposed kind."""
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                **{f"{k} comm": v for k, v in self.comm.items()}, "optimizer": self.optimizer}


def _gemms_per_layer(model, layout, tokens: int, moe: bool, imbalance: float = 1.0) -> list[tuple[int, int, int, int]]:
    """(m, n, k, batch) of one layer's weight GEMMs on one GPU, forward. Tensor parallel splits n (column-
    parallel: qkv, fc1) or k (row-parallel: proj, fc2); expert GEMMs see the tokens routed to this GPU (times
    `imbalance`, the most loaded rank's tokens over the mean). The router is the MoE layer's third GEMM."""
    h, t = model.hidden_size, layout.tp
    if model.kv_lora_rank is None:
        q, kv = model.num_attention_heads * model.head_dim, 2 * model.groups * model.head_dim
        gemms = [(tokens, (q + kv) // t, h, 1), (tokens, h, q // t, 1)]  # linear_qkv, linear_proj
    else:  # multi-latent attention: all its projections as one GEMM of the same weights
        gemms = [(tokens, round(model.attention_params() / h / t), h, 1)]
    gate = 2 if model.swiglu else 1
    if not moe:
        return gemms + [(tokens, gate * model.ffn_hidden_size // t, h, 1), (tokens, h, model.ffn_hidden_size // t, 1)]
    # MoE: this GPU's share of the tokens (sequence parallel), top-k copies each, spread over the experts;
    # it holds num_experts/ep experts, each sliced by etp (which gathers etp ranks' tokens)
    local_experts = model.num_experts // layout.ep
    routed = max(1, int(tokens // t * model.moe_router_topk * layout.etp * layout.ep * imbalance // model.num_experts))
    ffn = model.moe_ffn_hidden_size // layout.etp
    gemms += [(tokens // t, model.num_experts, h, 1),  # router
              (routed, gate * ffn, h, local_experts), (routed, h, ffn, local_experts)]
    if model.moe_shared_expert_intermediate_size:
        shared = model.moe_shared_expert_intermediate_size
        gemms += [(tokens, gate * shared // t, h, 1), (tokens, h, shared // t, 1)]
    return gemms


def _layer_forward(model, layout, train, hw: Hardware, moe: bool) -> dict[str, float]:
    gpu, t, b = hw.gpu, layout.tp, train.micro_batch_size
    s_q = train.seq_length // layout.cp
    tokens = b * s_q
    imbalance = getattr(train, "moe_imbalance", 1.0)
    gemms = _gemms_per_layer(model, layout, tokens, moe, imbalance)
    recipe = fp8_recipe(getattr(train, "fp8_recipe", None), gpu)
    quantised = [i for i in range(len(gemms)) if not (moe and i == (1 if model.kv_lora_rank is not None else 2))]
    if recipe is None:
        quantised = []
    fp8_gpu = None if recipe is None else dataclasses.replace(gpu, peak_flops=gpu.fp8_flops * recipe.gemm_efficiency)

    def one(i, m, n, k, batch):  # the GEMM at the fp8 rate (1-byte operands, bf16 output) or bf16; experts grouped
        args = (fp8_gpu, 1, BF16) if i in quantised else (gpu, BF16, BF16)
        if batch > 1:
            return grouped_gemm_time(m, n, k, args[0], batch, dtype_bytes=args[1], out_bytes=args[2])
        return gemm_time(m, n, k, args[0], dtype_bytes=args[1], out_bytes=args[2])

    gemm = sum(one(i, m, n, k, batch) for i, (m, n, k, batch) in enumerate(gemms))
    # backward of Y[m, n] = X[m, k] W[k, n]: dX = dY Wᵀ (m, k, n) and dW = Xᵀ dY (k, n, m), which
    # accumulates into the fp32 main_grad (read + write 8 bytes per weight)
    gemm_bwd = sum(one(i, m, k, n, batch) + one(i, k, n, m, batch) + elementwise_time(8 * k * n * batch, gpu)
                   for i, (m, n, k, batch) in enumerate(gemms))
    # fp8: every quantised GEMM casts its input X [m, k] forward and dY [m, n] backward; weights once per step
    cast = cast_bwd = weights = 0.0
    if recipe is not None:
        cast = elementwise_time(recipe.cast_bytes * sum(gemms[i][0] * gemms[i][2] * gemms[i][3] for i in quantised), gpu)
        cast_bwd = elementwise_time(recipe.cast_bytes * sum(gemms[i][0] * gemms[i][1] * gemms[i][3] for i in quantised), gpu)
        weights = elementwise_time(recipe.cast_bytes * sum(gemms[i][1] * gemms[i][2] * gemms[i][3] for i in quantised), gpu)
    heads = model.num_attention_heads // t
    if model.kv_lora_rank is None:
        d, dv = model.head_dim, model.head_dim
    else:
        d, dv = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    attention = attention_time(b, heads, s_q, train.seq_length, d, gpu, flash=train.flash_attention, value_dim=dv)
    sp = t if train.sequence_parallel and t > 1 else 1
    h = model.hidden_size
    if not moe:
        ffn_elements, permute = tokens * model.ffn_hidden_size / t, 0.0
    else:
        routed = tokens / t * model.moe_router_topk * imbalance
        ffn_elements = routed * model.moe_ffn_hidden_size + tokens * (model.moe_shared_expert_intermediate_size or 0) / t
        permute = PERMUTE_BYTES * routed * h + ROUTER_BYTES * tokens / t * model.num_experts
        if layout.ep > 1 and model.num_experts // layout.ep > 1:  # alltoall dispatcher: sort_chunks_by_idxs after the
            permute += PERMUTE_BYTES * routed * h  # dispatch (by local expert) and back before the combine
    # q and k of this GPU's heads: RoPE rotates them (MLA: only the rope part), qk_layernorm normalises them
    qk = tokens * (heads + max(1, model.groups // t)) * d if model.kv_lora_rank is None \
        else tokens * (heads + 1) * model.qk_pos_emb_head_dim
    qk_bytes = ROPE_BYTES * qk * ((model.position_embedding_type == "rope") + model.qk_layernorm)
    elementwise = elementwise_time(
        (2 * NORM_BYTES + 2 * BIAS_DROPOUT_ADD_BYTES) * tokens * h / sp
        + ACTIVATION_BYTES[model.swiglu] * ffn_elements + permute + qk_bytes, gpu)
    return {"gemm": gemm + cast, "gemm_backward": gemm_bwd + cast_bwd, "attention": attention,
            "elementwise": elementwise, "core_attention": 0.0 if train.flash_attention else attention,
            "fp8_cast": cast + cast_bwd, "fp8_weight_cast": weights}


def layer_forward(model, layout, train, hw: Hardware) -> dict[str, float]:
    """Seconds of one layer's forward for one micro-batch on one GPU (averaged over dense and MoE layers):
    'gemm' (and 'gemm_backward', its two backward GEMMs), 'attention', 'elementwise', and 'core_attention'
    (what selective recomputation redoes: the attention core, unless FlashAttention)."""
    moe_share = model.num_moe_layers / model.num_layers
    parts = [(share, _layer_forward(model, layout, train, hw, moe))
             for moe, share in ((False, 1 - moe_share), (True, moe_share)) if share]
    return {k: sum(share * f[k] for share, f in parts) for k in parts[0][1]}


def spans_nodes(layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether each kind's groups span nodes, in Megatron's rank order tp-cp-ep-dp-pp (tp fastest): a
    group of n ranks that are `stride` apart covers stride · n consecutive ranks. "dp" is the dp-cp
    group gradients are reduced over; expert layers order their ranks etp-ep-edp-pp."""
    stride = {"tp": 1, "cp": layout.tp, "dp": layout.tp, "pp": layout.tp * layout.cp * layout.dp, "ep": layout.etp}
    size = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp * layout.cp, "pp": layout.pp, "ep": layout.ep}
    return {k: stride[k] * size[k] > gpus_per_node for k in stride}


def _link(kind: str, layout, hw: Hardware) -> Link:
    """NVLink when the kind's group stays inside a node, else each GPU's NIC."""
    return hw.inter_node if spans_nodes(layout, hw.gpus_per_node)[kind] else hw.intra_node


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _hierarchical_cp(train, cp: int) -> tuple[int, int]:
    """(a2a size, p2p size) of cp_comm_type "a2a+p2p": Megatron's hierarchical_context_parallel_sizes."""
    sizes = getattr(train, "hierarchical_context_parallel_sizes", None)
    if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != cp:
        raise ValueError(f'cp_comm_type "a2a+p2p" needs hierarchical_context_parallel_sizes=(a2a, p2p) with a2a·p2p = '
                         f"cp = {cp}, got {sizes!r}")
    return sizes


def cp_layer_comm(model, layout, train, hw: Hardware, attention: float) -> float:
    """Exposed seconds of one layer's context-parallel communication, forward + backward, one micro-batch, for
    Megatron's cp_comm_type (TE's attention with CP; K/V carry max(1, groups/tp) heads):

        p2p         ring: cp−1 K/V blocks forward, K/V + dK/dV backward, each hidden behind one block of attention
        all_gather  all-gather K/V forward, again backward (TE keeps only the local K/V), reduce-scatter dK/dV:
                    before the attention that needs them, so exposed
        a2a         Ulysses: all-to-alls of q, k, v and the output forward (sequence gathered, heads scattered), of
                    dO, dQ, dK, dV backward: on the critical path
        a2a+p2p     a2a inside groups of a (the fast link), then a ring over p = cp/a of the gathered s/p tokens
    """
    b, t, cp, s = train.micro_batch_size, layout.tp, layout.cp, train.seq_length
    hd = model.head_dim if model.kv_lora_rank is None else model.qk_head_dim + model.qk_pos_emb_head_dim
    heads, groups = model.num_attention_heads // t, max(1, model.groups // t)
    kind = getattr(train, "cp_comm_type", "p2p")
    link = _link("cp", layout, hw)

    def ring(n: int, tokens: int, kv_heads: int, block: float) -> float:
        hop = collective_time("send_recv", BF16 * 2 * b * tokens * kv_heads * hd, 2, link)
        return (n - 1) * (overlapped(hop, block, hw.gpu) + overlapped(2 * hop, BACKWARD_FACTOR * block, hw.gpu))

    def ulysses(n: int, tokens: int) -> float:  # q + k + v + out (and their gradients) of `tokens` on this rank
        per = BF16 * b * tokens * hd
        return 2 * collective_time("all_to_all", per * (2 * heads + 2 * groups), n, link)

    if kind == "p2p":
        return ring(cp, s // cp, groups, attention / cp)
    if kind == "all_gather":
        kv = BF16 * 2 * b * s * groups * hd  # the gathered K/V
        return 2 * collective_time("all_gather", kv, cp, link) + collective_time("reduce_scatter", kv, cp, link)
    if kind == "a2a":
        return ulysses(cp, s // cp)
    if kind == "a2a+p2p":
        a, p = _hierarchical_cp(train, cp)
        inner = dataclasses.replace(layout, cp=a)  # the a2a group: neighbouring ranks
        one = ulysses(a, s // cp) if a > 1 else 0.0
        if a > 1 and spans_nodes(inner, hw.gpus_per_node)["cp"] != spans_nodes(layout, hw.gpus_per_node)["cp"]:
            one *= hw.intra_node.achievable_bandwidth / link.achievable_bandwidth  # a2a group inside the node
        return one + (ring(p, s // p, max(1, groups // a), attention / p) if p > 1 else 0.0)
    raise ValueError(f"unknown cp_comm_type {kind!r}: use one of {', '.join(CP_COMM_TYPES)} (Megatron's --cp-comm-type)")


def layer_comm(model, layout, train, hw: Hardware, fwd: dict[str, float]) -> dict[str, float]:
    """Exposed seconds of one layer's collectives for one micro-batch, forward + backward (+ recompute).

    tp  2 all-reduces forward and 2 backward of [s b, h] (SP: all-gather + reduce-scatter, the same
        volume); on the critical path unless tp_comm_overlap hides them under the layer's GEMMs
    cp  cp_layer_comm: the ring hidden behind attention, all-gather and a2a exposed
    ep  token dispatch and combine all-to-alls, forward and backward, of the most loaded rank's tokens
        (moe_imbalance x the mean); with overlap_moe_expert_parallel_comm Megatron runs one micro-batch's
        all-to-all beside another micro-batch's computation, so only what outlasts that layer's compute shows
    """
    b, t, cp = train.micro_batch_size, layout.tp, layout.cp
    tokens = b * train.seq_length // cp
    h = model.hidden_size
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0}
    if t > 1:
        kind = "all_gather" if train.sequence_parallel else "all_reduce"
        one = collective_time(kind, BF16 * tokens * h, t, _link("tp", layout, hw))
        if train.sequence_parallel:  # each all-reduce becomes an all-gather + a reduce-scatter
            one *= 2
        passes = 2 + (1 if train.recompute == "full" else 0)  # forward, backward, (recomputed forward)
        comm = 2 * one * passes
        if train.tp_comm_overlap:  # userbuffers: the collectives run in chunks under the GEMMs
            comm = overlapped(comm, fwd["gemm"] + fwd["gemm_backward"], hw.gpu)
        out["tp"] = comm
    if cp > 1:
        out["cp"] = cp_layer_comm(model, layout, train, hw, fwd["attention"])
    if model.num_experts is not None and layout.ep > 1 and model.num_moe_layers:
        routed = BF16 * tokens // t * model.moe_router_topk * h * getattr(train, "moe_imbalance", 1.0)
        share = model.num_moe_layers / model.num_layers  # per layer, averaged like layer_forward
        link = _link("ep", layout, hw)
        comm = 4 * collective_time("all_to_all", routed, layout.ep, link)
        # the dispatcher's preprocess all-gathers each rank's tokens per expert (int64) and copies the splits to the
        # host before the all-to-all (token_dispatcher.py: cuda_sync_point "before_ep_alltoall"): the GPU drains and
        # waits for the host to launch the next kernels -- a latency, once per layer forward
        comm += collective_time("all_gather", 8 * model.num_experts * layout.ep, layout.ep, link) + 2 * hw.gpu.kernel_overhead
        if getattr(train, "overlap_moe_expert_parallel_comm", False):
            compute = fwd["gemm"] + fwd["gemm_backward"] + (1 + BACKWARD_FACTOR) * (fwd["attention"] + fwd["elementwise"])
            comm = overlapped(comm, compute, hw.gpu)
        out["ep"] = share * comm
    return out


def forward_flops(model, seq_length: int) -> dict[str, float]:
    """Matmul FLOPs of one sequence's forward, by part: the layers' weights (2 per weight per token, active
    experts only), the attention core (q kᵀ and probabilities x v over the full s x s square, Megatron's
    convention) and the logit layer."""
    s, h, L = seq_length, model.hidden_size, model.num_layers
    attention = model.attention_params()
    dense_mlp = model.mlp_params(model.ffn_hidden_size)
    moe_layers = model.num_moe_layers
    if moe_layers:
        moe_mlp = (model.moe_router_topk * model.mlp_params(model.moe_ffn_hidden_size)
                   + model.mlp_params(model.moe_shared_expert_intermediate_size or 0) + model.num_experts * h)
    else:
        moe_mlp = 0.0
    weights = (L - moe_layers) * (attention + dense_mlp) + moe_layers * (attention + moe_mlp)
    # multi-token prediction (DeepSeek-V3): each MTP module is a projection [2h -> h], one more layer and the logits
    mtp = getattr(model, "mtp_num_layers", 0)
    weights += mtp * (2 * h * h + attention + (moe_mlp if moe_layers else dense_mlp))
    if model.kv_lora_rank is None:
        qk = v = model.head_dim
    else:
        qk, v = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    return {"layers": 2 * weights * s, "attention": 2 * s * s * model.num_attention_heads * (qk + v) * (L + mtp),
            "logits": 2 * model.vocab_size * h * s * (1 + mtp)}


def model_flops(model, train, num_sequences: int) -> float:
    """Forward + backward (3x the forward) over `num_sequences`: Megatron's model FLOPs, which for GPT
    are Korthikanti et al. 2022, Eq. 7: 72 B s l h² (1 + s/(6h) + V/(12 h l))."""
    return 3 * sum(forward_flops(model, train.seq_length).values()) * num_sequences


def recomputed_flops(model, train, num_sequences: int) -> float:
    """FLOPs activation recomputation adds: the layers' forward ("full") or the attention core's
    forward ("selective", unless FlashAttention, which never stored the scores)."""
    f = forward_flops(model, train.seq_length)
    extra = {"full": f["layers"] + f["attention"], "none": 0.0,
             "selective": 0.0 if train.flash_attention else f["attention"]}[train.recompute]
    return extra * num_sequences


def stage_layers(model, layout) -> list[int | float]:
    """Transformer layers on each pipeline rank: layout.pipeline_layout (uneven stages, e.g. parsed from
    Megatron's --pipeline-model-parallel-layout by planner.parse_pipeline_layout) or L/p on every rank."""
    given = getattr(layout, "pipeline_layout", None)
    if given is None:
        return [model.num_layers / layout.pp] * layout.pp
    return list(given)


def step_time(model, layout, train, hw: Hardware | str | None = None) -> StepTime:
    """The step's seconds on the slowest GPU (the last pipeline stage: its layers and the logit layer).
    The layout is taken as valid (planner.check_layout says why one is not)."""
    hw = hardware(hw if hw is not None else train.hardware)
    gpu, t, p, v = hw.gpu, layout.tp, layout.pp, layout.vpp
    m, rest = divmod(train.global_batch_size, train.micro_batch_size * layout.dp)  # micro-batches per step
    if rest or not m:
        raise ValueError(f"global batch {train.global_batch_size} is not a whole number of micro-batches "
                         f"({train.micro_batch_size}) times dp={layout.dp}")
    stages = stage_layers(model, layout)  # layers on each pipeline rank (all its virtual chunks)
    fwd = layer_forward(model, layout, train, hw)
    layer_fwd = fwd["gemm"] + fwd["attention"] + fwd["elementwise"]
    attention_bwd = (FLASH_BACKWARD_FACTOR if train.flash_attention else BACKWARD_FACTOR) * fwd["attention"]
    layer_bwd = fwd["gemm_backward"] + BACKWARD_FACTOR * fwd["elementwise"] + attention_bwd
    recompute = {"full": layer_fwd, "selective": fwd["core_attention"], "none": 0.0}[train.recompute]
    tokens = train.micro_batch_size * train.seq_length // layout.cp
    logits = gemm_time(tokens, model.vocab_size // t, model.hidden_size, gpu) * (1 + BACKWARD_FACTOR) \
        + elementwise_time(3 * 4 * tokens * model.vocab_size / t, gpu)  # fp32 softmax cross-entropy
    comm = layer_comm(model, layout, train, hw, fwd)
    # the last rank also runs the output layer + loss, and the MTP modules (DeepSeek-V3's multi-token prediction:
    # a [2h -> h] projection, one more layer and the logits again, each), as Megatron places them
    mtp = getattr(model, "mtp_num_layers", 0)
    head = logits * (1 + mtp) + mtp * gemm_time(tokens, model.hidden_size, 2 * model.hidden_size, gpu) * (1 + BACKWARD_FACTOR)
    # the slowest rank: its layers (+ the MTP layers and the head on the last one)
    per_rank = [(n + (mtp if r == p - 1 else 0)) * (layer_fwd + layer_bwd + recompute + sum(comm.values()))
                + (head if r == p - 1 else 0.0) for r, n in enumerate(stages)]
    slowest = max(range(p), key=lambda r: (per_rank[r], r))
    layers = stages[slowest] + (mtp if slowest == p - 1 else 0)
    mb_compute = layers * (layer_fwd + layer_bwd) + (head if slowest == p - 1 else 0.0)
    mb_recompute = layers * recompute
    mb_comm = {k: layers * c for k, c in comm.items()}
    t_mb = mb_compute + mb_recompute + sum(mb_comm.values())
    exposed = {k: m * c for k, c in mb_comm.items()}

    # pipeline: one activation forward and one gradient backward per micro-batch and model chunk,
    # scattered over the tp ranks (Narayanan 2021, Section 4.1) and received before the stage can run
    exposed["pp"] = 0.0
    if p > 1:
        hop = collective_time("send_recv", BF16 * tokens * model.hidden_size / t, 2, _link("pp", layout, hw))
        exposed["pp"] = 2 * m * v * hop

    exposed["dp"] = _data_parallel(model, layout, train, hw, m, mb_compute / (1 + BACKWARD_FACTOR), t_mb)
    optimizer = elementwise_time(ADAM_BYTES_PER_PARAM * _optimizer_params(model, layout, train), gpu)
    fp8_weights = layers * fwd["fp8_weight_cast"]  # TE quantises the weights once per step (first micro-batch)

    sequences = train.global_batch_size
    flops = model_flops(model, train, sequences)
    return StepTime(compute=m * mb_compute + fp8_weights, recompute=m * mb_recompute, bubble=bubble(p, m, v) * m * t_mb,
                    comm=exposed, optimizer=optimizer, model_flops=flops,
                    hardware_flops=flops + recomputed_flops(model, train, sequences),
                    num_gpus=layout.world_size, peak_flops=_peak(gpu, train),
                    per_microbatch={"compute": mb_compute, "recompute": mb_recompute, **mb_comm})


def _peak(gpu: GPU, train) -> float:
    """The peak MFU is measured against: the fp8 rate when the GEMMs run in fp8, else the 16-bit rate."""
    recipe = fp8_recipe(getattr(train, "fp8_recipe", None), gpu)
    return gpu.fp8_flops if recipe is not None else gpu.peak_flops


ADAM_BYTES_PER_PARAM = 4 * 4 + 3 * 4 + 2  # read fp32 param, grad, m, v; write param, m, v; write the bf16 copy


def _params_on_gpu(model, layout) -> tuple[float, float]:
    """(dense, expert) parameters on a GPU of the first stage: its layers' dense weights / tp, its experts
    / (ep·etp), the word embedding / tp."""
    per_layer, layers = model.layer_params(), max(stage_layers(model, layout))
    dense = layers * per_layer["dense"] / layout.tp + model.embedding_params() / layout.tp
    return dense, layers * per_layer["expert"] / (layout.ep * layout.etp)


def _optimizer_params(model, layout, train) -> float:
    """Parameters this GPU's Adam updates: all it holds, or its shard with the distributed optimizer
    (dense parameters over dp·cp, experts over the expert-data-parallel group tp·cp·dp/(ep·etp))."""
    dense, expert = _params_on_gpu(model, layout)
    if train.use_distributed_optimizer or train.zero_stage == 3:
        dense /= layout.dp * layout.cp
        expert /= layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)
    return dense + expert


def _data_parallel(model, layout, train, hw: Hardware, m: int, mb_forward: float, t_mb: float) -> float:
    """Exposed seconds of data-parallel communication.

    Megatron: one gradient all-reduce (distributed optimizer: reduce-scatter, then an all-gather of the
    updated bf16 params) per step over dp·cp. overlap_grad_reduce hides it behind the last micro-batch's
    backward, overlap_param_gather behind the next step's first forward. ZeRO-3 (zero_stage=3, as
    DeepSpeed): every micro-batch gathers the params for its forward (and recomputed forward) and its
    backward and reduce-scatters its grads, prefetched under that micro-batch's compute.
    """
    d = layout.dp * layout.cp
    if d == 1:
        return 0.0
    link = _link("dp", layout, hw)
    params = sum(_params_on_gpu(model, layout))
    if train.zero_stage == 3:
        gathers = 2 + (1 if train.recompute == "full" else 0)
        per_mb = (gathers * collective_time("all_gather", train.param_bytes * params, d, link)
                  + collective_time("reduce_scatter", train.grad_bytes * params, d, link))
        return m * overlapped(per_mb, t_mb, hw.gpu)
    backward = BACKWARD_FACTOR * mb_forward
    if train.use_distributed_optimizer:
        grads = collective_time("reduce_scatter", train.grad_bytes * params, d, link)
        gather = collective_time("all_gather", train.param_bytes * params, d, link)
    else:
        grads, gather = collective_time("all_reduce", train.grad_bytes * params, d, link), 0.0
    if train.overlap_grad_reduce:
        grads = overlapped(grads, backward, hw.gpu)
    if train.overlap_param_gather:
        gather = overlapped(gather, mb_forward, hw.gpu)
    return grads + gather
