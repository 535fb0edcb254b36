"""Bad inputs are named before any work: every batch checked up front, configs re-checked, NaN/Inf
refused by the mergers, unbounded iterables refused, and messages that say what is wrong."""

from __future__ import annotations

import copy
import itertools
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertModel

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.experts import load_model
from hf_featcal.merging import task_arithmetic, ties_merging
from test_llm import llm_config, lm_batch
from testing_utils import perturbed
from testing_utils import task_arithmetic as reference_task_arithmetic

VOCAB = 50


def _never_touched(calibrator: FeatCalCalibrator, monkeypatch) -> None:
    """Make any block work fail loudly: the checks must come first."""
    monkeypatch.setattr(calibrator, "_calibrate_block", lambda *a: pytest.fail("a block was calibrated"))


# ============================================================================ point 7: every batch, up front
def test_a_bad_shape_in_a_later_batch_is_refused_at_construction(clip_setting, generator):
    base, experts, merged, data = clip_setting
    bad = [*data["cars"][:2], {"pixel_values": torch.randn(2, 3, 4, 4, generator=generator)}]
    with pytest.raises(ValueError,
                       match=r"calibration_data\['cars'\]: the merged model cannot take its batches \(batch 2"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": bad})
    bad = [*data["cars"][:1], {"pixel_values": torch.zeros(2, 3, 8, 8, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\] batch 1: 'pixel_values' must be floating point"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": bad})


@pytest.fixture
def bert_setting(generator):
    base = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16)).eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = reference_task_arithmetic(base, experts)

    def batch():
        ids = torch.randint(1, VOCAB, (4, 6), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    data = {t: [batch(), batch()] for t in experts}
    return base, experts, merged, data, batch


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda b: b["input_ids"].__setitem__((3, 2), VOCAB + 7),
         rf"'input_ids' holds the token id {VOCAB + 7}, outside the model's vocabulary of {VOCAB}"),
        (lambda b: b["input_ids"].__setitem__((2, 0), -3), r"'input_ids' holds the negative token id -3"),
        (lambda b: b.__setitem__("input_ids", b["input_ids"].float()),
         r"'input_ids' must hold integer token ids, got dtype torch.float32"),
        (lambda b: b.__setitem__("attention_mask", b["attention_mask"][:, :4]),
         r"'attention_mask' has shape \(4, 4\), expected 'input_ids''s \(4, 6\)"),
        (lambda b: b.__setitem__("token_type_ids", b["input_ids"][:3] * 0),
         r"'token_type_ids' has shape \(3, 6\), but 'input_ids' holds 4 examples"),
        (lambda b: b.__setitem__("attention_mask", b["attention_mask"].numpy()),
         r"'attention_mask' is a numpy.ndarray, expected a torch.Tensor"),
    ],
)
def test_token_batches_are_checked_row_by_row_up_front(bert_setting, edit, match):
    base, experts, merged, data, _ = bert_setting
    later = copy.deepcopy(data["b"])
    edit(later[1])  # a later row of a later batch
    with pytest.raises(ValueError, match=r"calibration_data\['b'\] batch 1: " + match):
        FeatCalCalibrator(merged, base, experts, {**data, "b": later})


def test_a_task_of_padding_only_is_refused(bert_setting):
    base, experts, merged, data, _ = bert_setting
    padded = [{**b, "attention_mask": torch.zeros_like(b["attention_mask"])} for b in data["a"]]
    with pytest.raises(ValueError, match=r"calibration_data\['a'\] has no weighted token: every position is padding"):
        FeatCalCalibrator(merged, base, experts, {**data, "a": padded})


def test_a_task_whose_labels_are_all_ignored_is_refused(generator):
    base = AutoModelForCausalLM.from_config(llm_config("llama")).eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    merged = reference_task_arithmetic(base, experts)
    data = {t: [lm_batch(generator), lm_batch(generator)] for t in experts}
    data["code"] = [{**b, "labels": torch.full_like(b["input_ids"], -100)} for b in data["code"]]
    with pytest.raises(ValueError, match=r"calibration_data\['code'\] has no weighted token: .*labels -100"):
        FeatCalCalibrator(merged, base, experts, data)


def test_an_unwritable_checkpoint_dir_is_refused_before_any_work(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"`checkpoint_dir` .*a-file' is a file, not a folder"):
        FeatCalCalibrator(merged, base, experts, data, checkpoint_dir=tmp_path / "a-file")
    with pytest.raises(ValueError, match=r"`checkpoint_dir` .*a-file/sub' cannot be created: .*a-file' is a file"):
        FeatCalCalibrator(merged, base, experts, data, checkpoint_dir=tmp_path / "a-file" / "sub")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]  # nothing left behind by the check
    with pytest.raises(TypeError, match=r"`checkpoint_dir` must be a folder path \(str or os.PathLike\), got int"):
        FeatCalCalibrator(merged, base, experts, data, checkpoint_dir=3)


# ============================================================================ point 9: config edits
def test_config_assignments_are_validated(clip_setting):
    config = FeatCalConfig()
    with pytest.raises(ValueError, match=r"FeatCalConfig.teacher_alpha must be in \[0, 1\], got 5"):
        config.teacher_alpha = 5
    assert config.teacher_alpha == 0.25  # the old value is kept
    with pytest.raises(ValueError, match=r"FeatCalConfig.lambda_ratio must be a finite real number, got nan"):
        config.lambda_ratio = float("nan")
    config.layers_to_transform = 1
    assert config.layers_to_transform == [1]


def test_config_edited_after_construction_is_checked_at_calibrate(clip_setting, monkeypatch):
    base, experts, merged, data = clip_setting
    config = FeatCalConfig(target_modules=["fc1"])
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, config, show_progress=False)
    config.target_modules.append("gate_proj")  # edited in place: no assignment to check
    _never_touched(calibrator, monkeypatch)
    with pytest.raises(ValueError, match=r"FeatCalConfig.target_modules entry 'gate_proj' matches no module"):
        calibrator.calibrate()

    config = FeatCalConfig()
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, config, show_progress=False)
    config.batch_size = 4
    _never_touched(calibrator, monkeypatch)
    with pytest.raises(ValueError, match=r"FeatCalConfig.batch_size changed after the calibrator was built \(16 → 4\)"):
        calibrator.calibrate()


def test_a_valid_config_edit_after_construction_is_honoured(clip_setting):
    base, experts, merged, data = clip_setting
    config = FeatCalConfig()
    edited = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(edited, base, experts, data, config, show_progress=False)
    config.layers_to_transform = [1]
    config.lambda_ratio = 0.2
    calibrator.calibrate()
    fresh = copy.deepcopy(merged)
    FeatCalCalibrator(fresh, base, experts, data, FeatCalConfig(layers_to_transform=[1], lambda_ratio=0.2),
                      show_progress=False).calibrate()
    for key, value in fresh.state_dict().items():
        assert torch.equal(edited.state_dict()[key], value), key
    assert torch.equal(edited.encoder.layers[0].mlp.fc1.weight, merged.encoder.layers[0].mlp.fc1.weight)


# ============================================================================ point 10: NaN / Inf in merges
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_merging_refuses_non_finite_experts_and_base(clip_setting, tmp_path, bad):
    base, experts, _, _ = clip_setting
    broken = copy.deepcopy(experts["dtd"])
    with torch.no_grad():
        broken.encoder.layers[1].mlp.fc2.weight[3, 4] = bad
    for merge in (task_arithmetic, ties_merging):
        with pytest.raises(
            ValueError, match=r"expert 'dtd' has non-finite values \(NaN/Inf\) in 'encoder.layers.1.mlp.fc2.weight'"
        ):
            merge(base, {**experts, "dtd": broken})
    broken.save_pretrained(tmp_path / "dtd")
    with pytest.raises(
        ValueError,
        match=r"expert 'dtd' has non-finite values \(NaN/Inf\) in '(vision_model\.)?encoder.layers.1.mlp.fc2.weight'",
    ):
        task_arithmetic(base, {**experts, "dtd": str(tmp_path / "dtd")})
    broken_base = copy.deepcopy(base)
    with torch.no_grad():
        broken_base.embeddings.patch_embedding.weight[0, 0, 0, 0] = bad
    with pytest.raises(ValueError,
                       match=r"`base_model` has non-finite values \(NaN/Inf\) in 'embeddings.patch_embedding.weight'"):
        task_arithmetic(broken_base, experts)


# ============================================================================ point 11: unbounded input
def _bounded(items, limit=20000):
    """An endless stream that fails the test instead of hanging it when nothing stops reading."""
    for index, item in enumerate(items):
        if index >= limit:
            pytest.fail("the calibrator kept reading an unbounded iterable")
        yield item


def test_unbounded_iterables_are_refused(clip_setting, generator):
    base, experts, merged, data = clip_setting
    endless = _bounded(itertools.repeat(data["cars"][0]))
    with pytest.raises(
        ValueError,
        match=r"calibration_data\['cars'\] is a generator without a length, and FeatCalConfig.num_samples_per_task is "
              r"None",
    ):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": endless}, FeatCalConfig(num_samples_per_task=None))
    empty = _bounded(itertools.repeat({"pixel_values": torch.empty(0, 3, 8, 8)}))
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\] yielded 1000 empty batches in a row"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": empty})
    # bounded by num_samples_per_task, an endless stream is fine
    calibrator = FeatCalCalibrator(merged, base, experts, {**data, "cars": _bounded(itertools.repeat(data["cars"][0]))},
                                   FeatCalConfig(num_samples_per_task=12))
    assert calibrator.samples_per_task["cars"] == 12


# ============================================================================ point 12: messages
def test_a_numpy_array_is_named_as_such(clip_setting, generator):
    base, experts, merged, data = clip_setting
    arrays = [{"pixel_values": np.zeros((2, 3, 8, 8), dtype=np.float32)}]
    with pytest.raises(
        ValueError,
        match=r"calibration_data\['cars'\] item 0: the batch's 'pixel_values' is a numpy.ndarray, expected a "
              r"torch.Tensor",
    ):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": arrays})


def test_a_corrupt_safetensors_file_names_the_expert_and_the_file(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    experts["cars"].save_pretrained(tmp_path / "cars")
    path = tmp_path / "cars" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    match = rf"`experts\['cars'\]`: cannot read the safetensors file '{path}': .*incomplete metadata"
    with pytest.raises(ValueError, match=match):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "cars")}, data)
    with pytest.raises(ValueError, match=match):
        task_arithmetic(base, {**experts, "cars": str(tmp_path / "cars")})


def test_a_shard_index_naming_missing_files_is_reported(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    experts["cars"].save_pretrained(tmp_path / "cars", max_shard_size="10KB")
    shard = sorted(n for n in os.listdir(tmp_path / "cars") if n.startswith("model-0"))[0]
    os.remove(tmp_path / "cars" / shard)
    with pytest.raises(ValueError,
                       match=rf"`experts\['cars'\]`: the shard index .* lists files that do not exist: \[.*{shard}"):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "cars")}, data)


def test_a_malformed_featcal_config_names_its_path(tmp_path):
    (tmp_path / "featcal_config.json").write_text('{"lambda_ratio": 0.1,')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'featcal_config.json'}: not a valid JSON FeatCal config"):
        FeatCalConfig.from_pretrained(tmp_path)
    (tmp_path / "featcal_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError,
                       match=r"featcal_config.json: a FeatCal config must be a JSON object of fields, got list"):
        FeatCalConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nowhere.*: no FeatCal config there"):
        FeatCalConfig.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("missing", ["/nonexistent/models/expert", "./no/such/expert", "../no-such-expert"])
def test_a_missing_local_path_is_named_as_a_missing_folder(clip_setting, missing):
    base, experts, merged, data = clip_setting
    match = rf"`experts\['cars'\]`: cannot load a model config from '{missing}': no such local folder"
    with pytest.raises(ValueError, match=match):
        FeatCalCalibrator(merged, base, {**experts, "cars": missing}, data)
    with pytest.raises(ValueError, match=match):
        task_arithmetic(base, {**experts, "cars": missing})
    with pytest.raises(ValueError,
                       match=rf"`base_model`: cannot load a model config from '{missing}': no such local folder"):
        task_arithmetic(missing, experts)
    with pytest.raises(ValueError,
                       match=rf"`base_model`: cannot load a model config from '{missing}': no such local folder"):
        load_model(missing, "base_model")
