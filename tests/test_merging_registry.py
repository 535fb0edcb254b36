"""The merge-method registry (`hf_featcal.merging.registry`): a method is one file that declares its
parameters and registers itself, and the CLI, the recipe schema, `merge_models` and the compare grid
all offer it without another file changing; reading the registry loads no torch."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import CLIPVisionModel

from hf_featcal import cli, merging, recipes, schema
from hf_featcal.compare import check_merges, compare_post_merging, default_merges
from hf_featcal.config import FeatCalConfig
from hf_featcal.merging import MERGE_CONFIG_ATTRIBUTE, merge_methods, merge_models, registry
from testing_utils import (
    SHIPPED_METHODS,
    SRC,
    build_clip_setting,
    import_source,
    loads_torch,
)

# A method file as one would add it under hf_featcal/merging/methods/, written to a temporary folder:
# "base_only" keeps the base and adds `offset` to every floating weight (0 by default: the base alone);
# "data_probe" needs calibration data and records what it was given.
_METHOD_FILE = '''
from hf_featcal.merging.params import MergeMethod, MergeParameter
from hf_featcal.merging.registry import get_method, register

SEEN = []


def base_only(base_model, experts, offset=0.0):
    from hf_featcal.merging.engine import merge_task_vectors

    (offset,) = get_method("base_only").check(offset=offset)

    def delta(key, task_vectors):  # no task vector counts; the offset is added as a constant
        return task_vectors[0][1] * 0 + offset

    return merge_task_vectors(base_model, experts, "base_only", {"offset": offset}, delta, scaling_factor=1.0)


def data_probe(base_model, experts, calibration_data, *, num_samples_per_task=256, batch_size=16,
               processing_class=None, seed=42):
    SEEN.append((calibration_data, num_samples_per_task, batch_size, seed, processing_class))
    return get_method("average").function(base_model, experts)


register(MergeMethod(
    "base_only", base_only, summary="the base model", reference="a test method",
    parameters=(MergeParameter("offset", float, 0.0, "added to every weight", interval=(-1.0, 1.0, False, False)),),
    paper_defaults={"offset": 0.25},
))
register(MergeMethod("data_probe", data_probe, summary="a probe", reference="a test method",
                     needs_calibration_data=True))
'''


@pytest.fixture
def added_methods(tmp_path, monkeypatch):
    """The methods of `_METHOD_FILE`, registered by importing it (the registry restored afterwards)."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    return import_source(tmp_path, "base_only.py", _METHOD_FILE, "added_merge_methods")


def _weights_plus(model, offset):
    return {k: v + offset for k, v in model.state_dict().items() if v.is_floating_point()}


def test_an_added_method_reaches_merge_models_the_schema_and_recipes(added_methods, generator):
    base, experts, _, _ = build_clip_setting(generator)
    merged = merge_models(base, experts, "base_only", offset=0.5)
    for key, value in _weights_plus(base, 0.5).items():
        torch.testing.assert_close(merged.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == {"method": "base_only", "offset": 0.5,
                                                              "experts": list(experts)}
    with pytest.raises(ValueError, match=r"`offset` must be in \[-1, 1\], got 2"):
        merge_models(base, experts, "base_only", offset=2)
    assert merging.MERGE_METHODS["base_only"] is added_methods.base_only  # read when asked
    # the recipe schema and validator: the method's choice, its parameter line, its checks
    assert list(schema.merge_parameters("base_only")) == ["offset"]
    assert "base_only" in schema.recipe_key("merge.method").describe_value()
    rendered = schema.render_recipe_schema()
    assert "offset?: [-1, 1] [0.0]" in rendered and "base_only: added to every weight" in rendered
    assert recipes.validate_merge_spec("base_only", {"offset": -0.5}).params == {"offset": -0.5}
    with pytest.raises(recipes.RecipeError, match=r"merge.offset: must be in \[-1, 1\]"):
        recipes.validate_merge_spec("base_only", {"offset": 3.0})
    # a method that needs calibration data is the compare grid's, not `merge`'s nor a recipe's
    assert "data_probe" not in schema.recipe_key("merge.method").describe_value()
    with pytest.raises(recipes.RecipeError, match="merge.method"):
        recipes.validate_merge_spec("data_probe", {})
    with pytest.raises(ValueError, match="'data_probe' needs `calibration_data`"):
        merge_models(base, experts, "data_probe")


def test_an_added_method_is_a_cli_choice_with_its_flag(added_methods, generator, tmp_path, monkeypatch, capsys):
    base, experts, _, _ = build_clip_setting(generator)
    base.save_pretrained(tmp_path / "base")
    experts["cars"].save_pretrained(tmp_path / "cars")
    argv = ["merge", "--base", str(tmp_path / "base"), "--expert", f"cars={tmp_path / 'cars'}", "--method", "base_only"]
    assert cli.main([*argv, "--offset", "0.25", "--output-dir", str(tmp_path / "out")]) == 0
    saved = CLIPVisionModel.from_pretrained(tmp_path / "out")
    for key, value in _weights_plus(base, 0.25).items():
        torch.testing.assert_close(saved.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
    assert cli.main([*argv, "--offset", "1.5", "--output-dir", str(tmp_path / "refused")]) == 2
    assert "--offset: must be in [-1, 1], got 1.5" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["merge", "--help"]) == 0
    text = capsys.readouterr().out
    assert "base_only" in text and "--offset (0.0)" in text and "base_only: added to every weight" in text
    assert "data_probe" not in text
    assert cli.main(["compare", "--help"]) == 0
    assert "base_only, data_probe" in capsys.readouterr().out  # after the shipped methods


def test_an_added_method_is_in_the_compare_grid_with_its_paper_defaults(added_methods, generator):
    base, experts, _, data = build_clip_setting(generator)
    assert default_merges()["base_only"] == {"offset": 0.25}
    assert check_merges(None)["base_only"] == {"offset": 0.25} and check_merges(None)["data_probe"] == {}
    with pytest.raises(ValueError, match=r"`merges\['base_only'\]\['offset'\]` must be in \[-1, 1\]"):
        check_merges({"base_only": {"offset": 9.0}})

    def evaluate(model):  # the mean first weight: base_only's row is the base's plus its offset
        value = float(next(model.parameters()).detach().mean())
        return {t: value for t in experts}

    config = FeatCalConfig(num_samples_per_task=4, batch_size=2, seed=7)
    result = compare_post_merging(base, experts, data, evaluate, merges=["base_only", "data_probe"],
                                  post_merging=["none"], featcal_config=config)
    assert result.errors == {}
    expected = float(next(base.parameters()).detach().mean()) + 0.25
    assert result.scores["base_only"]["mean"] == pytest.approx(expected, rel=1e-5)
    # the data method got the grid's calibration data, batched as the FeatCal config says
    assert added_methods.SEEN == [(data, 4, 2, 7, None)]


def test_the_registry_lists_the_shipped_methods_with_their_declarations():
    methods = merge_methods()
    assert list(methods) == SHIPPED_METHODS
    assert list(merge_methods(calibration_data=True)) == ["regmean", "regmean_plusplus"]
    assert registry.get_method("simple_average") is methods["average"]
    with pytest.raises(KeyError, match="unknown merge method 'median'"):
        registry.get_method("median")
    for name, method in methods.items():
        assert method.reference and method.summary, name
        # the paper defaults are the functions' own defaults for what the grid sets
        assert all(method.declared()[p].default == v for p, v in method.paper_defaults.items()), name
        assert method.function.__module__ == f"hf_featcal.merging.methods.{name}"


@pytest.mark.parametrize("code", [
    "import hf_featcal.merging.params",
    "import hf_featcal.merging as m; m.merge_methods(); m.get_method('ties').check(density=0.5)",
    "from hf_featcal import cli; cli.main(['merge', '--help'])",
    "from hf_featcal import cli; cli.main(['compare', '--help'])",
    "from hf_featcal import schema; schema.render_recipe_schema()",
])
def test_reading_the_registry_loads_no_torch(code):
    assert loads_torch(code) is False


def test_every_method_and_post_merging_step_has_a_row_in_the_docs_table():
    from hf_featcal.compare import post_merging_steps

    docs = open(os.path.join(os.path.dirname(SRC), "docs", "merge-methods.md"), encoding="utf-8").read()
    rows = {line.split("|")[1].strip().strip("`") for line in docs.splitlines() if line.startswith("| `")}
    assert set(merge_methods()) <= rows, sorted(set(merge_methods()) - rows)
    assert set(post_merging_steps()) <= rows, sorted(set(post_merging_steps()) - rows)
    assert rows <= set(merge_methods()) | set(post_merging_steps()), "a row for something this build lacks"
