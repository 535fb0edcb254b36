"""An unregistered architecture (OPT) with the opt-in inferred layer map."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import perturbed, task_arithmetic


def _opt():
    return OPTForCausalLM(OPTConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16)).eval()


def _batch(generator, n=8):
    ids = torch.randint(3, 40, (n, 6), generator=generator)
    mask = torch.ones(n, 6, dtype=torch.long)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_unregistered_architecture_needs_opting_in(generator):
    model = _opt()
    with pytest.raises(ValueError, match=r"unsupported architecture OPTForCausalLM.*supported model types"):
        FeatCalCalibrator(model, None, {"a": _opt()}, {"a": [_batch(generator)]})


def test_inferred_layer_map_finds_blocks_and_calibrates(generator):
    base = _opt()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: [_batch(generator), _batch(generator)] for t in experts}
    given = copy.deepcopy(merged)
    with pytest.warns(
        UserWarning,
        match=r"inferred blocks \['model.decoder.layers'\] \(2 blocks\).*fc2 \(linear\).*final_layer_norm "
              r"\(layer_norm\)",
    ):
        calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False, allow_inferred_layer_map=True)
    calibrator.calibrate()
    for task, expert in experts.items():
        sums, count = torch.zeros(2, dtype=torch.float64), 0.0
        for batch in data[task]:
            outs = {}
            for key, model in (("m", given), ("e", expert)):
                store = []
                handles = [
                    layer.register_forward_hook(
                        lambda mod, a, o, store=store: store.append(o[0] if isinstance(o, tuple) else o)
                    )
                    for layer in model.model.decoder.layers
                ]
                with torch.no_grad():
                    model(**batch)
                for h in handles:
                    h.remove()
                outs[key] = store
            w = batch["attention_mask"].double()
            for i in range(2):
                sums[i] += ((outs["m"][i].double() - outs["e"][i].double()).norm(dim=-1) * w).sum()
            count += float(w.sum())
        assert calibrator.report.tasks[task]["before"] == pytest.approx((sums / count).tolist(), rel=1e-5)
    assert not torch.equal(merged.model.decoder.layers[1].fc2.weight, given.model.decoder.layers[1].fc2.weight)
    # exact recovery of an expert whose fc2 were perturbed
    expert = base.double()
    model = copy.deepcopy(expert)
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.fc2.weight.add_(0.3 * torch.randn(layer.fc2.weight.shape, generator=generator, dtype=torch.float64))
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype="float64", epsilon=1e-15)
    with pytest.warns(UserWarning, match="inferred blocks"):
        FeatCalCalibrator(model, None, {"t": expert}, {"t": [_batch(generator, 16) for _ in range(2)]}, config,
                          show_progress=False, allow_inferred_layer_map=True).calibrate()
    for lm_, le in zip(model.model.decoder.layers, expert.model.decoder.layers, strict=True):
        assert float((lm_.fc2.weight - le.fc2.weight).norm() / le.fc2.weight.norm()) <= 1e-8


def test_deberta_v2_is_refused_with_the_reason(generator):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    model = DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        relative_attention=True, pos_att_type=["p2c", "c2p"], max_position_embeddings=32)).eval()
    batch = _batch(generator)
    with pytest.raises(ValueError, match=r"DebertaV2ForSequenceClassification cannot be calibrated.*relative-position"):
        FeatCalCalibrator(model, None, {"a": copy.deepcopy(model)}, {"a": [batch]}, allow_inferred_layer_map=True)
