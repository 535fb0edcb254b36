"""`tune_featcal(criterion="no_harm")`: settings ranked by their worst per-task change against the merged
model's own scores (computed once), with "no calibration" a candidate; and the held-out size rule of
docs/tuning.md checked by simulation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.hparam_search import no_harm_score, tune_featcal
from testing_utils import pixel_batches

pytestmark = pytest.mark.filterwarnings("ignore::hf_featcal.FeatCalWarning")

GRID = [{"lambda_ratio": 0.05}, {"lambda_ratio": 0.5}, {"lambda_ratio": 0.05, "teacher_alpha": 1.0}]


def _pooled(model, pixels):
    with torch.no_grad():
        return model(pixel_values=pixels).pooler_output


class FeatureScores:
    """Per task, minus the mean distance of the model's pooled features on held-out images to a
    target model's (higher is better): a real score of the real model, recording every model scored."""

    def __init__(self, targets: dict, pixels: dict, sign: float = 1.0):
        self.targets = {t: _pooled(model, pixels[t]) for t, model in targets.items()}
        self.pixels, self.sign, self.scored = pixels, sign, []

    def __call__(self, model) -> dict[str, float]:
        self.scored.append(model)
        return {t: self.sign * -float((_pooled(model, self.pixels[t]) - target).norm(dim=-1).mean())
                for t, target in self.targets.items()}


def _held_out(generator, tasks):
    """Images of each task that calibration never sees."""
    return {t: pixel_batches(generator, [6])[0]["pixel_values"] for t in tasks}


@pytest.mark.parametrize("greater_is_better", [True, False])
def test_the_criterion_is_the_worst_change_against_the_merge(clip_setting, generator, greater_is_better):
    base, experts, merged, data = clip_setting
    sign = 1.0 if greater_is_better else -1.0  # False: the scores are distances, lower is better
    scores = FeatureScores(experts, _held_out(generator, experts), sign)
    result = tune_featcal(merged, base, experts, data, scores, GRID, criterion="no_harm",
                          greater_is_better=greater_is_better)

    # the merge is scored once, first, as itself; then once per setting
    assert len(scores.scored) == 1 + len(GRID)
    assert [model is merged for model in scores.scored] == [True] + [False] * len(GRID)
    # by hand: the merge's scores, each setting calibrated again and scored, min over tasks of the gain
    merged_scores = scores(merged)
    assert result.table[0] == {"score": 0.0, "seconds": result.table[0]["seconds"], "task_scores": merged_scores}
    keys = [(0.0, 0.0)]
    for point, row in zip(GRID, result.table[1:], strict=True):
        model = copy.deepcopy(merged)
        FeatCalCalibrator(model, base, experts, data, FeatCalConfig(**point), show_progress=False).calibrate()
        own = scores(model)
        assert row["task_scores"] == own
        gains = [sign * (own[t] - merged_scores[t]) for t in experts]
        assert row["score"] == min(gains) == no_harm_score(own, merged_scores, greater_is_better)
        keys.append((min(gains), sum(gains) / len(gains)))
    best = max(range(len(keys)), key=lambda i: (keys[i], -i))
    assert result.best_score == keys[best][0]
    assert result.best_params == ({} if best == 0 else GRID[best - 1])
    assert result.greater_is_better  # the criterion is a gain whatever the scores' direction
    # here calibration moves every task's features towards its expert: a setting wins, harming none
    assert best > 0 and result.best_score > 0
    assert result.best_config == FeatCalConfig(**GRID[best - 1])
    assert scores(result.best_model) == result.table[best]["task_scores"]


def test_no_calibration_wins_when_every_setting_lowers_a_task(clip_setting, generator):
    """Task `cars` scores the distance to the merged model's own features (any change lowers it), `dtd`
    the distance to its expert's: every setting lowers `cars`."""
    base, experts, merged, data = clip_setting
    given = copy.deepcopy(merged)
    scores = FeatureScores({"cars": given, "dtd": experts["dtd"]}, _held_out(generator, experts))
    result = tune_featcal(merged, base, experts, data, scores, GRID, criterion="no_harm")

    rows = result.table[1:]
    assert all(row["task_scores"]["cars"] < 0.0 == result.table[0]["task_scores"]["cars"] for row in rows)
    assert all(row["score"] < 0 for row in rows)
    assert result.best_config is None and result.best_params == {} and result.best_score == 0.0
    assert result.best_model is merged
    assert all(torch.equal(p, q) for p, q in zip(merged.parameters(), given.parameters(), strict=True))
    assert next(line for line in result.to_markdown().splitlines() if "no calibration" in line).endswith("| * |")
    # ranked by the mean instead, a calibrated setting is chosen (no "no calibration" candidate there)
    mean = tune_featcal(merged, base, experts, data, scores, GRID[:1], criterion="mean")
    assert mean.best_config == FeatCalConfig(**GRID[0])
    assert mean.best_score == pytest.approx(sum(mean.table[0]["task_scores"].values()) / 2, abs=1e-15)


def test_bad_criteria_and_scores_are_refused(clip_setting, generator):
    base, experts, merged, data = clip_setting
    scores = FeatureScores(experts, _held_out(generator, experts))
    with pytest.raises(ValueError, match=r"`criterion` must be one of \['score', 'mean', 'no_harm'\]"):
        tune_featcal(merged, base, experts, data, scores, GRID, criterion="min")
    assert scores.scored == []  # refused before anything was scored
    with pytest.raises(ValueError, match=r"criterion='no_harm', `validation_fn` must return a non-empty mapping"):
        tune_featcal(merged, base, experts, data, lambda model: 0.5, GRID, criterion="no_harm")
    with pytest.raises(ValueError, match=r"scores for tasks \['cars'\], but for \['cars', 'dtd'\] before"):
        tune_featcal(merged, base, experts, data,
                     lambda model: {"cars": 0.5} if model is not merged else {"cars": 0.5, "dtd": 0.5},
                     GRID, criterion="no_harm")


def test_held_out_size_rule_by_simulation():
    """docs/tuning.md: paired outcomes that disagree on a share q of the examples, with a true
    difference Δ, give SE(Δ̂) = sqrt((q − Δ²)/n); at n = 4·(q − Δ²)/Δ² the better setting is measured
    better in about 98 of 100 draws. Checked on simulated held-out sets."""
    generator = torch.Generator().manual_seed(0)
    delta = 0.02
    for q, documented_n in [(0.05, 500), (0.10, 1000), (0.32, 3200)]:
        n = 4 * (q - delta**2) / delta**2
        assert round(n, -2) == documented_n
        n = round(n)
        # per example: A right and B wrong with p10, the reverse with p01; they agree otherwise
        p10, p01 = (q + delta) / 2, (q - delta) / 2
        draws = torch.rand(4000, n, generator=generator, dtype=torch.float64)
        d = (draws < p10).double() - ((draws >= p10) & (draws < p10 + p01)).double()
        measured = d.mean(dim=1)
        assert float(measured.mean()) == pytest.approx(delta, abs=3 * math.sqrt((q - delta**2) / n / 4000))
        assert float(measured.std()) == pytest.approx(math.sqrt((q - delta**2) / n), rel=0.05)
        assert 0.96 <= float((measured > 0).double().mean()) <= 0.99
