"""Issue 38 items 2, 3 and 6, issue 41 items 3-5: what a run can check before it works it checks before
it works (and ``--check`` reports the same), pushes keep `--private` and local paths at home, and saves
of another command are not replaced silently. Tiny local CLIP world (tests/test_cli.py), no network."""

from __future__ import annotations

import pytest
import torch

import test_cli
from hf_featcal import cli
from hf_featcal.recipes import RecipeError, load_recipe
from test_cli import _recipe, _write
from test_cli_errors import _data, _experts, _one_error_line

world = test_cli.world  # the tiny local world of models and datasets (a module-scoped fixture)

torch.set_num_threads(1)


@pytest.fixture
def no_loading(monkeypatch):
    """Records every model load (the real loader still runs): a refusal before any work leaves it empty."""
    from hf_featcal import model_io

    calls: list[str] = []
    real = model_io.load_model

    def spy(source, *args, **kwargs):
        calls.append(str(source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(model_io, "load_model", spy)
    return calls


# ====================================================== issue 41 item 4: mistyped local paths
def test_a_mistyped_local_path_is_refused_at_once_in_recipes_and_flags(world, tmp_path, monkeypatch, capsys,
                                                                       no_loading):
    # in a recipe: `experts/` exists beside the recipe, so `experts/zorbz` is a local path, not a hub id
    path = _write(world / "typo.yaml", _recipe(world, base="experts/zorbz", output_dir=str(tmp_path / "o")))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key == "base" and "no local folder 'experts/zorbz'" in str(info.value)
    assert cli.main(["run", path, "--check"]) == 2
    assert "base: no local folder 'experts/zorbz'" in _one_error_line(capsys, "run")
    # more than one '/' is never a hub id
    path = _write(world / "typo2.yaml", _recipe(world, base="a/b/c", output_dir=str(tmp_path / "o")))
    assert cli.main(["run", path, "--check"]) == 2
    assert "base: no local folder 'a/b/c'" in _one_error_line(capsys, "run")
    # on the command line, relative to the working directory; --data is checked before any model loads
    monkeypatch.chdir(world)
    out = str(tmp_path / "out")
    assert cli.main(["calibrate", "--model", "base", "--base", "base", *_experts(world), "--data", "zorbs=data/zorbz",
                     "--data", f"glyphs={world / 'data' / 'glyphs'}", "--output-dir", out, "--quiet"]) == 2
    assert "--data zorbs: no local folder 'data/zorbz'" in _one_error_line(capsys, "calibrate")
    assert cli.main(["calibrate", "--model", "base", "--base", "experts/bse", *_experts(world), *_data(world),
                     "--output-dir", out, "--quiet"]) == 2
    assert "--base: no local folder 'experts/bse'" in _one_error_line(capsys, "calibrate")
    assert cli.main(["evaluate", "--model", "base", "--task", "zorbs", "--data", "zorbs=data/zorbz",
                     "--class-names", "zorbs=zorb,blip,quax"]) == 2
    assert "--data zorbs: no local folder 'data/zorbz'" in _one_error_line(capsys, "evaluate")
    assert no_loading == []
    # an `org/name` whose `org` is no local folder is still a hub id (recipes validate without the hub)
    recipe = load_recipe(_write(world / "hub.yaml", _recipe(world, base="openai/clip-vit-base-patch32",
                                                            output_dir=str(tmp_path / "o"))))
    assert recipe.base == "openai/clip-vit-base-patch32"


# ====================================================== issue 38 item 6: evaluate --output-json
def test_evaluate_refuses_an_output_json_that_would_replace_a_file_of_the_model(world, capsys, no_loading):
    config = world / "base" / "config.json"
    before = config.read_bytes()
    assert cli.main(["evaluate", "--model", str(world / "base"), "--task", "zorbs", "--data",
                     f"zorbs={world / 'data' / 'zorbs'}", "--class-names", "zorbs=zorb,blip,quax",
                     "--output-json", str(config)]) == 2
    line = _one_error_line(capsys, "evaluate")
    assert f"--output-json: '{config}' is a file of the folder of --model" in line
    assert config.read_bytes() == before and no_loading == []
