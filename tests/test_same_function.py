"""Experts that compute another function than the base are refused before any work, by merging and by
FeatCal alike: every config field that changes the function must agree (model_type, rope, tied
embeddings, activation, norm eps, ...); the fields listed in `FUNCTION_NEUTRAL_FIELDS` may differ."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from hf_featcal import FeatCalCalibrator
from hf_featcal.merging import merge_models, singular_value_calibration

GEOMETRY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32)


def llama(**changes) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights for every config: only the config differs
    return LlamaForCausalLM(LlamaConfig(**{**GEOMETRY, "tie_word_embeddings": False, **changes})).eval()


def batches() -> dict:
    return {t: [{"input_ids": torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(i))}]
            for i, t in enumerate(("a", "b"))}


@pytest.mark.parametrize(("expert", "field", "value", "base_value"), [
    (lambda: MistralForCausalLM(MistralConfig(**GEOMETRY, tie_word_embeddings=False)).eval(), "model_type",
     "'mistral'", "'llama'"),
    (lambda: llama(rope_theta=500000.0), "rope_parameters.rope_theta", "500000.0", "10000.0"),
    (lambda: llama(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_parameters.rope_type", "'linear'",
     "'default'"),
    (lambda: llama(hidden_act="gelu"), "hidden_act", "'gelu'", "'silu'"),
    (lambda: llama(rms_norm_eps=1e-5), "rms_norm_eps", "1e-05", "1e-06"),
    (lambda: llama(attention_bias=False, mlp_bias=False, head_dim=8, sliding_window=4), None, None, None),
], ids=["mistral", "rope_theta", "rope_scaling", "activation", "norm_eps", "unknown_field"])
def test_an_expert_of_another_function_is_refused_by_merge_svc_and_featcal(expert, field, value, base_value,
                                                                             tmp_path):
    base = llama()
    other = expert()
    if field is None:  # a field the base's config lacks is not compared; the rest agrees: accepted
        merge_models(base, {"a": other, "b": llama()}, "task_arithmetic")
        return
    named = (rf"`experts\['b'\]` has a different configuration from the (base|merged) model \(.*{field}: "
             rf"(base|merged) {base_value} vs {value}")
    with pytest.raises(ValueError, match=named):
        merge_models(base, {"a": llama(), "b": other}, "task_arithmetic")
    other.save_pretrained(tmp_path / "b")  # a folder, read lazily: the same check
    with pytest.raises(ValueError, match=named):
        merge_models(base, {"a": llama(), "b": str(tmp_path / "b")}, "ties")
    with pytest.raises(ValueError, match=named):
        singular_value_calibration(copy.deepcopy(base), base, {"a": llama(), "b": other})
    with pytest.raises(ValueError, match=named):
        FeatCalCalibrator(copy.deepcopy(base), base, {"a": llama(), "b": other}, batches())


def test_an_untied_expert_head_is_not_merged_into_a_tied_base():
    """A base with tied embeddings has no head of its own: an expert with an untied lm_head would lose it."""
    tied = llama(tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"`experts\['b'\]` .*tie_word_embeddings: (base|merged) True vs False"):
        merge_models(tied, {"a": llama(tie_word_embeddings=True), "b": llama()}, "task_arithmetic")


def test_fields_that_do_not_change_the_function_may_differ():
    base = llama()
    expert = llama(attention_dropout=0.1, pad_token_id=0, use_cache=False, id2label={0: "x", 1: "y"},
                   dtype="bfloat16", initializer_range=0.5)
    expert.config._name_or_path = "somewhere/else"
    expert.float().load_state_dict(base.state_dict())  # initializer_range changed the init: the base's weights
    with torch.no_grad():
        for p in expert.parameters():
            p.add_(0.01)
    merged = merge_models(base, {"a": expert, "b": llama()}, "task_arithmetic", scaling_factor=1.0)
    torch.testing.assert_close(merged.lm_head.weight, base.lm_head.weight + 0.01)
    FeatCalCalibrator(copy.deepcopy(merged), base, {"a": expert, "b": llama()}, batches(), show_progress=False)


def test_a_model_without_a_layer_map_is_checked_by_its_config():
    """GPT-2 has no layer map here: merging still compares the configs."""
    def gpt2(**changes):
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16,
                                          **changes)).eval()

    merge_models(gpt2(), {"a": gpt2(resid_pdrop=0.0), "b": gpt2()}, "task_arithmetic")  # a dropout: accepted
    with pytest.raises(ValueError, match=r"`experts\['b'\]` .*activation_function: base 'gelu_new' vs 'relu'"):
        merge_models(gpt2(), {"a": gpt2(), "b": gpt2(activation_function="relu")}, "task_arithmetic")
