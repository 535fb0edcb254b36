"""BERT / RoBERTa sequence-classification backbones and ViT on tiny random-init configs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import perturbed, task_arithmetic


def _randomise_layer_norms(model, generator):
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
                module.bias.add_(0.2 * torch.randn(module.bias.shape, generator=generator))


def _text(generator, n=4, length=7):
    ids = torch.randint(3, 40, (n, length), generator=generator)
    mask = torch.ones(n, length, dtype=torch.long)
    ids[0, 5:], mask[0, 5:] = 1, 0
    return {"input_ids": ids, "attention_mask": mask}


def _image(generator, n=4):
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=generator)}


FAMILIES = {
    "bert": (lambda: BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
              num_attention_heads=2, intermediate_size=32, num_labels=3)), _text),
    "roberta": (lambda: RobertaForSequenceClassification(RobertaConfig(vocab_size=40, hidden_size=16,
                                                                       num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=32, num_labels=3, pad_token_id=1)), _text),
    "vit": (lambda: ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32, image_size=8, patch_size=4, num_labels=3)), _image),
}


def _backbone(model):
    return getattr(model, "bert", None) or getattr(model, "roberta", None) or model.vit


def _blocks(model):
    backbone = _backbone(model)
    return backbone.layers if hasattr(backbone, "layers") else backbone.encoder.layer


def _ffn_out(block):
    """The feed-forward output projection of a block (BERT: output.dense; ViT: mlp.fc2)."""
    return block.mlp.fc2 if hasattr(block, "mlp") else block.output.dense


def _block_outputs(model, batch):
    outs = []
    handles = [layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
               for layer in _blocks(model)]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return outs


@pytest.mark.parametrize("family", list(FAMILIES))
# random tiny encoders: one task's head can read a worse feature after the joint calibration; the warning says so
@pytest.mark.filterwarnings("ignore:what the head reads moved away:hf_featcal.pipeline.context.FeatCalWarning")
def test_drift_and_recovery(family, generator):
    build, make_batch = FAMILIES[family]
    base = build().eval()
    _randomise_layer_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: [make_batch(generator), make_batch(generator)] for t in experts}
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    for task, expert in experts.items():
        sums, count = torch.zeros(2, dtype=torch.float64), 0.0
        for batch in data[task]:
            w = (
                batch["attention_mask"].double()
                if "attention_mask" in batch
                else torch.ones(batch["pixel_values"].shape[0], 5, dtype=torch.float64)
            )
            for i, (hm, he) in enumerate(zip(_block_outputs(given, batch), _block_outputs(expert, batch), strict=True)):
                sums[i] += ((hm.double() - he.double()).norm(dim=-1) * w).sum()
            count += float(w.sum())
        assert calibrator.report.tasks[task]["before"] == pytest.approx((sums / count).tolist(), rel=1e-5)
    # heads are task-specific: neither merged parameters of the head nor the embeddings change
    for name, value in given.classifier.state_dict().items():
        assert torch.equal(merged.classifier.state_dict()[name], value), name

    # exact recovery: one expert, only the feed-forward output projection of each block differs
    expert = base.double()
    perturbed_model = copy.deepcopy(expert)
    with torch.no_grad():
        for layer in _blocks(perturbed_model):
            _ffn_out(layer).weight.add_(0.3 * torch.randn(_ffn_out(layer).weight.shape, generator=generator,
                                                          dtype=torch.float64))
    batches = [
        {k: (v.double() if v.is_floating_point() else v) for k, v in make_batch(generator, n=16).items()}
        for _ in range(3)
    ]
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype="float64", epsilon=1e-15)
    FeatCalCalibrator(perturbed_model, None, {"t": expert}, {"t": batches}, config, show_progress=False).calibrate()
    for lp, le in zip(_blocks(perturbed_model), _blocks(expert), strict=True):
        assert float((_ffn_out(lp).weight - _ffn_out(le).weight).norm() / _ffn_out(le).weight.norm()) <= 1e-8
    probe = {k: (v.double() if v.is_floating_point() else v) for k, v in make_batch(generator, n=3).items()}
    with torch.no_grad():
        got, want = perturbed_model(**probe).logits, expert(**probe).logits
    assert float((got - want).norm() / want.norm()) <= 1e-8


def test_mismatched_encoder_experts(generator):
    build, make_batch = FAMILIES["bert"]
    base = build().eval()
    other = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=24, num_labels=3))
    data = {t: [make_batch(generator)] for t in ("a", "b")}
    with pytest.raises(ValueError, match=r"experts\['b'\].*intermediate_size: merged 32 vs 24"):
        FeatCalCalibrator(copy.deepcopy(base), base, {"a": base, "b": other}, data)
