"""Issue 29, items 7 and 11: what a run can check before it works, it checks before it works, naming
the argument or key; and the errors that were unclear say what is wrong (fast-mode dtypes, seeds,
output paths, image columns, a missing `processing_class`, duplicate YAML keys)."""

from __future__ import annotations

import copy
import json

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import test_cli
from hf_featcal import FeatCalCalibrator, FeatCalConfig, cli, recipes
from hf_featcal.recipes import RecipeError, load_recipe
from test_cli import _recipe, _write
from test_cli_errors import _data, _experts, _one_error_line

world = test_cli.world  # the tiny local world of models and datasets (a module-scoped fixture)

torch.set_num_threads(1)


# ================================================================== fast mode's dtype
@pytest.mark.parametrize("weights,forward", [(torch.float16, "bfloat16"), (torch.bfloat16, "float16")])
def test_a_fast_mode_dtype_that_cannot_run_the_model_is_refused_at_construction(clip_setting, weights, forward):
    base, experts, merged, data = clip_setting
    half = copy.deepcopy(merged).to(weights)
    before = {k: v.clone() for k, v in half.state_dict().items()}
    config = FeatCalConfig(forward_dtype=forward, num_samples_per_task=8)
    other = str(weights).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"forward_dtype='{forward}' cannot run `model`, whose weights are {other}"):
        FeatCalCalibrator(half, base, experts, data, config, show_progress=False)
    assert all(torch.equal(v, before[k]) for k, v in half.state_dict().items())
    # an in-memory expert in the other half dtype is named too (its blocks run under the same autocast)
    odd = {**experts, "dtd": copy.deepcopy(experts["dtd"]).to(weights)}
    with pytest.raises(ValueError, match=rf"cannot run `experts\['dtd'\]`, whose weights are {other}"):
        FeatCalCalibrator(copy.deepcopy(merged), base, odd, data, config, show_progress=False)
    # the matching dtype, and float32 weights with either dtype, are accepted
    FeatCalCalibrator(copy.deepcopy(merged).to(getattr(torch, forward)), None, {t: e.to(getattr(torch, forward))
                      for t, e in copy.deepcopy(experts).items()}, data, config, show_progress=False)
    FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, config, show_progress=False)


def test_a_recipe_fast_mode_dtype_is_refused_before_merging(world, tmp_path, capsys):
    from transformers import CLIPModel, CLIPProcessor

    CLIPModel.from_pretrained(world / "base").to(torch.float16).save_pretrained(tmp_path / "base16")
    CLIPProcessor.from_pretrained(world / "base").save_pretrained(tmp_path / "base16")
    out = tmp_path / "out"
    recipe = _recipe(world, base=str(tmp_path / "base16"), featcal={"forward_dtype": "bfloat16", "batch_size": 8},
                     evaluation=False, output_dir=str(out))
    path = _write(world / "fast16.yaml", recipe)
    assert cli.main(["run", path, "--quiet"]) == 2
    line = _one_error_line(capsys, "run")
    assert (
        "featcal.forward_dtype: FeatCalConfig.forward_dtype='bfloat16' cannot run `base`, whose weights are float16"
        in line
    )
    assert "Merging" not in capsys.readouterr().err
    assert not out.exists()
    # calibrate: found before the calibration data are loaded (a dataset that cannot load is not reached)
    featcal = tmp_path / "fast.json"
    featcal.write_text('{"forward_dtype": "bfloat16"}')
    unloadable = tmp_path / "not-a-dataset"
    unloadable.mkdir()
    assert cli.main(["calibrate", "--model", str(tmp_path / "base16"), "--base", str(tmp_path / "base16"),
                     *_experts(world), *_data(world, zorbs=unloadable), "--featcal-config", str(featcal),
                     "--output-dir", str(out), "--quiet"]) == 2
    line = _one_error_line(capsys, "calibrate")
    assert "forward_dtype='bfloat16' cannot run `--model`, whose weights are float16" in line and not out.exists()


# ============================================================================= seeds
def test_a_negative_seed_is_refused_naming_the_key(world, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"FeatCalConfig.seed must be a non-negative integer, got -1"):
        FeatCalConfig(seed=-1)
    FeatCalConfig(seed=0)
    path = _write(world / "seed.yaml", _recipe(world, featcal={"seed": -1}, output_dir=str(tmp_path / "never")))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key == "featcal.seed"
    assert cli.main(["run", path, "--check"]) == 2
    assert "featcal.seed: FeatCalConfig.seed must be a non-negative integer, got -1" in _one_error_line(capsys, "run")
    out = tmp_path / "out"
    assert cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world), "--seed", "-1", "--output-dir", str(out), "--quiet"]) == 2
    assert "featcal.seed" in _one_error_line(capsys, "calibrate") and not out.exists()


# ====================================================================== output paths
def test_demo_refuses_an_output_dir_that_is_a_file_before_building(tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    cache = tmp_path / "cache"
    assert cli.main(["demo", "--fast", "--output-dir", str(tmp_path / "a-file"), "--cache-dir", str(cache)]) == 2
    line = _one_error_line(capsys, "demo")
    assert "--output-dir" in line and "a-file' is a file" in line
    assert not cache.exists() and (tmp_path / "a-file").read_text() == "mine"


def test_evaluate_output_json_creates_its_folder_and_refuses_a_folder_up_front(world, tmp_path, capsys):
    args = ["evaluate", "--model", str(world / "base"), "--task", "zorbs", "--data",
            f"zorbs={world / 'data' / 'zorbs'}", "--class-names", "zorbs=zorb,blip,quax", "--batch-size", "8"]
    scores = tmp_path / "new" / "deeper" / "scores.json"
    assert cli.main([*args, "--output-json", str(scores)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(scores.read_text())
    assert f"| {100 * saved['scores']['zorbs']:.1f} |" in printed
    (tmp_path / "a-folder").mkdir()
    assert cli.main([*args, "--output-json", str(tmp_path / "a-folder")]) == 2
    assert "--output-json" in _one_error_line(capsys, "evaluate")
    (tmp_path / "a-file").write_text("x")
    assert cli.main([*args, "--output-json", str(tmp_path / "a-file" / "scores.json")]) == 2
    line = _one_error_line(capsys, "evaluate")
    assert "--output-json" in line and "cannot be written" in line


# ====================================================================== image columns
def _path_dataset(world, tmp_path) -> tuple[str, list[np.ndarray]]:
    """zorbs' DatasetDict with its images as PNG file paths (strings); returns the folder and the pixels."""
    source = datasets.load_from_disk(str(world / "data" / "zorbs"))
    splits, pixels = {}, []
    for split, ds in source.items():
        paths = []
        for i, image in enumerate(ds["image"]):
            path = tmp_path / "png" / f"{split}-{i}.png"
            path.parent.mkdir(exist_ok=True)
            image.save(path)  # lossless
            paths.append(str(path))
            if split == "train":
                pixels.append(np.asarray(image))
        splits[split] = datasets.Dataset.from_dict({"image": paths, "label": ds["label"]})
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "paths"))
    return str(tmp_path / "paths"), pixels


def test_an_image_column_of_file_paths_calibrates_as_the_images_do(world, tmp_path, capsys):
    folder, pixels = _path_dataset(world, tmp_path)
    spec = recipes.DatasetSpec(dataset=folder, split="train", num_examples=None, is_local=True)
    prepared = recipes.prepare_calibration("clip", "zorbs", spec, None, seed=0)
    decoded = [np.asarray(image) for image in prepared["image"]]
    assert len(decoded) == len(pixels) and all(np.array_equal(a, b) for a, b in zip(decoded, pixels, strict=True))

    outs = {}
    for name, zorbs in (("images", world / "data" / "zorbs"), ("paths", folder)):
        outs[name] = tmp_path / f"out-{name}"
        assert cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                         *_data(world, zorbs=zorbs), "--num-examples", "8", "--batch-size", "8",
                         "--output-dir", str(outs[name]), "--quiet"]) == 0
    capsys.readouterr()
    images, paths = (load_file(outs[n] / "model.safetensors") for n in ("images", "paths"))
    assert images.keys() == paths.keys() and all(torch.equal(images[k], paths[k]) for k in images)


def _with_image_column(world, tmp_path, name: str, values: list) -> str:
    train = datasets.load_from_disk(str(world / "data" / "zorbs"))["train"]
    ds = datasets.Dataset.from_dict({"image": values, "label": train["label"][: len(values)]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / name))
    return str(tmp_path / name)


@pytest.mark.parametrize("kind", ["ints", "arrays", "missing-paths"])
def test_an_image_column_that_holds_no_images_is_one_clear_line(world, tmp_path, capsys, kind):
    values = {"ints": list(range(8)), "arrays": [np.zeros((8, 8, 3), dtype=np.uint8).tolist()] * 8,
              "missing-paths": [str(tmp_path / f"gone-{i}.png") for i in range(8)]}[kind]
    folder = _with_image_column(world, tmp_path, kind, values)
    out = tmp_path / "out"
    assert cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world, zorbs=folder), "--output-dir", str(out), "--quiet"]) == 1  # a failed run
    line = _one_error_line(capsys, "calibrate")
    assert "calibration.tasks.zorbs: the image column 'image' holds" in line
    assert {"ints": "int64 values, not images", "arrays": "List values",
            "missing-paths": "file paths, but 8 of them are no file"}[kind] in line
    assert not out.exists()
    # the evaluation's image column is checked the same way
    assert cli.main(["evaluate", "--model", str(world / "base"), "--task", "zorbs", "--data", f"zorbs={folder}",
                     "--class-names", "zorbs=zorb,blip,quax"]) == 1
    assert "dataset of task 'zorbs': the image column 'image' holds" in _one_error_line(capsys, "evaluate")


def test_an_image_dataset_without_processing_class_names_the_argument(clip_setting):
    base, experts, merged, _ = clip_setting
    rng = np.random.default_rng(0)
    images = datasets.Dataset.from_dict({"image": [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
                                                   for _ in range(4)], "label": [0, 1, 0, 1]})
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\]: its rows have no 'pixel_values' \(columns: "
                                         r"\['image', 'label'\]\) and no `processing_class` was given"):
        FeatCalCalibrator(merged, base, experts, {"cars": images, "dtd": images}, show_progress=False)


# ==================================================================== duplicate keys
def test_a_key_given_twice_in_a_recipe_is_refused_naming_it_and_its_lines(world, tmp_path, capsys):
    text = open(_write(world / "once.yaml", _recipe(world, output_dir=str(tmp_path / "never")))).read()
    lines = text.splitlines()
    at = lines.index("  scaling_factor: 0.3")
    lines.insert(at + 1, "  scaling_factor: 0.9")
    path = world / "twice.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError,
                       match=rf"duplicate key 'scaling_factor' on line {at + 2} \(first given on line {at + 1}\)"):
        load_recipe(path)
    assert cli.main(["run", str(path), "--check"]) == 2
    assert "duplicate key 'scaling_factor'" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    # YAML merge keys (`<<: *anchor`) may still be overridden, as in yaml.safe_load
    assert recipes.load_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n") == {"a": {"b": 1, "c": 2},
                                                                               "d": {"b": 3, "c": 2}}
    featcal = tmp_path / "featcal.yaml"
    featcal.write_text("lambda_ratio: 0.1\nlambda_ratio: 0.2\n")
    assert cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world), "--featcal-config", str(featcal), "--output-dir", str(tmp_path / "never"),
                     "--quiet"]) == 2
    assert "duplicate key 'lambda_ratio' on line 2 (first given on line 1)" in capsys.readouterr().err
