"""Plot a FeatCal drift report: per-block feature drift before (dashed) and after (solid), per task.

Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it works headless
and never opens a window.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .report import DriftReport

__all__ = ["comparison_figure", "plot_comparison", "plot_drift", "plot_sample_efficiency", "sample_efficiency_figure"]


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


#: Colours of the compare grid's post-merging steps (another step takes the next free one of the cycle).
_STEP_COLOURS = {"none": "#9e9e9e", "featcal": "#1f77b4", "featcal_module": "#17becf", "svc": "#ff7f0e",
                 "surgery": "#2ca02c", "prob_surgery": "#d62728"}


def plot_comparison(result: Any, path: str | os.PathLike, *, dpi: int = 120) -> str:
    """Write `comparison_figure(result)` (a `compare.ComparisonResult`) as an image file; returns the path."""
    return _save_figure(comparison_figure(result), path, dpi)


def _save_figure(figure: Any, path: str | os.PathLike, dpi: int) -> str:
    """`figure` written to `path` (its folders made); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def comparison_figure(result: Any) -> Any:
    """Horizontal bar chart of a `compare.ComparisonResult`: one group per merge (top to bottom in the
    grid's order), one bar per post-merging step, each labelled with its mean score and, for a step,
    its gain over the merge alone; the score axis spans the data (not 0-100), so a gain of a point is
    visible; the experts' mean is a labelled dashed line; the legend sits below the axes. A failed row
    gets a "failed" label in place of its bar. Returns the matplotlib ``Figure`` (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    rows = [r for r in result.rows() if r != "experts"]
    merges = list(dict.fromkeys(r.split("+", 1)[0] for r in rows))
    steps = ["none", *dict.fromkeys(r.split("+", 1)[1] for r in rows if "+" in r)]
    if not any(r == m for r in rows for m in merges):  # no plain merge row asked for
        steps = steps[1:]
    mean = result.mean_key  # "mean", unless a task is named so
    means = [result.scores[r][mean] for r in rows if r in result.scores]
    ceiling = result.scores["experts"][mean] if "experts" in result.scores else None
    values = means + ([ceiling] if ceiling is not None else [])
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    span = (high - low) or max(abs(high), 1.0)
    left, right = low - 0.12 * span, high + 0.22 * span  # room on the right for the labels

    bar, gap = 1.0, 0.8  # bar height and the gap between groups, in bar heights
    group = len(steps) * bar + gap
    figure = Figure(figsize=(8.0, 1.4 + 0.16 * group * max(len(merges), 1)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    free = iter(c for c in _colours(len(steps) + len(_STEP_COLOURS)) if c not in _STEP_COLOURS.values())
    colours = {step: _STEP_COLOURS.get(step) or next(free) for step in steps}
    for i, merge in enumerate(merges):
        plain = result.scores.get(merge, {}).get(mean)
        for k, step in enumerate(steps):
            row = merge if step == "none" else f"{merge}+{step}"
            y = i * group + k * bar
            if row in result.scores:
                score = result.scores[row][mean]
                bars = axes.barh(y, score - left, left=left, height=0.9 * bar, color=colours[step])
                text = f"{score:.1f}" if step == "none" or plain is None else f"{score:.1f} ({score - plain:+.1f})"
                # a white box: the experts' line does not strike a label through
                axes.bar_label(bars, [text], padding=2, fontsize=7, zorder=3,
                               bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.85})
            elif row in result.errors:
                axes.annotate("failed", (left, y), xytext=(3, 0), textcoords="offset points", va="center",
                              fontsize=7, color="#c62828")
    axes.set_yticks([i * group + (len(steps) - 1) * bar / 2 for i in range(len(merges))], merges)
    axes.set_ylim(len(merges) * group - gap + 0.2, -0.8)  # first merge on top
    axes.set_xlim(left, right)
    axes.set_xlabel("mean score over tasks (axis zoomed to the scores)")
    axes.set_title("merge × post-merging step")
    axes.grid(True, axis="x", alpha=0.3)
    axes.tick_params(axis="y", length=0)
    handles: list[Any] = [Patch(color=colours[step], label=step) for step in steps]
    if ceiling is not None:
        handles.append(axes.axvline(ceiling, color="black", linestyle="--", linewidth=1, zorder=1,
                                    label="experts (ceiling)"))
        on_top = blended_transform_factory(axes.transData, axes.transAxes)
        axes.text(ceiling, 1.0, f"experts {ceiling:.1f}", transform=on_top, va="bottom", ha="center", fontsize=7)
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize="small", frameon=False)
    return figure


def plot_sample_efficiency(result: Any, path: str | os.PathLike, *, dpi: int = 120) -> str:
    """Write `sample_efficiency_figure(result)` (a `compare.ComparisonResult` with ``samples``) as an
    image file; returns the path."""
    return _save_figure(sample_efficiency_figure(result), path, dpi)


def sample_efficiency_figure(result: Any) -> Any:
    """Mean score against calibration examples per task (log axis, ticks at the numbers run), one panel
    per merge: one line with markers per post-merging step run at each number, the merge itself and the
    steps without data as flat lines (dotted), the experts' mean as the dashed black ceiling. A failed
    run is a gap in its line. Returns the matplotlib ``Figure`` (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not result.samples:
        raise ValueError("the comparison has no sample-efficiency axis (it was run without `samples`)")
    counts = list(result.samples)
    curves = result.curves()
    merges = list(curves)
    ceiling = result.scores["experts"][result.mean_key] if "experts" in result.scores else None
    columns = min(len(merges), 3) or 1
    panels = -(-max(len(merges), 1) // columns)
    figure = Figure(figsize=(max(6.4, 4.2 * columns), 3.3 * panels + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    steps = list(dict.fromkeys(step for merge in merges for step in curves[merge]))
    free = iter(c for c in _colours(len(steps) + len(_STEP_COLOURS)) if c not in _STEP_COLOURS.values())
    colours = {step: _STEP_COLOURS.get(step) or next(free) for step in steps}
    handles: dict[str, Any] = {}
    for index, merge in enumerate(merges):
        axes = figure.add_subplot(panels, columns, index + 1)
        for step, points in curves[merge].items():
            label = f"{merge} (merge only)" if step == "none" else step
            if "any" in points:  # run once: a flat line across the axis
                if points["any"] is None:
                    continue
                line = axes.plot([counts[0], counts[-1]], [points["any"]] * 2, linestyle=":", linewidth=1.6,
                                 color=colours[step], label=label)[0]
                handles.setdefault("merge only" if step == "none" else f"{step} (no data)", line)
                continue
            values = [points.get(str(n)) for n in counts]
            line = axes.plot(counts, [float("nan") if v is None else v for v in values], marker="o", markersize=4,
                             linewidth=1.6, color=colours[step], label=label)[0]
            handles.setdefault(step, line)
        if ceiling is not None:
            handles.setdefault("experts (ceiling)", axes.axhline(ceiling, color="black", linestyle="--",
                                                                  linewidth=1))
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, [str(n) for n in counts])
        axes.minorticks_off()
        axes.set_title(merge, fontsize="medium")
        axes.set_xlabel("calibration examples per task")
        axes.set_ylabel("mean score")
        axes.grid(True, alpha=0.3)
    figure.suptitle("accuracy against calibration examples per task")
    figure.legend(list(handles.values()), list(handles), loc="outside lower center",
                  ncol=min(len(handles), 3 if columns == 1 else 5), fontsize="small", frameon=False)
    return figure


def _colours(count: int) -> list[Any]:
    """The default colour cycle, or tab20 when there are more tasks than it has colours."""
    from matplotlib import colormaps, rcParams

    cycle = [c["color"] for c in rcParams["axes.prop_cycle"]]
    if count <= len(cycle):
        return cycle
    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]
