"""The step-time model (megalab/extras/step_time.py) against published training runs.

Predicted vs published, one row per figure, each with its table and row:
    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM":
        Table 1 (10 rows, achieved TFLOP/s per GPU), Table 2 (ZeRO-3 vs PTD-P, 12 rows);
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
        Table 5 (MFU and HFU of 22B, 175B, 530B, 1T).
Those are the CALIBRATION set. The VALIDATION set, never used to choose anything in the model: NVIDIA's
Megatron-Bridge performance tables (25.11 and 26.02 containers, DGX-H100 and DGX-B200 rows, FP8 current
scaling and MXFP8, dense and MoE: published_runs.validation_runs), tokens/s per GPU; the per-family error
table shows both sets apart.
One calibration for the A100 (step_time.A100_80GB, HDR_IB, NVLINK3), no per-run tuning. The model is
arithmetic, so this runs in well under a second; --quick runs the same (it is already quick).
With --sensitivity it also shows how the largest error moves when each estimated fraction of the
calibration (sustained, overlap_slowdown, memory_efficiency, link efficiency) is changed by ±20%.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report  # noqa: E402

from megalab.extras import published_runs as R  # noqa: E402
from megalab.extras import step_time as S  # noqa: E402


def sensitivity() -> list[list]:
    """Largest |error| over all rows with one calibration fraction scaled by 0.8 and 1.2."""
    base = S.hardware(R.SELENE)
    knobs = {
        "gpu.sustained": lambda hw, f: dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, sustained=min(1.0, hw.gpu.sustained * f))),
        "gpu.overlap_slowdown": lambda hw, f: dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, overlap_slowdown=hw.gpu.overlap_slowdown * f)),
        "gpu.memory_efficiency": lambda hw, f: dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, memory_efficiency=min(1.0, hw.gpu.memory_efficiency * f))),
        "links.efficiency": lambda hw, f: dataclasses.replace(
            hw, intra_node=dataclasses.replace(hw.intra_node, efficiency=min(1.0, hw.intra_node.efficiency * f)),
            inter_node=dataclasses.replace(hw.inter_node, efficiency=min(1.0, hw.inter_node.efficiency * f))),
    }
    rows = []
    for name, change in knobs.items():
        worst = []
        for factor in (0.8, 1.2):
            hw = change(base, factor)
            runs = [dataclasses.replace(r, train=dataclasses.replace(r.train, hardware=hw)) for r in R.all_runs()]
            worst.append(max(abs(row["error"]) for row in R.validation_rows(runs)))
        rows.append([name, f"{worst[0]:.1%}", f"{worst[1]:.1%}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke (the same run: it takes well under a second)")
    parser.add_argument("--sensitivity", action="store_true", help="also vary each estimated calibration fraction")
    args = parser.parse_args()
    rows = R.validation_rows(R.all_runs() + R.validation_runs())
    worst = max(abs(r["error"]) for r in rows if r["split"] == "calibration")
    hw = S.hardware(R.SELENE)
    families = {f"{split}: {family}": e for (split, family), e in R.family_errors(rows).items()}
    extra = {"largest_calibration_error": worst, "families": families, "hardware": hw.name, "gpu_source": hw.gpu.source,
             "intra_node": hw.intra_node.source, "inter_node": hw.inter_node.source}
    if args.sensitivity:
        extra["sensitivity"] = sensitivity()
    report("planner_validation", ["split", "source", "model", "layout", "metric", "published", "predicted", "error %"],
           [[r["split"], r["source"], r["model"], r["layout"], r["metric"], r["published"], round(r["predicted"], 1),
             round(100 * r["error"], 1)] for r in rows], extra)
    print(f"\n{R.family_table(rows)}")
    print(f"\ncalibration: largest error {worst:.1%} (tests/test_step_time.py requires 15%); validation bounds per "
          "family: tests/test_planner.py FAMILY_BOUNDS")
    if args.sensitivity:
        print("\nlargest error with one estimated fraction x0.8 / x1.2:")
        for name, low, high in extra["sensitivity"]:
            print(f"  {name:<24} {low:>7} {high:>7}")


if __name__ == "__main__":
    main()
