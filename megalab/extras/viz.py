"""Figures and widgets for the course: rank grids (chapter 02); DDP timelines, ZeRO memory and
pipeline timelines (chapter 03).

    rank_grid(tp=2, pp=2, dp=2)      one panel per kind of group; every rank a box, coloured by
                                     the group it belongs to, laid out 8 ranks (one node) per row
    rank_grid_explorer()             the same figure behind sliders for tp/pp/cp/dp/ep and the order
    pipeline_timeline(records)       a Gantt chart: one row per rank, forward (light) and backward
                                     (dark) boxes coloured by micro-batch, like Narayanan et al.'s Figs 3-4
    schedule_explorer()              sliders p, m, v and a schedule -> the simulated timeline and its bubble
    ddp_timeline(timelines)          per rank: backward, gradient hooks, each bucket's reduction
    zero_memory_bars(...)            bytes per rank for ZeRO stages 0-3 (params / grads / optimizer)
    zero_memory_explorer()           the same bars behind sliders: model size, dp size, bytes per value
    planner_bars(plans)              memory per GPU of planned layouts, stacked, against the GPU's memory
    step_time_bars(plans)            why a layout wins: each plan's step as stacked seconds of compute,
                                     recomputation, bubble, exposed communication per kind, optimizer
    validation_plot(rows)            the step-time model's predictions against published runs
    parallelism_planner()            model, GPUs, hardware, sequence, batch, SP/recompute/distributed
                                     optimizer/TP overlap -> the best layouts as a table, memory and time bars
"""

from __future__ import annotations

import functools

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from megalab.core.parallel_state import DEFAULT_ORDER, ParallelSizes, rank_groups
from megalab.core.pipeline_parallel import schedules as pp
from megalab.extras.pipeline_sim import bubble_fraction_of_total, measured_bubble, peak_in_flight, simulate

GROUP_TITLES = {
    "tp": "tensor parallel (tp)", "cp": "context parallel (cp)", "dp": "data parallel (dp)",
    "pp": "pipeline parallel (pp)", "ep": "expert parallel (ep)", "dp-cp": "data x context (dp-cp)",
    "tp-pp": "model parallel (tp-pp)", "etp": "expert tensor parallel (etp)", "edp": "expert data parallel (edp)",
    "embd": "embedding (first+last stage)",
}


def _exercise_in_one_line(show):
    """A widget callback that reports a blank exercise in one line (which one, where) instead of a traceback."""

    @functools.wraps(show)
    def guarded(*args, **kwargs):
        figures = set(plt.get_fignums())
        try:
            return show(*args, **kwargs)
        except NotImplementedError as exc:  # the student version: "exercise <id>: <task> — see <notebook>"
            for number in set(plt.get_fignums()) - figures:  # drop a half-drawn figure
                plt.close(number)
            print(f"This widget needs {exc}" if str(exc).startswith("exercise ") else f"not implemented: {exc}")

    return guarded


def rank_grid(tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1, etp: int | None = None, *,
              order: str = DEFAULT_ORDER, kinds: tuple[str, ...] = ("tp", "cp", "dp", "pp", "ep"),
              ranks_per_row: int = 8):
    """A figure with one row of boxes per node for each kind of group in `kinds`.

    The world is tp * cp * dp * pp ranks; ep (and etp) re-slice the same ranks for expert layers.
    Kinds whose groups are all single ranks are drawn in grey. Raises ValueError for a layout
    that does not fit (the message says why).
    """
    sizes = ParallelSizes(tp * cp * dp * pp, tp, pp, cp, ep, etp, order)
    groups = rank_groups(sizes)
    world = sizes.world_size
    cols = min(ranks_per_row, world)
    rows = -(-world // cols)
    fig, axes = plt.subplots(len(kinds), 1, figsize=(max(4.0, 0.7 * cols + 1), (0.55 * rows + 0.6) * len(kinds)),
                             squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, kind in zip(axes[:, 0], kinds):
        family = groups[kind]
        trivial = all(len(g) == 1 for g in family)
        for index, members in enumerate(family):
            for position, rank in enumerate(members):
                row, col = divmod(rank, cols)
                colour = "0.85" if trivial else cmap((2 * index) % 20 + (index // 10) % 2)  # dark hues first
                ax.add_patch(Rectangle((col, -row), 0.92, 0.85, facecolor=colour, edgecolor="black", linewidth=0.6))
                ax.text(col + 0.46, -row + 0.5, str(rank), ha="center", va="center", fontsize=9)
                ax.text(col + 0.46, -row + 0.15, f"g{index}.{position}", ha="center", va="center", fontsize=6)
        ax.set_xlim(-0.1, cols)
        ax.set_ylim(-rows + 0.9, 0.95)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{GROUP_TITLES.get(kind, kind)}: {len(family)} groups of {len(family[0])}", fontsize=9, loc="left")
    fig.suptitle(f"{world} ranks, order {sizes.dense_generator().order}  (box: rank; g<group>.<rank in group>)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def rank_grid_explorer():
    """Sliders for tp, pp, cp, dp, ep and a choice of order, redrawing `rank_grid` on every change."""
    import ipywidgets as widgets

    @_exercise_in_one_line
    def show(tp, pp, cp, dp, ep, order):
        try:
            fig = rank_grid(tp, pp, cp, dp, ep, order=order)
        except ValueError as exc:
            print(f"not a valid layout: {exc}")
            return
        plt.show(fig)

    slider = lambda name, top: widgets.IntSlider(value=2 if name in ("tp", "dp") else 1, min=1, max=top,
                                                 description=name, continuous_update=False)
    return widgets.interactive(
        show, tp=slider("tp", 8), pp=slider("pp", 4), cp=slider("cp", 4), dp=slider("dp", 8), ep=slider("ep", 8),
        order=widgets.Dropdown(options=["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp", "tp-pp-dp", "dp-tp-pp-cp"],
                               value=DEFAULT_ORDER, description="order"),
    )


def pipeline_timeline(records, title: str | None = None, ax=None, time_unit: str = "ms"):
    """Gantt chart of `pipeline_parallel.OpRecord`s (from `simulate` or the executor's timelines).

    Forward boxes are light, backward boxes dark, both in the micro-batch's colour; the label is
    the micro-batch, with the model chunk after a dot when there are several. White is bubble.
    Times are shown from the first op's start (x1000 for "ms" when the records are in seconds).
    """
    records = list(records)
    ranks = sorted({r.rank for r in records})
    t0 = min(r.start for r in records)
    scale = 1e3 if time_unit == "ms" else 1.0
    span = (max(r.end for r in records) - t0) * scale
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * len(ranks) + 1.0))
    cmap = plt.get_cmap("tab10")
    chunks = max(r.op.chunk for r in records) + 1
    for rec in records:
        row = ranks.index(rec.rank)
        start, width = (rec.start - t0) * scale, (rec.end - rec.start) * scale
        colour = cmap(rec.op.microbatch % 10)
        forward = rec.op.kind == "F"
        ax.add_patch(Rectangle((start, -row - 0.4), width, 0.8, facecolor=colour, alpha=0.45 if forward else 1.0,
                               edgecolor="black", linewidth=0.5, hatch="//" if rec.op.chunk % 2 else None))
        label = str(rec.op.microbatch) + (f".{rec.op.chunk}" if chunks > 1 else "")
        if width > span / 150:
            ax.text(start + width / 2, -row, label, ha="center", va="center", fontsize=7,
                    color="black" if forward else "white")
    ax.set_yticks([-i for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlim(0, span)
    ax.set_ylim(-len(ranks) + 0.45, 0.55)
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    bubble = measured_bubble(records)
    ax.set_title(title or f"bubble {bubble:.1%} of the step (light: forward, dark: backward)", fontsize=10,
                 loc="left")
    ax.figure.tight_layout()
    return ax.figure


def schedule_explorer():
    """Sliders p, m, v and a schedule: the simulated timeline (backward = 2 x forward) and its bubble."""
    import ipywidgets as widgets

    @_exercise_in_one_line
    def show(schedule, p, m, v):
        v = v if schedule == "interleaved" else 1
        try:
            records = simulate(p, m, v, schedule, forward_time=1 / v, backward_time=2 / v)
        except ValueError as exc:
            print(f"not a valid schedule: {exc}")
            return
        measured, theory = measured_bubble(records), bubble_fraction_of_total(p, m, v)
        peaks = [peak_in_flight(pp.get_schedule(p, r, m, v, schedule)) for r in range(p)]
        fig = pipeline_timeline(records, time_unit="", title=(
            f"{schedule}: p={p}, m={m}, v={v}  bubble {measured:.1%} of the step (theory (p-1)/(vm+p-1) = "
            f"{theory:.1%})  peak in-flight micro-batches per rank {peaks}"))
        plt.show(fig)

    slider = lambda name, value, top: widgets.IntSlider(value=value, min=1, max=top, description=name,
                                                        continuous_update=False)
    return widgets.interactive(
        show, schedule=widgets.Dropdown(options=["gpipe", "1f1b", "interleaved"], value="1f1b",
                                        description="schedule"),
        p=slider("p", 4, 8), m=slider("m", 8, 24), v=slider("v", 2, 4),
    )


def ddp_timeline(timelines: dict[int, dict], title: str = ""):
    """One row per rank from DistributedDataParallel.timeline: backward span, hook ticks, bucket reductions.

    timelines: {rank: {"backward": (start, end), "events": [(t, event, bucket), ...]}} in
    time.perf_counter() seconds; each rank is drawn relative to its own backward start.
    """
    fig, ax = plt.subplots(figsize=(8, 0.9 * len(timelines) + 1))
    cmap = plt.get_cmap("tab10")
    for row, (_, tl) in enumerate(sorted(timelines.items())):
        t0, t1 = tl["backward"]
        y = -row
        ax.broken_barh([(0, (t1 - t0) * 1e3)], (y + 0.05, 0.3), color="0.8")
        launched = {}
        for t, event, bucket in tl["events"]:
            ms = (t - t0) * 1e3
            if event == "grad_ready":
                ax.plot([ms, ms], [y + 0.05, y + 0.35], color="black", lw=0.8)
            elif event == "launch":
                launched[bucket] = ms
            elif event == "done" and bucket in launched:
                ax.broken_barh([(launched[bucket], max(ms - launched[bucket], 0.01))], (y - 0.4, 0.35),
                               color=cmap(bucket % 10))
                ax.text(launched[bucket], y - 0.22, f" b{bucket}", va="center", fontsize=7)
    ax.set_yticks([-r for r in range(len(timelines))], [f"rank {r}" for r in sorted(timelines)])
    ax.set_xlabel("ms since this rank's backward started  (grey: backward, ticks: grad hooks, colour: bucket reductions)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def zero_memory_bars(num_parameters: float, data_parallel_size: int, *, measured: dict[int, dict] | None = None,
                     optimizer_bytes_per_param: float = 12, param_bytes: float = 2, grad_bytes: float = 2, ax=None):
    """Stacked bars of bytes per rank for ZeRO stages 0-3 from calc.zero_memory_per_device.

    measured: {stage: {"params", "grads", "optimizer"} bytes} drawn as hatched bars beside the formula.
    """
    from megalab.extras.calc import zero_memory_per_device

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    parts, colours = ("params", "grads", "optimizer"), ("tab:blue", "tab:orange", "tab:green")
    unit, unit_name = (1e9, "GB") if num_parameters * param_bytes > 1e9 else (1e3, "KB")
    width = 0.38 if measured else 0.6
    for stage in range(4):
        bars = [("formula", zero_memory_per_device(num_parameters, data_parallel_size, stage,
                                                   optimizer_bytes_per_param, param_bytes, grad_bytes), "", 0.0)]
        if measured and stage in measured:
            bars = [(bars[0][0], bars[0][1], "", -width / 2), ("measured", measured[stage], "//", width / 2)]
        for _, values, hatch, dx in bars:
            bottom = 0.0
            for part, colour in zip(parts, colours):
                ax.bar(stage + dx, values[part] / unit, width, bottom=bottom, color=colour, hatch=hatch,
                       edgecolor="white", label=part if stage == 0 and not hatch else None)
                bottom += values[part] / unit
    ax.set_xticks(range(4), ["stage 0\n(DDP)", "stage 1\n(P_os)", "stage 2\n(P_os+g)", "stage 3\n(P_os+g+p)"])
    ax.set_ylabel(f"{unit_name} per rank")
    what = "formula (plain) vs measured (hatched)" if measured else "formula"
    ax.set_title(f"{num_parameters:.3g} parameters, dp = {data_parallel_size}: {what}", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def zero_memory_explorer():
    """Sliders: parameters (billions), data-parallel size, bytes per value -> zero_memory_bars."""
    import ipywidgets as widgets

    @_exercise_in_one_line
    def show(billions, dp, param_bytes, grad_bytes, optimizer_bytes):
        zero_memory_bars(billions * 1e9, dp, optimizer_bytes_per_param=optimizer_bytes, param_bytes=param_bytes,
                         grad_bytes=grad_bytes)
        plt.show()

    return widgets.interactive(
        show,
        billions=widgets.FloatLogSlider(value=7.5, base=10, min=-1, max=3, description="params (B)",
                                        continuous_update=False),
        dp=widgets.IntSlider(value=64, min=1, max=1024, description="dp", continuous_update=False),
        param_bytes=widgets.IntSlider(value=2, min=1, max=4, description="param B"),
        grad_bytes=widgets.IntSlider(value=2, min=1, max=4, description="grad B"),
        optimizer_bytes=widgets.IntSlider(value=12, min=0, max=16, description="optim B"),
    )


def planner_bars(plans, gpu_memory_gb: float, headroom: float = 0.1, ax=None):
    """Stacked GB per GPU (weights, grads, optimizer, activations) of each plan, best first, with
    the GPU's memory and the usable part (after headroom) as lines."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(plans) + 2), 3.8))
    parts = ("params", "grads", "optimizer", "activations")
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for i, plan in enumerate(plans):
        bottom = 0.0
        for part, colour in zip(parts, colours):
            value = plan.memory[part] / 1e9
            ax.bar(i, value, 0.7, bottom=bottom, color=colour, label=part if i == 0 else None,
                   hatch="" if plan.fits else "//", edgecolor="white")
            bottom += value
    ax.axhline(gpu_memory_gb, color="black", linewidth=1, label=f"{gpu_memory_gb:g} GB GPU")
    ax.axhline(gpu_memory_gb * (1 - headroom), color="black", linewidth=1, linestyle="--", label="usable")
    ax.set_xticks(range(len(plans)), [str(p.layout) for p in plans], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GB per GPU (first stage)")
    ax.legend(fontsize=7, ncol=3)
    return ax


STEP_COLOURS = {"compute": "tab:blue", "recompute": "tab:cyan", "bubble": "lightgrey", "tp comm": "tab:red",
                "cp comm": "tab:orange", "ep comm": "tab:purple", "pp comm": "tab:brown", "dp comm": "tab:green",
                "optimizer": "black"}


def step_time_bars(plans, ax=None):
    """Each plan's estimated step (step_time.StepTime.parts()), stacked: what the GPU spends on its own
    work, on recomputation, idle in the bubble, waiting on each kind of communication, in the optimizer."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(plans) + 2), 3.8))
    for i, plan in enumerate(plans):
        bottom = 0.0
        for part, seconds in plan.time.parts().items():
            if seconds <= 0:
                continue
            ax.bar(i, seconds, 0.7, bottom=bottom, color=STEP_COLOURS[part], edgecolor="white",
                   hatch="" if plan.fits else "//", label=part)
            bottom += seconds
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend([unique[k] for k in STEP_COLOURS if k in unique], [k for k in STEP_COLOURS if k in unique],
              fontsize=7, ncol=3)
    ax.set_xticks(range(len(plans)), [str(p.layout) for p in plans], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step")
    return ax


def validation_plot(rows, ax=None):
    """Predicted against published, one point per figure (published_runs.validation_rows), with the ±15% band."""
    if ax is None:
        _, ax = plt.subplots(figsize=(4.8, 4.2))
    groups = {"Table 1": "tab:blue", "ZeRO-3": "tab:red", "PTD-P": "tab:green", "Korthikanti": "tab:purple"}
    for key, colour in groups.items():
        pts = [r for r in rows if key in r["source"]]
        ratio = [(r["published"], r["predicted"]) for r in pts]
        # MFU/HFU (%) and TFLOP/s share one axis as a fraction of the A100's peak
        scale = [1 / 312 if r["metric"].startswith("TFLOP") else 1 / 100 for r in pts]
        ax.scatter([p * k for (p, _), k in zip(ratio, scale)], [q * k for (_, q), k in zip(ratio, scale)],
                   s=18, color=colour, label=key if key != "Table 1" else "Narayanan Table 1")
    ax.plot([0, 0.7], [0, 0.7], color="black", linewidth=1)
    ax.fill_between([0, 0.7], [0, 0.7 * 0.85], [0, 0.7 * 1.15], color="grey", alpha=0.2, label="±15%")
    ax.set_xlim(0.1, 0.65), ax.set_ylim(0.1, 0.65)
    ax.set_xlabel("published (fraction of the A100's 312 TFLOP/s)")
    ax.set_ylabel("predicted")
    ax.legend(fontsize=7)
    return ax


def parallelism_planner():
    """Dropdowns and sliders -> planner.plan: the table of the best layouts, their memory and their step time."""
    import ipywidgets as widgets

    from megalab.extras import planner, step_time

    @_exercise_in_one_line
    def show(model, gpus, hardware, seq_length, global_batch, gpu_memory, sequence_parallel, recompute,
             distributed_optimizer, tp_comm_overlap):
        train = planner.Training(seq_length=seq_length, global_batch_size=global_batch, gpu_memory_gb=gpu_memory,
                                 sequence_parallel=sequence_parallel, recompute=recompute,
                                 use_distributed_optimizer=distributed_optimizer, hardware=hardware,
                                 tp_comm_overlap=tp_comm_overlap)
        plans = planner.plan(planner.MODELS[model], gpus, train)
        if not plans:
            print(f"no valid layout of {gpus} GPUs for {model} with a global batch of {global_batch}")
            return
        fitting = sum(p.fits for p in plans)
        print(f"{model}: {len(plans)} valid layouts on {gpus} GPUs, {fitting} fit in {gpu_memory:g} GB "
              f"(keeping {train.memory_headroom:.0%} free)\n")
        print(planner.table(plans, 10))
        _, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
        planner_bars(plans[:12], gpu_memory, train.memory_headroom, ax=left)
        step_time_bars(plans[:12], ax=right)
        right.set_title("why a layout wins: the step, piece by piece", fontsize=9)
        plt.tight_layout()
        plt.show()

    return widgets.interactive(
        show,
        model=widgets.Dropdown(options=list(planner.MODELS), value="LLaMA-3 70B", description="model"),
        gpus=widgets.Dropdown(options=[8, 16, 32, 64, 128, 256, 512, 1024, 2048], value=64, description="GPUs"),
        hardware=widgets.Dropdown(options=list(step_time.HARDWARE), value="H100-SXM (DGX H100)", description="cluster"),
        seq_length=widgets.Dropdown(options=[2048, 4096, 8192, 16384, 32768, 131072], value=8192, description="seq"),
        global_batch=widgets.Dropdown(options=[64, 128, 256, 512, 1024, 2048], value=512, description="batch"),
        gpu_memory=widgets.Dropdown(options=[40.0, 80.0, 94.0, 141.0, 192.0], value=80.0, description="GPU GB"),
        sequence_parallel=widgets.Checkbox(value=True, description="sequence parallel"),
        recompute=widgets.Dropdown(options=["selective", "none", "full"], value="selective", description="recompute"),
        distributed_optimizer=widgets.Checkbox(value=True, description="distributed optimizer"),
        tp_comm_overlap=widgets.Checkbox(value=False, description="TP comm overlap"),
    )
