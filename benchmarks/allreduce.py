"""Our ring all-reduce (megalab.extras.comm.ring_all_reduce, send/recv only) vs dist.all_reduce.

    python benchmarks/allreduce.py            # 8 sizes, 1 KiB .. 16 MiB, on 4 ranks
    python benchmarks/allreduce.py --quick    # CI smoke: 3 small sizes, a few seconds

Both run in the same launch, on the same ranks, on the same tensors, size by size. Prints median
times per size, the ratio ours / library and busbw, then alpha and beta fitted with the ring model
(t = 2(n-1) alpha + 2(n-1)/n bytes beta); writes benchmarks/results/allreduce.json.
On CPU this is gloo; on a node with a GPU per rank it is NCCL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.extras import comm
from megalab.lab import launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: 3 small sizes, 3 repeats")
    parser.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs per size; the median is reported")
    args = parser.parse_args()
    numels = [2**8, 2**12, 2**16] if args.quick else [2**k for k in range(8, 24, 2)]  # float32: 1 KiB .. 16 MiB
    repeats = 3 if args.quick else args.repeats
    n = args.n

    run = launch.run_function(comm.measure_all_reduce, n, numels, repeats=repeats, launch=dict(timeout=600))
    timings = run.returns[0]  # every rank returns the same: time_collective keeps the slowest rank's time
    backend = launch.resolve_backend("auto", n)

    rows = [
        [f"{nbytes // 1024} KiB", t_dist * 1e3, t_ring * 1e3, t_ring / t_dist,
         comm.busbw(nbytes, t_dist, n) / 1e9, comm.busbw(nbytes, t_ring, n) / 1e9]
        for nbytes, t_dist, t_ring in zip(timings["nbytes"], timings["dist"], timings["ring"])
    ]
    fits = {}
    for name in ("dist", "ring"):
        alpha, beta = comm.fit_alpha_beta(
            timings["nbytes"], timings[name], latency_steps=2 * (n - 1), bytes_factor=2 * (n - 1) / n
        )
        fits[name] = {"alpha_us": alpha * 1e6, "bandwidth_GBps": 1 / beta / 1e9}
    geomean = statistics.geometric_mean(row[3] for row in rows)

    print(f"all-reduce on {n} {backend} ranks, float32, median of {repeats} runs")
    report(
        "allreduce",
        ["size", "dist.all_reduce ms", "ring (ours) ms", "ours/dist", "busbw dist GB/s", "busbw ours GB/s"],
        rows,
        {"ranks": n, "backend": backend, "repeats": repeats, "quick": args.quick, "timings_s": timings,
         "fit_ring_model": fits, "ratio_geomean": geomean},
    )
    for name, fit in fits.items():
        print(f"fit ({name}, ring model): alpha = {fit['alpha_us']:.1f} µs per message, 1/beta = {fit['bandwidth_GBps']:.3f} GB/s")
    print(f"ours / dist.all_reduce, geometric mean over sizes: {geomean:.2f}x")


if __name__ == "__main__":
    main()
