"""What the %%torchrun launcher costs over a bare `torchrun` of the same script.

Both start 4 gloo ranks that run one all_reduce; we time the whole launch, wall clock, and report
medians and their ratio (target: launcher / bare torchrun <= 1.2).
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
from _common import median, report  # noqa: E402

from megalab.lab import launch  # noqa: E402

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t[0].item():.0f}")
dist.barrier()
dist.destroy_process_group()
"""


def bare_torchrun(script: Path, n: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script)],
                   env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def ours(n: int) -> float:
    start = time.perf_counter()
    launch.run(SCRIPT, n, backend="gloo", timeout=120)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="CI smoke: 1 repeat, 2 ranks")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.n = 1, 2
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(SCRIPT)
        bare, mine = [], []
        for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
            bare.append(bare_torchrun(script, args.n))
            mine.append(ours(args.n))
    ratio = median(mine) / median(bare)
    report(
        "launcher_overhead",
        ["launcher", "ranks", "repeats", "median s", "min s", "max s"],
        [["torchrun (bare)", args.n, args.repeats, median(bare), min(bare), max(bare)],
         ["megalab.lab.launch.run", args.n, args.repeats, median(mine), min(mine), max(mine)]],
        {"ratio_ours_over_bare": ratio, "target": 1.2, "bare_s": bare, "ours_s": mine},
    )
    print(f"median ratio ours / bare torchrun = {ratio:.3f} (target <= 1.2)")


if __name__ == "__main__":
    main()
