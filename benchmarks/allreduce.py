"""Our ring all-reduce (megalab.comm.ring_all_reduce, send/recv only) vs dist.all_reduce.

    python benchmarks/allreduce.py            # 8 sizes, 1 KiB .. 16 MiB, on 4 ranks
    python benchmarks/allreduce.py --quick    # CI smoke: 3 small sizes, a few seconds

Both run in the same launch, on the same ranks, on the same tensors. Prints median times per size,
the ratio ours / library, busbw, and alpha, beta fitted with the ring model
(t = 2(n-1) alpha + 2(n-1)/n bytes beta), then writes benchmarks/results/allreduce.json.
On CPU this is gloo over shared memory/TCP; on a node with a GPU per rank it is NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from megalab import comm, launch

RESULTS = Path(__file__).resolve().parent / "results" / "allreduce.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: 3 small sizes, 3 repeats")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per size (median is reported)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()

    numels = [2**8, 2**12, 2**16] if args.quick else [2**k for k in range(8, 24, 2)]
    repeats = args.repeats or (3 if args.quick else 7)
    n = args.nproc
    run = launch.run_function(comm.measure_all_reduce, n, numels, repeats=repeats, launch=dict(timeout=600))
    timings = run.returns[0]  # time_collective already took the slowest rank of every run
    backend = launch.resolve_backend("auto", n)

    rows = []
    print(f"all-reduce on {n} {backend} ranks, float32, median of {repeats} runs")
    print(f"{'size':>10} {'dist.all_reduce':>16} {'ring (ours)':>12} {'ours/dist':>10} {'busbw dist':>11} {'busbw ours':>11}")
    for nbytes, t_dist, t_ring in zip(timings["nbytes"], timings["dist"], timings["ring"]):
        row = dict(
            nbytes=nbytes, dist_s=t_dist, ring_s=t_ring, ratio=t_ring / t_dist,
            busbw_dist=comm.busbw(nbytes, t_dist, n), busbw_ring=comm.busbw(nbytes, t_ring, n),
        )
        rows.append(row)
        print(
            f"{_size(nbytes):>10} {t_dist * 1e3:>13.3f} ms {t_ring * 1e3:>9.3f} ms {row['ratio']:>9.2f}x "
            f"{row['busbw_dist'] / 1e9:>7.2f} GB/s {row['busbw_ring'] / 1e9:>6.2f} GB/s"
        )

    fits = {}
    for name in ("dist", "ring"):
        alpha, beta = comm.fit_alpha_beta(
            timings["nbytes"], timings[name], latency_steps=2 * (n - 1), bytes_factor=2 * (n - 1) / n
        )
        fits[name] = dict(alpha_s=alpha, beta_s_per_byte=beta, bandwidth_bytes_per_s=1 / beta)
        print(f"fit ({name:>4}, ring model): alpha = {alpha * 1e6:8.2f} µs per message, 1/beta = {1 / beta / 1e9:6.2f} GB/s")
    geomean = statistics.geometric_mean(r["ratio"] for r in rows)
    print(f"ours / dist.all_reduce, geometric mean over sizes: {geomean:.2f}x")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        benchmark="allreduce", ranks=n, backend=backend, dtype="float32", repeats=repeats, quick=args.quick,
        torch=torch.__version__, machine=platform.machine(), cpus=os.cpu_count(),
        rows=rows, fit=fits, ratio_geomean=geomean,
    )
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def _size(nbytes: float) -> str:
    units = ["B", "KiB", "MiB", "GiB"]
    while nbytes >= 1024 and len(units) > 1:
        nbytes /= 1024
        units.pop(0)
    return f"{nbytes:.0f} {units[0]}"


if __name__ == "__main__":
    main()
