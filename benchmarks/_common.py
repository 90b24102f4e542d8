"""Shared by the benchmarks: medians, a printed table, and JSON in benchmarks/results/."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def report(name: str, header: list[str], rows: list[list], extra: dict | None = None) -> Path:
    """Print `rows` as a table and write them (plus `extra`) to benchmarks/results/NAME.json."""
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": platform.node(), "header": header, "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
