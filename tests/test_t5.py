"""FLAN-T5 / T5 encoder-decoder calibration on tiny random-init models."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel, T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import perturbed, task_arithmetic

VOCAB = 40


def t5_config(**overrides) -> T5Config:
    values = dict(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )
    values.update(overrides)
    return T5Config(**values)


def randomise_t5_norms(model, generator):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=generator))


def seq2seq_batch(generator, n=4, src=7, tgt=4, pad_rows=True):
    ids = torch.randint(2, VOCAB, (n, src), generator=generator)
    mask = torch.ones(n, src, dtype=torch.long)
    labels = torch.randint(2, VOCAB, (n, tgt), generator=generator)
    if pad_rows:
        ids[0, src - 2 :] = 0
        mask[0, src - 2 :] = 0
        labels[1, tgt - 1 :] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build_t5_setting(generator, tasks=("cola", "sst2")):
    """A tiny T5 base, perturbed experts for `tasks`, their Task-Arithmetic merge and two batches per task."""
    base = T5ForConditionalGeneration(t5_config()).eval()
    randomise_t5_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in tasks}
    merged = task_arithmetic(base, experts)
    data = {t: [seq2seq_batch(generator), seq2seq_batch(generator)] for t in experts}
    return base, experts, merged, data


@pytest.fixture
def t5_setting(generator):
    return build_t5_setting(generator)


def _block_outputs(model, batch):
    """Raw block outputs of a full forward (hooks on every T5Block), encoder blocks then decoder blocks."""
    outputs = []
    handles = [b.register_forward_hook(lambda m, a, out: outputs.append(out[0])) for b in model.encoder.block]
    handles += [b.register_forward_hook(lambda m, a, out: outputs.append(out[0])) for b in model.decoder.block]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return outputs


def _independent_drift(merged, expert, batches):
    n_enc = len(merged.encoder.block)
    sums = torch.zeros(n_enc + len(merged.decoder.block), dtype=torch.float64)
    counts = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        enc_mask = batch["attention_mask"].double()
        dec_mask = (batch["labels"] != -100).double()
        for i, (hm, he) in enumerate(zip(_block_outputs(merged, batch), _block_outputs(expert, batch), strict=True)):
            mask = enc_mask if i < n_enc else dec_mask
            sums[i] += ((hm.double() - he.double()).norm(dim=-1) * mask).sum()
        counts += torch.stack([enc_mask.sum(), dec_mask.sum()])
    return [float(sums[i] / counts[0 if i < n_enc else 1]) for i in range(len(sums))]


def test_drift_report_matches_full_model_forwards(t5_setting):
    base, experts, merged, data = t5_setting
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    report = calibrator.report.to_dict()["tasks"]
    for task, expert in experts.items():
        assert len(report[task]["before"]) == 4  # 2 encoder blocks, then 2 decoder blocks
        assert report[task]["before"] == pytest.approx(_independent_drift(given, expert, data[task]), rel=1e-5)
        assert report[task]["after"] == pytest.approx(_independent_drift(merged, expert, data[task]), rel=1e-5)
        assert report[task]["after"][-1] < report[task]["before"][-1]


def test_padding_content_and_extra_padding_change_nothing(t5_setting, generator):
    """Padded encoder positions and -100 label positions carry weight 0 in every statistic (also the
    cross-attention keys/values, which read the encoder output): adding padding changes nothing."""
    base, experts, merged, data = t5_setting
    padded = {}
    for task, batches in data.items():
        padded[task] = []
        for b in batches:
            n = b["input_ids"].shape[0]
            junk = torch.randint(2, VOCAB, (n, 3), generator=generator)  # content under a zero mask
            padded[task].append(
                {
                    "input_ids": torch.cat([b["input_ids"], junk], 1),
                    "attention_mask": torch.cat([b["attention_mask"], torch.zeros(n, 3, dtype=torch.long)], 1),
                    "labels": torch.cat([b["labels"], torch.full((n, 2), -100)], 1),
                }
            )
    other = copy.deepcopy(merged)
    one = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    one.calibrate()
    two = FeatCalCalibrator(other, base, experts, padded, show_progress=False)
    two.calibrate()
    for (name, p), q in zip(merged.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=name)
    for task in data:
        assert one.report.tasks[task]["before"] == pytest.approx(two.report.tasks[task]["before"], rel=1e-5)


@pytest.mark.parametrize("dtype,compute_dtype,epsilon,weight_tol,output_tol", [
    (torch.float32, "float32", 1e-8, 1e-3, 1e-4),
    (torch.float64, "float64", 1e-15, 1e-9, 1e-9),
])
def test_exact_recovery_when_only_wo_differs(generator, dtype, compute_dtype, epsilon, weight_tol, output_tol):
    expert = T5ForConditionalGeneration(t5_config()).eval()
    randomise_t5_norms(expert, generator)
    expert = expert.to(dtype)
    merged = copy.deepcopy(expert)
    with torch.no_grad():
        for block in list(merged.encoder.block) + list(merged.decoder.block):
            wo = block.layer[-1].DenseReluDense.wo.weight
            wo.add_(0.3 * torch.randn(wo.shape, generator=generator, dtype=dtype))
    # ≥ 32 (= d_ff) non-padding tokens per module on both sides: 48 examples × (≥5 source, ≥3 target)
    data = {"task": [seq2seq_batch(generator, n=16) for _ in range(3)]}
    probe = seq2seq_batch(generator, n=5, pad_rows=False)
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype=compute_dtype, epsilon=epsilon)

    def logits(model):
        with torch.no_grad():
            return model(**probe).logits

    assert float((logits(merged) - logits(expert)).norm() / logits(expert).norm()) > 0.05
    FeatCalCalibrator(merged, None, {"task": expert}, data, config, show_progress=False).calibrate()
    assert float((logits(merged) - logits(expert)).norm() / logits(expert).norm()) <= output_tol
    for mb, eb in zip(list(merged.encoder.block) + list(merged.decoder.block),
                      list(expert.encoder.block) + list(expert.decoder.block), strict=True):
        got, want = mb.layer[-1].DenseReluDense.wo.weight, eb.layer[-1].DenseReluDense.wo.weight
        assert float((got - want).norm() / want.norm()) <= weight_tol


def test_t5_v1_geometry_and_encoder_only_model(generator):
    """T5 v1.0: ReLU `wi`, tied embeddings; and T5EncoderModel (encoder stack only)."""
    config = t5_config(feed_forward_proj="relu", tie_word_embeddings=True)
    base = T5ForConditionalGeneration(config).eval()
    randomise_t5_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    given = copy.deepcopy(merged)
    data = {t: [seq2seq_batch(generator)] for t in experts}
    lm_head = merged.lm_head.weight.clone()
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    for task in experts:
        assert calibrator.report.tasks[task]["before"] == pytest.approx(
            _independent_drift(given, experts[task], data[task]), rel=1e-5
        )
    assert torch.equal(merged.lm_head.weight, lm_head)  # embeddings / head keep their merged values
    assert not torch.equal(merged.encoder.block[0].layer[1].DenseReluDense.wi.weight,
                           given.encoder.block[0].layer[1].DenseReluDense.wi.weight)

    encoder_only = T5EncoderModel(config).eval()
    encoder_only.load_state_dict(given.state_dict(), strict=False)
    enc_data = {t: [{k: v for k, v in b.items() if k != "labels"} for b in bs] for t, bs in data.items()}
    enc_cal = FeatCalCalibrator(encoder_only, base, experts, enc_data, show_progress=False)
    enc_cal.calibrate()
    assert len(enc_cal.report.tasks["a"]["before"]) == 2
    # the encoder result equals the encoder part of the full model's calibration
    for name, p in encoder_only.encoder.named_parameters():
        torch.testing.assert_close(p, merged.encoder.get_parameter(name), rtol=1e-5, atol=1e-6)


def test_untouched_modules_and_shared_position_bias(t5_setting):
    base, experts, merged, data = t5_setting
    before = copy.deepcopy(merged.state_dict())
    FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    after = merged.state_dict()
    for key in before:
        if any(s in key for s in ("shared", "embed_tokens", "relative_attention_bias", "final_layer_norm", "lm_head")):
            assert torch.equal(before[key], after[key]), key
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("EncDecAttention.k" in k for k in changed) and any("wi_1" in k for k in changed)


def test_batches_without_labels_are_refused(t5_setting):
    base, experts, merged, data = t5_setting
    no_labels = {t: [{k: v for k, v in b.items() if k != "labels"} for b in bs] for t, bs in data.items()}
    with pytest.raises(ValueError, match=r"calibration_data\['cola'\] batch 0: the batch lacks \['labels'\]"):
        FeatCalCalibrator(merged, base, experts, no_labels)


def test_mismatched_vocabulary_or_config(t5_setting):
    base, experts, merged, data = t5_setting
    with pytest.raises(ValueError, match=r"experts\['sst2'\].*vocab_size: merged 40 vs 48"):
        FeatCalCalibrator(merged, base, {**experts, "sst2": T5ForConditionalGeneration(t5_config(vocab_size=48))}, data)
    with pytest.raises(ValueError, match=r"base_model.*feed_forward_proj"):
        FeatCalCalibrator(merged, T5ForConditionalGeneration(t5_config(feed_forward_proj="relu")), experts, data)
    with pytest.raises(ValueError, match=r"experts\['cola'\].*num_decoder_layers: merged 2 vs 1"):
        FeatCalCalibrator(merged, base,
                          {**experts, "cola": T5ForConditionalGeneration(t5_config(num_decoder_layers=1))}, data)


def _word_tokenizer(words):
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def test_tokenised_dataset_with_default_seq2seq_collator(t5_setting):
    base, experts, merged, _ = t5_setting
    words = "sentence : the cat sat on a mat dog ran fast acceptable unacceptable".split()
    tokenizer = _word_tokenizer(words)
    texts = ["sentence : the cat sat", "sentence : a dog ran fast on the mat", "sentence : cat", "sentence : the mat"]
    targets = ["acceptable", "unacceptable the mat", "acceptable", "unacceptable"]
    rows = [{**tokenizer(t), "labels": tokenizer(y)["input_ids"]} for t, y in zip(texts, targets, strict=True)]
    dataset = Dataset.from_list(rows)
    calibrator = FeatCalCalibrator(
        merged, base, experts, {t: dataset for t in experts},
        FeatCalConfig(batch_size=3), processing_class=tokenizer, show_progress=False,
    )
    first = calibrator.batches["cola"][0]
    assert first["input_ids"].shape[0] == 3 and (first["labels"] == -100).any()
    assert torch.equal(first["attention_mask"] == 0, first["input_ids"] == 0)
    calibrator.calibrate()
    assert calibrator.report.tasks["cola"]["after"][-1] < calibrator.report.tasks["cola"]["before"][-1]
