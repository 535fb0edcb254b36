"""A saved folder of a model that reads text carries its tokenizer (issue 41, costly 1 and 6).

* `FeatCalCalibrator.save_model` given only a CLIP image processor (the README's Quickstart) takes the
  base's tokenizer, and transformers' zero-shot pipeline on the folder gives the scores a direct forward
  gives (not uniform ones); with no tokenizer anywhere it refuses before writing, naming what is missing.
* ``hf-featcal evaluate --model EXPERT --clip-model BASE`` takes the image processor from the expert's
  folder and the tokenizer from the base's.
"""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pytest
import torch
from transformers import CLIPImageProcessor, CLIPModel, CLIPVisionModel, pipeline

import test_cli
from hf_featcal import FeatCalCalibrator, FeatCalConfig, cli
from hf_featcal.merging import merge_models
from hf_featcal.processing import MissingTokenizerError
from test_downstream import _images, clip_processor, tiny_clip_model
from testing_utils import perturbed

world = test_cli.world  # the CLI tests' tiny CLIP world (module-scoped fixture)


def _tiny_clip(processor) -> CLIPModel:
    return tiny_clip_model(processor, torch.Generator().manual_seed(1))


def _calibrated(base_folder: str, base: CLIPModel, image_processor) -> FeatCalCalibrator:
    """A calibrated CLIPModel merge whose calibrator was given the image processor only."""
    generator = torch.Generator().manual_seed(2)
    experts = {}
    for task in ("cars", "dtd"):
        expert = CLIPVisionModel(base.config.vision_config).eval()
        expert.load_state_dict(perturbed(base, generator, 0.05).vision_model.state_dict())
        experts[task] = expert
    merged = merge_models(base_folder, experts, "task_arithmetic", scaling_factor=0.5)
    data = {t: [{"pixel_values": image_processor(_images(6, seed=i), return_tensors="pt")["pixel_values"]}]
            for i, t in enumerate(experts)}
    calibrator = FeatCalCalibrator(merged, base_folder, experts, data, FeatCalConfig(batch_size=6),
                                   processing_class=image_processor, show_progress=False)
    calibrator.calibrate()
    return calibrator


def test_a_clip_save_given_the_image_processor_carries_the_base_tokenizer(tmp_path):
    processor = clip_processor()
    base = _tiny_clip(processor)
    base.save_pretrained(tmp_path / "base")
    processor.save_pretrained(tmp_path / "base")  # the base folder has both halves, as a hub CLIP does
    calibrator = _calibrated(str(tmp_path / "base"), base, processor.image_processor)
    out = tmp_path / "saved"
    calibrator.save_model(out)  # as the README's Quickstart: processing_class=image processor only
    assert {"tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"} <= set(os.listdir(out))

    labels = ["red square", "green circle", "blue square"]
    image = _images(1, seed=7)[0]
    inputs = processor(text=[f"This is a photo of {label}." for label in labels], images=image,
                       return_tensors="pt", padding=True)
    with torch.no_grad():
        direct = calibrator.model.eval()(**inputs).logits_per_image.softmax(dim=-1)[0]
    scores = {row["label"]: row["score"]
              for row in pipeline("zero-shot-image-classification", model=str(out), device="cpu")(
                  image, candidate_labels=labels)}
    np.testing.assert_allclose([scores[label] for label in labels], direct.numpy(), rtol=0, atol=1e-5)
    assert float(direct.max() - direct.min()) > 1e-3  # not the uniform scores of a folder without a tokenizer


def test_a_clip_save_without_any_tokenizer_is_refused_before_writing(tmp_path):
    processor = clip_processor()
    base = _tiny_clip(processor)
    base.save_pretrained(tmp_path / "base")
    processor.image_processor.save_pretrained(tmp_path / "base")  # no tokenizer with the base
    calibrator = _calibrated(str(tmp_path / "base"), base, processor.image_processor)
    out = tmp_path / "saved"
    with pytest.raises(MissingTokenizerError, match=r"CLIPModel reads text.*gave CLIPImageProcessor.*the base \("):
        calibrator.save_model(out)
    assert not out.exists()
    calibrator.save_model(out, processing_class=[processor.image_processor, processor.tokenizer])  # given: saved
    assert "tokenizer.json" in os.listdir(out)


def test_evaluate_an_expert_takes_the_tokenizer_from_the_clip_model(world, tmp_path, capsys):
    """The expert folder has only an image processor; --clip-model's folder has the tokenizer: the score is
    the Python API's with the base's CLIPProcessor."""
    from transformers import CLIPProcessor

    from hf_featcal.evaluation import evaluate_clip_zeroshot

    expert = tmp_path / "expert"
    model = CLIPVisionModel.from_pretrained(world / "experts" / "zorbs")
    model.save_pretrained(expert)
    CLIPImageProcessor.from_pretrained(world / "base").save_pretrained(expert)
    scores = tmp_path / "scores.json"
    assert cli.main(["evaluate", "--model", str(expert), "--clip-model", str(world / "base"), "--task", "zorbs",
                     "--data", f"zorbs={world / 'data' / 'zorbs'}", "--class-names", "zorbs=zorb,blip,quax",
                     "--batch-size", "8", "--output-json", str(scores)]) == 0, capsys.readouterr().err
    reported = json.loads(scores.read_text())["scores"]["zorbs"]
    expected = evaluate_clip_zeroshot(
        model, CLIPModel.from_pretrained(world / "base"), CLIPProcessor.from_pretrained(world / "base"), ["zorbs"],
        datasets={"zorbs": datasets.load_from_disk(str(world / "data" / "zorbs"))["test"]},
        class_names={"zorbs": ["zorb", "blip", "quax"]}, batch_size=8)
    assert reported == pytest.approx(expected["zorbs"])
