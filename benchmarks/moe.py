"""EP=4 training step of one MoE layer: megalab's all-to-all dispatcher vs its all-gather dispatcher.

Both run in the same 4-rank gloo launch on the same weights and tokens (E experts, top-k, each rank
E/4 experts and its own tokens). The all-gather dispatcher moves every token to every rank and
reduce-scatters the outputs; the all-to-all dispatcher moves only the token copies routed to another
rank. A step is forward, backward and an SGD update; the two are timed interleaved, and we report
medians and the ratio alltoall / allgather (below 1 means the all-to-all is faster). The a2a bytes
each rank sent are compared with calc.moe_all_to_all_bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.extras import calc
from megalab.lab import launch  # noqa: E402

CODE = """
import torch
from benchmarks._common import timed_steps
from megalab.lab import dist as mdist
from megalab.core.transformer.moe import moe_layer as moe
from megalab.core import parallel_state as ps
from megalab.core.transformer.transformer_config import TransformerConfig

torch.set_num_threads(1)
rank, world = mdist.init()
ps.initialize_model_parallel(expert_model_parallel_size=world)
h, experts, topk, tokens, steps = {h}, {experts}, {topk}, {tokens}, {steps}
layers, optimizers = dict(), dict()
for name in ("alltoall", "allgather"):
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, vocab_size=8, seq_length=tokens,
                               num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type=name,
                               moe_grouped_gemm=True)
    torch.manual_seed(rank)  # each rank's experts differ; the two layers are identical
    layers[name] = moe.MoELayer(config)
    optimizers[name] = torch.optim.SGD(layers[name].parameters(), lr=1e-3)
x = torch.randn(tokens, 1, h, generator=torch.Generator().manual_seed(100 + rank))
times = timed_steps({{name: (lambda name=name: layers[name](x)) for name in layers}}, optimizers, steps)
mdist.publish("times", times)
mdist.publish("a2a_bytes", layers["alltoall"].token_dispatcher.a2a_bytes)
torch.distributed.barrier()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="CI smoke: a tiny layer, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.tokens, args.steps = 32, 64, 3
    ep = 4
    code = CODE.format(h=args.hidden, experts=args.experts, topk=args.topk, tokens=args.tokens, steps=args.steps)
    res = launch.run(code, ep, backend="gloo", timeout=300)
    times = res.results["times"][0]
    ours, theirs = median(times["alltoall"]), median(times["allgather"])
    ratio = ours / theirs
    per_rank = list(res.results["a2a_bytes"].values())  # fp32 activations, the last forward
    measured = sum(per_rank) / ep
    formula = calc.moe_all_to_all_bytes(args.tokens, args.topk, args.hidden, ep, bytes_per_element=4)
    shape = [ep, args.experts, args.topk, args.hidden, args.tokens, args.steps]
    report(
        "moe",
        ["dispatcher", "EP", "experts", "top-k", "hidden", "tokens/rank", "steps", "median ms", "min ms"],
        [["megalab MoEAlltoAllTokenDispatcher", *shape, 1e3 * ours, 1e3 * min(times["alltoall"])],
         ["megalab MoEAllGatherTokenDispatcher", *shape, 1e3 * theirs, 1e3 * min(times["allgather"])]],
        {"ratio_alltoall_over_allgather": ratio, "alltoall_s": times["alltoall"], "allgather_s": times["allgather"],
         "a2a_bytes_per_rank_measured": measured, "a2a_bytes_each_rank": per_rank, "a2a_bytes_per_rank_formula": formula},
    )
    print(f"median step time ratio alltoall / allgather = {ratio:.3f}")
    print(f"a2a bytes per rank per forward: measured mean {measured:.0f} (ranks {min(per_rank)}..{max(per_rank)}), formula 2 T k h (ep-1)/ep = {formula:.0f} "
          f"(ratio {measured / formula:.3f})")


if __name__ == "__main__":
    main()
