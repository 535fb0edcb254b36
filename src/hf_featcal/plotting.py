"""Plot a FeatCal drift report: per-block feature drift before (dashed) and after (solid), per task.

Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it works headless
and never opens a window.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .report import DriftReport

__all__ = ["plot_comparison", "plot_drift"]


def plot_drift(
    report: DriftReport | Mapping[str, Any] | str | os.PathLike,
    path: str | os.PathLike,
    *,
    title: str | None = "FeatCal: feature drift per block",
    log_scale: bool = False,
    dpi: int = 120,
) -> str:
    """Draw the drift of every task per block, before (dashed) vs after (solid) calibration.

    One colour per task; the x axis is the block index (T5: encoder blocks, then decoder blocks), the
    y axis the mean ‖h_merged − h_expert‖₂ per token at the block's output.

    Args:
        report: a `DriftReport`, its `to_dict()` form, or a folder / JSON file written by
            `DriftReport.save` (or `FeatCalCalibrator.save_model`).
        path: the image file to write (the format follows the suffix; ``.png`` recommended). Parent
            folders are created.
        title: figure title (None: no title).
        log_scale: use a logarithmic y axis.
        dpi: resolution of the saved image.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: when the report holds no drift values.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if isinstance(report, (str, os.PathLike)):
        report = DriftReport.load(report)
    elif isinstance(report, Mapping):
        report = DriftReport.from_dict(dict(report))
    if not isinstance(report, DriftReport):
        raise TypeError(
            f"`report` must be a DriftReport, its dict form or a saved report path, got {type(report).__name__}"
        )
    tasks = {t: s for t, s in report.tasks.items() if s.get("before") or s.get("after")}
    if not tasks:
        raise ValueError("the drift report has no values to plot (was it run with report_drift=False?)")

    figure = Figure(figsize=(7.0, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    cycle = _colours(len(tasks))
    handles: list[Any] = []
    for index, (task, stages) in enumerate(tasks.items()):
        colour = cycle[index % len(cycle)]
        before, after = stages.get("before", []), stages.get("after", [])
        if before:
            axes.plot(range(len(before)), before, linestyle="--", marker="o", markersize=3, color=colour, alpha=0.8)
        if after:
            axes.plot(range(len(after)), after, linestyle="-", marker="o", markersize=3, color=colour)
        handles.append(Line2D([], [], color=colour, linewidth=2, label=task))
    blocks = max(max(len(s.get("before", [])), len(s.get("after", []))) for s in tasks.values())
    if blocks <= 24:
        axes.set_xticks(range(blocks))
    axes.set_xlabel("block")
    axes.set_ylabel("drift ‖h_merged − h_expert‖ per token")
    if log_scale:
        axes.set_yscale("log")
    if title:
        axes.set_title(title)
    axes.grid(True, alpha=0.3)
    handles += [
        Line2D([], [], color="black", linestyle="--", label="before (merged)"),
        Line2D([], [], color="black", linestyle="-", label="after (FeatCal)"),
    ]
    axes.legend(handles=handles, fontsize="small", ncol=2 if len(handles) > 6 else 1)
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def plot_comparison(result: Any, path: str | os.PathLike, *, dpi: int = 120) -> str:
    """Bar chart of a `compare.ComparisonResult`: the mean score of every merge, one bar per
    post-merging step, with the experts' mean as the ceiling line. Failed rows get no bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    merges = [r for r in result.rows() if r != "experts" and "+" not in r]
    merges += [r.split("+", 1)[0] for r in result.rows() if "+" in r and r.split("+", 1)[0] not in merges]
    steps = ["none"] + sorted({r.split("+", 1)[1] for r in result.rows() if "+" in r})
    figure = Figure(figsize=(max(6.0, 1.3 * len(merges) + 2), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.8 / len(steps)
    cycle = _colours(len(steps))
    for k, step in enumerate(steps):
        xs, heights = [], []
        for i, merge in enumerate(merges):
            row = merge if step == "none" else f"{merge}+{step}"
            if row in result.scores:
                xs.append(i + (k - (len(steps) - 1) / 2) * width)
                heights.append(result.scores[row]["mean"])
        axes.bar(xs, heights, width=width, color=cycle[k % len(cycle)], label=step)
    if "experts" in result.scores:
        axes.axhline(result.scores["experts"]["mean"], color="black", linestyle="--", linewidth=1, label="experts")
    axes.set_xticks(range(len(merges)), merges, rotation=20)
    axes.set_ylabel("mean score over tasks")
    axes.set_title("merge × post-merging")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize="small")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def _colours(count: int) -> list[Any]:
    """The default colour cycle, or tab20 when there are more tasks than it has colours."""
    from matplotlib import colormaps, rcParams

    cycle = [c["color"] for c in rcParams["axes.prop_cycle"]]
    if count <= len(cycle):
        return cycle
    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]
