"""The compare grid's bar chart (`hf_featcal.plotting.comparison_figure`): with 11 merges × 4 steps every
bar carries its score, the legend is off the data, the score axis is zoomed to the scores and the
experts' line is labelled (geometry and artists, no pixels)."""

from __future__ import annotations

from matplotlib.text import Annotation

from hf_featcal.compare import ComparisonResult
from hf_featcal.plotting import comparison_figure, plot_comparison

MERGES = ["average", "task_arithmetic", "ties", "dare", "dare_ties", "regmean", "regmean_plusplus", "tsv_m",
          "iso_c", "iso_cts", "wudi"]
STEPS = ["featcal", "featcal_module", "svc"]


def grid() -> ComparisonResult:
    result = ComparisonResult(tasks=["a", "b"])
    result.scores["experts"] = {"a": 90.0, "b": 91.0, "mean": 90.5}
    for i, merge in enumerate(MERGES):
        result.scores[merge] = {"mean": 66.0 + i}
        for k, step in enumerate(STEPS):
            result.scores[f"{merge}+{step}"] = {"mean": 66.0 + i + 4.0 * (k + 1) - 0.25 * k}
    del result.scores["wudi+featcal_module"]
    result.errors["wudi+featcal_module"] = "RuntimeError: out of memory"
    return result


def test_every_bar_is_labelled_with_its_score_and_gain(tmp_path):
    result = grid()
    figure = comparison_figure(result)
    axes = figure.axes[0]
    bars = [patch for container in axes.containers for patch in container.patches]
    labels = [t.get_text() for t in axes.texts if isinstance(t, Annotation) and t.get_text() != "failed"]
    assert len(bars) == len(labels) == len(result.scores) - 1 == 11 * 4 - 1
    expected = []
    for merge in MERGES:
        plain = result.scores[merge]["mean"]
        expected.append(f"{plain:.1f}")
        for step in STEPS:
            if f"{merge}+{step}" in result.scores:
                mean = result.scores[f"{merge}+{step}"]["mean"]
                expected.append(f"{mean:.1f} ({mean - plain:+.1f})")
    assert labels == expected  # in the grid's order, e.g. "70.0 (+4.0)"
    assert [t.get_text() for t in axes.texts if isinstance(t, Annotation)].count("failed") == 1
    assert [t.get_text() for t in axes.get_yticklabels()] == MERGES

    path = plot_comparison(result, tmp_path / "chart" / "comparison.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_legend_is_off_the_data_the_axis_zoomed_and_the_ceiling_labelled():
    figure = comparison_figure(grid())
    axes = figure.axes[0]
    figure.canvas.draw()
    assert axes.get_legend() is None and len(figure.legends) == 1
    legend = figure.legends[0].get_window_extent()
    assert legend.y1 <= axes.get_window_extent().y0  # below the axes, over no bar
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["none", *STEPS, "experts (ceiling)"]
    low, high = axes.get_xlim()
    assert 60.0 < low < 66.0 and 90.5 < high < 100.0  # the scores' range (66-90.5), not 0-100
    assert any(t.get_text() == "experts 90.5" for t in axes.texts)
