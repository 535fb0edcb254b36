"""Calibration data handling: iterables used as given, Datasets drawn with the seed (or used whole, in
order), cut and batched."""

from __future__ import annotations

import copy

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from transformers import CLIPImageProcessor

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.data import prepare_batches


def _prepare(data, **kw):
    args = dict(main_input_name="pixel_values", num_samples=None, batch_size=4, seed=0)
    args.update(kw)
    return prepare_batches("t", data, **args)


def test_iterables_are_used_as_given_and_cut(generator):
    batches = [{"pixel_values": torch.randn(n, 3, 8, 8, generator=generator), "tag": "x"} for n in (5, 5, 5)]
    out = _prepare(iter(batches), num_samples=7, batch_size=2)
    assert [b["pixel_values"].shape[0] for b in out] == [5, 2]  # batch_size does not re-chunk
    assert torch.equal(out[1]["pixel_values"], batches[1]["pixel_values"][:2])
    assert out[1]["tag"] == "x"
    assert [b["pixel_values"].shape[0] for b in _prepare(batches, num_samples=None)] == [5, 5, 5]
    assert [b["pixel_values"].shape[0] for b in _prepare(batches, num_samples=10)] == [5, 5]


def test_dataset_is_shuffled_with_the_seed_cut_and_batched(generator):
    pixels = torch.randn(11, 3, 8, 8, generator=generator)
    dataset = Dataset.from_dict({"pixel_values": pixels.numpy(), "label": list(range(11))}).with_format("torch")
    out = _prepare(dataset, num_samples=9, batch_size=4, seed=3)
    assert [b["pixel_values"].shape[0] for b in out] == [4, 4, 1]
    order = [int(row["label"]) for row in dataset.shuffle(seed=3).select(range(9))]
    got = torch.cat([b["labels"] for b in out]).tolist()  # default_data_collator renames label → labels
    assert got == order
    assert torch.allclose(torch.cat([b["pixel_values"] for b in out]), pixels[order])


def test_dataset_with_images_and_processing_class(generator):
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)) for _ in range(6)]
    dataset = Dataset.from_dict({"image": images, "label": [0, 1, 0, 1, 0, 1]})
    processor = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    out = _prepare(dataset, batch_size=4, seed=1, processing_class=processor)
    assert [b["pixel_values"].shape for b in out] == [torch.Size([4, 3, 8, 8]), torch.Size([2, 3, 8, 8])]
    want = processor(images=[dataset[i]["image"] for i in range(4)], return_tensors="pt")["pixel_values"]  # in order
    assert torch.allclose(out[0]["pixel_values"], want)


def test_dataset_with_images_and_a_per_image_transform():
    """A per-image transform (open_clip's / torchvision's `preprocess`) as the processing class."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(5)]
    dataset = Dataset.from_dict({"image": images, "label": [0, 1, 0, 1, 0]})

    def preprocess(image):
        return torch.as_tensor(np.array(image), dtype=torch.float32).permute(2, 0, 1) / 255  # a writable copy

    out = _prepare(dataset, batch_size=3, seed=2, processing_class=preprocess)
    want = torch.stack([preprocess(dataset[i]["image"]) for i in range(5)])  # num_samples None: all, in order
    assert [b["pixel_values"].shape[0] for b in out] == [3, 2]
    assert torch.equal(torch.cat([b["pixel_values"] for b in out]), want)


def test_calibrator_accepts_datasets(clip_setting, generator):
    base, experts, merged, data = clip_setting
    datasets = {
        t: Dataset.from_dict({"pixel_values": torch.cat([b["pixel_values"] for b in bs]).numpy()}).with_format("torch")
        for t, bs in data.items()
    }
    config = FeatCalConfig(num_samples_per_task=8, batch_size=3)
    calibrator = FeatCalCalibrator(merged, base, experts, datasets, config, show_progress=False)
    assert calibrator.samples_per_task == {"cars": 8, "dtd": 8}
    assert calibrator.batch_sizes["cars"] == [3, 3, 2]
    calibrator.calibrate()
    assert calibrator.report.tasks["cars"]["after"][-1] < calibrator.report.tasks["cars"]["before"][-1]


def test_extra_batch_keys_are_ignored_by_the_model(clip_setting, generator):
    """Keys the tower's forward does not take (labels, ids, text, a per-batch tensor) change nothing:
    the batches are counted and cut by their pixel values, and the calibrated model and the drift
    report are bit-identical to those from the same batches without the extra keys."""
    base, experts, merged, data = clip_setting
    config = FeatCalConfig(num_samples_per_task=8)  # batches of 5, 5, 3: the second one is cut to 3
    plain = copy.deepcopy(merged)
    plain_calibrator = FeatCalCalibrator(plain, base, experts, data, config, show_progress=False)
    plain_calibrator.calibrate()

    def with_extras(batch):
        n = batch["pixel_values"].shape[0]
        return {"class_weights": torch.rand(10, generator=generator), **batch,
                "labels": torch.randint(0, 10, (n,), generator=generator), "example_id": torch.arange(n),
                "caption": ["a photo"] * n}

    calibrator = FeatCalCalibrator(merged, base, experts, {t: [with_extras(b) for b in bs] for t, bs in data.items()},
                                   config, show_progress=False)
    assert calibrator.samples_per_task == plain_calibrator.samples_per_task == {"cars": 8, "dtd": 8}
    assert calibrator.batch_sizes == {"cars": [5, 3], "dtd": [5, 3]}
    extras = {t: [with_extras(b) for b in bs] for t, bs in data.items()}
    cut = prepare_batches("cars", extras["cars"], main_input_name="pixel_values", num_samples=8, batch_size=5,
                          seed=config.seed)[1]  # as the calibrator prepares them
    assert torch.equal(cut["pixel_values"], data["cars"][1]["pixel_values"][:3]) and cut["labels"].shape == (3,)
    calibrator.calibrate()
    for (name, p), q in zip(merged.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert calibrator.report.to_dict() == plain_calibrator.report.to_dict()


def test_text_columns_beside_token_ids_are_dropped_by_the_default_collator():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "b": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    rows = [{"input_text": "a b", "input_ids": [3, 4], "attention_mask": [1, 1], "labels": [3]},
            {"input_text": "a", "input_ids": [3], "attention_mask": [1], "labels": [4, 3]}]
    dataset = Dataset.from_list(rows)
    out = _prepare(dataset, main_input_name="input_ids", batch_size=2, processing_class=tokenizer)
    assert set(out[0]) == {"input_ids", "attention_mask", "labels"}
    assert out[0]["labels"].shape == (2, 2) and (out[0]["labels"] == -100).sum() == 1


def test_a_dataset_without_num_samples_is_used_whole_in_its_order(generator):
    """num_samples None draws nothing: every row, in the Dataset's order (no shuffle)."""
    pixels = torch.randn(7, 3, 8, 8, generator=generator)
    dataset = Dataset.from_dict({"pixel_values": pixels.numpy(), "label": list(range(7))}).with_format("torch")
    out = _prepare(dataset, num_samples=None, batch_size=3, seed=5)
    assert torch.cat([b["labels"] for b in out]).tolist() == list(range(7))


def test_a_recipes_calibration_data_are_drawn_once(tmp_path, monkeypatch, generator):
    """Issue 30: the recipe path draws its examples once. `recipes.load.prepare_calibration` shuffles
    with the seed and cuts; the calibrator's batching (num_samples_per_task None, as recipes set it)
    takes those rows in that order: one shuffle in all, and the rows are the first `num_examples` of a
    shuffle of the whole split with the seed."""
    from hf_featcal.recipes.load import prepare_calibration
    from hf_featcal.recipes.spec import DatasetSpec

    pixels = torch.randn(20, 3, 8, 8, generator=generator)
    Dataset.from_dict({"pixel_values": pixels.numpy()}).save_to_disk(str(tmp_path / "d"))
    expected = Dataset.from_dict({"row": list(range(20))}).shuffle(seed=4)["row"][:9]
    shuffles = []
    original = Dataset.shuffle

    def counting_shuffle(self, *args, **kwargs):
        shuffles.append(kwargs.get("seed"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Dataset, "shuffle", counting_shuffle)
    spec = DatasetSpec(dataset=str(tmp_path / "d"), split="train", num_examples=9, is_local=True)
    prepared = prepare_calibration("clip", "t", spec, None, seed=4).with_format("torch")
    batches = _prepare(prepared, num_samples=None, batch_size=4, seed=4)
    assert shuffles == [4]
    assert [b["pixel_values"].shape[0] for b in batches] == [4, 4, 1]
    assert torch.allclose(torch.cat([b["pixel_values"] for b in batches]), pixels[expected])
