"""CP=2 training step of a small GPT: ring attention (p2p, zigzag) vs all-gather CP vs one process.

One 2-rank gloo launch times, interleaved on the same weights and tokens: a forward + backward
of ContextParallelGPTModel with the ring ("p2p") and with the all-gather variant (each rank holds
s/2 tokens), and of the single-process GPTModel on the whole sequence (every rank runs its own
copy at the same time, so both ranks stay busy as in the CP runs). One thread per rank. The
all-gather variant here computes its dense s/cp x s scores under a mask (no causal block skipping),
so it also does about twice the ring's attention FLOPs. We report
medians and the ratios ours / all-gather and ours / single process (below 1: ours is faster).
On gloo/CPU the ring's overlap of send/recv with compute is limited; on NCCL/GPU it hides the transfers.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="CI smoke: seq 128, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.steps = 128, 2
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
