"""TP=2 training step of one MLP block: megalab's Column/RowParallelLinear vs PyTorch DTensor TP.

Both run in the same 2-rank gloo launch on the same weights: ours (ColumnParallelLinear ->
GeLU -> RowParallelLinear) and `parallelize_module` with ColwiseParallel/RowwiseParallel.
A step is forward, backward and an SGD update; the two are timed interleaved, and we report
medians and the ratio ours / DTensor (below 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.lab import launch  # noqa: E402

CODE = """
import torch
from benchmarks._common import timed_steps
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from megalab.lab import dist as mdist
from megalab.core import parallel_state as ps
from megalab.core.tensor_parallel import layers as tp
from megalab.core.transformer.transformer_config import TransformerConfig
from megalab.core.utils import init_method_normal

torch.set_num_threads(1)
rank, world = mdist.init()
ps.initialize_model_parallel(tensor_model_parallel_size=world)
h, ffn, tokens, steps = {h}, {ffn}, {tokens}, {steps}
config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, vocab_size=8, seq_length=tokens)
init = init_method_normal(0.02)
torch.manual_seed(0)
col = tp.ColumnParallelLinear(h, ffn, config=config, init_method=init)
row = tp.RowParallelLinear(ffn, h, config=config, init_method=init)
ours = torch.nn.ModuleDict(dict(fc1=col, fc2=row))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(h, ffn), torch.nn.Linear(ffn, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


theirs = parallelize_module(MLP(), init_device_mesh("cpu", (world,)), dict(fc1=ColwiseParallel(), fc2=RowwiseParallel()))
x = torch.randn(tokens, 1, h, generator=torch.Generator().manual_seed(1))
forward = dict(ours=lambda: row(F.gelu(col(x))), dtensor=lambda: theirs(x))
optimizers = dict(ours=torch.optim.SGD(ours.parameters(), lr=1e-3), dtensor=torch.optim.SGD(theirs.parameters(), lr=1e-3))
times = timed_steps(forward, optimizers, steps)
mdist.publish("times", times)
torch.distributed.barrier()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CI smoke: a tiny MLP, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.tokens, args.steps = 64, 64, 3
    h, ffn = args.hidden, 4 * args.hidden
    res = launch.run(CODE.format(h=h, ffn=ffn, tokens=args.tokens, steps=args.steps), 2, backend="gloo", timeout=300)
    times = res.results["times"][0]
    ours, theirs = median(times["ours"]), median(times["dtensor"])
    ratio = ours / theirs
    report(
        "tensor_parallel",
        ["implementation", "TP", "hidden", "tokens", "steps", "median ms", "min ms"],
        [["megalab ColumnParallel/RowParallel", 2, h, args.tokens, args.steps, 1e3 * ours, 1e3 * min(times["ours"])],
         ["DTensor Colwise/RowwiseParallel", 2, h, args.tokens, args.steps, 1e3 * theirs,
          1e3 * min(times["dtensor"])]],
        {"ratio_ours_over_dtensor": ratio, "ours_s": times["ours"], "dtensor_s": times["dtensor"]},
    )
    print(f"median step time ratio ours / DTensor = {ratio:.3f}")


if __name__ == "__main__":
    main()
