"""Every user error of the command line: one line on stderr naming what is wrong, found before anything is
merged or calibrated; exit status 2 for a usage error, 1 for a run that failed."""

from __future__ import annotations

import datasets
import pytest
import torch

import test_cli
from hf_featcal import cli
from test_cli import TASKS, _recipe, _write

world = test_cli.world  # the tiny local world of models and datasets (a module-scoped fixture)


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"hf-featcal {command}: error: "), err
    return lines[0]


def _experts(world):
    return [a for t in TASKS for a in ("--expert", f"{t}={world / 'experts' / t}")]


def _data(world, **overrides):
    return [a for t in TASKS for a in ("--data", f"{t}={overrides.get(t, world / 'data' / t)}")]


@pytest.mark.parametrize("device",
                         ["meta", "not-a-device", "cuda:97"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_an_unusable_device_is_one_line_and_nothing_runs(world, capsys, tmp_path, device):
    out = tmp_path / "out"
    code = cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world), "--device", device, "--output-dir", str(out), "--quiet"])
    assert code == 2
    line = _one_error_line(capsys, "calibrate")
    assert f"--device: '{device}'" in line or "--device: 'meta' holds no values" in line
    assert not out.exists()
    recipe = _write(world / "device-recipe.yaml", _recipe(world, output_dir=str(tmp_path / "run-out")))
    assert cli.main(["run", recipe, "--device", device, "--quiet"]) == 2
    assert "--device" in _one_error_line(capsys, "run")
    assert not (tmp_path / "run-out").exists()


def test_a_local_split_with_no_rows(world, capsys, tmp_path):
    train = datasets.load_from_disk(str(world / "data" / "zorbs"))["train"]
    datasets.DatasetDict({"train": train.select([]), "test": train.select(range(4))}).save_to_disk(
        str(tmp_path / "empty-split")
    )
    datasets.DatasetDict({"train": train.select(range(4))}).save_to_disk(str(tmp_path / "ok"))
    for folder in ("empty-split",):
        code = cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                         *_data(world, zorbs=tmp_path / folder), "--output-dir", str(tmp_path / "out"), "--quiet"])
        assert code == 1  # the data given cannot be used: the run failed (2 is for usage errors)
        line = _one_error_line(capsys, "calibrate")
        assert f"calibration.tasks.zorbs: cannot load the local dataset '{tmp_path / folder}'" in line


def test_a_recipe_path_that_is_a_folder(world, capsys, tmp_path):
    assert cli.main(["run", str(tmp_path)]) == 2
    assert f"recipe file '{tmp_path}' is a folder, not a YAML file" in _one_error_line(capsys, "run")


def test_an_output_dir_that_cannot_be_written_is_refused_before_merging(world, capsys, tmp_path):
    (tmp_path / "a-file").write_text("x")
    code = cli.main(["merge", "--base", str(world / "base"), *_experts(world), "--method", "task_arithmetic",
                     "--output-dir", str(tmp_path / "a-file" / "merged")])
    assert code == 2
    err_line = _one_error_line(capsys, "merge")
    assert "--output-dir" in err_line and "a-file' is a file" in err_line
    code = cli.main(["calibrate", "--model", str(world / "base"), "--base", str(world / "base"), *_experts(world),
                     *_data(world), "--output-dir", str(tmp_path / "a-file"), "--quiet"])
    assert code == 2
    assert "--output-dir" in _one_error_line(capsys, "calibrate")


def test_an_error_found_while_running_is_one_line_with_status_1(world, capsys, tmp_path):
    """A ValueError raised deep in the run (here: an expert whose weights do not fit) is one line; the run
    failed, so the status is 1 (2 is for usage errors)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    odd = CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=8, patch_size=4))
    odd.save_pretrained(tmp_path / "odd")
    code = cli.main(["merge", "--base", str(world / "base"), "--expert", f"zorbs={tmp_path / 'odd'}",
                     "--method", "task_arithmetic", "--output-dir", str(tmp_path / "merged")])
    assert code == 1
    line = _one_error_line(capsys, "merge")
    assert "ValueError: `experts['zorbs']` has a different configuration" in line  # the calibrator's check
    assert "hidden_size" in line
