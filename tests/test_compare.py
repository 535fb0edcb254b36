"""`compare_post_merging`: every row is the score of the model that row names (recomputed here by
calling the merge and FeatCal directly), each merge is computed once, a failing combination is
reported without stopping the grid, and the files are written."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from datasets import Dataset

import hf_featcal.merging as merging
from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.compare import compare_post_merging, post_merging_steps
from hf_featcal.regmean import regmean_merging
from testing_utils import build_clip_setting


@pytest.fixture
def setting(generator):
    base, experts, _, data = build_clip_setting(generator)
    probes = {t: torch.randn(3, 3, 8, 8, generator=generator) for t in experts}

    def evaluate(model):  # closer to each expert's features on its own probes = higher
        with torch.no_grad():
            return {t: -float((model(pixel_values=x).pooler_output - experts[t](pixel_values=x).pooler_output).norm())
                    for t, x in probes.items()}

    return base, experts, data, evaluate


def test_rows_are_the_scores_of_the_models_they_name(setting, monkeypatch):
    base, experts, data, evaluate = setting
    calls = []
    original = merging.merge_models
    monkeypatch.setattr(merging, "merge_models", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    config = FeatCalConfig(num_samples_per_task=8)
    result = compare_post_merging(base, experts, data, evaluate, merges=["task_arithmetic", "ties", "regmean"],
                                  post_merging=["none", "featcal"], featcal_config=config)
    assert calls == ["task_arithmetic", "ties", "regmean"]  # each merge once, reused by every post-merging step
    assert result.errors == {}
    assert list(result.scores) == ["experts", "task_arithmetic", "task_arithmetic+featcal", "ties", "ties+featcal",
                                   "regmean", "regmean+featcal"]
    assert result.scores["experts"]["mean"] == 0.0  # each expert is its own target
    for method, params in (("task_arithmetic", {"scaling_factor": 0.3}),
                           ("ties", {"scaling_factor": 0.3, "density": 0.2})):
        merged = original(base, experts, method, **params)
        direct = evaluate(merged)
        assert result.scores[method] == pytest.approx({**direct, "mean": sum(direct.values()) / 2}, rel=1e-6)
        calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, config, show_progress=False)
        after = evaluate(calibrator.calibrate())
        assert result.scores[f"{method}+featcal"] == pytest.approx({**after, "mean": sum(after.values()) / 2}, rel=1e-6)
        assert result.drift[f"{method}+featcal"] == pytest.approx(
            {t: d["after"][-1] for t, d in calibrator.report.tasks.items()}
        )
        assert result.drift[method] == pytest.approx({t: d["before"][-1] for t, d in calibrator.report.tasks.items()})
    direct = evaluate(regmean_merging(base, experts, data, num_samples_per_task=8))
    assert result.scores["regmean"] == pytest.approx({**direct, "mean": sum(direct.values()) / 2}, rel=1e-6)
    assert result.scores["task_arithmetic+featcal"]["mean"] > result.scores["task_arithmetic"]["mean"]


def test_a_failing_combination_is_reported_and_the_grid_goes_on(setting, tmp_path):
    base, experts, data, evaluate = setting
    ties = merging.merge_models(base, experts, "ties", scaling_factor=0.3, density=0.2)

    def evaluate_or_fail(model):  # the caller's evaluation fails on the TIES merge only, with a multi-line message
        if all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), ties.state_dict().values(), strict=True)):
            raise RuntimeError("out of memory | try a smaller batch\nor another device")
        return evaluate(model)

    result = compare_post_merging(base, experts, data, evaluate_or_fail, merges=["ties", "average"],
                                  post_merging=["none", "featcal"],
                                  featcal_config=FeatCalConfig(num_samples_per_task=8))
    assert result.errors == {"ties": "RuntimeError: out of memory | try a smaller batch\nor another device"}
    assert {"ties+featcal", "average", "average+featcal"} <= set(result.scores)
    table = result.to_markdown()
    # every line of the table has the header's cells: an error's `|` is escaped, its line break removed
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table.splitlines()]
    columns = ["", "", *result.tasks, "mean", "drift", "seconds", "memory", "task at inference", "parameters", ""]
    assert len(cells) == 2 + len(result.rows()) and set(cells) == {len(columns)}
    # the cost columns are the row's seconds and peak memory, failed rows too
    for row in result.rows():
        line = next(x for x in table.splitlines() if x.startswith(f"| {row} |"))
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)][1:-1]
        inference = ["no", "0"] if row in result.scores and row != "experts" else ["", ""]
        assert cells[-4:] == [f"{result.seconds[row]:.1f}", f"{result.memory[row]:.0f}", *inference], line
    assert "| ties | failed: RuntimeError: out of memory \\| try a smaller batch or another device |" in table
    assert "| average+featcal |" in table
    paths = result.save(tmp_path / "out")
    assert json.loads(open(paths["json"]).read()) == json.loads(json.dumps(result.to_dict()))
    assert open(paths["md"]).read() == table
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _evaluations(evaluate):
    calls = []

    def counted(model):
        calls.append(model)
        return evaluate(model)

    return calls, counted


@pytest.mark.parametrize("merges,match", [
    ({"ties": {"density": 5.0}, "average": {}}, r"`merges\['ties'\]\['density'\]` must be in \(0, 1\], got 5.0"),
    ({"regmean": {"reduction": -1}}, r"`merges\['regmean'\]\['reduction'\]` must be in \[0, 1\], got -1"),
    ({"dare": {"drop_rate": 0.5, "density": 0.2}}, r"`merges\['dare'\]`: unknown parameter 'density'"),
])
def test_bad_merge_parameters_are_refused_before_any_work(setting, merges, match):
    base, experts, data, evaluate = setting
    calls, counted = _evaluations(evaluate)
    with pytest.raises(ValueError, match=match):
        compare_post_merging(base, experts, data, counted, merges=merges)
    assert calls == []  # not even the experts' row (computed before the first merge)


def test_missing_or_empty_calibration_data_is_refused_before_any_merge(setting):
    base, experts, data, evaluate = setting
    calls, counted = _evaluations(evaluate)
    with pytest.raises(ValueError,
                       match=r"tasks \['dtd'\] have an expert in `experts` but no entry in `calibration_data`"):
        compare_post_merging(base, experts, {"cars": data["cars"]}, counted, merges=["average"])
    for empty in ([], Dataset.from_dict({"pixel_values": []})):
        with pytest.raises(ValueError, match=r"calibration_data\['dtd'\] is empty"):
            compare_post_merging(base, experts, {**data, "dtd": empty}, counted, merges=["average"])
    assert calls == []


def test_an_evaluation_without_a_task_names_it(setting):
    base, experts, data, evaluate = setting

    def only_cars(model):
        return {"cars": evaluate(model)["cars"]}

    with pytest.raises(ValueError, match=r"`evaluate` returned no score for the tasks \['dtd'\] of experts\['dtd'\] "
                                         r"\(it returned \['cars'\]\)"):
        compare_post_merging(base, experts, data, only_cars, merges=["average"], post_merging=["none"])


def test_a_fast_mode_dtype_that_cannot_run_the_models_is_refused_before_any_merge(setting):
    base, experts, data, evaluate = setting
    calls, counted = _evaluations(evaluate)
    half = {t: copy.deepcopy(e).to(torch.float16) for t, e in experts.items()}
    with pytest.raises(ValueError, match=r"forward_dtype='bfloat16' cannot run `base`, whose weights are float16"):
        compare_post_merging(copy.deepcopy(base).to(torch.float16), half, data, counted, merges=["average"],
                             featcal_config=FeatCalConfig(forward_dtype="bfloat16"))
    assert calls == []


def test_unknown_methods_and_steps_are_named(setting):
    base, experts, data, evaluate = setting
    with pytest.raises(ValueError, match=r"`merges`: unknown methods \['slerp'\]"):
        compare_post_merging(base, experts, data, evaluate, merges=["slerp"])
    with pytest.raises(ValueError, match=r"`post_merging`: unknown steps \['magic'\]"):
        compare_post_merging(base, experts, data, evaluate, post_merging=["magic"])
    assert post_merging_steps()[:2] == ("none", "featcal")


def test_a_task_named_mean_keeps_its_score(setting, tmp_path):
    """A task may be named "mean": its score stays under its name, the mean over the tasks goes under
    `mean_key` ("(mean)"), in the scores, the table and the chart."""
    base, experts, data, evaluate = setting
    renamed = dict(zip(("mean", "b"), experts.values(), strict=True))
    data = dict(zip(("mean", "b"), data.values(), strict=True))

    def evaluate_renamed(model):
        return dict(zip(("mean", "b"), evaluate(model).values(), strict=True))

    result = compare_post_merging(base, renamed, data, evaluate_renamed, merges=["task_arithmetic"],
                                  post_merging=["none"])
    direct = evaluate_renamed(merging.merge_models(base, renamed, "task_arithmetic", scaling_factor=0.3))
    assert result.scores["task_arithmetic"]["mean"] == pytest.approx(direct["mean"], rel=1e-6)  # the task's own
    assert result.errors == {} and result.mean_key == "(mean)"
    assert result.scores["task_arithmetic"] == pytest.approx(
        {"mean": direct["mean"], "b": direct["b"], "(mean)": (direct["mean"] + direct["b"]) / 2}, rel=1e-6)
    assert direct["mean"] != pytest.approx((direct["mean"] + direct["b"]) / 2)  # the two would be told apart
    table = result.to_markdown().splitlines()
    assert table[0].startswith("|  | mean | b | (mean) | last-block drift | seconds |")
    row = next(line for line in table if line.startswith("| task_arithmetic |"))
    assert row.split(" | ")[1:4] == [f"{direct['mean']:.1f}", f"{direct['b']:.1f}",
                                     f"{(direct['mean'] + direct['b']) / 2:.1f}"]
    result.save(tmp_path)  # the chart reads the mean under its key
    assert json.loads((tmp_path / "comparison.json").read_text())["scores"]["task_arithmetic"]["mean"] == \
        pytest.approx(direct["mean"], rel=1e-6)
