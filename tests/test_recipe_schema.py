"""The recipe schema is declared once (`hf_featcal.schema.RECIPE_SECTIONS`): the validator, the rendered
schema (recipes docstring, ``hf-featcal run --help``, docs/recipes.md) and the CLI flags that set a
recipe key all follow it; and ``hf-featcal merge`` / ``calibrate`` run the recipe run's own stages."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import test_cli
from hf_featcal import cli, recipes, schema
from hf_featcal.merging import merge_methods
from hf_featcal.recipes import RecipeError, parse_recipe
from hf_featcal.schema import RECIPE_SECTIONS, TASK, recipe_keys
from test_cli import TASKS, _recipe, _write

world = test_cli.world  # the tiny local world of models and datasets (a module-scoped fixture)
ROOT = Path(__file__).resolve().parent.parent

# hub ids pass validation without a download; mnist / dtd are built-in CLIP tasks (no class names needed)
_CLIP = {
    "model_family": "clip",
    "base": "org/clip-base",
    "experts": {"mnist": "org/clip-mnist", "dtd": "org/clip-dtd"},
    "merge": {"method": "task_arithmetic"},
    "calibration": {"default": {"dataset": "org/{task}-data"}},
}
_T5 = {
    "model_family": "flan_t5",
    "base": "org/t5-base",
    "experts": {"cola": "org/t5-cola", "rte": "org/t5-rte"},
    "merge": {"method": "task_arithmetic"},
    "calibration": {"default": {"dataset": "nyu-mll/glue", "config": "{task}"}},
}
_LLAMA = {
    "model_family": "causal_lm",
    "base": "org/llama-base",
    "experts": {"math": "org/llama-math", "code": "org/llama-code"},
    "merge": {"method": "task_arithmetic"},
    "calibration": {"default": {"dataset": "org/{task}-text"}},
    "evaluation": {"lm_eval_tasks": ["hellaswag"]},  # lm_eval_include_path is checked only with tasks
}
#: A valid base recipe of each family a key may be tried on.
_BASE_RECIPES = {"clip": _CLIP, "flan_t5": _T5, "causal_lm": _LLAMA}
_CHECKED_KINDS = ("int", "choice", "str", "folder", "repo_id")


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _subcommand_help(name: str) -> str:
    import argparse

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return _normalised(commands.choices[name].format_help())


# ================================================================ the validator follows the declarations
def _only_for(section: str, name: str) -> str:
    """The family of the base recipe a key is tried on: the first of its owners with a base recipe (clip for
    keys every family takes)."""
    note = schema.families_note(section, name)
    owners = note[: -len(" only: ")].split(" / ") if note else ["clip"]
    return next(owner for owner in owners if owner in _BASE_RECIPES)


def _bad_value(key: schema.RecipeKey) -> object:
    """A value the declaration refuses, derived from its fields (not from `RecipeKey.check`)."""
    if key.kind == "int":
        return key.minimum - 1 if key.minimum is not None else "seven"
    return {"choice": "no-such-choice", "str": 3, "folder": 3, "repo_id": "not a repo"}[key.kind]


def _expected_problem(key: schema.RecipeKey) -> str:
    if key.kind == "int":
        return f"must be an integer ≥ {key.minimum}" if key.minimum is not None else "must be an integer"
    return {"choice": "must be one of", "str": "must be a non-empty string", "folder": "must be a string",
            "repo_id": "must be a hub repo id"}[key.kind]


def _with_value(section: str, name: str, value: object) -> tuple[dict, str]:
    """A valid base recipe with `section.name` set to `value`, and the key path the error must name."""
    family = _only_for(section, name)
    recipe = copy.deepcopy(_BASE_RECIPES[family])
    task = next(iter(recipe["experts"]))
    path = [p if p != TASK else task for p in section.split(".") if p] + [name]
    node = recipe
    for i, part in enumerate(path[:-1]):
        if part not in node or not isinstance(node[part], dict):
            node[part] = {"dataset": f"org/{task}-other"} if i > 0 and path[i - 1] in ("tasks", "datasets") else {}
        node = node[part]
    node[path[-1]] = value
    return recipe, ".".join(path)


_CHECKED = [(section, key) for section, keys in RECIPE_SECTIONS.items() for key in keys if key.kind in _CHECKED_KINDS]


@pytest.mark.parametrize(("section", "key"), _CHECKED, ids=[f"{s or 'top'}.{k.name}" for s, k in _CHECKED])
def test_a_wrong_value_for_each_declared_key_names_its_key_path(section, key):
    recipe, path = _with_value(section, key.name, _bad_value(key))
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe)
    assert err.value.key == path
    assert _expected_problem(key) in str(err.value)


def test_the_issue_s_example_path():
    recipe = copy.deepcopy(_T5)
    recipe["calibration"]["tasks"] = {"cola": {"max_input_length": 0}}
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe)
    assert str(err.value) == "calibration.tasks.cola.max_input_length: must be an integer ≥ 1 or null, got 0 (int)"


_SECTIONS_WITH_KEYS = [s for s in RECIPE_SECTIONS if s not in ("experts", "merge")]  # task-keyed / method-keyed


@pytest.mark.parametrize("section", _SECTIONS_WITH_KEYS, ids=lambda s: s or "top")
def test_an_unknown_key_is_refused_in_every_declared_section(section):
    recipe, path = _with_value(section, "surprise", 1)
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe)
    assert err.value.key == path
    message = str(err.value)
    assert "unknown key" in message
    listed = re.search(r"valid keys here: (\[.*\])", message).group(1)
    assert set(ast.literal_eval(listed)) <= set(recipe_keys(section))
    if section in ("", "calibration", "evaluation", "compare"):  # every family takes all of these
        assert ast.literal_eval(listed) == list(recipe_keys(section))


def test_required_keys_are_the_declared_ones():
    required = [k.name for k in RECIPE_SECTIONS[""] if k.required]
    assert required == ["model_family", "base", "experts", "merge", "calibration"]
    for name in required:
        recipe = copy.deepcopy(_CLIP)
        del recipe[name]
        with pytest.raises(RecipeError, match=f"^{name}: is required$"):
            parse_recipe(recipe)


def test_parse_recipe_applies_the_declared_defaults():
    """The defaults the schema documents are the ones a recipe without those keys gets."""
    declared = recipe_keys("calibration.default")
    assert (declared["split"].default, declared["num_examples"].default) == ("train", 256)
    assert (declared["max_input_length"].default, declared["max_target_length"].default) == (512, 32)
    clip = parse_recipe(copy.deepcopy(_CLIP))
    assert {(s.split, s.num_examples, s.config) for s in clip.calibration.values()} == {("train", 256, None)}
    assert clip.evaluation.max_samples is None and clip.evaluation.batch_size == 64
    assert clip.push_to_hub is None
    t5 = parse_recipe(copy.deepcopy(_T5))
    assert {(s.max_input_length, s.max_target_length, s.glue_task) for s in t5.calibration.values()} == {
        (512, 32, "cola"), (512, 32, "rte")}
    assert t5.evaluation.batch_size == 32


def test_the_declared_range_and_default_are_the_ones_enforced(monkeypatch, capsys):
    """Change a declaration only: the validator, the CLI flag, its help and the defaults all follow."""
    changed = tuple(
        dataclasses.replace(k, minimum=10) if k.name == "num_examples"
        else dataclasses.replace(k, default=100) if k.name == "max_input_length" else k
        for k in RECIPE_SECTIONS["calibration.default"]
    )
    monkeypatch.setitem(RECIPE_SECTIONS, "calibration.default", changed)
    monkeypatch.setitem(RECIPE_SECTIONS, f"calibration.tasks.{TASK}", changed)
    recipe = copy.deepcopy(_CLIP)
    recipe["calibration"]["default"]["num_examples"] = 5
    with pytest.raises(RecipeError,
                       match=re.escape("calibration.default.num_examples: must be an integer ≥ 10 or null, got 5")):
        parse_recipe(recipe)
    assert {s.max_input_length for s in parse_recipe(copy.deepcopy(_T5)).calibration.values()} == {100}
    argv = ["calibrate", "--model", "org/merged", "--expert", "a=org/expert-a", "--data", "a=org/data",
            "--num-examples", "5", "--output-dir", "unused-out"]
    assert cli.main(argv) == 2
    assert "--num-examples: must be an integer ≥ 10, got 5" in capsys.readouterr().err
    assert "prompt truncation length in tokens (null: none) (default: 100)" in _subcommand_help("calibrate")


def test_every_family_key_is_declared(monkeypatch):
    recipes.parse._check_family_keys()  # as shipped
    from hf_featcal.families import get_family

    monkeypatch.setattr(type(get_family("flan_t5")), "calibration_data_keys", ("glue_task", "max_prompt_tokens"))
    with pytest.raises(RuntimeError, match="max_prompt_tokens"):
        recipes.parse._check_family_keys()


# ======================================================================== the rendered schema
def _schema_lines() -> list[tuple[str, str, schema.RecipeKey]]:
    """(section, rendered key name, declaration) of every declared key."""
    return [(section, key.name, key) for section, keys in RECIPE_SECTIONS.items() for key in keys]


def test_run_help_lists_every_declared_key_with_its_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    raw = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help().splitlines()
    # a key line with its comment (which a long key line carries on the next line)
    lines = [line + (raw[i + 1] if i + 1 < len(raw) and raw[i + 1].lstrip().startswith("# ") else "")
             for i, line in enumerate(raw)]
    for section, name, key in _schema_lines():
        mark = "" if key.required or name == TASK else "?"
        found = [line for line in lines if line.strip().startswith(f"{name}{mark}: ")]
        assert found, f"{section}.{name} is not in run --help"
        default = key.describe_default()
        if default is not None and key.kind != "section":
            assert any(f"[{default}]" in line for line in found), (section, name, default)
        assert any(_normalised(key.help) in _normalised(line) for line in found), (section, name)
    for field in dataclasses.fields(__import__("hf_featcal.config", fromlist=["FeatCalConfig"]).FeatCalConfig):
        assert any(line.strip().startswith(f"{field.name}?: [") for line in lines), field.name
    for method in merge_methods(calibration_data=False).values():
        for parameter in method.parameters:
            assert any(line.strip().startswith(f"{parameter.name}?: {parameter.describe_range()} [") for line in lines)


def test_the_recipes_docstring_and_docs_show_the_rendered_schema():
    assert schema.render_recipe_schema(indent=4) in recipes.__doc__
    docs = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    block = re.search(r"## The recipe schema\n.*?```text\n(.*?)```", docs, re.S).group(1)
    assert block == schema.render_recipe_schema(featcal_fields=False) + "\n", (
        "docs/recipes.md's schema block is stale: paste hf_featcal.schema.render_recipe_schema(featcal_fields=False)")


# ================================================================== CLI flags from the declarations
_FLAGS = [
    *(("calibrate", "calibration.default", name) for name in recipe_keys("calibration.default")),
    ("calibrate", "", "output_dir"), ("calibrate", "", "push_to_hub"),
    ("evaluate", "evaluation", "split"), ("evaluate", "evaluation", "max_samples"), ("evaluate", "evaluation",
                                                                                     "batch_size"),
    ("run", "", "output_dir"), ("run", "", "push_to_hub"),
]


@pytest.mark.parametrize(("command", "section", "name"), _FLAGS, ids=[f"{c}-{n}" for c, _, n in _FLAGS])
def test_each_recipe_flag_shows_the_declared_help_and_default(command, section, name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    key = recipe_keys(section)[name]
    text = _subcommand_help(command)
    assert key.flag in text
    help_text = _normalised(key.help)
    assert help_text in text, (command, name)
    after = text.split(help_text, 1)[1]
    default = key.default if key.default is not None else key.describe_default()
    if command == "run":
        assert f"override the recipe's {name}: {help_text}" in text
    elif default not in (None, "null") and not (command == "calibrate" and name == "output_dir"):
        assert after.startswith(f" (default: {default})"), (command, name, after[:80])


_RANGED_FLAGS = [(c, s, n) for c, s, n in _FLAGS if recipe_keys(s)[n].kind in ("int", "repo_id")]
_COMMAND_ARGV = {
    "calibrate": ["calibrate", "--model", "org/merged", "--expert", "a=org/expert-a", "--data", "a=org/data",
                  "--output-dir", "unused-out"],
    "evaluate": ["evaluate", "--model", "org/model", "--task", "mnist"],
    "run": ["run", "unused.yaml"],
}


@pytest.mark.parametrize(("command", "section", "name"), _RANGED_FLAGS, ids=[f"{c}-{n}" for c, _, n in _RANGED_FLAGS])
def test_a_wrong_flag_value_is_refused_by_the_declaration_and_exits_2(command, section, name, capsys):
    key = recipe_keys(section)[name]
    assert cli.main([*_COMMAND_ARGV[command], key.flag, str(_bad_value(key))]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hf-featcal {command}: error: argument {key.flag}")
    assert _expected_problem(key) in err


# ============================================================ the commands run the recipe's stages
_STAGES = ("check_recipe_targets", "check_output_dir", "load_calibration_data", "check_recipe_inputs",
           "merge_experts", "build_calibrator", "calibrate_merged", "save_run", "push_run")


@pytest.fixture
def stage_calls(monkeypatch):
    calls: list[str] = []
    for name in _STAGES:
        stage = getattr(recipes, name)

        def spy(*args, _stage=stage, _name=name, **kwargs):
            calls.append(_name)
            return _stage(*args, **kwargs)

        # the CLI calls the package's names, run_recipe its module's, the pre-flight its own
        for module in (recipes, recipes.run, recipes.preflight):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy)
    return calls


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_merge_and_calibrate_run_the_recipe_stages_and_save_the_same_model(world, tmp_path, stage_calls, capsys):
    recipe = _recipe(world, evaluation=False, output_dir=str(tmp_path / "run"),
                     featcal={"lambda_ratio": 0.05, "batch_size": 8})
    assert cli.main(["run", _write(world / "stages.yaml", recipe), "--quiet"]) == 0  # paths relative to the world
    assert stage_calls == [
        "check_recipe_targets",
        "check_output_dir",
        "check_recipe_targets",
        "check_output_dir",
        "load_calibration_data",
        "check_recipe_inputs",
        "merge_experts",
        "build_calibrator",
        "calibrate_merged",
        "save_run",
        "push_run",
    ]  # the CLI's check of output folder and push, then run_recipe (its pre-flight before the merge)

    stage_calls.clear()
    experts = [a for t in TASKS for a in ("--expert", f"{t}={world / 'experts' / t}")]
    assert cli.main(["merge", "--base", str(world / "base"), *experts, "--method", "task_arithmetic",
                     "--scaling-factor", "0.3", "--output-dir", str(tmp_path / "merged")]) == 0
    assert stage_calls == ["check_output_dir", "merge_experts"]

    stage_calls.clear()
    assert cli.main(["calibrate", "--model", str(tmp_path / "merged"), "--base", str(world / "base"), *experts,
                     "--data-default", str(world / "data" / "{task}"), "--split", "train", "--num-examples", "16",
                     "--lambda-ratio", "0.05", "--batch-size", "8", "--quiet", "--output-dir",
                     str(tmp_path / "cli")]) == 0
    assert stage_calls == ["check_output_dir", "load_calibration_data", "build_calibrator", "calibrate_merged",
                           "save_run", "push_run"]
    capsys.readouterr()

    # equivalent inputs through the same stages: the same weights, bit for bit, and the same drift
    from_run, from_cli = _load_weights(tmp_path / "run"), _load_weights(tmp_path / "cli")
    assert from_run.keys() == from_cli.keys()
    different = [name for name in from_run if not torch.equal(from_run[name], from_cli[name])]
    assert different == []
    merged = _load_weights(tmp_path / "merged")
    fc2 = "vision_model.encoder.layers.1.mlp.fc2.weight"
    assert not torch.equal(from_cli[fc2], merged[fc2])  # calibration did change the merge
    drift = [json.loads((tmp_path / d / "featcal_drift_report.json").read_text())["tasks"] for d in ("run", "cli")]
    assert drift[0] == drift[1]
    assert (tmp_path / "run" / "featcal_recipe.yaml").is_file() and not (
        tmp_path / "cli" / "featcal_recipe.yaml"
    ).exists()


def test_a_flag_for_another_family_names_the_flag_and_writes_nothing(world, tmp_path, capsys):
    experts = [a for t in TASKS for a in ("--expert", f"{t}={world / 'experts' / t}")]
    out = tmp_path / "out"
    assert cli.main(["calibrate", "--model", str(world / "base"), *experts, "--data-default",
                     str(world / "data" / "{task}"), "--glue-task", "cola", "--output-dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "hf-featcal calibrate: error: calibration data: calibration.default.glue_task: only for model_family 'flan_t5'"
    )
    assert err.endswith("(given by --glue-task)")
    assert not out.exists()


def test_a_recipe_error_carries_its_key_and_reason_as_fields():
    """The CLI maps an error to its flag by `key` and prints `reason`: no message is split apart."""
    from hf_featcal.recipes import KeyChecker, validate_merge_spec

    with pytest.raises(RecipeError) as info:
        validate_merge_spec("ties", {"density": 2.0})
    assert (info.value.key, info.value.reason) == ("merge.density", "must be in (0, 1], got 2.0")
    with pytest.raises(RecipeError) as info:
        KeyChecker("r.yaml").integer(0, "calibration.default.num_examples", 1)
    assert info.value.key == "calibration.default.num_examples" and info.value.source == "r.yaml"
    assert str(info.value) == f"r.yaml: calibration.default.num_examples: {info.value.reason}"
    assert info.value.reason.startswith("must be an integer ≥ 1")
