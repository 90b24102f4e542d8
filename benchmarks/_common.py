"""Shared by the benchmarks: medians, a printed table, JSON in benchmarks/results/, and (inside
the ranks) interleaved timed training steps."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(os.environ.get("MEGALAB_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def report(name: str, header: list[str], rows: list[list], extra: dict | None = None) -> Path:
    """Print `rows` as a table and write them (plus `extra`) to benchmarks/results/NAME.json."""
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": platform.node(), "load_average": os.getloadavg(), "header": header,
               "rows": rows, **(extra or {})}  # the load matters for every figure: record it with them
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def timed_steps(forward: dict[str, Callable], optimizers: dict[str, object], steps: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Inside every rank: SGD-style steps on loss = forward[name]().square().mean(), the variants
    interleaved so they share the machine's state, each between two barriers (the slowest rank's
    time). Returns the seconds of the last `steps` steps per variant."""
    import torch.distributed as dist

    times = {name: [] for name in forward}
    for step in range(warmup + steps):
        for name, fn in forward.items():
            dist.barrier()
            start = time.perf_counter()
            loss = fn().square().mean()
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    return times
