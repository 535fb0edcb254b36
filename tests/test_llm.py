"""Decoder-only LLMs (Llama, Mistral, Qwen2, Qwen3) on tiny random-init configs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import assert_same_up_to_rounding, perturbed, task_arithmetic

VOCAB = 48
CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}


def llm_config(family: str, **overrides):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
    if family == "qwen3":
        values["head_dim"] = 8
    values.update(overrides)
    return CONFIGS[family](**values)


def randomise_rms_norms(model, generator):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=generator))


def lm_batch(generator, n=4, length=7, pad=True):
    ids = torch.randint(1, VOCAB, (n, length), generator=generator)
    mask = torch.ones(n, length, dtype=torch.long)
    if pad:  # left padding, as for generation
        ids[0, :2] = 0
        mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(params=list(CONFIGS))
def llm_setting(request, generator):
    base = AutoModelForCausalLM.from_config(llm_config(request.param)).eval()
    randomise_rms_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    merged = task_arithmetic(base, experts)
    data = {t: [lm_batch(generator), lm_batch(generator)] for t in experts}
    return request.param, base, experts, merged, data


def _independent_drift(merged, expert, batches, weights_of=lambda b: b["attention_mask"]):
    layers = merged.config.num_hidden_layers
    sums, count = torch.zeros(layers, dtype=torch.float64), 0.0
    for batch in batches:
        with torch.no_grad():
            hm = merged(**batch, output_hidden_states=True).hidden_states
            he = expert(**batch, output_hidden_states=True).hidden_states
        w = weights_of(batch).double()
        # hidden_states[l + 1] is layer l's raw output, except the last entry, which has the final norm:
        # take the last layer's output from a hook instead
        for layer in range(layers - 1):
            sums[layer] += ((hm[layer + 1].double() - he[layer + 1].double()).norm(dim=-1) * w).sum()
        outs = []
        for model in (merged, expert):
            store = []
            handle = model.model.layers[-1].register_forward_hook(
                lambda m, a, o, store=store: store.append(o[0] if isinstance(o, tuple) else o)
            )
            with torch.no_grad():
                model(**batch)
            handle.remove()
            outs.append(store[0])
        sums[-1] += ((outs[0].double() - outs[1].double()).norm(dim=-1) * w).sum()
        count += float(w.sum())
    return (sums / count).tolist()


def test_drift_report_matches_full_model_forwards(llm_setting):
    family, base, experts, merged, data = llm_setting
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    for task, expert in experts.items():
        stages = calibrator.report.tasks[task]
        assert stages["before"] == pytest.approx(_independent_drift(given, expert, data[task]), rel=1e-5), family
        assert stages["after"] == pytest.approx(_independent_drift(merged, expert, data[task]), rel=1e-5), family
        assert stages["after"][-1] < stages["before"][-1]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_exact_recovery_when_only_down_proj_differs(generator, family):
    expert = AutoModelForCausalLM.from_config(llm_config(family)).eval()
    randomise_rms_norms(expert, generator)
    expert = expert.double()
    merged = copy.deepcopy(expert)
    with torch.no_grad():
        for layer in merged.model.layers:
            layer.mlp.down_proj.weight.add_(0.3 * torch.randn(layer.mlp.down_proj.weight.shape, generator=generator,
                                                              dtype=torch.float64))
    data = {"task": [lm_batch(generator, n=16) for _ in range(3)]}  # ≥ 48 (= intermediate) tokens
    probe = lm_batch(generator, n=3, pad=False)
    logits = lambda m: m(**probe).logits  # noqa: E731
    with torch.no_grad():
        assert float((logits(merged) - logits(expert)).norm() / logits(expert).norm()) > 0.01
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype="float64", epsilon=1e-15)
    FeatCalCalibrator(merged, None, {"task": expert}, data, config, show_progress=False).calibrate()
    with torch.no_grad():
        assert float((logits(merged) - logits(expert)).norm() / logits(expert).norm()) <= 1e-8
    for ml, el in zip(merged.model.layers, expert.model.layers, strict=True):
        w, want = ml.mlp.down_proj.weight.detach(), el.mlp.down_proj.weight.detach()
        assert float((w - want).norm() / want.norm()) <= 1e-8


def test_only_selected_positions_count(generator):
    """labels = -100 (or loss_mask = 0) take positions out of every statistic: changing what the
    model sees there (under a causal mask, after the last counted token) changes nothing."""
    base = AutoModelForCausalLM.from_config(llm_config("llama")).eval()
    randomise_rms_norms(base, generator)
    experts = {"a": perturbed(base, generator, 0.05).eval()}
    merged = task_arithmetic(base, experts)
    batch = lm_batch(generator, n=6, length=8, pad=False)
    labels = batch["input_ids"].clone()
    labels[:, 5:] = -100
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][:, 5:] = torch.randint(1, VOCAB, (6, 3), generator=generator)
    one, two = copy.deepcopy(merged), copy.deepcopy(merged)
    FeatCalCalibrator(one, base, experts, {"a": [{**batch, "labels": labels}]}, show_progress=False).calibrate()
    FeatCalCalibrator(two, base, experts, {"a": [{**other, "loss_mask": (labels != -100).long()}]},
                      show_progress=False).calibrate()
    for (name, p), q in zip(one.named_parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    changed = copy.deepcopy(merged)
    FeatCalCalibrator(changed, base, experts, {"a": [other]}, show_progress=False).calibrate()
    assert not torch.allclose(changed.model.layers[0].mlp.down_proj.weight, one.model.layers[0].mlp.down_proj.weight)


def test_causal_lm_checkpoints_on_disk(generator, tmp_path):
    base = AutoModelForCausalLM.from_config(llm_config("qwen2")).eval()
    randomise_rms_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: [lm_batch(generator)] for t in experts}
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    FeatCalCalibrator(merged, base, {t: str(tmp_path / t) for t in experts}, data, show_progress=False).calibrate()
    assert_same_up_to_rounding(merged.named_parameters(), reference.named_parameters())


def test_mismatched_llm_experts(llm_setting):
    family, base, experts, merged, data = llm_setting
    other = AutoModelForCausalLM.from_config(llm_config(family, num_key_value_heads=4))
    with pytest.raises(ValueError, match=r"experts\['code'\].*num_key_value_heads: merged 2 vs 4"):
        FeatCalCalibrator(merged, base, {**experts, "code": other}, data)


def test_keys_and_values_see_every_attended_position(generator, monkeypatch):
    """With positions selected by `labels`, q (and every other module) counts only the selected
    positions, while k/v count every non-padding position up to the last selected one (those are the
    positions the selected ones attend to)."""
    from hf_featcal.statistics import LinearGroupStatistics

    base = AutoModelForCausalLM.from_config(llm_config("llama")).eval()
    experts = {"a": perturbed(base, generator, 0.05).eval()}
    batch = lm_batch(generator, n=2, length=8, pad=True)  # row 0: two left-padding positions
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, 4:6] = 5
    labels[1, 3] = 5
    seen = {}
    original = LinearGroupStatistics.accumulate_mixture

    def record(self, x_s, x_e, alpha, weights, targets=None, expert_outputs=None):
        seen.setdefault(self.modules, weights.clone())
        return original(self, x_s, x_e, alpha, weights, targets, expert_outputs)

    monkeypatch.setattr(LinearGroupStatistics, "accumulate_mixture", record)
    FeatCalCalibrator(task_arithmetic(base, experts), base, experts, {"a": [{**batch, "labels": labels}]},
                      show_progress=False).calibrate()
    counted = (labels != -100).float()
    attended = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(seen[("self_attn.k_proj", "self_attn.v_proj")], attended)
    assert torch.equal(seen[("self_attn.q_proj",)], counted)
    assert torch.equal(seen[("mlp.gate_proj", "mlp.up_proj")], counted)


def test_the_layer_map_is_specialised_for_the_batches_not_changed(generator):
    """Batches that select positions give k/v their own token weights in a copy of the layer map; the
    map the calibrator started from (and any other calibrator's) is left as it was."""
    from hf_featcal.architectures import get_layer_map

    base = AutoModelForCausalLM.from_config(llm_config("llama")).eval()
    batch = lm_batch(generator, n=2, length=8, pad=True)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, -2:] = 5
    plain = get_layer_map(base, "model")
    selecting = plain.for_batches({"a": [{**batch, "labels": labels}]})
    assert selecting is not plain and selecting.weight_source("self_attn.k_proj") == "attended"
    assert plain.weight_source("self_attn.k_proj") == "tokens"
    assert plain.for_batches({"a": [batch]}) is plain
