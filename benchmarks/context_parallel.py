"""CP=2 training step of a small GPT: ring attention (p2p, zigzag) vs all-gather CP vs one process;
every cp_comm_type's attention side by side at cp = 4.

One 2-rank gloo launch times, interleaved on the same weights and tokens: a forward + backward
of ContextParallelGPTModel with the ring ("p2p") and with the all-gather variant (each rank holds
s/2 tokens), and of the single-process GPTModel on the whole sequence (every rank runs its own
copy at the same time, so both ranks stay busy as in the CP runs). One thread per rank. The
all-gather variant here computes its dense s/cp x s scores under a mask (no causal block skipping),
so it also does about twice the ring's attention FLOPs. We report
medians and the ratios ours / all-gather and ours / single process (below 1: ours is faster).
On gloo/CPU the ring's overlap of send/recv with compute is limited; on NCCL/GPU it hides the transfers.

Every cp_comm_type side by side (`--quick` runs only this part, small, on 2 ranks: a2a+p2p as [2, 1]): one 4-rank
gloo launch (`--cp`), cp = 4, GQA,
each variant's attention forward + backward interleaved on the same q, k, v: p2p (the ring), all_gather (ours,
keeps the gathered K/V), all_gather_te (Transformer Engine's: local K/V saved, gathered again in backward),
a2a (Ulysses) and a2a+p2p (hierarchical_context_parallel_sizes [2, 2]). Per rank: the bytes sent
(CollectiveTracer) and the bytes kept for backward (SavedTensorsMeter), each against its formula
(context_parallel.communication_per_layer / saved_bytes_per_layer), the K/V held at once (formula), and the
median step time; ratios against the ring of the same run. The times are CPU times of this plain-PyTorch code, not
of TE's kernels: a2a and our all_gather compute dense masked s x s (a2a) or s/cp x s scores, half of them hidden by
the causal mask, where the ring and all_gather_te skip the blocks the mask hides; the bytes and memory carry over.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.lab import launch  # noqa: E402

CODE = """
import time
import torch
from megalab.core.distributed.finalize_model_grads import finalize_model_grads
from megalab.core.models.gpt.gpt_layer_specs import context_parallel_layer_spec
from megalab.core.models.gpt.gpt_model import GPTModel
from megalab.core.utils import get_batch_on_this_cp_rank
from megalab.lab import dist as mdist
from megalab.core import parallel_state as ps
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.models.gpt.gpt_model import GPTModel

torch.set_num_threads(1)
rank, world = mdist.init()
state = ps.initialize_model_parallel(context_parallel_size=world)
config = TransformerConfig(num_layers={layers}, hidden_size={hidden}, num_attention_heads={heads}, vocab_size=256,
                           seq_length={seq}, hidden_dropout=0.0, attention_dropout=0.0)
models = {{}}
for name in ("p2p", "all_gather"):
    torch.manual_seed(0)
    models[name] = GPTModel(config, context_parallel_layer_spec(variant=name))
torch.manual_seed(0)
models["single"] = GPTModel(config)
ids = torch.randint(0, 256, (1, {seq}), generator=torch.Generator().manual_seed(1))
labels = torch.roll(ids, -1, 1)
local = get_batch_on_this_cp_rank(dict(tokens=ids, labels=labels), world, state.get_context_parallel_rank())


def step(name):
    model = models[name]
    model.zero_grad(set_to_none=True)
    if name == "single":
        model(ids, labels=labels).mean().backward()
    else:
        (model(local["tokens"], local["position_ids"], local["labels"]).sum() / ids.numel() * world).backward()
        finalize_model_grads([model], state)  # the mean over dp x cp, hence the loss x cp above


times = {{name: [] for name in models}}
for i in range({steps} + 1):  # one warm-up step
    for name in models:
        torch.distributed.barrier()
        start = time.perf_counter()
        step(name)
        torch.distributed.barrier()
        if i:
            times[name].append(time.perf_counter() - start)
mdist.publish("times", times)
torch.distributed.barrier()
"""


ATTENTION = """
import time
import torch
from megalab.core import parallel_state as ps
from megalab.core.utils import cp_rank_positions
from megalab.extras.comm_tracer import CollectiveTracer
from megalab.extras.profiling import SavedTensorsMeter
from megalab.lab import dist as mdist
from megalab.transformer_engine import context_parallel as cpm

torch.set_num_threads(1)
rank, world = mdist.init()
state = ps.initialize_model_parallel(context_parallel_size=world, hierarchical_context_parallel_sizes=[2, world // 2])
cp, r = world, state.get_context_parallel_rank()
b, np_, ng, hn, s = 1, {heads}, {groups}, {head_dim}, {seq}
g = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(b, h, s, hn, generator=g) for h in (np_, ng, ng, np_))
pos = cp_rank_positions(s, cp, r)
local = [t[:, :, pos].contiguous() for t in (q, k, v)]
variants = ("p2p", "all_gather", "all_gather_te", "a2a", "a2a+p2p")


def step(variant):
    leaves = [t.clone().requires_grad_() for t in local]
    out = cpm.context_parallel_attention(*leaves, variant=variant)
    out.backward(dout[:, :, pos])
    return out, leaves


measured, times = {{}}, {{name: [] for name in variants}}
reference = None
for name in variants:
    with CollectiveTracer() as trace, SavedTensorsMeter() as meter:
        out = cpm.context_parallel_attention(*[t.clone().requires_grad_() for t in local], variant=name)
    with CollectiveTracer() as trace_bwd:
        out.backward(dout[:, :, pos])
    got, _ = step(name)
    reference = got if reference is None else reference
    measured[name] = dict(sent=trace.wire_bytes + trace_bwd.wire_bytes, saved=meter.bytes,
                          max_diff_vs_ring=(got - reference).abs().max().item(),
                          sent_formula=cpm.communication_per_layer(s, b, np_, ng, hn, cp, name, a2a_size=2)["total"],
                          **{{f"{{k}}_formula": v for k, v in cpm.saved_bytes_per_layer(s, b, np_, ng, hn, cp, name).items()}})
for i in range({steps} + 1):  # one warm-up round
    for name in variants:
        torch.distributed.barrier()
        start = time.perf_counter()
        step(name)
        torch.distributed.barrier()
        if i:
            times[name].append(time.perf_counter() - start)
mdist.publish("attention", dict(measured=measured, times=times))
torch.distributed.barrier()
"""


def attention_side_by_side(args) -> None:
    """Every cp_comm_type at cp = args.cp (that many gloo ranks; a2a+p2p as [2, cp/2]): bytes, memory, time,
    ratios vs the ring."""
    code = ATTENTION.format(heads=args.heads_attention, groups=args.groups, head_dim=args.head_dim,
                            seq=args.seq_attention, steps=args.steps)
    res = launch.run(code, args.cp, backend="gloo", timeout=600)
    got = res.results["attention"][0]
    measured, times = got["measured"], got["times"]
    med = {name: median(ts) for name, ts in times.items()}
    rows = []
    for name, m in measured.items():  # the formulas: computed in the ranks (no torch import here)
        rows.append([name, m["sent"] / 2**10, m["sent_formula"] / 2**10, m["sent"] / measured["p2p"]["sent"],
                     m["saved"] / 2**10, m["saved_formula"] / 2**10, m["kv_buffer_formula"] / 2**10, 1e3 * med[name],
                     med[name] / med["p2p"]])
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report("context_parallel_variants",
           ["cp_comm_type", "sent KiB", "formula", "sent / ring", "saved KiB", "formula", "K/V held KiB",
            "median ms", "time / ring"], rows,
           {"cp": args.cp, "hierarchical_context_parallel_sizes": [2, args.cp // 2], "seq": args.seq_attention,
            "heads": args.heads_attention, "query_groups": args.groups, "head_dim": args.head_dim,
            "steps": args.steps, "max_output_diff_vs_ring": {n: m["max_diff_vs_ring"] for n, m in measured.items()},
            "load": load, "times_s": times})
    print(f"cp={args.cp}, s={args.seq_attention}, {args.heads_attention} heads / {args.groups} key-value heads: time / ring "
          + ", ".join(f"{n} {med[n] / med['p2p']:.2f}" for n in med) + f"   ({load})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-attention", type=int, default=2048, help="the side by side of every cp_comm_type")
    parser.add_argument("--heads-attention", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, default=4, help="ranks of the side by side (even: a2a+p2p is [2, cp/2])")
    parser.add_argument("--quick", action="store_true", help="CI smoke: only the side by side, seq 128, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.seq_attention, args.head_dim, args.steps, args.cp = 128, 16, 2, 2
        attention_side_by_side(args)
        return
    attention_side_by_side(args)
    code = CODE.format(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, steps=args.steps)
    res = launch.run(code, 2, backend="gloo", timeout=600)
    times = res.results["times"][0]
    med = {name: median(ts) for name, ts in times.items()}
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    labels = {"p2p": "ring attention CP=2 (zigzag)", "all_gather": "all-gather KV CP=2", "single": "single process"}
    report(
        "context_parallel",
        ["implementation", "seq", "hidden", "layers", "steps", "median ms", "min ms"],
        [[labels[n], args.seq, args.hidden, args.layers, args.steps, 1e3 * med[n], 1e3 * min(times[n])]
         for n in ("p2p", "all_gather", "single")],
        {"ratio_ring_over_all_gather": med["p2p"] / med["all_gather"],
         "ratio_ring_over_single": med["p2p"] / med["single"], "load": load, "times_s": times},
    )
    print(f"median step time ratio ring / all-gather = {med['p2p'] / med['all_gather']:.3f}, "
          f"ring / single process = {med['p2p'] / med['single']:.3f}   ({load})")


if __name__ == "__main__":
    main()
