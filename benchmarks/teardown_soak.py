"""Teardown soak: many consecutive 4-rank cells that each run a DDP training step.

torch 2.13 + gloo ranks sometimes abort at exit ("terminate called without an active exception",
SIGABRT) after all user code has finished. megalab's worker tears down in order (barrier,
destroy_process_group) and leaves with os._exit, and the launcher counts a cell as passed when every
rank finished the cell. This benchmark counts spurious failures over N cells (target: 0), and with
--control also runs the same step under bare torchrun with a plain destroy_process_group() at the end
to show the failure rate the mitigation removes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.lab import launch  # noqa: E402

DDP_STEP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 32) + dist.get_rank()
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
print(f"rank {dist.get_rank()} loss {loss.item():.4f}")
"""
CONTROL_TAIL = "dist.destroy_process_group()\n"


def soak(runs: int, n: int) -> tuple[int, list[str], list[float]]:
    failures, messages, times = 0, [], []
    for i in range(runs):
        start = time.perf_counter()
        try:
            launch.run(DDP_STEP, n, backend="gloo", timeout=120)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failures += 1
            messages.append(f"run {i}: {type(exc).__name__}: {exc}")
        times.append(time.perf_counter() - start)
        print(f"\rmegalab cells: {i + 1}/{runs}, failures {failures}", end="", flush=True)
    print()
    return failures, messages, times


def control(runs: int, n: int) -> tuple[int, list[str]]:
    failures, codes = 0, []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "step.py"
        script.write_text(DDP_STEP + CONTROL_TAIL)
        for i in range(runs):
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                failures += 1
                codes.append(f"run {i}: exit {proc.returncode}; " + ("SIGABRT" if "SIGABRT" in proc.stderr else proc.stderr[-200:]))
            print(f"\rbare torchrun: {i + 1}/{runs}, failures {failures}", end="", flush=True)
    print()
    return failures, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--control", type=int, default=0, help="also run this many bare-torchrun cells")
    parser.add_argument("--quick", action="store_true", help="CI smoke: 3 cells of 2 ranks")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.n, args.control = 3, 2, 0
    failures, messages, times = soak(args.runs, args.n)
    rows = [["megalab.lab.launch.run (orderly teardown)", args.n, args.runs, failures]]
    extra = {"megalab_failures": messages, "median_cell_s": sorted(times)[len(times) // 2]}
    if args.control:
        c_fail, c_codes = control(args.control, args.n)
        rows.append(["bare torchrun + destroy_process_group", args.n, args.control, c_fail])
        extra["control_failures"] = c_codes
    report("teardown_soak", ["launcher", "ranks", "cells", "failed"], rows, extra)
    for m in messages:
        print("  ", m)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
