"""Singular Value Calibration (`hf_featcal.merging.svc`) against a float64 reference written here from
the paper's formulas, on a tiny CLIPVisionModel and a tiny LlamaForCausalLM whose experts differ from
the base in every tensor; its checks before work, the caller's models, lazy folders, a CLIPModel base
with vision-tower experts, the compare grid's "svc" step and ``hf-featcal merge --svc``."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from transformers import CLIPModel, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

import hf_featcal.merging.engine as engine
from hf_featcal import cli
from hf_featcal.compare import compare_post_merging, post_merging_steps
from hf_featcal.merging import (
    MERGE_CONFIG_ATTRIBUTE,
    merge_models,
    singular_value_calibration,
    task_arithmetic,
    ties_merging,
)
from hf_featcal.merging.svc import svc_alpha_for
from hf_featcal.recipes.parse import _parse_compare
from hf_featcal.recipes.spec import KeyChecker
from testing_utils import (
    assert_same_state,
    build_clip_setting,
    randomise_norms,
    snapshot,
    tiny_clip_config,
    tiny_vision_config,
)


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


def tiny_clip_vision() -> CLIPVisionModel:
    model = CLIPVisionModel(tiny_vision_config()).eval()
    randomise_norms(model, torch.Generator().manual_seed(1))
    return model


def fine_tuned(base: nn.Module, shared: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> nn.Module:
    """A copy of `base` with every float tensor moved by a direction all experts share plus one of its own."""
    expert = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, value in expert.state_dict().items():
            if value.is_floating_point():
                value.add_(shared[key] + scale * torch.randn(value.shape, generator=generator))
    return expert


def experts_of(base: nn.Module, count: int = 3) -> dict[str, nn.Module]:
    generator = torch.Generator().manual_seed(100)
    shared = {k: 0.05 * torch.randn(v.shape, generator=generator)
              for k, v in base.state_dict().items() if v.is_floating_point()}
    return {f"task{i}": fine_tuned(base, shared, seed=i + 1) for i in range(count)}


def float64_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in model.state_dict().items() if v.is_floating_point()}


def reference_svc(merged: dict, base: dict, experts: list[dict], matrices: list[str], alpha: float) -> dict:
    """The paper's rule, one matrix and one singular direction at a time, in float64: ΔW = U diag(σ) Vᵀ;
    a_r = u_rᵀ ΔW, a_r^i = u_rᵀ ΔW_i; s_r^i = ⟨a_r, a_r^i⟩ / ‖a_r^i‖² (‖a_r^i‖² floored at 1e-12, as
    FusionBench: a task with no response there has s = 0); γ_r = K / Σ_i max(α, s_r^i);
    W = W_0 + U diag(γσ) Vᵀ."""
    out = {}
    for key in matrices:
        delta = merged[key] - base[key]
        u, sigma, vh = torch.linalg.svd(delta, full_matrices=False)
        gamma = torch.empty_like(sigma)
        for r in range(sigma.numel()):
            merged_response = u[:, r] @ delta
            total = 0.0
            for expert in experts:
                response = u[:, r] @ (expert[key] - base[key])
                s = float(merged_response @ response) / max(float(response @ response), 1e-12)
                total += max(alpha, s)
            gamma[r] = len(experts) / total
        out[key] = base[key] + u @ torch.diag(gamma * sigma) @ vh
    return out


def matrix_keys(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.dim() == 2]


# --------------------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("build", [tiny_clip_vision, tiny_llama], ids=["clip_vision", "llama"])
@pytest.mark.parametrize("scaling,alpha", [(0.3, 0.1), (1.0, 1.0)], ids=["ta0.3-alpha0.1", "ta1.0-alpha1"])
def test_svc_is_the_papers_rule(build, scaling, alpha):
    """λ = 0.3 with α = 0.1 (FusionBench's TA setting) raises under-counted directions; λ = 1 with α = 1
    only shrinks the directions the experts' shared part over-counts."""
    base = build()
    experts = experts_of(base)
    merged = task_arithmetic(base, experts, scaling_factor=scaling)
    calibrated = singular_value_calibration(merged, base, experts, alpha=alpha)

    matrices = matrix_keys(base)
    assert len(matrices) == (13 if isinstance(base, CLIPVisionModel) else 16)  # 6 Linears × 2 layers + position
    # embedding / 7 Linears × 2 layers + embed_tokens + lm_head (untied)
    merged64, expected = float64_state(merged), reference_svc(
        float64_state(merged), float64_state(base), [float64_state(e) for e in experts.values()], matrices, alpha)
    state = calibrated.state_dict()
    moved = 0.0
    for key in matrices:
        torch.testing.assert_close(state[key].double(), expected[key], rtol=1e-6, atol=1e-7, msg=key)
        moved = max(moved, float((expected[key] - merged64[key]).abs().max()))
    assert moved > 1e-2  # the calibration is not the identity on these inputs
    for key, value in merged.state_dict().items():  # everything else keeps the merged values, bit for bit
        if key not in matrices:
            assert torch.equal(state[key], value), key
    assert state[matrices[0]].dtype == torch.float32
    record = getattr(calibrated.config, MERGE_CONFIG_ATTRIBUTE)
    assert record == {"method": "task_arithmetic", "scaling_factor": scaling, "experts": list(experts),
                      "post_merging": [{"method": "svc", "alpha": alpha, "experts": list(experts),
                                        "matrices": len(matrices)}]}


def test_a_clip_model_base_with_a_vision_expert_and_a_full_expert():
    """The text tower is covered by the full expert only: the vision-tower expert is the base there
    (its ΔW_i = 0, so it adds α to every sum); the projections and the text tower follow the reference
    with that expert's full state being the base outside its tower."""
    torch.manual_seed(0)
    base = CLIPModel(tiny_clip_config()).eval()
    both = experts_of(base, count=2)
    vision_only = CLIPVisionModel(base.config.vision_config).eval()
    vision_only.load_state_dict(both["task0"].vision_model.state_dict())
    experts = {"vision": vision_only, "full": both["task1"]}
    merged = task_arithmetic(base, experts, scaling_factor=0.3)
    calibrated = singular_value_calibration(merged, base, experts, alpha=0.1)

    base64 = float64_state(base)
    as_full = {**base64, **{f"vision_model.{k}": v for k, v in float64_state(vision_only).items()}}
    matrices = matrix_keys(base)
    expected = reference_svc(float64_state(merged), base64, [as_full, float64_state(both["task1"])], matrices, 0.1)
    state = calibrated.state_dict()
    for key in matrices:
        torch.testing.assert_close(state[key].double(), expected[key], rtol=1e-6, atol=1e-7, msg=key)
    assert not torch.equal(state["text_model.encoder.layers.0.mlp.fc1.weight"],
                           merged.state_dict()["text_model.encoder.layers.0.mlp.fc1.weight"])


def test_a_matrix_no_expert_covers_is_left_as_merged():
    """FusionBench would scale such a matrix's ΔW by 1/α; ours leaves it (a CLIPModel's text tower when
    the experts are vision towers: there ΔW = 0 in FusionBench's full-model setting too)."""
    torch.manual_seed(0)
    base = CLIPModel(tiny_clip_config()).eval()
    experts = {t: CLIPVisionModel(base.config.vision_config).eval() for t in ("a", "b")}
    for expert in experts.values():
        expert.load_state_dict(base.vision_model.state_dict())
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape))
    merged = task_arithmetic(base, experts, scaling_factor=0.3)
    with torch.no_grad():  # a merge from elsewhere that moved the text tower too
        merged.text_model.encoder.layers[0].mlp.fc1.weight.add_(0.1)
    calibrated = singular_value_calibration(merged, base, experts, alpha=0.1)
    state, before = calibrated.state_dict(), merged.state_dict()
    for key in matrix_keys(base):
        changed = not torch.equal(state[key], before[key])
        assert changed == key.startswith("vision_model."), key
    assert getattr(calibrated.config, MERGE_CONFIG_ATTRIBUTE)["post_merging"][0]["matrices"] == 13


# --------------------------------------------------------------------------------------- checks and inputs
@pytest.mark.parametrize("alpha", [0.0, -0.1, float("nan"), float("inf"), True, "1"])
def test_a_bad_alpha_is_refused_before_any_tensor_is_read(clip_setting, alpha, monkeypatch):
    base, experts, merged, _ = clip_setting
    touched = []
    monkeypatch.setattr(engine, "open_expert", lambda *a, **k: touched.append(a) or None)
    monkeypatch.setattr(engine.Expert, "read", lambda *a, **k: touched.append(a) or None)
    with pytest.raises(ValueError, match=r"`alpha` must be (in \(0, inf\)|a finite real number), got"):
        singular_value_calibration(merged, base, experts, alpha=alpha)
    assert touched == []


def test_bad_models_are_named(clip_setting, tmp_path):
    base, experts, merged, _ = clip_setting
    with pytest.raises(ValueError, match="`merged_model` must be"):
        singular_value_calibration(merged.state_dict(), base, experts)
    with pytest.raises(ValueError, match="`base_model` must be"):
        singular_value_calibration(merged, 3, experts)
    with pytest.raises(ValueError, match="`experts` must contain at least one expert"):
        singular_value_calibration(merged, base, {})
    wide = CLIPVisionModel(tiny_vision_config(intermediate_size=48))
    with pytest.raises(ValueError, match=r"`base_model`.* has a different configuration.*intermediate_size"):
        singular_value_calibration(merged, wide, experts)
    with torch.no_grad():
        broken = copy.deepcopy(merged)
        broken.encoder.layers[1].mlp.fc1.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"`merged_model` has non-finite values \(NaN/Inf\) in "
                                         r"'encoder.layers.1.mlp.fc1.weight'"):
        singular_value_calibration(broken, base, experts)


def test_the_callers_models_are_unchanged_and_the_result_is_new(clip_setting):
    base, experts, merged, _ = clip_setting
    merged = task_arithmetic(base, experts)
    states = {"base": snapshot(base), "merged": snapshot(merged), **{t: snapshot(e) for t, e in experts.items()}}
    record = copy.deepcopy(getattr(merged.config, MERGE_CONFIG_ATTRIBUTE))
    calibrated = singular_value_calibration(merged, base, experts, alpha=0.1)
    assert calibrated is not merged and calibrated.config is not merged.config
    for name, model in {"base": base, "merged": merged, **experts}.items():
        assert_same_state(model, states[name])
    assert getattr(merged.config, MERGE_CONFIG_ATTRIBUTE) == record  # no "post_merging" on the caller's
    assert not any(p.data_ptr() == q.data_ptr() for p in calibrated.parameters() for q in merged.parameters())
    again = singular_value_calibration(calibrated, base, experts, alpha=0.5)  # a second step is recorded too
    assert [s["alpha"] for s in getattr(again.config, MERGE_CONFIG_ATTRIBUTE)["post_merging"]] == [0.1, 0.5]


def test_folders_are_read_lazily_and_give_the_same_result(tmp_path, monkeypatch):
    base = tiny_llama()
    experts = experts_of(base, count=2)
    merged = task_arithmetic(base, experts)
    for name, model in {"base": base, "merged": merged, **experts}.items():
        model.save_pretrained(tmp_path / name)
    in_memory = singular_value_calibration(merged, base, experts, alpha=0.2)

    loads = []
    import hf_featcal.model_io as model_io

    for module in (engine, model_io):
        original = module.load_model
        monkeypatch.setattr(module, "load_model",
                            lambda source, *a, _original=original, **k: loads.append(str(source)) or _original(
                                source, *a, **k))
    from_folders = singular_value_calibration(tmp_path / "merged", tmp_path / "base",
                                              {t: tmp_path / t for t in experts}, alpha=0.2)
    assert loads == [str(tmp_path / "merged")]  # the base and the experts are read tensor by tensor
    assert_same_state(from_folders, in_memory.state_dict())
    assert getattr(from_folders.config, MERGE_CONFIG_ATTRIBUTE)["method"] == "task_arithmetic"


def lora_experts(base: nn.Module, folder, targets: dict[str, list[str]]) -> dict[str, nn.Module]:
    """PEFT LoRA adapters on `base` (random A and B), saved under `folder`/<task>; returns each merged into
    a copy of the base with PEFT's own `merge_and_unload` (the experts in full, for the reference)."""
    from peft import LoraConfig, get_peft_model

    full = {}
    for seed, (task, modules) in enumerate(targets.items()):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=8, target_modules=modules,
                                                                    init_lora_weights=False))
        peft_model.save_pretrained(folder / task)
        full[task] = peft_model.merge_and_unload().eval()
    return full


def test_lora_adapter_experts_are_read_on_the_base_not_on_the_merge(tmp_path):
    """ΔW_i of an adapter expert is B_i A_i · scale (the adapter on the base), whatever the merge did: SVC
    with adapter folders equals the float64 reference on the experts PEFT merges into the base."""
    base = tiny_llama()
    full = lora_experts(base, tmp_path, {"a": ["q_proj", "up_proj"], "b": ["q_proj", "v_proj"]})
    merged = task_arithmetic(base, full, scaling_factor=0.6)
    adapters = {task: str(tmp_path / task) for task in full}
    calibrated = singular_value_calibration(merged, base, adapters, alpha=0.1)

    adapted = [k for k in matrix_keys(base) if any(f".{m}." in k for m in ("q_proj", "up_proj", "v_proj"))]
    expected = reference_svc(float64_state(merged), float64_state(base), [float64_state(e) for e in full.values()],
                             adapted, 0.1)
    state, merged_state = calibrated.state_dict(), merged.state_dict()
    for key in matrix_keys(base):
        if key in adapted:
            torch.testing.assert_close(state[key].double(), expected[key], rtol=1e-6, atol=1e-7, msg=key)
            assert not torch.equal(state[key], merged_state[key]), key  # SVC changed it
        else:  # no adapter covers it: left as merged
            assert torch.equal(state[key], merged_state[key]), key
    in_memory = singular_value_calibration(merged, base, full, alpha=0.1)  # the full experts: the same matrices
    for key in adapted:
        torch.testing.assert_close(state[key], in_memory.state_dict()[key], rtol=1e-6, atol=1e-7, msg=key)


# --------------------------------------------------------------------------------------- compare, recipes, CLI
def test_the_compare_grid_runs_svc_after_each_merge(clip_setting, generator):
    base, experts, _, data = clip_setting
    probes = {t: torch.randn(3, 3, 8, 8, generator=generator) for t in experts}

    def evaluate(model):
        with torch.no_grad():
            return {t: -float((model(pixel_values=x).pooler_output - experts[t](pixel_values=x).pooler_output).norm())
                    for t, x in probes.items()}

    assert "svc" in post_merging_steps()
    result = compare_post_merging(base, experts, data, evaluate, merges=["task_arithmetic", "ties"],
                                  post_merging=["none", "svc"])
    assert result.errors == {}
    assert list(result.scores) == ["experts", "task_arithmetic", "task_arithmetic+svc", "ties", "ties+svc"]
    assert set(result.seconds) == set(result.scores)
    for method, params in (("task_arithmetic", {"scaling_factor": 0.3}),
                           ("ties", {"scaling_factor": 0.3, "density": 0.2})):
        assert svc_alpha_for(method) == 0.1  # FusionBench's configs (singular_value_calibration/*.yaml)
        direct = evaluate(singular_value_calibration(merge_models(base, experts, method, **params), base, experts,
                                                     alpha=0.1))
        assert result.scores[f"{method}+svc"] == pytest.approx({**direct, "mean": sum(direct.values()) / 2},
                                                              rel=1e-6)
        assert result.scores[f"{method}+svc"] != result.scores[method]
    one = compare_post_merging(base, experts, data, evaluate, merges=["task_arithmetic"], post_merging=["svc"],
                               svc_alpha=0.5)
    direct = evaluate(singular_value_calibration(task_arithmetic(base, experts), base, experts, alpha=0.5))
    assert one.scores["task_arithmetic+svc"] == pytest.approx({**direct, "mean": sum(direct.values()) / 2}, rel=1e-6)
    calls = []
    with pytest.raises(ValueError, match=r"`svc_alpha` must be in \(0, inf\), got -1"):
        compare_post_merging(base, experts, data, lambda m: calls.append(m) or evaluate(m), svc_alpha=-1)
    assert calls == []


def test_a_recipes_compare_section_takes_svc():
    assert _parse_compare(KeyChecker(), {"post_merging": ["none", "svc"]}).post_merging == ["none", "svc"]
    from hf_featcal.schema import render_recipe_schema

    steps = "none | featcal | featcal_module | featcal_guarded | svc | surgery | prob_surgery"
    assert f"post_merging?: [{steps}, ...]" in render_recipe_schema()


def test_hf_featcal_merge_svc(tmp_path, capsys):
    base, experts, _, _ = build_clip_setting(torch.Generator().manual_seed(3))
    base.save_pretrained(tmp_path / "base")
    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / task)
    sources = [arg for task in experts for arg in ("--expert", f"{task}={tmp_path / task}")]
    out = tmp_path / "out"
    assert cli.main(["merge", "--base", str(tmp_path / "base"), *sources, "--method", "ties", "--svc",
                     "--output-dir", str(out)]) == 0
    assert "(ties + SVC (alpha=0.1); tasks: cars, dtd)" in capsys.readouterr().out
    saved = CLIPVisionModel.from_pretrained(out)
    expected = singular_value_calibration(ties_merging(base, experts), base, experts, alpha=0.1)
    assert_same_state(saved, expected.state_dict())
    record = json.loads((out / "config.json").read_text())[MERGE_CONFIG_ATTRIBUTE]
    assert record["post_merging"] == [{"method": "svc", "alpha": 0.1, "experts": list(experts), "matrices": 13}]

    for flags, message in ((["--svc", "--svc-alpha", "0"], "--svc-alpha: must be in (0, inf), got 0.0"),
                           (["--svc-alpha", "0.5"], "--svc-alpha: needs --svc")):
        assert cli.main(["merge", "--base", str(tmp_path / "base"), *sources, *flags,
                         "--output-dir", str(tmp_path / "never")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_an_unknown_or_undeclared_merge_gets_svcs_default_alpha():
    assert svc_alpha_for(None) == svc_alpha_for("no_such_merge") == 1.0
    assert svc_alpha_for("iso_cts") == 0.2 and svc_alpha_for("simple_average") == 0.1  # an alias finds its method


@pytest.mark.parametrize("bad", [0.0, -0.1, 1])
def test_a_method_declaring_a_bad_svc_alpha_is_refused_at_registration(bad):
    import dataclasses

    from hf_featcal.merging.registry import get_method

    with pytest.raises(RuntimeError, match="svc_alpha must be a float > 0"):
        dataclasses.replace(get_method("task_arithmetic"), svc_alpha=bad).check_declaration()


def test_only_the_experts_the_merge_recorded_are_accepted(monkeypatch):
    """The merge record names its experts: SVC with other ones (one more, one less, another name) is
    refused, naming both lists, before the base or any expert is read; a merge without a record is taken."""
    base = tiny_llama()
    experts = experts_of(base, count=2)
    merged = task_arithmetic(base, experts)
    opened = []
    original = engine.open_expert
    monkeypatch.setattr(engine, "open_expert", lambda *a, **k: opened.append(a[0]) or original(*a, **k))
    extra = experts_of(base, count=3)
    for given in ({"task0": experts["task0"]}, extra, {"task0": experts["task0"], "other": experts["task1"]}):
        with pytest.raises(ValueError, match=r"`experts` must be the experts `merged_model` was merged from, which "
                                             r"its merge record names: \['task0', 'task1'\]; got \["):
            singular_value_calibration(merged, base, given)
    assert opened == []
    singular_value_calibration(merged, base, dict(reversed(experts.items())))  # the order does not matter
    unrecorded = copy.deepcopy(merged)
    delattr(unrecorded.config, MERGE_CONFIG_ATTRIBUTE)
    singular_value_calibration(unrecorded, base, extra)
