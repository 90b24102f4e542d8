"""Figures and widgets for the course: rank grids (chapter 02).

    rank_grid(tp=2, pp=2, dp=2)      one panel per kind of group; every rank a box, coloured by
                                     the group it belongs to, laid out 8 ranks (one node) per row
    rank_grid_explorer()             the same figure behind sliders for tp/pp/cp/dp/ep and the order
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from megalab.parallel_state import DEFAULT_ORDER, ParallelSizes, rank_groups

GROUP_TITLES = {
    "tp": "tensor parallel (tp)", "cp": "context parallel (cp)", "dp": "data parallel (dp)",
    "pp": "pipeline parallel (pp)", "ep": "expert parallel (ep)", "dp-cp": "data x context (dp-cp)",
    "tp-pp": "model parallel (tp-pp)", "etp": "expert tensor parallel (etp)", "edp": "expert data parallel (edp)",
    "embd": "embedding (first+last stage)",
}


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
