"""`hf-featcal compare`: the demo grid on the fast digits scenario, and a recipe-driven grid on tiny
local CLIP models and datasets (rows re-evaluated directly, a non-zero exit when every requested row
failed, schema errors naming the key path and bad values refused before any work)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_featcal import cli, recipes
from hf_featcal.compare import compare_demo
from hf_featcal.families import get_family
from hf_featcal.recipes import RecipeError, load_recipe
from test_cli import TASKS, _recipe, _write, world  # noqa: F401 - `world` is the tiny local world fixture

TASKS_LIST = list(TASKS)

torch.set_num_threads(1)

FAST = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, pretrain_epochs=3, finetune_epochs=3)


def test_compare_demo_prints_the_table_of_the_models_it_names(tmp_path, capsys):
    from hf_featcal.merging import merge_models
    from hf_featcal.scenarios.digits import build_digits_scenario

    cache, out = tmp_path / "cache", tmp_path / "cmp"
    assert cli.main(["compare", "--demo", "--fast", "--cache-dir", str(cache), "--output-dir", str(out),
                     "--samples-per-task", "32", "--merges", "task_arithmetic", "ties", "--post-merging",
                     "none", "featcal"]) == 0
    text = capsys.readouterr().out
    saved = json.loads((out / "comparison.json").read_text())
    assert list(saved["scores"]) == ["experts", "task_arithmetic", "task_arithmetic+featcal", "ties", "ties+featcal"]
    assert saved["errors"] == {}
    for row, scores in saved["scores"].items():  # the printed table is the saved one
        assert (
            f"| {row} | " + " | ".join(f"{scores[t]:.1f}" for t in saved["tasks"]) + f" | {scores['mean']:.1f} |"
            in text
        )
    assert (out / "comparison.md").read_text() in text
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # one row re-evaluated directly: the Task Arithmetic merge (λ = 0.3) of the cached scenario
    scenario = build_digits_scenario(seed=0, cache_dir=cache, **FAST)
    assert scenario.loaded_from_cache
    merged = merge_models(scenario.base, scenario.experts, "task_arithmetic", scaling_factor=0.3)
    direct = {t: 100.0 * v for t, v in scenario.evaluate(merged).items()}
    assert saved["scores"]["task_arithmetic"] == pytest.approx({**direct, "mean": sum(direct.values()) / len(direct)})
    own = {t: 100.0 * scenario.evaluate(expert)[t] for t, expert in scenario.experts.items()}
    assert {t: saved["scores"]["experts"][t] for t in own} == pytest.approx(own)

    # the same grid from Python gives the same numbers
    result = compare_demo(tmp_path / "py", cache_dir=cache, samples_per_task=32, merges=["task_arithmetic", "ties"],
                          post_merging=["none", "featcal"], scenario_overrides=FAST, log=None)
    assert list(result.scores) == list(saved["scores"])
    for row, scores in saved["scores"].items():
        assert result.scores[row] == pytest.approx(scores)


def test_compare_demo_refuses_unknown_names_before_any_work(tmp_path, capsys):
    assert cli.main(["compare", "--demo", "--merges", "slerp", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "--merges: unknown methods ['slerp']" in capsys.readouterr().err
    assert cli.main(["compare", "--demo", "--post-merging", "magic", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "--post-merging: unknown steps ['magic']" in capsys.readouterr().err
    assert cli.main(["compare", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "give --demo or a RECIPE" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_compare_recipe_rows(world, capsys):  # noqa: F811
    from transformers import CLIPModel

    from hf_featcal.merging import merge_models

    out = world / "compare-out"
    grid = {"merges": {"task_arithmetic": {"scaling_factor": 0.5}, "average": None, "regmean": None},
            "post_merging": ["none", "featcal"]}
    path = _write(world / "compare.yaml", _recipe(world, compare=grid, output_dir=str(out)))
    assert cli.main(["compare", path, "--quiet"]) == 0
    text = capsys.readouterr().out
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["tasks"] == list(TASKS)
    assert list(saved["scores"]) == ["experts", "task_arithmetic", "task_arithmetic+featcal", "average",
                                     "average+featcal",
                                   "regmean", "regmean+featcal"]
    assert saved["errors"] == {}
    assert "| average+featcal | " in text and "zero-shot" in text.lower()
    assert set(saved["drift"]) == {"task_arithmetic", "task_arithmetic+featcal", "average", "average+featcal",
                                   "regmean", "regmean+featcal"}

    # rows re-evaluated directly: zero-shot accuracy with the base's text tower, in %
    recipe = load_recipe(path)
    base = CLIPModel.from_pretrained(world / "base")
    processing = get_family("clip").load_processing(str(world / "base"))
    experts = {t: str(world / "experts" / t) for t in TASKS}
    merged = merge_models(str(world / "base"), experts, "task_arithmetic",
                          scaling_factor=0.5)  # the compare section's λ
    direct, _ = recipes.evaluate_model("clip", merged, recipe.evaluation, processing=processing, clip_model=base,
                                       device="cpu")
    assert {t: saved["scores"]["task_arithmetic"][t] for t in TASKS} == pytest.approx(
        {t: 100 * v for t, v in direct.items()}
    )
    from transformers import CLIPVisionModel

    for task in TASKS:
        expert = CLIPVisionModel.from_pretrained(world / "experts" / task)
        own, _ = recipes.evaluate_model("clip", expert, recipe.evaluation, processing=processing, clip_model=base,
                                        device="cpu")
        assert saved["scores"]["experts"][task] == pytest.approx(100 * own[task])
    # the recipe's own merge section (task_arithmetic λ = 0.3) is not a row
    assert "task_arithmetic (scaling_factor=0.3)" not in text


def test_compare_exits_non_zero_when_no_requested_row_succeeded(world, tmp_path, capsys):  # noqa: F811
    """Experts whose first MLP overflows float32 features: every FeatCal row fails while calibrating."""
    from transformers import CLIPVisionModel

    for task in TASKS:
        expert = CLIPVisionModel.from_pretrained(world / "experts" / task)
        with torch.no_grad():
            next(p for n, p in expert.named_parameters() if n.endswith("layers.0.mlp.fc1.weight")).mul_(1e20)
        expert.save_pretrained(tmp_path / "experts" / task)
    out = tmp_path / "out"
    recipe = _recipe(world, experts={t: str(tmp_path / "experts" / t) for t in TASKS}, output_dir=str(out),
                     compare={"merges": {"average": None}, "post_merging": ["featcal"]})
    path = _write(world / "overflow.yaml", recipe)
    assert cli.main(["compare", path, "--quiet"]) == 1
    captured = capsys.readouterr()
    saved = json.loads((out / "comparison.json").read_text())
    assert list(saved["scores"]) == ["experts"] and list(saved["errors"]) == ["average+featcal"]
    assert "non-finite values" in saved["errors"]["average+featcal"]
    assert "| average+featcal | failed: FeatCalError: non-finite values" in captured.out
    assert "hf-featcal compare: error: none of the 1 requested rows succeeded" in captured.err


BAD_COMPARE = [
    ("compare.merges.slerp", {"merges": {"slerp": {}}}),
    ("compare.merges.ties.densty", {"merges": {"ties": {"densty": 0.2}}}),
    ("compare.merges.ties.density", {"merges": {"ties": {"density": 5.0}}}),
    ("compare.merges.regmean.reduction", {"merges": {"regmean": {"reduction": 1.5}}}),
    ("compare.merges.dare.rescale_mode", {"merges": {"dare": {"rescale_mode": "l2"}}}),
    ("compare.merges.regmean", {"merges": {"regmean": 0.9}}),
    ("compare.post_merging[1]", {"post_merging": ["none", "magic"]}),
    ("compare.post_merging.surgery", {"post_merging": {"surgery": {"rank": 0}}}),
    ("compare.samples[0]", {"samples": [0]}),
    ("compare.grid", {"grid": []}),
]


@pytest.mark.parametrize("key,section", BAD_COMPARE, ids=[key for key, _ in BAD_COMPARE])
def test_bad_compare_sections_name_the_key_path(world, key, section, capsys):  # noqa: F811
    path = _write(world / "bad-compare.yaml", _recipe(world, compare=section, output_dir=str(world / "never")))
    assert cli.main(["compare", path]) == 2
    err = capsys.readouterr().err
    assert f"{key}:" in err and "bad-compare.yaml" in err and "Traceback" not in err
    assert cli.main(["run", path, "--check"]) == 2  # the schema is the recipe's: `run` refuses it too
    capsys.readouterr()
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key == key
    assert not (world / "never").exists()


def test_compare_section_defaults_and_round_trip(world):  # noqa: F811
    from hf_featcal.compare import DEFAULT_MERGES

    path = _write(world / "grid.yaml", _recipe(world, compare={"merges": {"ties": {"density": 0.5}, "regmean": None}}))
    recipe = load_recipe(path)
    assert recipe.compare.merges == {"ties": {**DEFAULT_MERGES["ties"], "density": 0.5},
                                     "regmean": DEFAULT_MERGES["regmean"]}
    assert recipe.compare.post_merging is None
    saved = _write(world / "grid-resolved.yaml", recipe.to_dict())
    assert load_recipe(saved).compare == recipe.compare
    assert load_recipe(_write(world / "plain.yaml", _recipe(world))).compare is None


def test_compare_help(capsys):
    assert cli.main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-featcal compare") and "--demo" in out and "examples:" in out


def test_compare_puts_lora_adapters_on_the_recipes_base_as_run_does(world, tmp_path, monkeypatch):  # noqa: F811
    """A LoRA adapter expert of a recipe is the recipe's `base` with the adapter applied, in `compare` as in
    `run`: not the model its adapter_config.json records (here another expert's folder), and also when it
    records none. The experts the grid gets are checked against PEFT's `merge_and_unload` on the base."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import CLIPModel, CLIPVisionModel

    import hf_featcal.compare as compare
    from hf_featcal.compare import compare_recipe

    base = CLIPModel.from_pretrained(world / "base")
    tower = CLIPVisionModel(base.config.vision_config).eval()
    tower.load_state_dict(base.vision_model.state_dict())
    recorded = {TASKS_LIST[0]: str(world / "experts" / TASKS_LIST[1]), TASKS_LIST[1]: None}
    expected = {}
    for seed, task in enumerate(TASKS_LIST):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(tower), LoraConfig(r=2, lora_alpha=8, init_lora_weights=False,
                                                                    target_modules=["q_proj", "fc1"]))
        peft_model.save_pretrained(tmp_path / task)
        expected[task] = peft_model.merge_and_unload().state_dict()
        config_path = tmp_path / task / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = recorded[task]
        config_path.write_text(json.dumps(config))

    handed: dict = {}
    original = compare.compare_post_merging
    monkeypatch.setattr(compare, "compare_post_merging",
                        lambda base, experts, *a, **k: handed.update(experts) or original(base, experts, *a, **k))
    path = _write(world / "compare-lora.yaml", _recipe(world, experts={t: str(tmp_path / t) for t in TASKS_LIST},
                                                       output_dir=str(tmp_path / "out")))
    result = compare_recipe(load_recipe(path), merges=["task_arithmetic"], post_merging=["none"], device="cpu",
                            log=None)
    assert result.errors == {} and list(result.scores) == ["experts", "task_arithmetic"]
    for task in TASKS_LIST:
        state = handed[task].vision_model.state_dict()
        for key, value in expected[task].items():
            torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=f"{task}: {key}")
        assert not torch.equal(state["encoder.layers.0.self_attn.q_proj.weight"],
                               base.vision_model.state_dict()["encoder.layers.0.self_attn.q_proj.weight"])
