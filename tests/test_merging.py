"""Task Arithmetic / simple averaging (`hf_featcal.merging`) on tiny random-init CLIP models."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

from hf_featcal.merging import MERGE_CONFIG_ATTRIBUTE, find_key_prefix, simple_average, task_arithmetic
from testing_utils import assert_same_state, snapshot


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
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(merged.parameters(), base.parameters(), strict=True))
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
    """The merged model computes what a fresh model holding θ⁰ + 0.3·Σ(θⁱ − θ⁰) computes (and not the base's output)."""
    base, experts = vision_setting
    merged = task_arithmetic(base, experts)
    base_sd = base.state_dict()
    independent = CLIPVisionModel(vision_config()).eval()
    independent.load_state_dict(
        {
            k: v + 0.3 * sum(e.state_dict()[k] - v for e in experts.values()) if v.is_floating_point() else v
            for k, v in base_sd.items()
        }
    )
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, want, base_out = merged(pixel_values=pixels), independent(pixel_values=pixels), base(pixel_values=pixels)
    assert out.pooler_output.shape == (2, 32)
    torch.testing.assert_close(out.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.pooler_output, want.pooler_output, rtol=1e-5, atol=1e-5)
    assert float((out.pooler_output - base_out.pooler_output).abs().max()) > 1e-2


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
    assert (
        find_key_prefix({"vision_model.enc.w", "vision_model.enc.b", "text_model.enc.w"}, {"enc.w", "enc.b"})
        == "vision_model."
    )
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
    # a family the library knows: the calibrator's configuration check speaks first
    with pytest.raises(ValueError, match=r"experts\['wide'\]` has a different configuration.*intermediate_size"):
        task_arithmetic(base, {**experts, "wide": wrong})


def test_key_mismatch_names_the_expert(vision_setting):
    base, experts = vision_setting
    deeper = CLIPVisionModel(vision_config(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"experts\['deep'\]` has a different configuration.*num_hidden_layers"):
        task_arithmetic(base, {"deep": deeper})
    # a text model cannot be merged into a vision model either
    text_only = CLIPModel(clip_config()).text_model
    with pytest.raises(ValueError, match="'text'"):
        simple_average(base, {"text": text_only})


# ================================================================================================
# TIES-Merging, DARE, `merge_models`, and experts / base given as folders
# ================================================================================================
import hashlib  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

import hf_featcal.merging.engine as merging_engine  # noqa: E402
from hf_featcal.merging import (  # noqa: E402
    MERGE_METHODS,
    dare_merging,
    dare_ties_merging,
    merge_models,
    ties_merging,
)


def float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.state_dict().items() if v.is_floating_point()}


def expected_ties(base, experts, scaling, density, per_tensor, merge_func="mean"):
    """TIES written out with plain torch on the state dicts (independent of the implementation)."""
    base_sd = float_state(base)
    trimmed = []
    for expert in experts.values():
        expert_sd = float_state(expert)
        tau = {k: expert_sd[k] - b for k, b in base_sd.items()}
        if per_tensor:
            out = {}
            for k, t in tau.items():
                keep = max(1, int(density * t.numel()))
                flat = torch.zeros(t.numel())
                if keep:
                    index = t.abs().flatten().topk(keep).indices
                    flat[index] = t.flatten()[index]
                out[k] = flat.view(t.shape)
        else:
            magnitudes = torch.cat([t.abs().flatten() for t in tau.values()])
            keep = max(1, int(density * magnitudes.numel()))
            threshold = magnitudes.sort(descending=True).values[keep - 1]
            out = {k: torch.where(t.abs() >= threshold, t, torch.zeros_like(t)) for k, t in tau.items()}
        trimmed.append(out)
    result = {}
    for k, b in base_sd.items():
        stack = torch.stack([t[k] for t in trimmed])
        elected = torch.where(stack.sum(0) >= 0, 1.0, -1.0)
        agree = (stack != 0) & (torch.sign(stack) == elected)
        chosen = (stack * agree).sum(0)
        merged = chosen / agree.sum(0).clamp(min=1) if merge_func == "mean" else chosen
        result[k] = b + scaling * merged
    return result


def dare_keep_mask(seed: int, name: str, key: str, shape, drop_rate: float) -> torch.Tensor:
    """The documented DARE mask: CPU generator seeded from sha256(f"{seed}:{name}:{key}")."""
    digest = hashlib.sha256(f"{seed}:{name}:{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.rand(shape, generator=generator) >= drop_rate


def expected_dare(base, experts, scaling, drop_rate, rescale, seed):
    base_sd = float_state(base)
    result = {}
    for k, b in base_sd.items():
        total = torch.zeros_like(b)
        for name, expert in experts.items():
            tau = float_state(expert)[k] - b
            tau = tau * dare_keep_mask(seed, name, k, tau.shape, drop_rate)
            total = total + (tau / (1 - drop_rate) if rescale else tau)
        result[k] = b + scaling * total
    return result


def assert_state_close(model: nn.Module, expected: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    state = model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key].float(), value, rtol=0, atol=atol, msg=key)


def assert_states_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


class TwoTensors(nn.Module):
    """A model with two plain parameters (names `big.weight` and `small.weight`)."""

    def __init__(self, n: int = 10) -> None:
        super().__init__()
        self.big = nn.Linear(n, 1, bias=False)
        self.small = nn.Linear(n, 1, bias=False)


def with_task_vector(base: nn.Module, values: dict[str, list[float]]) -> nn.Module:
    out = copy.deepcopy(base)
    with torch.no_grad():
        for key, vals in values.items():
            out.state_dict()[key].add_(torch.tensor(vals).view_as(out.state_dict()[key]))
    return out


# ------------------------------------------------------------------------------------------ TIES
@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_ties_matches_formula(vision_setting, density, per_tensor):
    base, experts = vision_setting
    merged = ties_merging(base, experts, scaling_factor=0.7, density=density, per_tensor_trim=per_tensor)
    assert_state_close(merged, expected_ties(base, experts, 0.7, density, per_tensor))
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == {
        "method": "ties", "scaling_factor": 0.7, "density": density, "per_tensor_trim": per_tensor,
        "merge_func": "mean", "experts": ["task0", "task1", "task2"],
    }


def test_ties_sum_merge_func(vision_setting):
    base, experts = vision_setting
    merged = ties_merging(base, experts, scaling_factor=0.3, density=0.3, merge_func="sum")
    assert_state_close(merged, expected_ties(base, experts, 0.3, 0.3, False, merge_func="sum"))


def test_ties_global_and_per_tensor_trimming_differ_as_expected():
    torch.manual_seed(0)
    base = TwoTensors()
    big = [10.0 + i for i in range(10)]
    small = [0.1 * (i + 1) for i in range(10)]
    expert = with_task_vector(base, {"big.weight": big, "small.weight": [-s for s in small]})
    base_sd = snapshot(base)

    # over the whole task vector the top half is exactly `big`: `small` is trimmed away entirely
    merged = ties_merging(base, {"e": expert}, scaling_factor=1.0, density=0.5)
    torch.testing.assert_close(merged.big.weight - base_sd["big.weight"], torch.tensor([big]), rtol=0, atol=1e-5)
    assert torch.equal(merged.small.weight, base_sd["small.weight"])

    # per tensor, the top half of each tensor survives
    merged = ties_merging(base, {"e": expert}, scaling_factor=1.0, density=0.5, per_tensor_trim=True)
    expected_big = torch.tensor([[0.0] * 5 + big[5:]])
    expected_small = torch.tensor([[0.0] * 5 + [-s for s in small[5:]]])
    torch.testing.assert_close(merged.big.weight - base_sd["big.weight"], expected_big, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged.small.weight - base_sd["small.weight"], expected_small, rtol=0, atol=1e-6)


def test_ties_sign_election_and_disjoint_mean_on_a_constructed_example():
    base = TwoTensors(n=4)
    with torch.no_grad():
        base.big.weight.zero_()
        base.small.weight.zero_()
    columns = [(3.0, -1.0, 2.0), (-3.0, 1.0, 1.0), (0.0, 0.0, 0.0), (4.0, -4.0, 0.0)]
    experts = {
        f"e{i}": with_task_vector(base, {"big.weight": [c[i] for c in columns], "small.weight": [0.0] * 4})
        for i in range(3)
    }
    merged = ties_merging(base, experts, scaling_factor=1.0, density=1.0)
    # + elected: mean(3, 2); - elected: -3; nothing: 0; tie (sum 0) elects +: 4
    assert merged.big.weight.flatten().tolist() == [2.5, -3.0, 0.0, 4.0]
    summed = ties_merging(base, experts, scaling_factor=0.5, density=1.0, merge_func="sum")
    assert summed.big.weight.flatten().tolist() == [2.5, -1.5, 0.0, 2.0]


def test_ties_single_expert_full_density_is_the_expert(vision_setting):
    base, experts = vision_setting
    for per_tensor in (False, True):
        merged = ties_merging(base, {"a": experts["task0"]}, scaling_factor=1.0, density=1.0,
                              per_tensor_trim=per_tensor)
        assert_state_close(merged, float_state(experts["task0"]))


def test_ties_on_clip_model_base_merges_the_vision_tower_only():
    torch.manual_seed(0)
    base = CLIPModel(clip_config()).eval()
    experts = {"a": fine_tuned(base.vision_model, 1), "b": fine_tuned(base.vision_model, 2)}
    merged = ties_merging(base, experts, scaling_factor=0.4, density=0.3)
    vision_only = ties_merging(base.vision_model, experts, scaling_factor=0.4, density=0.3)
    merged_sd, vision_sd = merged.state_dict(), vision_only.state_dict()
    for key, value in base.state_dict().items():
        if key.startswith("vision_model."):
            assert torch.equal(merged_sd[key], vision_sd[key[len("vision_model."):]]), key
        else:
            assert torch.equal(merged_sd[key], value), key


def test_kth_largest_magnitude_matches_topk():
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):
        chunks = [torch.randn(int(torch.randint(1, 40, (1,), generator=generator)), generator=generator).abs()
                  for _ in range(4)]
        chunks += [torch.zeros(25), torch.full((6,), 0.5), torch.tensor([float("inf")])]
        values = torch.cat(chunks)
        for k in (1, 2, values.numel() // 5, values.numel() // 2, values.numel()):
            expected = values.topk(k).values[-1].item()
            assert merging_engine.kth_largest_magnitude(lambda chunks=chunks: iter(chunks), k) == expected, (trial, k)
    assert merging_engine.kth_largest_magnitude(lambda: iter(chunks), 0) == math.inf


def test_tied_weights_are_merged_once_and_stay_tied():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    torch.manual_seed(0)
    base = Tied()
    expert = fine_tuned(base, 1)
    assert expert.b.weight is expert.a.weight
    for merged in (task_arithmetic(base, {"e": expert}, 0.5), ties_merging(base, {"e": expert}, 0.5, density=1.0)):
        assert merged.b.weight is merged.a.weight
        torch.testing.assert_close(merged.a.weight, base.a.weight + 0.5 * (expert.a.weight - base.a.weight),
                                   rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ DARE
@pytest.mark.parametrize("rescale", [True, False])
@pytest.mark.parametrize("drop_rate", [0.5, 0.9])
def test_dare_matches_formula(vision_setting, drop_rate, rescale):
    base, experts = vision_setting
    merged = dare_merging(base, experts, scaling_factor=0.6, drop_rate=drop_rate, rescale=rescale, seed=7)
    assert_state_close(merged, expected_dare(base, experts, 0.6, drop_rate, rescale, 7), atol=1e-5)
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == {
        "method": "dare", "scaling_factor": 0.6, "drop_rate": drop_rate, "rescale": rescale,
        "rescale_mode": "keep_rate", "seed": 7, "experts": ["task0", "task1", "task2"],
    }


def test_dare_entries_are_dropped_or_rescaled(vision_setting):
    base, experts = vision_setting
    merged = dare_merging(base, {"a": experts["task0"]}, scaling_factor=1.0, drop_rate=0.75, seed=3)
    kept = total = 0
    for key, b in float_state(base).items():
        tau = float_state(experts["task0"])[key] - b
        delta = merged.state_dict()[key].float() - b
        is_kept = torch.isclose(delta, tau / 0.25, rtol=0, atol=1e-5) & (tau != 0)
        is_dropped = delta.abs() <= 1e-6
        assert bool((is_kept | is_dropped).all()), key
        kept += int(is_kept.sum())
        total += tau.numel()
    assert abs(kept / total - 0.25) < 0.02


def test_dare_is_deterministic_and_seed_dependent(vision_setting):
    base, experts = vision_setting
    rng_before = torch.get_rng_state()
    first = dare_merging(base, experts, drop_rate=0.5, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's global RNG is untouched
    second = dare_merging(base, experts, drop_rate=0.5, seed=1)
    assert_states_equal(first, second)
    reordered = dare_merging(base, dict(reversed(list(experts.items()))), drop_rate=0.5, seed=1)
    for key, value in first.state_dict().items():
        torch.testing.assert_close(reordered.state_dict()[key], value, rtol=0, atol=1e-6)
    other = dare_merging(base, experts, drop_rate=0.5, seed=2)
    key = "encoder.layers.0.mlp.fc1.weight"
    assert not torch.allclose(first.state_dict()[key], other.state_dict()[key])


@pytest.mark.parametrize("rescale", [True, False])
def test_dare_without_dropping_is_task_arithmetic(vision_setting, rescale):
    base, experts = vision_setting
    assert_states_equal(dare_merging(base, experts, 0.3, drop_rate=0.0, rescale=rescale),
                        task_arithmetic(base, experts, 0.3))


# ------------------------------------------------------------------------------------------ side effects
def test_ties_and_dare_leave_inputs_alone(vision_setting):
    base, experts = vision_setting
    before_base = snapshot(base)
    before_experts = {t: snapshot(e) for t, e in experts.items()}
    for merged in (ties_merging(base, experts), ties_merging(base, experts, per_tensor_trim=True),
                   dare_merging(base, experts), dare_merging(base, experts, rescale_mode="l1"),
                   dare_ties_merging(base, experts)):
        assert merged is not base
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(merged.parameters(), base.parameters(), strict=True))
        assert_same_state(base, before_base)
        for task, expert in experts.items():
            assert_same_state(expert, before_experts[task])
        assert not hasattr(base.config, MERGE_CONFIG_ATTRIBUTE)
        assert all(not hasattr(e.config, MERGE_CONFIG_ATTRIBUTE) for e in experts.values())


def test_ties_record_survives_save_and_load(vision_setting, tmp_path):
    base, experts = vision_setting
    merged = ties_merging(base, experts, density=0.25)
    merged.save_pretrained(tmp_path)
    reloaded = CLIPVisionModel.from_pretrained(tmp_path)
    assert getattr(reloaded.config, MERGE_CONFIG_ATTRIBUTE) == getattr(merged.config, MERGE_CONFIG_ATTRIBUTE)
    assert getattr(reloaded.config, MERGE_CONFIG_ATTRIBUTE)["density"] == 0.25
    assert_same_state(reloaded, snapshot(merged))


# ------------------------------------------------------------------------------------------ folders
METHOD_CASES = [
    ("average", {}),
    ("task_arithmetic", {"scaling_factor": 0.4}),
    ("ties", {"scaling_factor": 0.5, "density": 0.3}),
    ("ties", {"scaling_factor": 0.5, "density": 0.3, "per_tensor_trim": True}),
    ("dare", {"scaling_factor": 0.5, "drop_rate": 0.6, "seed": 5}),
    ("dare", {"scaling_factor": 0.5, "drop_rate": 0.6, "seed": 5, "rescale_mode": "l1"}),
    ("dare_ties", {"scaling_factor": 0.5, "drop_rate": 0.6, "seed": 5, "rescale_mode": "l1"}),
]


@pytest.fixture
def saved_setting(vision_setting, tmp_path):
    base, experts = vision_setting
    base.save_pretrained(tmp_path / "base")
    paths = {}
    for i, (task, expert) in enumerate(experts.items()):
        folder = tmp_path / task
        # one expert sharded (model.safetensors.index.json), one as str path, one as Path
        expert.save_pretrained(folder, max_shard_size="40KB" if i == 0 else "1GB")
        paths[task] = str(folder) if i == 1 else folder
    assert (tmp_path / "task0" / "model.safetensors.index.json").is_file()
    return base, experts, tmp_path / "base", paths


@pytest.mark.parametrize("method,params", METHOD_CASES)
def test_folders_give_the_same_merge_as_models(saved_setting, method, params, monkeypatch):
    base, experts, base_path, paths = saved_setting
    in_memory = merge_models(base, experts, method, **params)

    loads = []
    real_load_model = merging_engine.load_model
    monkeypatch.setattr(merging_engine, "load_model",
                        lambda source, argument: loads.append(argument) or real_load_model(source, argument))
    from_folders = merge_models(base_path, paths, method, **params)
    assert loads == ["base_model"]  # experts with safetensors are read lazily, never loaded whole
    assert isinstance(from_folders, CLIPVisionModel)
    assert_states_equal(from_folders, in_memory)
    assert getattr(from_folders.config, MERGE_CONFIG_ATTRIBUTE) == getattr(in_memory.config, MERGE_CONFIG_ATTRIBUTE)

    mixed = merge_models(base, {"task0": paths["task0"], "task1": experts["task1"], "task2": paths["task2"]},
                         method, **params)
    assert_states_equal(mixed, in_memory)


def save_transformers4_style(model: CLIPVisionModel, folder) -> None:
    """A CLIPVisionModel checkpoint as transformers 4.x wrote it: keys under `vision_model.`."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    state = {"vision_model." + k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_transformers4_vision_checkpoints_and_clip_model_base(tmp_path):
    torch.manual_seed(0)
    clip = CLIPModel(clip_config()).eval()
    vision = clip.vision_model
    experts = {"a": fine_tuned(vision, 1), "b": fine_tuned(vision, 2)}
    old_style = {}
    for task, expert in experts.items():
        save_transformers4_style(expert, tmp_path / task)
        old_style[task] = tmp_path / task
    for method, params in METHOD_CASES:
        # a CLIPVisionModel base: the `vision_model.` prefix of the files is stripped
        assert_states_equal(merge_models(vision, old_style, method, **params),
                            merge_models(vision, experts, method, **params))
        # a CLIPModel base: the file keys line up as they are
        assert_states_equal(merge_models(clip, old_style, method, **params),
                            merge_models(clip, experts, method, **params))
    # the text tower of the CLIPModel base is untouched
    merged = ties_merging(clip, old_style)
    for key, value in clip.state_dict().items():
        if not key.startswith("vision_model."):
            assert torch.equal(merged.state_dict()[key], value), key


def test_folder_expert_that_does_not_line_up_is_named(vision_setting, tmp_path):
    base, experts = vision_setting
    CLIPVisionModel(vision_config(num_hidden_layers=3)).save_pretrained(tmp_path / "deep")
    with pytest.raises(ValueError, match=r"experts\['deep'\]` has a different configuration.*num_hidden_layers"):
        ties_merging(base, {**experts, "deep": tmp_path / "deep"})
    CLIPVisionModel(vision_config(intermediate_size=48)).save_pretrained(tmp_path / "wide")
    # a family the library knows: the calibrator's configuration check speaks first
    with pytest.raises(ValueError, match=r"experts\['wide'\]` has a different configuration.*intermediate_size"):
        dare_merging(base, {"wide": tmp_path / "wide"})
    with pytest.raises(ValueError, match=r"experts\['missing'\]"):
        task_arithmetic(base, {"missing": tmp_path / "does-not-exist"})
    with pytest.raises(ValueError, match="base_model"):
        merge_models(tmp_path / "does-not-exist", experts, "ties")


# ------------------------------------------------------------------------------------------ dispatcher
def test_merge_models_dispatches(vision_setting):
    base, experts = vision_setting
    assert set(MERGE_METHODS) >= {"average", "task_arithmetic", "ties", "dare", "dare_ties"}
    assert_states_equal(merge_models(base, experts, "average"), simple_average(base, experts))
    assert_states_equal(merge_models(base, experts, "task_arithmetic", scaling_factor=0.2),
                        task_arithmetic(base, experts, 0.2))
    assert_states_equal(merge_models(base, experts, "ties", density=0.4, per_tensor_trim=True),
                        ties_merging(base, experts, density=0.4, per_tensor_trim=True))
    assert_states_equal(merge_models(base, experts, "dare", drop_rate=0.3, seed=4),
                        dare_merging(base, experts, drop_rate=0.3, seed=4))
    assert_states_equal(merge_models(base, experts, "dare_ties", drop_rate=0.3, seed=4, merge_func="mean"),
                        dare_ties_merging(base, experts, drop_rate=0.3, seed=4, merge_func="mean"))
    # a recorded merge can be replayed through the dispatcher
    record = dict(getattr(merge_models(base, experts, "ties", density=0.4).config, MERGE_CONFIG_ATTRIBUTE))
    record.pop("experts")
    assert_states_equal(merge_models(base, experts, **record), ties_merging(base, experts, density=0.4))


@pytest.mark.parametrize("method,params,argument", [
    ("median", {}, "method"),
    (None, {}, "method"),
    ("average", {"scaling_factor": 0.3}, "scaling_factor"),
    ("ties", {"drop_rate": 0.5}, "drop_rate"),
    ("dare", {"density": 0.5}, "density"),
    ("ties", {"density": 0.0}, "density"),
    ("ties", {"density": 1.5}, "density"),
    ("ties", {"density": float("nan")}, "density"),
    ("ties", {"density": "0.2"}, "density"),
    ("ties", {"scaling_factor": float("inf")}, "scaling_factor"),
    ("ties", {"per_tensor_trim": 1}, "per_tensor_trim"),
    ("ties", {"merge_func": "max"}, "merge_func"),
    ("dare", {"drop_rate": 1.0}, "drop_rate"),
    ("dare", {"drop_rate": -0.1}, "drop_rate"),
    ("dare", {"scaling_factor": float("nan")}, "scaling_factor"),
    ("dare", {"seed": 1.5}, "seed"),
    ("dare", {"seed": True}, "seed"),
    ("dare", {"rescale": "yes"}, "rescale"),
    ("task_arithmetic", {"scaling_factor": None}, "scaling_factor"),
    ("dare", {"rescale_mode": "l2"}, "rescale_mode"),
    ("dare", {"rescale_mode": None}, "rescale_mode"),
    ("dare_ties", {"merge_func": "max"}, "merge_func"),
    ("dare_ties", {"density": 0.5}, "density"),
    ("dare_ties", {"drop_rate": 1.0}, "drop_rate"),
    ("dare_ties", {"seed": 1.5}, "seed"),
    ("dare_ties", {"rescale": 1}, "rescale"),
    ("dare_ties", {"rescale_mode": "inverse"}, "rescale_mode"),
    ("dare_ties", {"scaling_factor": float("inf")}, "scaling_factor"),
])
def test_merge_models_rejects_bad_arguments(vision_setting, method, params, argument):
    base, experts = vision_setting
    with pytest.raises(ValueError, match=f"`{argument}`"):
        merge_models(base, experts, method, **params)


def test_new_methods_reject_bad_inputs(vision_setting):
    base, experts = vision_setting
    for function in (ties_merging, dare_merging, dare_ties_merging):
        with pytest.raises(ValueError, match="experts"):
            function(base, {})
        with pytest.raises(ValueError, match="experts"):
            function(base, list(experts.values()))
        with pytest.raises(ValueError, match=r"experts\['bad'\]"):
            function(base, {"bad": 3})
        with pytest.raises(ValueError, match="base_model"):
            function(3, experts)


# ------------------------------------------------------------------------------------------ peers
# The peers' published formulas (mergekit 0.1.5, FusionBench 0.2.33), written out here with plain
# torch from their documented behaviour; nothing is imported from either library.
def fusionbench_ties(base, experts, scaling, threshold, merge_func):
    """FusionBench's TiesMergingAlgorithm: each task vector flattened over the state dict (keys
    sorted); keep |tau| >= its (d - int(K*d))-th smallest magnitude (K = threshold / 100); elected
    sign = sign of the sum, a zero sum taking the sign of the sum of all elected signs; disjoint
    mean / sum of the entries with the elected sign."""
    base_sd = float_state(base)
    keys = sorted(base_sd)
    flat_base = torch.cat([base_sd[k].flatten() for k in keys])
    K = threshold / 100
    rows = []
    for expert in experts.values():
        expert_sd = float_state(expert)
        tau = torch.cat([(expert_sd[k] - base_sd[k]).flatten() for k in keys])
        d = tau.numel()
        kth = tau.abs().kthvalue(d - int(d * K)).values
        rows.append(tau * (tau.abs() >= kth))
    v = torch.stack(rows)
    sign = torch.sign(v.sum(0))
    sign[sign == 0] = torch.sign(sign.sum())
    selected = v * torch.where(sign > 0, v > 0, v < 0)
    merged = selected.sum(0)
    if merge_func == "mean":
        merged = merged / (selected != 0).sum(0).clamp(min=1)
    flat = flat_base + scaling * merged
    out, offset = {}, 0
    for k in keys:
        n = base_sd[k].numel()
        out[k] = flat[offset:offset + n].view_as(base_sd[k])
        offset += n
    return out


def mergekit_trim(tau, density):
    """mergekit's `magnitude` sparsification: the max(1, int(density * numel)) largest |tau| kept."""
    if density >= 1:
        return tau
    k = max(1, int(density * tau.numel()))
    mask = torch.zeros(tau.numel())
    mask[torch.argsort(tau.abs().reshape(-1), descending=True)[:k]] = 1
    return tau * mask.view_as(tau)


def mergekit_l1_drop(tau, keep):
    """mergekit's `bernoulli` with rescale_norm=l1: masked * (||tau||_1 / ||masked||_1), unscaled
    when either norm is below 1e-7."""
    masked = tau * keep
    before, after = tau.abs().sum(), masked.abs().sum()
    if before < 1e-7 or after < 1e-7:
        return masked
    return masked * (before / after)


def mergekit_consensus(deltas, scaling, normalize):
    """mergekit's generalized task arithmetic with sign consensus ("sum"), weights 1:
    majority = +1 where sum >= 0 else -1; mask = sign(delta) == majority; mixed = sum(delta * mask),
    divided by the mask count (zero counts -> 1) when normalize; times lambda."""
    majority = (deltas.sum(0) >= 0).float() * 2 - 1
    mask = deltas.sign() == majority
    mixed = (deltas * mask).sum(0)
    if normalize:
        divisor = mask.float().sum(0)
        divisor[divisor == 0] = 1
        mixed = mixed / divisor
    return scaling * mixed


def mergekit_ties(base, experts, scaling, density):
    base_sd = float_state(base)
    out = {}
    for k, b in base_sd.items():
        deltas = torch.stack([mergekit_trim(float_state(e)[k] - b, density) for e in experts.values()])
        out[k] = b + mergekit_consensus(deltas, scaling, normalize=True)
    return out


def dropped(tau, keep, drop_rate, rescale_mode):
    return mergekit_l1_drop(tau, keep) if rescale_mode == "l1" else tau * keep / (1 - drop_rate)


def expected_dare_ties(base, experts, scaling, drop_rate, rescale_mode, seed, merge_func):
    """mergekit's dare_ties (normalize false = sum; "mean" = normalize true) on the documented masks."""
    base_sd = float_state(base)
    out = {}
    for k, b in base_sd.items():
        deltas = torch.stack([
            dropped(float_state(e)[k] - b, dare_keep_mask(seed, name, k, b.shape, drop_rate), drop_rate, rescale_mode)
            for name, e in experts.items()
        ])
        out[k] = b + mergekit_consensus(deltas, scaling, normalize=merge_func == "mean")
    return out


def test_global_trim_keeps_one_entry_fewer_than_fusionbench(vision_setting):
    base, experts = vision_setting
    d = sum(v.numel() for v in float_state(base).values())
    threshold = 20  # FusionBench's config default: density 0.2
    kept = int(d * threshold / 100)
    # one expert, lambda 1: the merged delta is the trimmed task vector
    single = {"task0": experts["task0"]}
    ours = ties_merging(base, single, scaling_factor=1.0, density=0.2)
    changed = sum(int((ours.state_dict()[k].float() != b).sum()) for k, b in float_state(base).items())
    assert changed == kept
    peer = fusionbench_ties(base, single, 1.0, threshold, "mean")
    changed_peer = sum(int((peer[k] != b).sum()) for k, b in float_state(base).items())
    assert changed_peer == kept + 1
    # keeping int(density * d) = kept + 1 entries here gives FusionBench's merge (three experts, mean and sum)
    density = (kept + 1.5) / d
    for merge_func in ("mean", "sum"):
        assert_state_close(ties_merging(base, experts, 0.3, density, merge_func=merge_func),
                           fusionbench_ties(base, experts, 0.3, threshold, merge_func))
    same_density = ties_merging(base, experts, 0.3, 0.2)
    peer = fusionbench_ties(base, experts, 0.3, threshold, "mean")
    assert any(not torch.allclose(same_density.state_dict()[k], v, rtol=0, atol=1e-7) for k, v in peer.items())


@pytest.mark.parametrize("density", [0.02, 0.3])
def test_per_tensor_trim_matches_mergekit_ties(vision_setting, density):
    base, experts = vision_setting
    # at density 0.02 the 32-entry tensors have int(density * numel) = 0: mergekit keeps one entry
    assert any(int(density * v.numel()) == 0 for v in float_state(base).values()) == (density == 0.02)
    merged = ties_merging(base, experts, 0.7, density, per_tensor_trim=True)
    assert_state_close(merged, mergekit_ties(base, experts, 0.7, density))


def test_trim_keeps_at_least_one_entry_per_tensor_and_per_task_vector():
    base = TwoTensors(n=4)
    expert = with_task_vector(base, {"big.weight": [0.5, -4.0, 1.0, 2.0], "small.weight": [0.1, 0.2, -0.3, 0.05]})
    base_sd = snapshot(base)
    # per tensor: int(0.2 * 4) = 0, each tensor keeps its largest-magnitude entry
    merged = ties_merging(base, {"e": expert}, scaling_factor=1.0, density=0.2, per_tensor_trim=True)
    torch.testing.assert_close(merged.big.weight - base_sd["big.weight"], torch.tensor([[0.0, -4.0, 0.0, 0.0]]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(merged.small.weight - base_sd["small.weight"], torch.tensor([[0.0, 0.0, -0.3, 0.0]]),
                               rtol=0, atol=1e-6)
    # over the whole task vector: int(0.1 * 8) = 0, the single largest entry is kept
    merged = ties_merging(base, {"e": expert}, scaling_factor=1.0, density=0.1)
    torch.testing.assert_close(merged.big.weight - base_sd["big.weight"], torch.tensor([[0.0, -4.0, 0.0, 0.0]]),
                               rtol=0, atol=1e-6)
    assert torch.equal(merged.small.weight, base_sd["small.weight"])


@pytest.mark.parametrize("drop_rate", [0.5, 0.9])
def test_dare_l1_rescaling_matches_mergekit(vision_setting, drop_rate):
    base, experts = vision_setting
    merged = dare_merging(base, experts, scaling_factor=0.6, drop_rate=drop_rate, seed=7, rescale_mode="l1")
    base_sd = float_state(base)
    expected = {}
    for k, b in base_sd.items():
        total = sum(mergekit_l1_drop(float_state(e)[k] - b, dare_keep_mask(7, name, k, b.shape, drop_rate))
                    for name, e in experts.items())
        expected[k] = b + 0.6 * total
    assert_state_close(merged, expected)
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE)["rescale_mode"] == "l1"
    # one expert, lambda 1: every tensor keeps the L1 norm of its task vector (unless all was dropped)
    single = dare_merging(base, {"task0": experts["task0"]}, 1.0, drop_rate, seed=7, rescale_mode="l1")
    for k, b in base_sd.items():
        tau = float_state(experts["task0"])[k] - b
        norm = (single.state_dict()[k] - b).abs().sum()
        if dare_keep_mask(7, "task0", k, b.shape, drop_rate).any():
            torch.testing.assert_close(norm, tau.abs().sum(), rtol=1e-5, atol=0)
        else:
            assert norm == 0
    # differs from the keep-rate rescaling
    keep_rate = dare_merging(base, experts, scaling_factor=0.6, drop_rate=drop_rate, seed=7)
    key = "encoder.layers.0.mlp.fc1.weight"
    assert not torch.allclose(keep_rate.state_dict()[key], merged.state_dict()[key], rtol=0, atol=1e-6)


def test_dare_l1_rescaling_leaves_an_all_dropped_tensor_unscaled():
    base = TwoTensors(n=2)
    expert = with_task_vector(base, {"big.weight": [1.0, -2.0], "small.weight": [0.5, 0.25]})
    seed = next(s for s in range(1000) if not dare_keep_mask(s, "e", "small.weight", (1, 2), 0.8).any()
                and dare_keep_mask(s, "e", "big.weight", (1, 2), 0.8).sum() == 1)
    merged = dare_merging(base, {"e": expert}, scaling_factor=1.0, drop_rate=0.8, seed=seed, rescale_mode="l1")
    assert torch.equal(merged.small.weight, base.small.weight)  # all dropped: no 0/0
    # the one kept entry of `big` carries the tensor's L1 norm, 3
    delta = (merged.big.weight - base.big.weight).flatten()
    kept = dare_keep_mask(seed, "e", "big.weight", (1, 2), 0.8).flatten()
    torch.testing.assert_close(delta[kept].abs(), torch.tensor([3.0]), rtol=0, atol=1e-6)
    assert bool(torch.isfinite(merged.big.weight).all())


@pytest.mark.parametrize("merge_func", ["sum", "mean"])
@pytest.mark.parametrize("rescale_mode", ["keep_rate", "l1"])
def test_dare_ties_matches_mergekit_formula(vision_setting, rescale_mode, merge_func):
    base, experts = vision_setting
    merged = dare_ties_merging(base, experts, scaling_factor=0.6, drop_rate=0.7, seed=3,
                               rescale_mode=rescale_mode, merge_func=merge_func)
    assert_state_close(merged, expected_dare_ties(base, experts, 0.6, 0.7, rescale_mode, 3, merge_func))
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == {
        "method": "dare_ties", "scaling_factor": 0.6, "drop_rate": 0.7, "rescale": True,
        "rescale_mode": rescale_mode, "seed": 3, "merge_func": merge_func, "experts": ["task0", "task1", "task2"],
    }


def test_dare_ties_uses_the_dare_masks_and_elects_signs(vision_setting):
    base, experts = vision_setting
    # one expert: no sign conflict, DARE-TIES (sum) is DARE with the same masks
    single = {"task1": experts["task1"]}
    assert_state_close(dare_ties_merging(base, single, 0.5, 0.6, seed=2),
                       float_state(dare_merging(base, single, 0.5, 0.6, seed=2)))
    # several: sign election makes it differ from DARE's plain sum
    key = "encoder.layers.0.mlp.fc1.weight"
    assert not torch.allclose(dare_ties_merging(base, experts, 0.5, 0.6, seed=2).state_dict()[key],
                              dare_merging(base, experts, 0.5, 0.6, seed=2).state_dict()[key], rtol=0, atol=1e-6)
    # no dropping: TIES without trimming, sum
    assert_state_close(dare_ties_merging(base, experts, 0.5, 0.0, merge_func="sum"),
                       expected_ties(base, experts, 0.5, 1.0, False, merge_func="sum"))


def test_recipe_schema_accepts_the_new_method_and_option():
    from hf_featcal.recipes import RecipeError, validate_merge_spec

    spec = validate_merge_spec("dare_ties", {"drop_rate": 0.5, "rescale_mode": "l1", "merge_func": "mean", "seed": 1})
    assert (spec.method, spec.params["rescale_mode"], spec.params["merge_func"]) == ("dare_ties", "l1", "mean")
    assert validate_merge_spec("dare", {"rescale_mode": "keep_rate"}).params == {"rescale_mode": "keep_rate"}
    with pytest.raises(RecipeError, match="merge.rescale_mode"):
        validate_merge_spec("dare", {"rescale_mode": "l2"})
    with pytest.raises(RecipeError, match="merge.density"):
        validate_merge_spec("dare_ties", {"density": 0.2})


@pytest.mark.parametrize("other", [dict(num_hidden_layers=1), dict(num_attention_heads=2), dict(hidden_act="gelu")])
@pytest.mark.parametrize("as_folder", [False, True])
def test_experts_of_another_configuration_are_refused_as_the_calibrator_refuses_them(
    vision_setting, tmp_path, other, as_folder
):
    """Issue 29 item 6: fewer layers (keys a subset of the base's), another head count or activation
    (same shapes) used to merge silently; `merge` now refuses them up front with the calibrator's message."""
    from hf_featcal import FeatCalCalibrator

    base, experts = vision_setting
    odd = CLIPVisionModel(vision_config(**other)).eval()
    if as_folder:
        odd.save_pretrained(tmp_path / "odd")
        odd = str(tmp_path / "odd")
    (field, value), = other.items()
    expected = (
        rf"`experts\['odd'\]` has a different configuration from the merged model \({field}: merged .* vs {value!r}\)"
    )
    with pytest.raises(ValueError, match=expected) as from_merge:
        task_arithmetic(base, {"task0": experts["task0"], "odd": odd})
    data = {t: [{"pixel_values": torch.randn(2, 3, 16, 16)}] for t in ("task0", "odd")}
    with pytest.raises(ValueError) as from_calibrator:
        FeatCalCalibrator(copy.deepcopy(base), base, {"task0": experts["task0"], "odd": odd}, data)
    assert str(from_merge.value) == str(from_calibrator.value)


@pytest.mark.parametrize("scaling", [1e300, -1e300, 100.5])
def test_absurd_scaling_factor_is_refused_up_front(vision_setting, scaling):
    """Issue 29 item 11: `scaling_factor: 1e300` gave a merge full of Inf; the declared range refuses it
    (the same declaration checks recipes and `hf-featcal merge --scaling-factor`)."""
    from hf_featcal.recipes import RecipeError, validate_merge_spec

    base, experts = vision_setting
    with pytest.raises(ValueError, match=r"`scaling_factor` must be in \[-100, 100\], got " + re.escape(repr(scaling))):
        merge_models(base, experts, "ties", scaling_factor=scaling)
    with pytest.raises(RecipeError, match=r"merge.scaling_factor.*must be in \[-100, 100\]"):
        validate_merge_spec("task_arithmetic", {"scaling_factor": scaling})


def test_a_non_finite_merge_is_refused_and_the_inputs_stay_as_they_were(vision_setting):
    """Issue 29 item 11: finite inputs whose merge overflows (here float32: 2 x 3e38) are refused before
    the tensor is written, naming `scaling_factor` and the tensor; base and experts are unchanged."""
    base, experts = vision_setting
    huge = copy.deepcopy(experts["task0"])
    with torch.no_grad():
        huge.post_layernorm.weight.fill_(3e38)  # finite in float32
    before = {"base": snapshot(base), "huge": snapshot(huge)}
    expected = (r"the merge is not finite \(NaN/Inf\) in 'post_layernorm.weight' with "
                r"`scaling_factor`=2.0 \(torch.float32\); refusing it")
    with pytest.raises(ValueError, match=expected):
        task_arithmetic(base, {"huge": huge}, scaling_factor=2.0)
    assert_same_state(base, before["base"])
    assert_same_state(huge, before["huge"])
