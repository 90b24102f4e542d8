"""Measured pipeline bubbles vs theory, and our executor's step time vs torch.distributed.pipelining.

Every stage is a FixedDurationStage (forward --forward-ms, backward twice that, per micro-batch and
rank, by sleeping), so the numbers show the schedule, not the CPU load. For each (schedule, p, m, v) we
run one step on 4 ranks (p = 2 runs two pipelines side by side; --full adds p = 8 on 8 ranks) and
report the bubble measured from the executor's timeline against (p − 1)/(v·m + p − 1), the
most micro-batch activations each rank held at once (GPipe m, 1F1B p − rank), and the
step time of the same schedule under torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B) with the same stages. Medians over --repeats steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report  # noqa: E402

from megalab.extras.pipeline_sim import bubble_fraction_of_total  # noqa: E402
from megalab.lab import launch  # noqa: E402

WORKER = """
import time, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from megalab.lab import dist as mdist
from megalab.core import parallel_state
from megalab.core.pipeline_parallel import schedules as pp
from megalab.extras.pipeline_sim import FixedDurationStage, measured_bubble, run_fixed_duration_pipeline

TORCH = {{"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}}
rank, world = mdist.init()
out = {{}}
for kind, p, m, v in {configs}:
    state = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=p)
    group, pp_rank = state.get_pipeline_model_parallel_group(), state.get_pipeline_model_parallel_rank()
    bubbles, ours, theirs = [], [], []
    for _ in range({repeats}):
        res = run_fixed_duration_pipeline(m, kind, v, {fwd}, {bwd}, group=group)
        records = [None] * p
        dist.all_gather_object(records, res.timeline, group=group)
        records = [r for rs in records for r in rs]
        bubbles.append(measured_bubble(records))
        ours.append(max(r.end for r in records) - min(r.start for r in records))
    if p == world:  # the reference: same stages, same schedule; its first step (shape inference) not timed
        chunks = [FixedDurationStage({fwd} / v, {bwd} / v) for _ in range(v)]
        stages = [PipelineStage(c, pp.virtual_stage(p, pp_rank, k), p * v, torch.device("cpu"), group=group)
                  for k, c in enumerate(chunks)]
        sched = TORCH[kind](stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda o, t: (o * t).sum())
        x = torch.ones(4 * m, 8)
        for i in range({repeats} + 1):
            dist.barrier(group=group)
            start = time.perf_counter()
            if pp_rank == 0:
                sched.step(x)
            elif pp_rank == p - 1:
                sched.step(target=x)
            else:
                sched.step()
            spans = [None] * p
            dist.all_gather_object(spans, (start, time.perf_counter()), group=group)
            if i > 0:
                theirs.append(max(e for _, e in spans) - min(s for s, _ in spans))
    peaks = [None] * p
    dist.all_gather_object(peaks, res.peak_in_flight, group=group)
    out[(kind, p, m, v)] = (bubbles, ours, theirs, peaks)
    parallel_state.destroy_model_parallel()
mdist.publish("results", out)
dist.barrier()
"""


def measure(configs: list[tuple], world: int, repeats: int, forward_ms: float) -> dict:
    code = WORKER.format(configs=configs, repeats=repeats, fwd=forward_ms, bwd=2 * forward_ms)
    res = launch.run(code, world, timeout=300)
    return res.results["results"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few configurations, one step each (CI smoke)")
    parser.add_argument("--full", action="store_true", help="also p = 8 on 8 ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=40.0,
                        help="stage forward time (backward: twice); longer hides more of the communication")
    args = parser.parse_args()
    if args.quick:
        runs = {4: [("1f1b", 4, 4, 1), ("interleaved", 4, 4, 2)]}
        repeats, args.forward_ms = 1, 10.0
    else:
        runs = {4: [("gpipe", 4, 8, 1), ("1f1b", 2, 2, 1), ("1f1b", 2, 4, 1), ("1f1b", 2, 8, 1),
                    ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1),
                    ("interleaved", 2, 4, 2), ("interleaved", 2, 8, 2),
                    ("interleaved", 4, 8, 2), ("interleaved", 4, 16, 2), ("interleaved", 4, 8, 4)]}
        if args.full:
            runs[8] = [("1f1b", 8, 8, 1), ("1f1b", 8, 16, 1), ("interleaved", 8, 16, 2)]
        repeats = args.repeats
    rows = []
    for world, configs in runs.items():
        for (kind, p, m, v), (bubbles, ours, theirs, peaks) in measure(configs, world, repeats, args.forward_ms).items():
            theory = bubble_fraction_of_total(p, m, v)
            measured = median(bubbles)
            step_ours = median(ours) * 1e3
            step_torch = median(theirs) * 1e3 if theirs else None
            rows.append([kind, p, m, v, round(theory, 4), round(measured, 4), round(measured / theory, 3),
                         round(step_ours, 1), None if step_torch is None else round(step_torch, 1),
                         None if step_torch is None else round(step_ours / step_torch, 3),
                         " ".join(map(str, peaks))])
    report("pipeline_bubbles", ["schedule", "p", "m", "v", "theory (p-1)/(vm+p-1)", "measured", "measured/theory",
                                "step ms ours", "step ms torch", "ours/torch", "peak in-flight per rank"], rows,
           extra={"forward_ms": args.forward_ms, "backward_ms": 2 * args.forward_ms, "repeats": repeats})


if __name__ == "__main__":
    main()
