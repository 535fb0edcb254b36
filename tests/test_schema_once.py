"""One declaration drives merging, recipes and the CLI: the merge parameters each method's file
registers (`hf_featcal.merging.registry`) and the fields of `FeatCalConfig`."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from hf_featcal import cli, merging
from hf_featcal.config import FeatCalConfig
from hf_featcal.merging import MergeParameter, merge_methods, registry
from hf_featcal.recipes import RecipeError, parse_featcal, validate_merge_spec
from testing_utils import SHIPPED_METHODS

# every hub id passes the CLI's source check without a download; the merge flags are checked first
_MERGE_ARGV = ["merge", "--base", "org/base", "--expert", "a=org/expert-a", "--output-dir", "unused-out"]

def _bad_value(parameter: MergeParameter) -> object:
    """A value the declaration refuses, derived independently of `MergeParameter.check`."""
    if parameter.interval is not None:
        low, high, low_open, high_open = parameter.interval
        return high + 0.5 if not high_open else high  # just past (or on an open) upper bound
    return {float: math.nan, int: 1.5, bool: 1, str: "no-such-choice"}[parameter.kind]


# the methods `merge` and recipes offer (a method that needs calibration data is the compare grid's)
_DECLARED = [(m, p) for m, method in merge_methods(calibration_data=False).items() for p in method.parameters]


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(("method", "parameter"), _DECLARED, ids=[f"{m}.{p.name}" for m, p in _DECLARED])
def test_a_bad_value_is_refused_alike_by_merging_the_recipe_and_the_cli(method, parameter, capsys):
    bad = _bad_value(parameter)
    # merging: before any model is looked at (the base here is not even a model)
    with pytest.raises(ValueError) as from_merging:
        merge_methods()[method].function("not-a-model", {}, **{parameter.name: bad})
    prefix = f"`{parameter.name}` "
    assert str(from_merging.value).startswith(prefix)
    problem = str(from_merging.value)[len(prefix):]
    assert f"got {bad!r}" in problem
    # the recipe validator: the same problem, under the key path
    with pytest.raises(RecipeError) as from_recipe:
        validate_merge_spec(method, {parameter.name: bad})
    assert from_recipe.value.key == f"merge.{parameter.name}"
    assert str(from_recipe.value) == f"merge.{parameter.name}: {problem}"
    # the CLI: exit 2, one line naming the flag; a real number reaches the shared check unchanged
    if parameter.kind is float:
        assert cli.main([*_MERGE_ARGV, "--method", method, parameter.flag, repr(bad)]) == 2
        assert _one_line_error(capsys) == f"hf-featcal merge: error: {parameter.flag}: {problem}"


def test_the_declared_range_is_the_one_enforced(monkeypatch, capsys):
    """Narrow `density` in the declaration only: merging, the recipe validator and the CLI all follow."""
    ties = merge_methods()["ties"]
    narrowed = tuple(
        dataclasses.replace(p, interval=(0.0, 0.5, True, False)) if p.name == "density" else p for p in ties.parameters
    )
    monkeypatch.setitem(registry._METHODS, "ties", dataclasses.replace(ties, parameters=narrowed))
    with pytest.raises(ValueError, match=re.escape("`density` must be in (0, 0.5], got 0.6")):
        merging.ties_merging("not-a-model", {}, density=0.6)
    with pytest.raises(RecipeError, match=re.escape("merge.density: must be in (0, 0.5], got 0.6")):
        validate_merge_spec("ties", {"density": 0.6})
    assert cli.main([*_MERGE_ARGV, "--method", "ties", "--density", "0.6"]) == 2
    assert _one_line_error(capsys).endswith("--density: must be in (0, 0.5], got 0.6")
    assert "(0, 0.5]" in _subcommand_help("merge")


def test_declarations_match_the_merge_functions():
    """Registration compares names and defaults with each function's signature."""
    for method in merge_methods().values():
        method.check_declaration()  # as shipped
    ties = merge_methods()["ties"]
    drifted = tuple(dataclasses.replace(p, default=0.25) if p.name == "density" else p for p in ties.parameters)
    with pytest.raises(RuntimeError, match="ties"):
        registry.register(dataclasses.replace(ties, parameters=drifted))
    dare = merge_methods()["dare"]
    with pytest.raises(RuntimeError, match="rescale_mode"):
        registry.register(dataclasses.replace(dare, parameters=dare.parameters[:-1]))
    with pytest.raises(RuntimeError, match="undeclared parameters \\['density'\\]"):
        registry.register(dataclasses.replace(dare, paper_defaults={"density": 0.2}))
    with pytest.raises(ValueError, match="`drop_rate` must be in"):
        registry.register(dataclasses.replace(dare, paper_defaults={"drop_rate": 1.0}))
    regmean = merge_methods()["regmean"]  # the calibration arguments are not declared parameters
    with pytest.raises(RuntimeError, match="batch_size"):
        registry.register(dataclasses.replace(regmean, needs_calibration_data=False))
    with pytest.raises(ValueError, match=r"names \['simple_average'\] are already registered"):
        registry.register(dataclasses.replace(merge_methods()["task_arithmetic"], aliases=("simple_average",)))
    assert list(merge_methods()) == SHIPPED_METHODS


def _subcommand_help(name: str) -> str:
    import argparse

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return _normalised(commands.choices[name].format_help())


def test_merge_help_shows_each_declared_help_range_and_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no line wrapping inside hyphenated words
    text = _subcommand_help("merge")
    for _method, parameter in _DECLARED:
        assert parameter.flag in text
        assert _normalised(parameter.help) in text, parameter.name
        if parameter.kind is not bool:
            assert f"{parameter.describe_range()} (default" in text
    assert "dare_ties: 'sum'" in text and "ties: 'mean'" in text  # per-method defaults of merge_func
    assert "--density (0.2)" in text and "--drop-rate (0.9)" in text  # the methods table


def test_calibrate_help_shows_the_featcal_fields_help_and_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    text = _subcommand_help("calibrate")
    fields = {f.name: f for f in dataclasses.fields(FeatCalConfig)}
    for name in ("lambda_ratio", "anchor_rho", "teacher_alpha", "batch_size", "seed"):
        flag = "--" + name.replace("_", "-")
        expected = _normalised(f"{fields[name].metadata['help']} (default {fields[name].default!r})")
        assert flag in text and expected in text, name


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"batch_size": 8, "teacher_alpha": 2.0}, "featcal.teacher_alpha"),
        ({"lambda_ratio": -1.0}, "featcal.lambda_ratio"),
        ({"target_modules": "(", "seed": 1}, "featcal.target_modules"),
        ({"compute_dtype": "float16"}, "featcal.compute_dtype"),
        ({"seed": 1, "granularity": "layer", "batch_size": 4}, "featcal.granularity"),
    ],
)
def test_featcal_errors_name_the_offending_key(section, key):
    with pytest.raises(RecipeError) as err:
        parse_featcal(None, section)
    assert err.value.key == key


def test_a_bad_featcal_option_names_its_key_and_exits_2(capsys):
    argv = ["calibrate", "--model", "org/merged", "--base", "org/base", "--expert", "a=org/expert-a",
            "--data", "a=org/data", "--teacher-alpha", "2", "--output-dir", "unused-out"]
    assert cli.main(argv) == 2
    assert "featcal.teacher_alpha: FeatCalConfig.teacher_alpha must be in [0, 1]" in _one_line_error(capsys)
