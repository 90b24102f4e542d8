"""The rank-grid figure and its explorer build for valid layouts and explain invalid ones."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from megalab.extras import viz  # noqa: E402


@pytest.mark.exercise("parallel_state.get_ranks")
def test_rank_grid_draws_every_rank_once_per_kind():
    fig = viz.rank_grid(tp=2, pp=2, cp=2, dp=2, ep=2, kinds=("tp", "dp", "pp", "ep"))
    axes = fig.get_axes()
    where = "viz.rank_grid(tp=2, pp=2, cp=2, dp=2, ep=2) for tp, dp, pp, ep"
    assert len(axes) == 4, f"{where} drew {len(axes)} panels, expected 4 (one per kind)"
    assert all(len(ax.patches) == 16 for ax in axes), (
        f"{where}: ranks drawn per panel {[len(ax.patches) for ax in axes]}, expected 16 each (every rank once)")
    title = axes[0].get_title(loc="left")
    assert title.endswith("8 groups of 2"), f"{where}: the tp panel's title {title!r} should end in '8 groups of 2'"
    plt.close(fig)


def test_rank_grid_rejects_bad_layout():
    with pytest.raises(ValueError, match="expert"):
        viz.rank_grid(tp=2, dp=2, ep=4)


def test_explorer_builds():
    widget = viz.rank_grid_explorer()
    assert [c.description for c in widget.children[:6]] == ["tp", "pp", "cp", "dp", "ep", "order"]
    plt.close("all")


@pytest.mark.exercise("pp.num_warmup")
@pytest.mark.exercise("pp.one_f_one_b")
def test_pipeline_timeline_draws_every_op():
    from megalab.extras.pipeline_sim import simulate

    records = simulate(4, 8, kind="1f1b")
    fig = viz.pipeline_timeline(records, time_unit="")
    ax = fig.get_axes()[0]
    where = "viz.pipeline_timeline of a simulated 1F1B schedule (pp=4, m=8)"
    assert len(ax.patches) == 4 * 16, f"{where} drew {len(ax.patches)} ops, expected 64 (4 ranks x 8 forwards + 8 backwards)"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"rank {r}" for r in range(4)], f"{where}: the row labels are {labels}, expected rank 0..3"
    title = ax.get_title(loc="left")
    assert "27.3%" in title, f"{where}: the title {title!r} should give the bubble (p-1)/(m+p-1) = 3/11 = 27.3%"
    plt.close(fig)


def test_schedule_explorer_builds():
    widget = viz.schedule_explorer()
    assert [c.description for c in widget.children[:4]] == ["schedule", "p", "m", "v"]
    plt.close("all")
def test_ddp_timeline_draws_backward_and_buckets():
    events = [(0.001, "grad_ready", 0), (0.002, "launch", 0), (0.004, "done", 0), (0.005, "finish", -1)]
    fig = viz.ddp_timeline({0: {"backward": (0.0, 0.003), "events": events},
                            1: {"backward": (0.0, 0.003), "events": events}})
    ax = fig.get_axes()[0]
    assert len(ax.collections) == 4  # per rank: the backward bar and one bucket bar
    plt.close(fig)


def test_zero_memory_bars_and_explorer():
    measured = {s: {"params": 1e3, "grads": 1e3, "optimizer": 1e3} for s in range(4)}
    ax = viz.zero_memory_bars(1e6, 4, measured=measured)
    assert len(ax.patches) == 4 * 2 * 3  # stages x (formula, measured) x parts
    plt.close(ax.figure)
    assert viz.zero_memory_explorer().children
