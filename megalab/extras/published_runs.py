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

All runs: A100-SXM4-80GB on Selene (8 GPUs and 8 HDR NICs a node), GPT with V = 51,200, s = 2048,
LayerNorm, GeLU MLP of 4h, learned positions, tied embeddings, 16-bit, no FlashAttention (2021-22).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalab.extras import calc, step_time
from megalab.extras.planner import Layout, ModelSpec, Training

SELENE = "A100-80GB (Selene)"
VOCAB, SEQ = 51200, 2048


def gpt(billions: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(f"GPT {billions:g}B", layers, hidden, heads, 4 * hidden, VOCAB, swiglu=False,
                     normalization="LayerNorm", untie_embeddings_and_output_weights=False)


@dataclass(frozen=True)
class PublishedRun:
    source: str  # paper, table, row
    model: ModelSpec
    layout: Layout
    train: Training
    published: dict[str, float]  # "TFLOP/s per GPU" (Narayanan), "MFU %" and "HFU %" (Korthikanti)

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
                          normalization="LayerNorm", untie_embeddings_and_output_weights=False)
        train = Training(seq_length=SEQ, global_batch_size=batch, micro_batch_size=mbs, sequence_parallel=True,
                         recompute="selective", use_distributed_optimizer=False, hardware=SELENE,
                         flash_attention=False, overlap_grad_reduce=False, overlap_param_gather=False)
        runs.append(PublishedRun(f"Korthikanti et al. 2022, Table 5, {name} column", model,
                                 Layout(tp=t, pp=p, dp=gpus // (t * p)), train, {"MFU %": mfu, "HFU %": hfu}))
    return runs


def all_runs() -> list[PublishedRun]:
    return narayanan_table_1() + narayanan_table_2() + korthikanti_table_5()


def predict(run: PublishedRun) -> dict[str, float]:
    """The published metrics from the predicted step time, each with the paper's own FLOP count:
    Narayanan's Eq. 3 (with the recomputed forward), Korthikanti's model FLOPs (Eq. 7) and hardware
    FLOPs (calc.korthikanti_hardware_flops)."""
    t = step_time.step_time(run.model, run.layout, run.train)
    m, tr = run.model, run.train
    args = (tr.global_batch_size, tr.seq_length, m.num_layers, m.hidden_size, m.vocab_size)
    gpus, peak = run.layout.world_size, step_time.hardware(tr.hardware).gpu.peak_flops
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
            rows.append({"source": run.source, "model": run.model.name, "layout": str(run.layout), "metric": metric,
                         "published": published, "predicted": predicted[metric],
                         "error": predicted[metric] / published - 1})
    return rows


def validation_table(rows: list[dict] | None = None) -> str:
    rows = rows if rows is not None else validation_rows()
    head = f"{'source':<46} {'model':<11} {'layout':<22} {'metric':<16} {'published':>9} {'predicted':>9} {'error':>7}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['source']:<46} {r['model']:<11} {r['layout']:<22} {r['metric']:<16} {r['published']:>9.1f} "
              f"{r['predicted']:>9.1f} {r['error']:>+7.1%}" for r in rows]
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"{len(rows)} published figures, largest error {worst:.1%}")
    return "\n".join(lines)
