"""Published training runs the step-time model must reproduce: configurations and measured figures,
each with its table and row.

    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM" (SC'21, arXiv 2104.04473):
        Table 1   weak scaling, 1.7B to 1T parameters on up to 3,072 A100s: achieved TFLOP/s per GPU,
                  counted with Eq. 3 (which includes the recomputed forward pass). Micro-batch sizes,
                  virtual pipeline stages and DDP kind from the authors' scripts, Megatron-LM
                  examples/academic_paper_scripts/sc21/run_table_1.sh; all rows recompute every layer ("uniform").
        Table 2   175B and 530B, DeepSpeed ZeRO-3 without model parallelism vs PTD parallelism (t=8;
                  p=12 for 175B, p=35 for 530B): achieved TFLOP/s per GPU.
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
        (MLSys'23, arXiv 2205.05198):
        Table 5   model and hardware FLOPs utilisation (MFU, HFU) with sequence parallelism and
                  selective recomputation, data-parallel size 1; configurations from its Table 3.

These runs: A100-SXM4-80GB on Selene (8 GPUs and 8 HDR NICs a node), GPT with V = 51,200, s = 2048,
LayerNorm, GeLU MLP of 4h, learned positions, tied embeddings, 16-bit, no FlashAttention (2021-22).
They are the CALIBRATION set: the step-time model's estimated fractions were chosen against them.

The VALIDATION set (split="validation", never used to choose anything in the model) is NVIDIA's
Megatron-Bridge performance summary, tables of the 25.11 and 26.02 NeMo containers:
    https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/0a25f911b2ed6c6905a539504fdb8e5b40e3438b/docs/performance-summary-archive.md
    (also https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html)
every DGX-H100 and DGX-B200 row whose model the planner can describe: LLaMA-3 8B / 70B, LLaMA-3.1 405B,
Qwen3 30B-A3B and 235B-A22B (dense and MoE, FP8 current scaling and MXFP8; GB200/GB300/B300 systems,
GPT-OSS (sliding-window attention), DeepSeek-V3 (MTP) and the 25.09 rows (no precision given) left out).
Metric: "Tokens / sec / GPU". What a row does not give is our reading, the same for every row: sequence
parallelism with tp > 1, the distributed optimizer with overlapped grad reduce and param gather, TP
communication overlap with tp > 1, FlashAttention without recomputation, the ring for CP, balanced experts
("we force-balance the token distribution among experts", the table's note: moe_imbalance 1), no EP overlap
(but for the H100 Qwen3 235B-A22B rows, whose recipe overlaps it: _RECIPE_SETTINGS),
FSDP > 0 as ZeRO-3, and uneven stages where the layers do not divide: the embedding and the loss each take
one layer's slot (Megatron's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split), e.g. LLaMA-3.1 405B's 126
layers over pp 8 x vpp 8 as 15, 16 x 6, 15 per rank. "FP8" (26.02, H100) is read as FP8-CS, the name the
25.11 table gives the same H100 runs.

What the model still misses (the validation table, stated, not tuned away): the small-expert Qwen3 30B-A3B
runs take 2.2-3.2x the predicted step on both GPUs, Qwen3 235B-A22B on B200 1.6-1.8x (on H100, where the
inter-node all-to-all dominates, within 3%), and LLaMA-3 8B on B200 runs 21-28% slower than predicted. The
modelled MoE mechanisms (the permutes and the dispatcher's sort, the router, TE's per-expert GEMMs, the
dispatcher's host sync, RoPE and q/k norms) moved the MoE families' mean error from +86% to +68% (H100) and from
+182% to +142% (B200), the dense ones by about a point. The likely causes of the rest:
host time -- a fine-grained MoE layer launches hundreds of small kernels (routing, permutes, per-expert fp8
quantisation and GEMMs, forward and backward), and Megatron's MoE guide (megatron/core/transformer/moe/README.md,
"CPU Overhead Bottleneck") names exactly this and CUDA graphs of attn / moe_router / moe_preprocess as its cure;
the planner has no cited per-launch host cost, so it models none. But on H100 the 30B-A3B time scales with the
tokens (micro-batch 2 in 25.11 and 1 in 26.02 give the same tokens/s), which launch overhead alone would not do:
GPU kernels far below the roofline at these shapes (768-wide experts, 2,048 tokens each) are as likely. On B200,
the best GEMM fraction is H100's (no published B200 matmul table), which the 8B rows suggest is too high.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalab.extras import calc, step_time
from megalab.extras.planner import Layout, ModelSpec, Training, embedding_and_loss_layout

SELENE = "A100-80GB (Selene)"
VOCAB, SEQ = 51200, 2048


def gpt(billions: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(f"GPT {billions:g}B", layers, hidden, heads, 4 * hidden, VOCAB, swiglu=False,
                     normalization="LayerNorm", untie_embeddings_and_output_weights=False,
                     position_embedding_type="learned_absolute")


@dataclass(frozen=True)
class PublishedRun:
    source: str  # paper, table, row
    model: ModelSpec
    layout: Layout
    train: Training
    published: dict[str, float]  # "TFLOP/s per GPU" (Narayanan), "MFU %" / "HFU %" (Korthikanti), "tokens/s per GPU"
    split: str = "calibration"  # "calibration": the model's estimates were chosen against it; "validation": never
    family: str = "A100 dense BF16/FP16"  # for the per-family error table

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.layout}"


def _narayanan_train(batch: int, micro_batch: int, overlapped_ddp: bool, zero3: bool = False) -> Training:
    """2021 Megatron: fp16, full recomputation, no SP, unfused attention, fp16 gradients all-reduced
    (torch DDP overlaps them with backward, Megatron's "local" DDP reduces after it)."""
    return Training(seq_length=SEQ, global_batch_size=batch, micro_batch_size=micro_batch, sequence_parallel=False,
                    recompute="full", use_distributed_optimizer=False, grad_bytes=2, hardware=SELENE,
                    flash_attention=False, overlap_grad_reduce=overlapped_ddp, overlap_param_gather=False,
                    zero_stage=3 if zero3 else 0)


# (params B, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s) from Table 1; (micro-batch, layers per
# virtual stage or None, DDP) from run_table_1.sh
_TABLE_1 = [
    ((1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (16, None, "torch")),
    ((3.6, 32, 3072, 30, 2, 1, 64, 512, 138), (16, None, "torch")),
    ((7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (16, None, "torch")),
    ((18.4, 48, 6144, 40, 8, 1, 256, 1024, 135), (8, None, "torch")),
    ((39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (4, None, "local")),
    ((76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140), (2, 5, "local")),
    ((145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (2, 5, "local")),
    ((310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155), (1, 3, "local")),
    ((529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1, 1, "local")),
    ((1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163), (1, None, "local")),
]


def narayanan_table_1() -> list[PublishedRun]:
    runs = []
    for row, ((billions, heads, hidden, layers, t, p, gpus, batch, tflops), (mbs, per_chunk, ddp)) in enumerate(_TABLE_1, 1):
        vpp = layers // p // per_chunk if per_chunk else 1
        layout = Layout(tp=t, pp=p, dp=gpus // (t * p), vpp=vpp)
        runs.append(PublishedRun(f"Narayanan et al. 2021, Table 1, row {row}", gpt(billions, heads, hidden, layers),
                                 layout, _narayanan_train(batch, mbs, ddp == "torch"), {"TFLOP/s per GPU": tflops}))
    return runs


# (scheme, params B, model-parallel size, batch, GPUs, micro-batch, TFLOP/s) — Table 2, rows in order
_TABLE_2 = [
    ("ZeRO-3", 174.6, 1, 1536, 384, 4, 144), ("ZeRO-3", 174.6, 1, 1536, 768, 2, 88),
    ("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44),
    ("ZeRO-3", 529.6, 1, 2560, 640, 4, 138), ("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98),
    ("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48),
    ("PTD-P", 174.6, 96, 1536, 384, 1, 153), ("PTD-P", 174.6, 96, 1536, 768, 1, 149),
    ("PTD-P", 174.6, 96, 1536, 1536, 1, 141),
    ("PTD-P", 529.6, 280, 2240, 560, 1, 171), ("PTD-P", 529.6, 280, 2240, 1120, 1, 167),
    ("PTD-P", 529.6, 280, 2240, 2240, 1, 159),
]
_GPT_175B, _GPT_530B = (96, 12288, 96), (128, 20480, 105)


def narayanan_table_2() -> list[PublishedRun]:
    runs = []
    for row, (scheme, billions, mp, batch, gpus, mbs, tflops) in enumerate(_TABLE_2, 1):
        model = gpt(billions, *(_GPT_175B if billions < 200 else _GPT_530B))
        if scheme == "ZeRO-3":
            layout, train = Layout(dp=gpus), _narayanan_train(batch, mbs, True, zero3=True)
        else:
            layout, train = Layout(tp=8, pp=mp // 8, dp=gpus // mp), _narayanan_train(batch, mbs, False)
        runs.append(PublishedRun(f"Narayanan et al. 2021, Table 2, row {row} ({scheme})", model, layout, train,
                                 {"TFLOP/s per GPU": tflops}))
    return runs


# (name, heads, hidden, layers, t, p, GPUs, batch, micro-batch) — Korthikanti Table 3; (MFU %, HFU %) — Table 5
_KORTHIKANTI = [
    (("22B", 64, 6144, 48, 8, 1, 8, 4, 4), (41.5, 43.7)),
    (("175B", 96, 12288, 96, 8, 8, 64, 64, 1), (51.4, 52.8)),
    (("530B", 128, 20480, 105, 8, 35, 280, 280, 1), (56.0, 57.0)),
    (("1T", 160, 25600, 128, 8, 64, 512, 512, 1), (56.3, 57.0)),
]


def korthikanti_table_5() -> list[PublishedRun]:
    """Micro-batch sizes (the 22B's whole batch of 4 at once, 1 for the pipelined models) and the
    non-interleaved schedule are our reading: Table 3 lists neither."""
    runs = []
    for (name, heads, hidden, layers, t, p, gpus, batch, mbs), (mfu, hfu) in _KORTHIKANTI:
        model = ModelSpec(f"GPT {name}", layers, hidden, heads, 4 * hidden, VOCAB, swiglu=False,
                          normalization="LayerNorm", untie_embeddings_and_output_weights=False,
                          position_embedding_type="learned_absolute")
        train = Training(seq_length=SEQ, global_batch_size=batch, micro_batch_size=mbs, sequence_parallel=True,
                         recompute="selective", use_distributed_optimizer=False, hardware=SELENE,
                         flash_attention=False, overlap_grad_reduce=False, overlap_param_gather=False)
        runs.append(PublishedRun(f"Korthikanti et al. 2022, Table 5, {name} column", model,
                                 Layout(tp=t, pp=p, dp=gpus // (t * p)), train, {"MFU %": mfu, "HFU %": hfu}))
    return runs


# ------------------------------------------------------------------------------ the validation set
BRIDGE = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/0a25f911b2ed6c6905a539504fdb8e5b40e3438b/docs/performance-summary-archive.md"
# LLaMA-3.1 405B (Meta's config.json: 126 layers, h 16384, 128 heads, 8 kv groups, ffn 53248, vocab 128256)
LLAMA31_405B = ModelSpec("LLaMA-3.1 405B", 126, 16384, 128, 53248, 128256, num_query_groups=8, kv_channels=128)
# Qwen3 MoE (Qwen's config.json): every layer MoE, 128 experts, top-8, head_dim 128, untied embeddings, RoPE,
# q_norm / k_norm (Megatron's qk_layernorm)
QWEN3_30B_A3B = ModelSpec("Qwen3 30B-A3B", 48, 2048, 32, 6144, 151936, num_query_groups=4, kv_channels=128,
                          num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, qk_layernorm=True)
QWEN3_235B_A22B = ModelSpec("Qwen3 235B-A22B", 94, 4096, 64, 12288, 151936, num_query_groups=4, kv_channels=128,
                            num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536, qk_layernorm=True)
H100, B200 = "H100-SXM (DGX H100)", "B200 (DGX B200)"
_RECIPE = {"FP8-CS": "tensorwise", "FP8": "tensorwise", "FP8-MX": "mxfp8", "MXFP8": "mxfp8"}


# (container, system, model, GPUs, precision, GBS, MBS, seq, FSDP, TP, PP, CP, VP, EP, tokens/s/GPU) -- the
# table's columns in its order (25.11 tables: "System: DGX-..." sections; 26.02: "Model: ..." sections)
_BRIDGE_ROWS = [
    ("25.11", H100, "LLAMA3_8B", 8, "FP8-CS", 128, 1, 8192, 8, 1, 1, 1, None, 1, 14451),
    ("25.11", H100, "LLAMA3_70B", 64, "FP8-CS", 128, 1, 8192, 0, 4, 8, 1, 5, 1, 1602),
    ("25.11", H100, "LLAMA3.1_405B", 1024, "FP8-CS", 512, 1, 8192, 0, 8, 8, 2, 8, 1, 292),
    ("25.11", H100, "Qwen3_30B_a3B", 16, "FP8-CS", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 5275),
    ("25.11", H100, "Qwen3_235B_a22B", 256, "FP8-CS", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 1575),
    ("25.11", B200, "LLAMA3_8B", 8, "FP8-CS", 128, 2, 8192, 0, 1, 1, 1, None, 1, 30624),
    ("25.11", B200, "LLAMA3_8B", 8, "FP8-MX", 128, 2, 8192, 0, 1, 1, 1, None, 1, 29521),
    ("25.11", B200, "LLAMA3.1_405B", 128, "FP8-CS", 64, 1, 8192, 0, 4, 8, 2, 8, 1, 661),
    ("25.11", B200, "LLAMA3.1_405B", 128, "FP8-MX", 64, 1, 8192, 0, 4, 8, 2, 8, 1, 624),
    ("25.11", B200, "Qwen3_30B_a3B", 8, "FP8-MX", 512, 1, 4096, 0, 1, 1, 1, None, 8, 9299),
    ("25.11", B200, "Qwen3_235B_a22B", 64, "FP8-MX", 1024, 1, 4096, 0, 1, 8, 1, 2, 8, 3269),
    ("26.02", H100, "LLAMA3_70B", 64, "FP8", 256, 1, 8192, 0, 4, 8, 1, 5, None, 1621),
    ("26.02", H100, "LLAMA3.1_405B", 1024, "FP8", 1536, 1, 8192, 0, 8, 8, 2, 8, None, 311),
    ("26.02", H100, "Qwen3_30B_a3B", 16, "FP8", 1024, 1, 4096, 0, 1, 2, 1, 12, 8, 5113),
    ("26.02", H100, "Qwen3_235B_a22B", 256, "FP8", 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 1633),
    ("26.02", B200, "Qwen3_30B_a3B", 8, "MXFP8", 512, 1, 4096, 0, 1, 1, 1, None, 8, 9691),
    ("26.02", B200, "Qwen3_235B_a22B", 256, "MXFP8", 8192, 1, 4096, 0, 1, 8, 1, None, 8, 3805),
]


# Settings a row does not show, from its recipe (Megatron-Bridge scripts/performance/configs/qwen/
# qwen3_workload_base_configs.py at 01b2977e518f0a58ec870daba2fb2c04d76a91b2: QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V1,
# tp 2, pp 8, vpp 4, ep 32 as the rows, moe_a2a_overlap=True, i.e. --overlap-moe-expert-parallel-comm)
_RECIPE_SETTINGS = {(H100, "Qwen3_235B_a22B"): {"overlap_moe_expert_parallel_comm": True}}
# The other MoE rows' recipes in the same file do not overlap it: QWEN3_235B_A22B_PRETRAIN_CONFIG_B200_FP8_CS_V1
# (= _FP8_MX_V1) and QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 set moe_a2a_overlap=False, the B200 30B-A3B
# configs leave the default. EP's link follows the row's layout (step_time.spans_nodes): the H100 235B-A22B's
# ep 32 spans 4 nodes (InfiniBand), every other row's ep 8 stays inside a node (NVLink). All MoE rows are modelled
# with Megatron's alltoall dispatcher (its permutes, sort by local expert and host sync): scripts/performance/
# configs/qwen/qwen3_llm_pretrain.py sets "alltoall" for 235B-A22B on H100 and B200 but "flex" (HybridEP, which
# fuses the permutes into the dispatch) for 30B-A3B; the 30B-A3B rows' layouts (pp 2 on H100) are not those of
# that file's configs, so which dispatcher they ran is not known.


def megatron_bridge_tables() -> list[PublishedRun]:
    from megalab.extras.planner import LLAMA3_8B, LLAMA3_70B

    models = {"LLAMA3_8B": LLAMA3_8B, "LLAMA3_70B": LLAMA3_70B, "LLAMA3.1_405B": LLAMA31_405B,
              "Qwen3_30B_a3B": QWEN3_30B_A3B, "Qwen3_235B_a22B": QWEN3_235B_A22B}
    runs = []
    for (container, system, name, gpus, precision, gbs, mbs, seq, fsdp, tp, pp, cp, vp, ep, tokens) in _BRIDGE_ROWS:
        model, vpp = models[name], vp or 1
        layout = Layout(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), ep=ep or 1, vpp=vpp,
                        pipeline_layout=None if model.num_layers % (pp * vpp) == 0
                        else embedding_and_loss_layout(model.num_layers, pp, vpp))
        train = Training(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs, sequence_parallel=tp > 1,
                         recompute="selective", hardware=system, fp8_recipe=_RECIPE[precision],
                         tp_comm_overlap=tp > 1, zero_stage=3 if fsdp else 0,
                         **_RECIPE_SETTINGS.get((system, name), {}))
        section = f"System: {system.split()[-1][:-1]}" if container == "25.11" else f"Model: {name}"
        family = f"{system.split()[0].split('-')[0]} {'MoE' if model.num_experts else 'dense'} FP8"
        runs.append(PublishedRun(f"Megatron-Bridge perf. summary, {container} container, {section}, {name} "
                                 f"{gpus} GPUs {precision} row", model, layout, train, {"tokens/s per GPU": tokens},
                                 split="validation", family=family))
    return runs


def all_runs() -> list[PublishedRun]:
    """The calibration set (the A100 papers' runs): what the model's estimated fractions were chosen against."""
    return narayanan_table_1() + narayanan_table_2() + korthikanti_table_5()


def validation_runs() -> list[PublishedRun]:
    """The validation set: published runs the model was never tuned on (split="validation")."""
    return megatron_bridge_tables()


def predict(run: PublishedRun) -> dict[str, float]:
    """The published metrics from the predicted step time, each with the paper's own FLOP count:
    Narayanan's Eq. 3 (with the recomputed forward), Korthikanti's model FLOPs (Eq. 7) and hardware
    FLOPs (calc.korthikanti_hardware_flops)."""
    t = step_time.step_time(run.model, run.layout, run.train)
    m, tr = run.model, run.train
    args = (tr.global_batch_size, tr.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
    gpus, peak = run.layout.world_size, step_time.hardware(tr.hardware).gpu.peak_flops
    if "tokens/s per GPU" in run.published:
        return {"tokens/s per GPU": tr.global_batch_size * tr.seq_length / t.total / gpus}
    per_gpu = {
        "TFLOP/s per GPU": calc.flops_per_iteration(*args, recompute=True) / t.total / gpus / 1e12,
        "MFU %": 100 * calc.flops_per_iteration(*args, recompute=False) / t.total / gpus / peak,
        "HFU %": 100 * calc.korthikanti_hardware_flops(*args) / t.total / gpus / peak,
    }
    return {k: per_gpu[k] for k in run.published}


def validation_rows(runs: list[PublishedRun] | None = None) -> list[dict]:
    """One row per published figure: source, model, layout, metric, published, predicted, error."""
    rows = []
    for run in runs or all_runs():
        predicted = predict(run)
        for metric, published in run.published.items():
            rows.append({"source": run.source, "split": run.split, "family": run.family,
                         "precision": run.train.fp8_recipe or "bf16/fp16",
                         "model": run.model.name, "layout": str(run.layout), "metric": metric,
                         "published": published, "predicted": predicted[metric],
                         "error": predicted[metric] / published - 1})
    return rows


def family_errors(rows: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """{(split, family): {"runs", "mean", "largest"}}: the figures' count, mean signed and largest |error|."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        out.setdefault((r["split"], r["family"]), []).append(r["error"])
    return {k: {"runs": len(e), "mean": sum(e) / len(e), "largest": max(map(abs, e))} for k, e in sorted(out.items())}


def family_table(rows: list[dict]) -> str:
    """The per-family error table: calibration and validation apart."""
    head = f"{'split':<12} {'family':<24} {'figures':>7} {'mean error':>11} {'largest |error|':>16}"
    lines = [head, "-" * len(head)]
    lines += [f"{split:<12} {family:<24} {e['runs']:>7} {e['mean']:>+11.1%} {e['largest']:>16.1%}"
              for (split, family), e in family_errors(rows).items()]
    return "\n".join(lines)


def validation_table(rows: list[dict] | None = None) -> str:
    rows = rows if rows is not None else validation_rows()
    head = f"{'source':<46} {'model':<11} {'layout':<22} {'metric':<16} {'published':>9} {'predicted':>9} {'error':>7}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['source']:<46} {r['model']:<11} {r['layout']:<22} {r['metric']:<16} {r['published']:>9.1f} "
              f"{r['predicted']:>9.1f} {r['error']:>+7.1%}" for r in rows]
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"{len(rows)} published figures, largest error {worst:.1%}")
    return "\n".join(lines)
