"""save_model / push_to_hub / config and report round trips."""

from __future__ import annotations

import json
import os

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import CLIPVisionModel

from hf_featcal import DriftReport, FeatCalCalibrator, FeatCalConfig
from testing_utils import hub_stand_in


@pytest.fixture
def calibrated(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    base.save_pretrained(tmp_path / "base")
    merged.config.hf_featcal_merge = {"method": "task_arithmetic", "scaling_factor": 0.3}
    config = FeatCalConfig(num_samples_per_task=10)
    calibrator = FeatCalCalibrator(merged, str(tmp_path / "base"), experts, data, config, show_progress=False)
    calibrator.calibrate()
    return calibrator, data


def test_save_model_round_trip(calibrated, tmp_path):
    calibrator, data = calibrated
    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    assert {"config.json", "model.safetensors", "README.md", "featcal_config.json", "featcal_drift_report.json"} <= set(
        os.listdir(out)
    )
    loaded = CLIPVisionModel.from_pretrained(out).eval()
    pixels = data["cars"][0]["pixel_values"]
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=pixels).last_hidden_state,
                           calibrator.model(pixel_values=pixels).last_hidden_state)
    assert FeatCalConfig.from_pretrained(out) == calibrator.config
    assert DriftReport.load(out).to_dict() == calibrator.report.to_dict()
    assert json.loads((out / "featcal_drift_report.json").read_text()) == calibrator.report.to_dict()

    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    # a local base folder without a recorded hub id: named in the text, not in the hub metadata
    assert "base_model" not in meta and "local folder `base`" in card.text
    assert str(tmp_path) not in card.content
    assert meta["library_name"] == "transformers"
    assert "featcal" in meta["tags"]
    assert meta["featcal"]["tasks"] == ["cars", "dtd"]
    assert meta["featcal"]["samples_per_task"] == {"cars": 10, "dtd": 10}
    assert meta["featcal"]["merge"] == {"method": "task_arithmetic", "scaling_factor": 0.3}
    assert meta["featcal"]["config"]["lambda_ratio"] == 0.05
    last_before = calibrator.report.tasks["cars"]["before"][-1]
    assert f"{last_before:.4g}" in card.text


def test_push_to_hub_uploads_the_saved_folder(calibrated, monkeypatch):
    """The hub cannot be reached here: record what the standard huggingface_hub calls receive."""
    from huggingface_hub import HfApi

    hub_stand_in(monkeypatch)  # a token, no repository yet; the calls below are recorded here
    calibrator, _ = calibrated
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)

    def upload_folder(self, *, repo_id, folder_path, commit_message, **kwargs):
        calls["upload_folder"] = (repo_id, sorted(os.listdir(folder_path)), commit_message)
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert calibrator.push_to_hub("me/clip-featcal", private=True) == "commit-info"
    assert calls["create_repo"] == ("me/clip-featcal", {"private": True, "exist_ok": True})
    repo, files, _ = calls["upload_folder"]
    assert repo == "me/clip-featcal"
    assert {"model.safetensors", "README.md", "featcal_config.json", "featcal_drift_report.json"} <= set(files)


def test_saving_before_calibration_is_refused(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    with pytest.raises(RuntimeError, match="call calibrate"):
        calibrator.save_model(tmp_path)


def test_config_json_round_trip(tmp_path):
    config = FeatCalConfig(lambda_ratio=0.1, target_modules=r".*fc\d", layers_to_transform=range(0, 2),
                           num_samples_per_task=None)
    config.save_pretrained(tmp_path)
    again = FeatCalConfig.from_pretrained(tmp_path)
    assert again == config
    assert again.layers_to_transform == [0, 1]
    (tmp_path / "bad.json").write_text(json.dumps({"lambda_ratio": 0.1, "lamda": 2}))
    with pytest.raises(ValueError, match=r"unknown FeatCalConfig fields \['lamda'\]"):
        FeatCalConfig.from_pretrained(tmp_path / "bad.json")


def test_config_fields_have_help():
    import dataclasses

    for f in dataclasses.fields(FeatCalConfig):
        assert f.metadata.get("help"), f.name


def test_module_selection_rules():
    config = FeatCalConfig(target_modules=["fc2", "self_attn.q_proj"], exclude_modules=r"mlp\.fc2")
    assert config.module_selected("self_attn.q_proj")
    assert not config.module_selected("mlp.fc2")
    assert not config.module_selected("self_attn.k_proj")
    assert FeatCalConfig(layers_to_transform=-1).block_selected(11, 12)
    assert not FeatCalConfig(layers_to_transform=-1).block_selected(10, 12)


def test_the_drift_table_keeps_one_row_per_task_whatever_its_name():
    """Task names holding `|` or a line break stay one cell of one row of the model card's drift table."""
    import re

    from hf_featcal.report import DriftReport

    names = ["plain", "a|b", "two\nlines", "pipe | and\r\nbreak"]
    stages = {"before": [0.5, 0.4], "after": [0.3, 0.2], "head_before": [0.1], "head_after": [0.05]}
    table = DriftReport({name: dict(stages) for name in names}).summary_markdown().split("\n")

    def cells(line: str) -> list[str]:  # a Markdown row: split at the `|` that are not escaped
        assert line.startswith("|") and line.endswith("|"), line
        return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line[1:-1])]

    header, rule, *rows = table
    assert len(cells(header)) == len(cells(rule)) == 6
    assert len(rows) == len(names)
    for row, name in zip(rows, names, strict=True):
        assert len(cells(row)) == 6, row
        assert cells(row)[0] == " ".join(name.split())  # the name, its line breaks as spaces
        assert cells(row)[1:3] == ["0.4", "0.2"]
