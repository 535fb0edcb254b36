"""Task Arithmetic / simple averaging (`hf_featcal.merging`) on tiny random-init CLIP models."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

from hf_featcal.merging import MERGE_CONFIG_ATTRIBUTE, find_key_prefix, simple_average, task_arithmetic


def vision_config(**overrides) -> CLIPVisionConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=16, patch_size=4, num_channels=3)
    values.update(overrides)
    return CLIPVisionConfig(**values)


def clip_config() -> CLIPConfig:
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=16)
    return CLIPConfig(vision_config=vision_config().to_dict(), text_config=text, projection_dim=16)


def fine_tuned(model: nn.Module, seed: int, scale: float = 0.05) -> nn.Module:
    """A copy of `model` with every float tensor perturbed (a stand-in for fine-tuning)."""
    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in out.state_dict().values():
            if value.is_floating_point():
                value.add_(scale * torch.randn(value.shape, generator=generator).to(value.dtype))
    return out


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    assert current.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(current[key], value), key


@pytest.fixture
def vision_setting():
    torch.manual_seed(0)
    base = CLIPVisionModel(vision_config()).eval()
    experts = {f"task{i}": fine_tuned(base, seed=i + 1) for i in range(3)}
    return base, experts


# ------------------------------------------------------------------------------------------ formula
@pytest.mark.parametrize("scaling", [0.3, 1.0, -0.5])
def test_task_arithmetic_matches_formula(vision_setting, scaling):
    base, experts = vision_setting
    merged = task_arithmetic(base, experts, scaling_factor=scaling)
    base_sd = base.state_dict()
    merged_sd = merged.state_dict()
    assert merged_sd.keys() == base_sd.keys()
    for key, value in base_sd.items():
        expected = value + scaling * sum(e.state_dict()[key] - value for e in experts.values())
        torch.testing.assert_close(merged_sd[key], expected, rtol=0, atol=1e-6, msg=key)


def test_simple_average_is_the_mean_of_the_experts(vision_setting):
    base, experts = vision_setting
    merged = simple_average(base, experts)
    for key, value in merged.state_dict().items():
        expected = torch.stack([e.state_dict()[key] for e in experts.values()]).mean(0)
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=key)
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == {
        "method": "simple_average",
        "scaling_factor": pytest.approx(1 / 3),
        "experts": ["task0", "task1", "task2"],
    }


def test_scaling_zero_returns_the_base_weights(vision_setting):
    base, experts = vision_setting
    merged = task_arithmetic(base, experts, scaling_factor=0)
    assert_same_state(merged, snapshot(base))


def test_single_expert_with_scaling_one_is_the_expert(vision_setting):
    base, experts = vision_setting
    merged = task_arithmetic(base, {"task0": experts["task0"]}, scaling_factor=1.0)
    for key, value in experts["task0"].state_dict().items():
        torch.testing.assert_close(merged.state_dict()[key], value, rtol=0, atol=1e-6)


def test_merge_is_computed_in_float32_and_cast_back():
    torch.manual_seed(0)
    base = CLIPVisionModel(vision_config()).to(torch.bfloat16).eval()
    experts = {"a": fine_tuned(base, 1), "b": fine_tuned(base, 2)}
    merged = task_arithmetic(base, experts, 0.3)
    for key, value in base.state_dict().items():
        assert merged.state_dict()[key].dtype == torch.bfloat16
        expected = (value.float() + 0.3 * sum(e.state_dict()[key].float() - value.float() for e in experts.values()))
        assert torch.equal(merged.state_dict()[key], expected.to(torch.bfloat16)), key


def test_non_float_buffers_are_left_alone():
    class WithCounter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("steps", torch.tensor([3], dtype=torch.long))

    torch.manual_seed(0)
    base = WithCounter()
    expert = fine_tuned(base, 1)
    expert.steps.fill_(100)
    merged = task_arithmetic(base, {"a": expert}, 1.0)
    assert merged.steps.item() == 3
    torch.testing.assert_close(merged.linear.weight, expert.linear.weight, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ no side effects
def test_inputs_are_not_modified_and_result_is_new(vision_setting):
    base, experts = vision_setting
    before_base = snapshot(base)
    before_experts = {t: snapshot(e) for t, e in experts.items()}
    for merged in (task_arithmetic(base, experts, 0.3), simple_average(base, experts)):
        assert merged is not base and all(merged is not e for e in experts.values())
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(merged.parameters(), base.parameters()))
        assert_same_state(base, before_base)
        for task, expert in experts.items():
            assert_same_state(expert, before_experts[task])
        assert not hasattr(base.config, MERGE_CONFIG_ATTRIBUTE)
        assert all(not hasattr(e.config, MERGE_CONFIG_ATTRIBUTE) for e in experts.values())
    # the merged model is independent: editing it leaves the base alone
    with torch.no_grad():
        merged.post_layernorm.weight.add_(1.0)
    assert_same_state(base, before_base)


def test_merged_model_runs_forward(vision_setting):
    base, experts = vision_setting
    merged = task_arithmetic(base, experts)
    out = merged(pixel_values=torch.randn(2, 3, 16, 16))
    assert out.pooler_output.shape == (2, 32)


# ------------------------------------------------------------------------------------------ record
def test_merge_record_survives_save_and_load(vision_setting, tmp_path):
    base, experts = vision_setting
    merged = task_arithmetic(base, experts, scaling_factor=0.3)
    record = {"method": "task_arithmetic", "scaling_factor": 0.3, "experts": ["task0", "task1", "task2"]}
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == record
    json.dumps(getattr(merged.config, MERGE_CONFIG_ATTRIBUTE))  # JSON-serialisable
    merged.save_pretrained(tmp_path)
    with open(tmp_path / "config.json", encoding="utf-8") as handle:
        assert json.load(handle)[MERGE_CONFIG_ATTRIBUTE] == record
    reloaded = CLIPVisionModel.from_pretrained(tmp_path)
    assert getattr(reloaded.config, MERGE_CONFIG_ATTRIBUTE) == record
    assert_same_state(reloaded, snapshot(merged))


# ------------------------------------------------------------------------------------------ mixed CLIPModel base
def test_clip_model_base_with_vision_experts_merges_only_the_vision_tower(tmp_path):
    torch.manual_seed(0)
    base = CLIPModel(clip_config()).eval()
    vision_base = base.vision_model
    assert isinstance(vision_base, CLIPVisionModel)
    experts = {"a": fine_tuned(vision_base, 1), "b": fine_tuned(vision_base, 2)}
    before = snapshot(base)

    merged = task_arithmetic(base, experts, scaling_factor=0.3)
    assert isinstance(merged, CLIPModel)
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    merged_vision_keys = 0
    for key, value in base_sd.items():
        if not value.is_floating_point():
            continue
        if key.startswith("vision_model."):
            sub = key[len("vision_model."):]
            expected = value + 0.3 * sum(e.state_dict()[sub] - value for e in experts.values())
            torch.testing.assert_close(merged_sd[key], expected, rtol=0, atol=1e-6, msg=key)
            merged_vision_keys += 1
        else:  # text tower, projections, logit scale: untouched
            assert torch.equal(merged_sd[key], value), key
    assert merged_vision_keys == len(experts["a"].state_dict())
    assert_same_state(base, before)

    merged.save_pretrained(tmp_path)
    assert getattr(CLIPModel.from_pretrained(tmp_path).config, MERGE_CONFIG_ATTRIBUTE)["experts"] == ["a", "b"]


def test_find_key_prefix():
    assert find_key_prefix({"a.x", "a.y"}, {"a.x"}) == ""
    assert find_key_prefix({"vision_model.enc.w", "vision_model.enc.b", "text_model.enc.w"}, {"enc.w", "enc.b"}) == "vision_model."
    assert find_key_prefix({"vision_model.enc.w"}, {"enc.w", "enc.extra"}) is None
    assert find_key_prefix({"a"}, set()) is None


# ------------------------------------------------------------------------------------------ errors
def test_empty_or_invalid_experts_raise(vision_setting):
    base, experts = vision_setting
    with pytest.raises(ValueError, match="experts"):
        task_arithmetic(base, {})
    with pytest.raises(ValueError, match="experts"):
        simple_average(base, {})
    with pytest.raises(ValueError, match="experts"):
        task_arithmetic(base, list(experts.values()))
    with pytest.raises(ValueError, match=r"experts\['bad'\]"):
        task_arithmetic(base, {"bad": "not a model"})
    with pytest.raises(ValueError, match="base_model"):
        task_arithmetic("not a model", experts)


@pytest.mark.parametrize("scaling", [float("nan"), float("inf"), -math.inf, "0.3", None, True])
def test_invalid_scaling_factor_raises(vision_setting, scaling):
    base, experts = vision_setting
    with pytest.raises(ValueError, match="scaling_factor"):
        task_arithmetic(base, experts, scaling_factor=scaling)


def test_shape_mismatch_names_the_expert(vision_setting):
    base, experts = vision_setting
    wrong = CLIPVisionModel(vision_config(intermediate_size=48))
    with pytest.raises(ValueError, match="'wide'.*shape"):
        task_arithmetic(base, {**experts, "wide": wrong})


def test_key_mismatch_names_the_expert(vision_setting):
    base, experts = vision_setting
    deeper = CLIPVisionModel(vision_config(num_hidden_layers=3))
    with pytest.raises(ValueError, match="'deep'.*does not line up"):
        task_arithmetic(base, {"deep": deeper})
    # a text model cannot be merged into a vision model either
    text_only = CLIPModel(clip_config()).text_model
    with pytest.raises(ValueError, match="'text'"):
        simple_average(base, {"text": text_only})
