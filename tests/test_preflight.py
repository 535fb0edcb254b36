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


# ====================================================== issue 38 item 2: one pre-flight
class MergeCalls(list):
    """The methods merged, in order; `params`: the keyword arguments of each merge."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[dict] = []


@pytest.fixture
def merge_spy(monkeypatch):
    """Records every merge (the real merge still runs): a refusal before the merge leaves it empty."""
    from hf_featcal import merging

    calls = MergeCalls()
    real = merging.merge_models

    def spy(base, experts, method, **kwargs):
        calls.append(method)
        calls.params.append(kwargs)
        return real(base, experts, method, **kwargs)

    monkeypatch.setattr(merging, "merge_models", spy)
    return calls


def _wrong_size_pixels(world) -> str:
    """A calibration dataset of ready `pixel_values` at 16x16, which the 8x8 CLIP tower cannot take."""
    import datasets
    import numpy as np

    folder = world / "data-16px"
    if not folder.exists():
        pixels = np.zeros((4, 3, 16, 16), dtype=np.float32)
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"pixel_values": list(pixels)})}).save_to_disk(
            str(folder))
    return str(folder)


PREFLIGHT_CASES = {
    "selects-nothing": (dict(featcal={"target_modules": ["no_such_module"], "batch_size": 8}),
                        "featcal: FeatCalConfig.target_modules entry 'no_such_module' matches no module"),
    "excludes-everything": (dict(featcal={"exclude_modules": ".*", "batch_size": 8}),
                            "featcal: FeatCalConfig selects no module to calibrate"),
    "layers-outside": (dict(featcal={"layers_to_transform": [7], "batch_size": 8}),
                       "featcal: FeatCalConfig.layers_to_transform has block indices [7] outside the model's 2 blocks"),
    "batches-the-model-cannot-take": (
        "pixels", "calibration: calibration_data['zorbs']: the merged model cannot take its batches"),
    "class-names": (dict(evaluation={"split": "test", "batch_size": 8,
                                     "class_names": {"zorbs": ["zorb", "blip"], "glyphs": ["glyph", "wisp"]}}),
                    "evaluation.class_names.zorbs: 2 class names, but the evaluation dataset"),
}


@pytest.mark.parametrize("case", list(PREFLIGHT_CASES))
def test_run_refuses_before_the_merge_and_check_reports_the_same(world, tmp_path, capsys, merge_spy, case):
    changes, expected = PREFLIGHT_CASES[case]
    if changes == "pixels":
        changes = dict(calibration={"default": {"dataset": "./data/{task}", "split": "train", "num_examples": 16},
                                    "tasks": {"zorbs": {"dataset": _wrong_size_pixels(world)}}})
    if "evaluation" not in changes:
        changes["evaluation"] = False
    out = tmp_path / "out"
    path = _write(world / f"pre-{case}.yaml", _recipe(world, output_dir=str(out), **changes))
    assert cli.main(["run", path, "--quiet"]) == 2
    line = _one_error_line(capsys, "run")
    assert expected in line, line
    assert merge_spy == [] and not out.exists()
    assert cli.main(["run", path, "--check"]) == 2  # the same error, nothing merged
    assert expected in _one_error_line(capsys, "run") and merge_spy == []


def test_compare_refuses_a_grid_whose_featcal_rows_must_all_fail_before_any_merge(world, tmp_path, capsys,
                                                                                   merge_spy):
    out = tmp_path / "out"
    grid = {"merges": {"average": None, "task_arithmetic": None}, "post_merging": ["none", "featcal"]}
    recipe = _recipe(world, output_dir=str(out), featcal={"target_modules": ["no_such_module"], "batch_size": 8},
                     compare=grid)
    path = _write(world / "pre-compare.yaml", recipe)
    assert cli.main(["compare", path, "--quiet"]) == 2
    assert "featcal: FeatCalConfig.target_modules entry 'no_such_module' matches no module" in _one_error_line(
        capsys, "compare")
    assert merge_spy == [] and not (out / "comparison.json").exists()


def test_run_check_refuses_the_output_folder_run_refuses(world, tmp_path, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    path = _write(world / "pre-out.yaml", _recipe(world, output_dir=str(out), evaluation=False))
    assert cli.main(["run", path, "--check"]) == 2
    assert "is not empty and is not an earlier hf_featcal save" in _one_error_line(capsys, "run")
    assert (out / "notes.txt").read_text() == "mine"


def test_a_push_without_a_token_fails_before_any_work(world, tmp_path, capsys, monkeypatch, no_loading, merge_spy):
    from testing_utils import hub_stand_in

    calls = hub_stand_in(monkeypatch, token=None)
    out = tmp_path / "out"
    path = _write(world / "pre-token.yaml", _recipe(world, output_dir=str(out), evaluation=False,
                                                     push_to_hub="me/tiny-featcal"))
    for extra in ([], ["--check"]):
        assert cli.main(["run", path, "--quiet", *extra]) == 2
        assert "push_to_hub: no Hugging Face token found" in _one_error_line(capsys, "run")
    assert cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world), "--output-dir", str(out), "--push-to-hub", "me/x", "--quiet"]) == 2
    assert "--push-to-hub: no Hugging Face token found" in _one_error_line(capsys, "calibrate")
    assert no_loading == [] and merge_spy == [] and not out.exists() and calls["upload_folder"] == []


def test_demo_refuses_a_non_finite_scaling_factor_before_building(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli.main(["demo", "--fast", "--scaling-factor", "nan", "--cache-dir", str(cache),
                     "--output-dir", str(tmp_path / "out")]) == 2
    assert "--scaling-factor must be a finite real number, got nan" in _one_error_line(capsys, "demo")
    assert not cache.exists()


def test_a_recipe_base_without_an_image_processor_names_base(world, tmp_path, capsys, merge_spy):
    import shutil

    bare = tmp_path / "bare-base"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(world / "base" / name, bare / name)
    path = _write(world / "pre-bare.yaml", _recipe(world, base=str(bare), output_dir=str(tmp_path / "o"),
                                                    evaluation=False))
    assert cli.main(["run", path, "--quiet"]) == 2
    line = _one_error_line(capsys, "run")
    assert f"base: '{bare}' has no CLIPImageProcessor to process the calibration data with" in line
    assert "huggingface.co" not in line and merge_spy == []


# ====================================================== issue 38 items 2-3: pushes
def _open_clip_save(world, tmp_path) -> str:
    """A save (the real `atomic_folder`) holding what an open_clip run writes about its sources: the
    resolved recipe (`Recipe.to_dict`, with `local-dir:/abs/...` references), a card naming them and a
    JSON file; plus a file of someone else's that the manifest does not list."""
    import json

    import yaml

    from hf_featcal.saving import atomic_folder

    for name in ("oc-base", "oc-experts/zorbs", "oc-experts/glyphs"):
        (tmp_path / name).mkdir(parents=True)
    recipe = load_recipe(_write(tmp_path / "oc.yaml", _recipe(
        world, model_family="open_clip", base=f"local-dir:{tmp_path / 'oc-base'}",
        experts={t: f"local-dir:{tmp_path / 'oc-experts' / t}" for t in ("zorbs", "glyphs")},
        calibration={"default": {"dataset": str(world / "data" / "{task}"), "split": "train", "num_examples": 16}},
        evaluation=False, output_dir=str(tmp_path / "oc-out"))))
    assert recipe.base == f"local-dir:{tmp_path / 'oc-base'}"
    folder = tmp_path / "save"
    with atomic_folder(folder) as staging:
        with open(f"{staging}/featcal_recipe.yaml", "w", encoding="utf-8") as handle:
            yaml.safe_dump(recipe.to_dict(), handle, sort_keys=False)
        with open(f"{staging}/README.md", "w", encoding="utf-8") as handle:
            handle.write(f"Merged from `{recipe.base}` and file://{tmp_path / 'oc-base'} ({tmp_path}/oc-base).\n")
        with open(f"{staging}/featcal_config.json", "w", encoding="utf-8") as handle:
            json.dump({"sources": [recipe.experts["zorbs"], f"see local-dir:{tmp_path}/x"]}, handle)
    (folder / "notes.txt").write_text(f"mine, about {tmp_path}")
    return str(folder)


def test_push_command_uploads_exactly_the_save_with_no_local_path_in_any_form(world, tmp_path, monkeypatch,
                                                                                capsys):
    import yaml

    from testing_utils import hub_stand_in

    folder = _open_clip_save(world, tmp_path)
    calls = hub_stand_in(monkeypatch)
    assert cli.main(["push", folder, "me/oc-featcal"]) == 0
    assert "Pushed the 4 files of the save" in capsys.readouterr().out
    (repo, files, _), = calls["upload_folder"]
    assert repo == "me/oc-featcal"
    assert sorted(files) == ["README.md", "featcal_config.json", "featcal_manifest.json", "featcal_recipe.yaml"]
    for name, content in files.items():  # no form of the local path in any uploaded file
        assert str(tmp_path).encode() not in content, (name, content)
        assert str(world).encode() not in content, (name, content)
    pushed = yaml.safe_load(files["featcal_recipe.yaml"])
    assert pushed["base"] == "local-dir:<local>/oc-base"
    assert pushed["experts"] == {t: f"local-dir:<local>/{t}" for t in ("zorbs", "glyphs")}
    assert b"file://<local>/oc-base" in files["README.md"]
    # the hub ids a card names stay as they are
    assert calls["create_repo"] == [("me/oc-featcal", {"private": None, "exist_ok": True})]
    # not a save: refused, naming the folder
    assert cli.main(["push", str(tmp_path / "oc-base"), "me/oc-featcal"]) == 2
    assert "holds no hf_featcal save" in _one_error_line(capsys, "push")


def test_push_without_a_token_fails_at_once(world, tmp_path, monkeypatch, capsys):
    from testing_utils import hub_stand_in

    folder = _open_clip_save(world, tmp_path)
    calls = hub_stand_in(monkeypatch, token=None)
    assert cli.main(["push", folder, "me/oc-featcal"]) == 1  # a failed run (2 is for usage errors)
    assert "no Hugging Face token found, so nothing can be pushed: log in with `hf auth login`" in _one_error_line(
        capsys, "push")
    assert calls == {"create_repo": [], "upload_folder": [], "repo_info": []}


def test_private_into_an_existing_public_repo_is_refused(world, tmp_path, monkeypatch, capsys, no_loading):
    from testing_utils import hub_stand_in

    folder = _open_clip_save(world, tmp_path)
    calls = hub_stand_in(monkeypatch, public=("me/public",), private=("me/secret",))
    assert cli.main(["push", folder, "me/public", "--private"]) == 1  # a failed run
    line = _one_error_line(capsys, "push")
    assert "'me/public' exists and is public; a private push would publish the files there" in line
    assert calls["upload_folder"] == [] and calls["create_repo"] == []
    # run: refused in the pre-flight, before anything loads (and --check says the same)
    path = _write(world / "pre-public.yaml", _recipe(world, output_dir=str(tmp_path / "out"), evaluation=False,
                                                      push_to_hub="me/public", private=True))
    for extra in ([], ["--check"]):
        assert cli.main(["run", path, "--quiet", *extra]) == 2
        assert "push_to_hub: 'me/public' exists and is public" in _one_error_line(capsys, "run")
    assert no_loading == [] and calls["upload_folder"] == []
    # an existing private repository, or a new one (created private), is pushed to
    for repo in ("me/secret", "me/new"):
        assert cli.main(["push", folder, repo, "--private"]) == 0
    assert [c[0] for c in calls["upload_folder"]] == ["me/secret", "me/new"]
    assert calls["create_repo"][-1] == ("me/new", {"private": True, "exist_ok": True})
    # without --private nothing is asked of the repository's visibility
    asked = len(calls["repo_info"])
    assert cli.main(["push", folder, "me/public"]) == 0 and len(calls["repo_info"]) == asked


# ====================================================== issue 38 item 6: adapters where models go
def _adapter_without_recorded_base(world, tmp_path) -> str:
    """A PEFT LoRA adapter of the world's base CLIPModel whose adapter_config.json records no base."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import CLIPModel

    base = CLIPModel.from_pretrained(world / "base")
    adapter = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "fc1"], init_lora_weights=False))
    folder = tmp_path / "adapter"
    adapter.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def test_calibrate_names_its_options_for_an_adapter(world, tmp_path, capsys, no_loading):
    adapter = _adapter_without_recorded_base(world, tmp_path)
    out = tmp_path / "out"
    common = [*_experts(world), *_data(world), "--lambda-ratio", "0.05", "--batch-size", "8", "--num-examples", "8",
              "--output-dir", str(out), "--quiet"]
    # --base given an adapter: the option is named, and what it takes
    assert cli.main(["calibrate", "--model", str(world / "base"), "--base", adapter, *common]) == 2
    line = _one_error_line(capsys, "calibrate")
    assert f"--base: '{adapter}' is a LoRA adapter, not a full model: --base takes the model the experts" in line
    assert "base_model" not in line and no_loading == []
    # --model an adapter without a recorded base and no --base: asks for --base
    assert cli.main(["calibrate", "--model", adapter, *common]) == 2
    assert (f"--model: '{adapter}' is a LoRA adapter that records no base model: pass the model it was trained on "
            "as --base") in _one_error_line(capsys, "calibrate")
    assert no_loading == [] and not out.exists()
    # ... and with --base, the adapter is applied to it (not "pass the base model")
    assert cli.main(["calibrate", "--model", adapter, "--base", str(world / "base"), *common]) == 0
    assert (out / "featcal_manifest.json").exists()


# ====================================================== issue 41 item 3: replacing another's save
def test_a_save_of_another_command_or_model_is_replaced_only_with_overwrite(world, tmp_path, capsys, merge_spy):
    import json

    out = tmp_path / "out"
    base = str(world / "base")
    assert cli.main(["calibrate", "--model", base, "--base", base, *_experts(world), *_data(world),
                     "--lambda-ratio", "0.05", "--batch-size", "8", "--num-examples", "8", "--output-dir", str(out),
                     "--quiet"]) == 0
    manifest = json.loads((out / "featcal_manifest.json").read_text())
    assert manifest["written_by"] == {"command": "hf-featcal calibrate", "base": base}
    calibrated = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    merge = ["merge", "--base", base, *_experts(world), "--method", "task_arithmetic", "--output-dir", str(out)]
    # a merge into the calibrated save: refused before merging, naming both writers; nothing changed
    assert cli.main(merge) == 2
    line = _one_error_line(capsys, "merge")
    assert (f"holds an earlier save by `hf-featcal calibrate` of the base '{base}', and this save is by "
            f"`hf-featcal merge` of the base '{base}': replacing it needs overwrite=True (CLI: --overwrite") in line
    assert merge_spy == [] and {p.name: p.read_bytes() for p in out.iterdir()} == calibrated
    # with --overwrite: replaced, and one line says what
    assert cli.main([*merge, "--overwrite"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Replaced")]
    assert said == [f"Replaced the earlier save in {out} (by `hf-featcal calibrate` of the base '{base}'; "
                    f"{len(manifest['files']) + 1} files)"]
    assert "featcal_drift_report.json" not in {p.name for p in out.iterdir()}  # the calibrated save's files went
    # the same command on the same base replaces its own save (saying so); on another base it is refused
    assert cli.main(merge) == 0
    assert "Replaced the earlier save in" in capsys.readouterr().err
    other = str(world / "experts" / "zorbs")
    assert cli.main(["merge", "--base", other, *_experts(world), "--method", "task_arithmetic",
                     "--output-dir", str(out)]) == 2
    assert f"this save is by `hf-featcal merge` of the base '{other}'" in _one_error_line(capsys, "merge")
    assert merge_spy == ["task_arithmetic", "task_arithmetic"]


# ====================================================== issue 41 item 5: compare's grid
def test_compare_recipe_defaults_to_its_own_merge_and_says_the_grid_size_first(world, tmp_path, capsys, merge_spy):
    import json

    from hf_featcal.compare import DEFAULT_MERGES

    out = tmp_path / "out"
    recipe = _recipe(world, output_dir=str(out), merge={"method": "task_arithmetic", "scaling_factor": 0.7})
    path = _write(world / "grid-own.yaml", recipe)
    assert cli.main(["compare", path, "--post-merging", "none", "--quiet"]) == 0
    captured = capsys.readouterr()
    grid_line = (f"Grid: 1 merge × 1 post-merging step = 1 rows, plus the experts' row (--all-merges: "
                 f"{len(DEFAULT_MERGES)} merges)")
    assert grid_line in captured.err.splitlines()
    assert captured.err.index(grid_line) < captured.err.index("Loading the base model")  # before any work
    assert "merges: the recipe's own (task_arithmetic (scaling_factor=0.7))" in captured.out
    assert list(json.loads((out / "comparison.json").read_text())["scores"]) == ["experts", "task_arithmetic"]
    assert list(merge_spy) == ["task_arithmetic"] and merge_spy.params[0]["scaling_factor"] == 0.7
    # --merges picks from every merge (at its defaults) when the recipe has no compare section
    assert cli.main(["compare", path, "--merges", "average", "--post-merging", "none", "--quiet"]) == 0
    assert "Grid: 1 merge × 1 post-merging step = 1 rows, plus the experts' row\n" in capsys.readouterr().err
    assert list(json.loads((out / "comparison.json").read_text())["scores"]) == ["experts", "average"]
