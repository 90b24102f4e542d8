"""The course's own runs, predicted by the calibrated cost model and measured: predicted, measured, ratio.

One case per notebook section "Predicted vs measured" (01·03 all-reduce, 03·01 DDP step, 03·05 TP step,
03·07 1F1B and interleaved, 03·08 CP ring attention, 03·09 MoE all-to-all, 06·04 recompute), each
re-running that notebook's measured run at its sizes in one launch of 4 gloo ranks. The calibration
(extras/calibrate.py: matmul FLOP/s, gloo alpha and beta) is measured afresh first unless --cached.
Run it on a quiet machine: `python benchmarks/predicted_vs_measured.py` (about a minute); the table
and benchmarks/results/predicted_vs_measured.json hold the figures the notebooks quote.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.extras import calibrate  # noqa: E402
from megalab.lab import launch  # noqa: E402

RANKS = 4

# every case's measured run, in one 4-rank launch (the notebooks' code, their sizes; {steps} repeats)
CODE = r"""
import statistics, time, torch, torch.nn.functional as F
import torch.distributed as dist
from torch import nn
from megalab.lab import dist as mdist
from megalab.core import parallel_state as ps
from megalab.extras import comm
rank, world = mdist.init()
steps = {steps}
out = dict()

def median_of(fn, n=steps):
    fn()  # warm-up
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is done when every rank is
    return t.item()

# 01·03: dist.all_reduce of 4 KiB and 4 MiB
for numel in (1024, 2**20):
    out[f"all_reduce {{numel * 4 // 1024}} KiB"] = comm.time_collective(lambda t: dist.all_reduce(t), torch.zeros(numel), repeats=steps)

# 03·01: 8 x Linear(512, 512) + tanh, batch 256 per rank; naive / buckets of 2 layers, no overlap / overlap
from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel, all_reduce_gradients
def make():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.Tanh())])
x, y = torch.randn(256, 512), torch.randn(256, 512)
naive = make()
def naive_step():
    naive.zero_grad(); F.mse_loss(naive(x), y).backward(); all_reduce_gradients(naive)
out["ddp naive"] = median_of(naive_step)
for name, overlap in (("ddp buckets", False), ("ddp buckets, overlap", True)):
    ddp = DistributedDataParallel(make(), bucket_size=2 * 512 * 513, overlap_grad_reduce=overlap)
    def ddp_step(ddp=ddp):
        ddp.zero_grad_buffer(); F.mse_loss(ddp(x), y).backward(); ddp.finish_grad_sync()
    out[name] = median_of(ddp_step)

# 03·05: a GPT step at t = 4 (L=2, b=8, s=32, h=64)
from megalab.core.models.gpt.gpt_layer_specs import tensor_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.extras.comm_tracer import CollectiveTracer
ps.initialize_model_parallel(tensor_model_parallel_size=world)
config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=128, seq_length=32,
                           hidden_dropout=0.0, attention_dropout=0.0)
torch.manual_seed(0)
model = GPTModel(config, tensor_parallel_layer_spec())
ids = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(0))
with CollectiveTracer() as trace:
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
out["tp records"] = trace.records
out["tp step"] = median_of(lambda: model(ids[:, :-1], labels=ids[:, 1:]).mean().backward())
ps.destroy_model_parallel()

# 03·07: fixed-duration stages (forward 20 ms, backward 40 ms), p = 4, m = 8
from megalab.extras.pipeline_sim import run_fixed_duration_pipeline
for kind, v in (("1f1b", 1), ("interleaved", 2)):
    records = run_fixed_duration_pipeline(8, kind, v, forward_ms=20, backward_ms=40).timeline
    span = torch.tensor([max(r.end for r in records) - min(r.start for r in records)])
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    out[f"pipeline {{kind}}"] = span.item()

# 03·08: ring attention forward, cp = 4, zigzag, s = 1024, 4 heads of 32, one thread per rank
from megalab.core.utils import cp_rank_positions
from megalab.transformer_engine import context_parallel as cpm
torch.set_num_threads(1)
state = ps.initialize_model_parallel(context_parallel_size=world)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 1024, 32, generator=g) for _ in range(3))
pos = cp_rank_positions(1024, world, rank, True)
local = [t[:, :, pos].clone() for t in (q, k, v)]
with torch.no_grad():
    cpm.context_parallel_attention(*local)
    work = cpm.AttentionWork()
    cpm.context_parallel_attention(*local, work=work)
    out["cp blocks (thread time)"] = work.seconds
    out["cp forward"] = median_of(lambda: cpm.context_parallel_attention(*local))
ps.destroy_model_parallel()

# 03·09: the MoE layer of the notebook (EP = 4, 8 experts, top-2, h = 16, 16 tokens per rank), forward
from megalab.core.transformer.moe import moe_layer as moe
ps.initialize_model_parallel(expert_model_parallel_size=world)
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=8, seq_length=16,
                           num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
torch.manual_seed(0)
layer = moe.MoELayer(config)
x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(rank))
with torch.no_grad():
    out["moe forward"] = median_of(lambda: layer(x))
out["moe a2a bytes"] = layer.token_dispatcher.a2a_bytes
ps.destroy_model_parallel()
mdist.publish("measured", out)
dist.barrier()
"""


def recompute_measured(steps: int) -> dict[str, float]:
    """06·04's recompute run in this process: forward + backward, best of `steps`, per recompute setting."""
    import torch

    from megalab.core.models.gpt.gpt_model import GPTModel
    from megalab.core.transformer.transformer_config import TransformerConfig

    cfg = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=128,
               hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    settings = {"none": {}, "selective": dict(recompute_granularity="selective"),
                "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    batch = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, extra in settings.items():
        torch.manual_seed(0)
        m = GPTModel(TransformerConfig(**cfg, **extra)).train()
        times = []
        for _ in range(steps + 1):  # the first is a warm-up
            m.zero_grad()
            start = time.perf_counter()
            m(batch[:, :-1], labels=batch[:, 1:]).mean().backward()
            times.append(time.perf_counter() - start)
        out[name] = min(times[1:])
    return out, TransformerConfig(**cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=7, help="timed repeats per case (medians)")
    parser.add_argument("--cached", action="store_true", help="use the cached calibration instead of measuring it again")
    parser.add_argument("--quick", action="store_true", help="CI smoke: 2 repeats, the cached calibration if any")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.cached = 2, True
    cal = calibrate.calibration(refresh=not args.cached)
    print(cal.summary())
    rec, rec_config = recompute_measured(max(3, args.steps))  # before the launch: its ranks' exit takes the cores
    res = launch.run(CODE.format(steps=args.steps), RANKS, backend="gloo", timeout=300)
    measured = res.results["measured"]
    m0 = measured[0]
    ddp = dict(layers=8, width=512, batch=256, ranks=RANKS)
    cases = [
        ("01·03 all_reduce 4 KiB", calibrate.predict_all_reduce(cal, RANKS, 4096), m0["all_reduce 4 KiB"]),
        ("01·03 all_reduce 4 MiB", calibrate.predict_all_reduce(cal, RANKS, 4 * 2**20), m0["all_reduce 4096 KiB"]),
        ("03·01 DDP naive", calibrate.predict_ddp_step(cal, **ddp)["total"], m0["ddp naive"]),
        ("03·01 DDP buckets", calibrate.predict_ddp_step(cal, **ddp, bucket_size=2 * 512 * 513)["total"],
         m0["ddp buckets"]),
        ("03·01 DDP buckets, overlap", calibrate.predict_ddp_step(cal, **ddp, bucket_size=2 * 512 * 513,
                                                                   overlap_grad_reduce=True)["total"],
         m0["ddp buckets, overlap"]),
    ]
    from megalab.core.transformer.transformer_config import TransformerConfig
    from megalab.extras import calc

    tp_config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=128, seq_length=32)
    tp_flops = calc.model_flops(tp_config, 8, 32) / RANKS
    cases.append(("03·05 TP step (t=4)", calibrate.predict_traced_step(cal, m0["tp records"], tp_flops, RANKS)["total"],
                  m0["tp step"]))
    for kind, v in (("1f1b", 1), ("interleaved", 2)):
        cases.append((f"03·07 {kind} (p=4, m=8, v={v})",
                      calibrate.predict_pipeline(cal, RANKS, 8, v, 0.02, 0.04)["total"], m0[f"pipeline {kind}"]))
    cp = [calibrate.predict_cp_attention(cal, 1024, RANKS, r) for r in range(RANKS)]
    cases.append(("03·08 CP blocks, thread time (max rank)", max(p["thread time"] for p in cp),
                  max(measured[r]["cp blocks (thread time)"] for r in range(RANKS))))
    cases.append(("03·08 CP ring forward (cp=4)", max(p["total"] for p in cp), m0["cp forward"]))
    a2a = statistics.mean(measured[r]["moe a2a bytes"] for r in range(RANKS))
    cases.append(("03·09 MoE forward, all-to-all", calibrate.predict_moe_all_to_all(cal, RANKS, a2a)["total"],
                  m0["moe forward"]))
    predicted = calibrate.predict_recompute(cal, rec_config, 4, 128)
    for name in ("none", "selective", "full"):
        cases.append((f"06·04 fwd+bwd, recompute {name}", predicted[name], rec[name]))
    rows = [[name, 1e3 * p, 1e3 * m, m / p] for name, p, m in cases]
    report("predicted_vs_measured", ["case", "predicted ms", "measured ms", "measured / predicted"], rows,
           {"calibration": cal.to_json(), "steps": args.steps})


if __name__ == "__main__":
    main()
