"""The post-merging step registry (`hf_featcal.post_merging`): a step is one file that declares its
parameters and registers itself, and the schema, the CLI, recipes and the compare grid all offer it
without another file changing; a step whose result has per-task modules is scored task by task inside
its module; every step of a grid gets the one calibration set, at each number of the samples axis;
reading the registry loads no torch."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from hf_featcal import cli, post_merging, schema
from hf_featcal.compare import compare_post_merging
from hf_featcal.config import FeatCalConfig
from hf_featcal.post_merging import registry
from hf_featcal.recipes.parse import _parse_compare
from hf_featcal.recipes.spec import KeyChecker, RecipeError
from testing_utils import build_clip_setting, import_source, loads_torch

SHIPPED_STEPS = ["none", "featcal", "featcal_module", "featcal_guarded", "svc", "surgery", "prob_surgery"]

# A step file as one would add it under hf_featcal/post_merging/steps/, written to a temporary folder:
# "task_offset" needs calibration data and returns the merged model with per-task modules, each adding
# `scale` × (the task's index + 1) to the pooled output (what the heads read), and records what it got.
_STEP_FILE = '''
import contextlib

from hf_featcal.merging.params import MergeParameter
from hf_featcal.post_merging.registry import PostMergingResult, PostMergingStep, register_step

SEEN = []


class OffsetModules:
    """Per-task constant added to pooler_output while `for_task` is open."""

    needs_task = True

    def __init__(self, offsets):
        self.offsets = offsets

    def num_parameters(self):
        return len(self.offsets)

    @contextlib.contextmanager
    def for_task(self, model, task):
        def hook(module, args, output):
            output.pooler_output = output.pooler_output + self.offsets[task]
            return output

        handle = model.register_forward_hook(hook)
        try:
            yield model
        finally:
            handle.remove()


def apply(merged, base, experts, calibration_data, *, config=None, processing_class=None, device=None, scale=0.0):
    SEEN.append((calibration_data, config.num_samples_per_task, config.seed, scale))
    return PostMergingResult(merged, task_modules=OffsetModules({t: scale * (i + 1) for i, t in enumerate(experts)}))


register_step(PostMergingStep(
    "task_offset", apply, summary="a per-task offset", reference="a test step",
    parameters=(MergeParameter("scale", float, 0.0, "offset per task index", interval=(-1.0, 1.0, False, False)),),
    paper_defaults={"scale": 0.5}, needs_calibration_data=True, per_task_modules=True,
))
'''


@pytest.fixture
def added_step(tmp_path, monkeypatch):
    """The step of `_STEP_FILE`, registered by importing it (the registry restored afterwards)."""
    monkeypatch.setattr(registry, "_STEPS", dict(registry._STEPS))
    return import_source(tmp_path, "task_offset.py", _STEP_FILE, "added_post_merging_step")


def test_an_added_step_reaches_the_schema_recipes_and_the_cli(added_step, monkeypatch, capsys):
    assert post_merging.step_names() == (*SHIPPED_STEPS, "task_offset")
    assert "task_offset" in schema.recipe_key("compare.post_merging").describe_value()
    assert "| prob_surgery | task_offset, ...]" in schema.render_recipe_schema()
    spec = _parse_compare(KeyChecker(), {"post_merging": {"task_offset": {"scale": 0.25}, "none": None}})
    assert spec.post_merging == ["task_offset", "none"] and spec.step_parameters == {"task_offset": {"scale": 0.25}}
    with pytest.raises(RecipeError, match=r"compare.post_merging.task_offset: task_offset.scale must be in \[-1, 1\]"):
        _parse_compare(KeyChecker(), {"post_merging": {"task_offset": {"scale": 2.0}}})
    with pytest.raises(RecipeError, match="compare.post_merging.task_offset: .* no parameter 'rank'"):
        _parse_compare(KeyChecker(), {"post_merging": {"task_offset": {"rank": 2}}})
    assert _parse_compare(KeyChecker(), {"post_merging": ["task_offset"], "samples": [8, 2]}).samples == [8, 2]
    with pytest.raises(RecipeError, match=r"compare.samples\[1\]"):
        _parse_compare(KeyChecker(), {"samples": [8, 0]})
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["compare", "--help"]) == 0
    text = capsys.readouterr().out
    assert "of: none, featcal, featcal_module, featcal_guarded, svc, surgery, prob_surgery, task_offset" in text
    assert "task_offset: a per-task offset [calibration data; model + per-task modules (task needed at " \
           "inference); scale=0.5]" in text
    # a value the declaration refuses stops the command before anything is built
    assert cli.main(["compare", "--demo", "--post-merging", "task_offset", "--step-parameter",
                     "task_offset.scale=3"]) == 2
    assert "task_offset.scale must be in [-1, 1], got 3" in capsys.readouterr().err


def test_an_added_step_runs_in_the_grid_task_by_task_on_one_calibration_set(added_step, generator, monkeypatch):
    import hf_featcal.merging as merging

    base, experts, _, data = build_clip_setting(generator)  # 13 calibration examples per task
    probes = {t: torch.randn(3, 3, 8, 8, generator=generator) for t in experts}
    target = {t: experts[t](pixel_values=x).pooler_output.detach() for t, x in probes.items()}

    def score_on(model, task):  # closer to the expert's pooled output = higher
        with torch.no_grad():
            return -float((model(pixel_values=probes[task]).pooler_output - target[task]).norm())

    whole, per_task = [], []
    merges_run = []
    original = merging.merge_models
    monkeypatch.setattr(merging, "merge_models", lambda *a, **k: merges_run.append(a[2]) or original(*a, **k))
    config = FeatCalConfig(num_samples_per_task=8, seed=3)
    result = compare_post_merging(
        base, experts, data, lambda m: whole.append(m) or {t: score_on(m, t) for t in experts},
        merges=["task_arithmetic", "average"], post_merging={"none": None, "task_offset": {"scale": 0.125}},
        featcal_config=config, evaluate_expert=lambda m, t: per_task.append(t) or score_on(m, t), samples=[8, 2])
    assert result.errors == {} and merges_run == ["task_arithmetic", "average"]  # each merge once
    assert list(result.scores) == ["experts", "task_arithmetic", "task_arithmetic+task_offset@2",
                                   "task_arithmetic+task_offset@8", "average", "average+task_offset@2",
                                   "average+task_offset@8"]
    # the one calibration set (the caller's data, the grid's seed) at each number of the axis, in order
    assert [(d is data, n, seed, scale) for d, n, seed, scale in added_step.SEEN] == [
        (True, 2, 3, 0.125), (True, 8, 3, 0.125)] * 2
    # a per-task row: each task scored once, alone, with its own offset; independently, that offset is a
    # shift of the post-layernorm's bias (pooler_output = post_layernorm(CLS))
    assert len(whole) == 2 and per_task == list(experts) * 5  # experts' row, then four per-task rows
    merged = original(base, experts, "task_arithmetic")
    for index, task in enumerate(experts):
        shifted = copy.deepcopy(merged)
        with torch.no_grad():
            shifted.post_layernorm.bias += 0.125 * (index + 1)
        assert result.scores["task_arithmetic+task_offset@8"][task] == pytest.approx(score_on(shifted, task), rel=1e-5)
    assert result.scores["task_arithmetic"]["cars"] == pytest.approx(score_on(merged, "cars"), rel=1e-5)
    assert result.needs_task == {row: "task_offset" in row for row in result.scores if row != "experts"}
    assert result.added_parameters["average+task_offset@2"] == 2 and result.added_parameters["average"] == 0
    curves = result.curves()
    assert curves["average"]["none"] == {"any": result.scores["average"]["mean"]}
    assert curves["average"]["task_offset"] == {n: result.scores[f"average+task_offset@{n}"]["mean"]
                                                for n in ("2", "8")}
    table = result.to_markdown()
    assert "| task_arithmetic+task_offset@8 |" in table and table.count(" | yes | 2 |") == 4
    # a number of examples the data cannot give is refused before anything is scored
    whole.clear()
    with pytest.raises(ValueError, match=r"`samples`: 16 calibration examples per task .* holds 13"):
        compare_post_merging(base, experts, data, lambda m: whole.append(m) or {}, samples=[2, 16])
    assert whole == []


def test_the_sample_efficiency_chart_draws_the_grid(added_step, generator, tmp_path):
    from hf_featcal.plotting import sample_efficiency_figure

    base, experts, _, data = build_clip_setting(generator)

    def evaluate(model):
        value = float(next(model.parameters()).detach().mean())
        return {t: value for t in experts}

    result = compare_post_merging(base, experts, data, evaluate, merges=["task_arithmetic"],
                                  post_merging=["none", "task_offset"], samples=[2, 4, 8],
                                  evaluate_expert=lambda m, t: float(m(pixel_values=data[t][0]["pixel_values"])
                                                                     .pooler_output.sum()))
    axes = sample_efficiency_figure(result).axes[0]
    lines = {line.get_label(): line for line in axes.lines}
    step = lines["task_offset"]
    assert list(step.get_xdata()) == [2, 4, 8]
    assert list(step.get_ydata()) == pytest.approx([result.scores[f"task_arithmetic+task_offset@{n}"]["mean"]
                                                    for n in (2, 4, 8)])
    flat = lines["task_arithmetic (merge only)"]
    assert list(flat.get_ydata()) == pytest.approx([result.scores["task_arithmetic"]["mean"]] * 2)
    ceiling = [line for line in axes.lines if line.get_linestyle() == "--"]
    assert [float(line.get_ydata()[0]) for line in ceiling] == pytest.approx([result.scores["experts"]["mean"]])
    paths = result.save(tmp_path)
    assert open(paths["samples_png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(open(paths["json"]).read())
    assert saved["samples"] == [2, 4, 8] and saved["curves"] == json.loads(json.dumps(result.curves()))
    assert set(saved["memory"]) == set(saved["seconds"]) == set(result.rows())


def test_the_registry_lists_the_shipped_steps_with_their_declarations():
    steps = post_merging.post_merging_steps()
    assert list(steps) == SHIPPED_STEPS
    assert list(post_merging.post_merging_steps(calibration_data=False)) == ["none", "svc"]
    assert [n for n, s in steps.items() if s.per_task_modules] == ["surgery", "prob_surgery"]
    assert steps["surgery"].paper_defaults == {"rank": 16, "steps": 1000, "lr": 1e-3, "batch_size": 16}
    assert steps["prob_surgery"].paper_defaults == {"hidden": 128, "steps": 5000, "lr": 1e-3, "batch_size": 16,
                                                    "kl_weight": 1e-4}
    for name, step in steps.items():
        assert step.reference and step.summary, name
        assert all(step.declared()[p].default == v for p, v in step.paper_defaults.items()), name
        assert step.function.__module__ == f"hf_featcal.post_merging.steps.{name}"
    with pytest.raises(KeyError, match="unknown post-merging step 'magic'"):
        post_merging.get_step("magic")
    with pytest.raises(ValueError, match=r"surgery.steps must be in \[1, inf\), got 0"):
        steps["surgery"].run(None, None, {}, {}, steps=0)
    with pytest.raises(ValueError, match="'surgery' needs `calibration_data`"):
        steps["surgery"].run(None, None, {})
    with pytest.raises(RuntimeError, match="differ from its declarations"):
        registry.register_step(registry.PostMergingStep(
            "drifted", lambda merged, base, experts, calibration_data, *, config, processing_class, device, k=1: None,
            summary="", reference=""))


@pytest.mark.parametrize("code", [
    "import hf_featcal.post_merging as p; p.post_merging_steps(); p.get_step('svc').checked_parameters({'alpha': 2})",
    "from hf_featcal import cli; cli.main(['compare', '--help'])",
])
def test_reading_the_step_registry_loads_no_torch(code):
    assert loads_torch(code) is False


def test_a_save_with_per_task_modules_writes_and_lists_them_for_a_push(generator, tmp_path):
    from transformers import CLIPVisionModel

    from hf_featcal.post_merging.save import save_post_merged
    from hf_featcal.post_merging.task_modules import CONFIG_NAME, WEIGHTS_NAME, TaskModules
    from hf_featcal.saving import MANIFEST_NAME, push_staging, read_manifest

    base, experts, merged, data = build_clip_setting(generator)
    result = post_merging.get_step("surgery").run(merged, base, experts, data, config=FeatCalConfig(seed=1),
                                                  steps=3, rank=2)
    written = save_post_merged(result, tmp_path / "out", step="surgery")
    assert {WEIGHTS_NAME, CONFIG_NAME, "README.md", "config.json", "model.safetensors", MANIFEST_NAME} <= set(written)
    assert read_manifest(tmp_path / "out") == written
    with push_staging(tmp_path / "out") as staged:  # what a push uploads
        assert {WEIGHTS_NAME, CONFIG_NAME} <= set(os.listdir(staged))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "**Task needed at inference:** yes" in card
    assert f"**Parameters added to the merged model:** {2 * 2 * 2 * 16:,}" in card  # 2 tasks × (D, U) × 2 × 16
    loaded, modules = CLIPVisionModel.from_pretrained(tmp_path / "out"), TaskModules.from_pretrained(tmp_path / "out")
    x = data["dtd"][0]["pixel_values"]
    with torch.no_grad(), result.task_modules.for_task(merged, "dtd"):
        expected = merged(pixel_values=x).pooler_output
    with torch.no_grad(), modules.for_task(loaded, "dtd"):
        assert torch.equal(loaded(pixel_values=x).pooler_output, expected)
    with torch.no_grad():  # the modules change the output: the check above could fail
        assert not torch.allclose(loaded(pixel_values=x).pooler_output, expected)


def test_a_surgery_row_is_the_score_of_fit_surgerys_modules_task_by_task(generator):
    from hf_featcal.post_merging.surgery import fit_surgery

    base, experts, merged, data = build_clip_setting(generator)
    probes = {t: torch.randn(3, 3, 8, 8, generator=generator) for t in experts}

    def score_on(model, task):
        with torch.no_grad():
            return float(model(pixel_values=probes[task]).pooler_output.sum())

    config = FeatCalConfig(num_samples_per_task=8, seed=5)
    result = compare_post_merging(base, experts, data, lambda m: {t: score_on(m, t) for t in experts},
                                  merges=["task_arithmetic"], post_merging={"surgery": {"steps": 4, "rank": 2}},
                                  featcal_config=config, evaluate_expert=score_on)
    assert result.errors == {}
    # the same modules, trained directly on the grid's draw (8 examples, seed 5), applied task by task
    modules = fit_surgery(merged, experts, data, method="surgery", steps=4, rank=2, seed=5, data_seed=5,
                          num_samples_per_task=8)
    for task in experts:
        with modules.for_task(merged, task):
            assert result.scores["task_arithmetic+surgery"][task] == pytest.approx(score_on(merged, task), rel=1e-5)
    assert result.needs_task["task_arithmetic+surgery"] is True
    assert result.added_parameters["task_arithmetic+surgery"] == modules.num_parameters() == 2 * 2 * 2 * 16
