"""Our DDP and ZeRO (megalab.core.distributed.distributed_data_parallel) vs PyTorch's: step time and bytes per rank.

    python benchmarks/data_parallel.py            # MLP 8 x 1024 x 1024 (8.4 M params), 4 ranks, 15 steps each
    python benchmarks/data_parallel.py --quick    # CI smoke: a small MLP, 3 steps, a few seconds

One launch; every rank builds all variants, and the steps are interleaved (one step of each variant,
then the next round) so that a machine whose load changes treats them alike. A step is
zero-grad, forward, backward, gradient sync and optimizer step (Adam); its time is the slowest rank's.

    ours DDP (stage 0)      vs torch DistributedDataParallel                 same bucket size (25 MB)
    ours ZeRO-1             vs ZeroRedundancyOptimizer under torch DDP
    ours ZeRO-3             vs FSDP2 fully_shard on every layer
    ours ZeRO-2             (no PyTorch counterpart; reported alone)

Prints median step times and ours/torch ratios, then the bytes each rank keeps (params, grads,
optimizer state) against calc.zero_memory_per_device; writes benchmarks/results/data_parallel.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.extras import calc
from megalab.lab import launch  # noqa: E402

PAIRS = [("DDP", "ours stage 0", "torch DDP"), ("ZeRO-1", "ours stage 1", "torch ZeroRedundancyOptimizer"),
         ("ZeRO-2", "ours stage 2", None), ("ZeRO-3", "ours stage 3", "torch FSDP2 fully_shard")]


def measure(layers: int, hidden: int, batch: int, steps: int, warmup: int) -> dict:
    """Runs on every rank: median step time (s, slowest rank) per variant, and ours' bytes per rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from megalab.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megalab.core.optimizer.distrib_optimizer import DistributedOptimizer, optimizer_state_bytes
    from megalab.lab import dist as mdist

    rank, world = mdist.init()
    bucket_elements = 25 * 2**20 // 4  # torch DDP's default bucket_cap_mb=25, in float32 elements

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.Tanh())])

    variants = {}
    for stage in range(4):
        model = DistributedDataParallel(mlp(), zero_stage=stage, bucket_size=bucket_elements)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4) if stage == 0 else \
            DistributedOptimizer(model, torch.optim.Adam, lr=1e-4)
        variants[f"ours stage {stage}"] = (model, opt, model.zero_grad_buffer, model.finish_grad_sync)
    model = TorchDDP(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    variants["torch DDP"] = (model, opt, opt.zero_grad, None)
    model = TorchDDP(mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
    variants["torch ZeroRedundancyOptimizer"] = (model, opt, opt.zero_grad, None)
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    variants["torch FSDP2 fully_shard"] = (model, opt, opt.zero_grad, None)

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)
    times = {name: [] for name in variants}
    for step in range(warmup + steps):
        for name, (model, opt, zero_grad, finish) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            zero_grad()
            F.mse_loss(model(x), y).backward()
            if finish:
                finish()
            opt.step()
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times[name].append(elapsed.item())

    memory = {}
    for stage in range(4):
        model, opt, _, _ = variants[f"ours stage {stage}"]
        memory[stage] = {**model.memory_bytes(), "optimizer": optimizer_state_bytes(opt)} if stage == 0 \
            else opt.memory_bytes()
    num_params = sum(p.numel() for p in mlp().parameters())
    dist.barrier()
    return {"median_s": {name: statistics.median(ts) for name, ts in times.items()}, "times_s": times,
            "memory": memory, "num_parameters": num_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: small MLP, 3 steps")
    parser.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per variant; the median is reported")
    args = parser.parse_args()
    layers, hidden, batch = (2, 128, 16) if args.quick else (8, 1024, 32)
    steps, warmup = (3, 1) if args.quick else (args.steps, 3)

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "from megalab.lab.dist import publish\n"
            "import data_parallel as bench\n"
            f"publish('result', bench.measure({layers}, {hidden}, {batch}, {steps}, {warmup}))\n")
    result = launch.run(code, args.n, timeout=600).results["result"][0]
    med = result["median_s"]
    rows = [[what, med[ours] * 1e3, med[ref] * 1e3 if ref else "-", med[ours] / med[ref] if ref else "-",
             ref or "-"] for what, ours, ref in PAIRS]
    n, psi = args.n, result["num_parameters"]
    memory_rows = []
    for stage, measured in result["memory"].items():
        formula = calc.zero_memory_per_device(psi, n, stage, optimizer_bytes_per_param=8, param_bytes=4, grad_bytes=4)
        total = sum(measured[k] for k in ("params", "grads", "optimizer"))
        memory_rows.append({"stage": stage, **{f"measured_{k}": v for k, v in measured.items()},
                            "measured_total": total, "formula_total": formula["total"],
                            "measured/formula": total / formula["total"]})

    print(f"{n} ranks, MLP {layers} x {hidden} x {hidden} ({psi} parameters, float32), batch {batch} per rank, "
          f"Adam; median of {steps} steps (slowest rank)")
    report("data_parallel", ["", "ours ms", "torch ms", "ours/torch", "torch reference"], rows,
           {"ranks": n, "layers": layers, "hidden": hidden, "batch": batch, "steps": steps, "quick": args.quick,
            "num_parameters": psi, "times_s": result["times_s"], "memory_bytes_per_rank": memory_rows})
    print("\nbytes per rank (rank 0) kept between steps vs calc.zero_memory_per_device(param 4, grad 4, optimizer 8):")
    for row in memory_rows:
        print(f"  stage {row['stage']}: measured {row['measured_total'] / 2**20:8.2f} MiB  formula "
              f"{row['formula_total'] / 2**20:8.2f} MiB  measured/formula {row['measured/formula']:.4f}")


if __name__ == "__main__":
    main()
