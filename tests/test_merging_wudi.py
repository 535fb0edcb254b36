"""WUDI merging (`hf_featcal.merging.methods.wudi`) against an independent reference: the paper's loss
Σ_i ‖(τ_m − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F in float64 (its gradient by autograd) and Adam written out from its
formulas, on a tiny Linear and on tiny CLIP vision / Llama models whose experts differ from the base in
every tensor."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import CLIPVisionModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from hf_featcal.merging import MERGE_CONFIG_ATTRIBUTE, get_method, merge_models
from hf_featcal.merging.methods.wudi import wudi_merging
from testing_utils import tiny_vision_config

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # Adam's torch defaults, which FusionBench uses


def paper_loss(merged: torch.Tensor, taus: list[torch.Tensor]) -> torch.Tensor:
    """Σ_i ‖(τ_m − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F (float64; zero task vectors bring no term)."""
    merged = merged.double()
    terms = [torch.linalg.matrix_norm((merged - t.double()) @ t.double().T) ** 2 / torch.linalg.matrix_norm(
        t.double()) ** 2 for t in taus if bool(t.abs().sum() > 0)]
    return sum(terms[1:], terms[0])


def reference_wudi(taus: list[torch.Tensor], steps: int, lr: float) -> torch.Tensor:
    """τ_m from Σ τ_i after `steps` Adam steps on `paper_loss`, in float64:
    m ← β1 m + (1 − β1) g, v ← β2 v + (1 − β2) g², τ_m ← τ_m − lr · m̂ / (√v̂ + ε) with m̂ = m / (1 − β1^t),
    v̂ = v / (1 − β2^t)."""
    merged = sum(t.double() for t in taus)
    m = torch.zeros_like(merged)
    v = torch.zeros_like(merged)
    for t in range(1, steps + 1):
        point = merged.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(paper_loss(point, taus), point)
        m = BETA1 * m + (1 - BETA1) * grad
        v = BETA2 * v + (1 - BETA2) * grad**2
        m_hat = m / (1 - BETA1**t)
        v_hat = v / (1 - BETA2**t)
        merged = merged - lr * m_hat / (v_hat.sqrt() + EPS)
    return merged


def perturbed(model: nn.Module, seed: int, scale: float) -> nn.Module:
    """A copy of `model` with every floating-point tensor moved (an expert differing in every tensor)."""
    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in out.state_dict().values():
            if value.is_floating_point():
                value.add_(scale * torch.randn(value.shape, generator=generator))
    return out


def float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def task_vectors(base: nn.Module, experts: dict[str, nn.Module]) -> dict[str, list[torch.Tensor]]:
    base_state = float_state(base)
    states = [float_state(e) for e in experts.values()]
    return {k: [s[k].double() - b.double() for s in states] for k, b in base_state.items()}


class TinyLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def _no_progress_bars():
    """The bars are tested on their own; elsewhere they would only fill the captured output."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if enabled:
        hf_logging.enable_progress_bar()


@pytest.mark.parametrize(("scales", "lr"), [((0.01, 0.1, 1.0), 1e-2), ((1e-8, 1e-7, 1e-6), 1e-7)])
def test_steps_match_the_paper_loss_and_adam_written_out(scales, lr):
    """Task vectors of very different norms (the loss's 1/‖τ_i‖² weighting changes the steps' direction);
    the second set's gradients are near Adam's ε. The base is zero: the merge is τ_m itself."""
    torch.manual_seed(0)
    base = TinyLinear()
    with torch.no_grad():
        for value in base.parameters():
            value.zero_()
    experts = {f"t{i}": perturbed(base, seed=i, scale=scale) for i, scale in enumerate(scales)}
    merged = wudi_merging(base, experts, iter_num=5, lr=lr)
    taus = task_vectors(base, experts)
    got = float_state(merged)
    expected = reference_wudi(taus["proj.weight"], steps=5, lr=lr)
    start = sum(taus["proj.weight"])
    assert (expected - start).abs().max() > 1e-3 * start.abs().max()  # the steps move it beyond the tolerance
    torch.testing.assert_close(got["proj.weight"].double(), expected, rtol=1e-5, atol=0)  # float32 rounding
    torch.testing.assert_close(got["proj.bias"].double(), sum(taus["proj.bias"]) / 3, rtol=1e-6, atol=0)
    assert getattr(merged, "config", merged) is merged  # a plain module: the record is an attribute
    assert getattr(merged, MERGE_CONFIG_ATTRIBUTE) == {
        "method": "wudi", "iter_num": 5, "lr": lr, "experts": ["t0", "t1", "t2"]}


@pytest.mark.parametrize("family", ["clip", "llama"])
def test_every_matrix_lowers_the_loss_and_the_rest_is_the_mean(family):
    torch.manual_seed(0)
    base = CLIPVisionModel(tiny_vision_config()).eval() if family == "clip" else tiny_llama()
    experts = {f"t{i}": perturbed(base, seed=i, scale=scale) for i, scale in enumerate((0.02, 0.05, 0.1))}
    before = {name: float_state(model) for name, model in [("base", base), *experts.items()]}
    merged = merge_models(base, experts, "wudi", iter_num=10, lr=1e-4)

    for name, model in [("base", base), *experts.items()]:  # the caller's models are unchanged
        assert all(torch.equal(float_state(model)[k], v) for k, v in before[name].items()), name
    got, base_state = float_state(merged), before["base"]
    taus = task_vectors(base, experts)
    matrices = [k for k, v in base_state.items() if v.dim() == 2]
    others = [k for k, v in base_state.items() if v.dim() != 2]
    assert len(matrices) >= 13 and others  # the attention and MLP Linears, embeddings / heads; norms, biases
    for key in matrices:
        start = sum(taus[key])
        merged_tau = got[key].double() - base_state[key].double()
        assert paper_loss(merged_tau, taus[key]) < paper_loss(start, taus[key]) * (1 - 1e-4), key
    for key in others:
        torch.testing.assert_close(got[key].double() - base_state[key].double(), sum(taus[key]) / 3, rtol=0,
                                   atol=1e-6, msg=key)


def test_an_expert_equal_to_the_base_brings_no_term():
    """FusionBench divides by its zero norm (a NaN merge); here the matrices merge as without it, and the
    mean still counts it."""
    torch.manual_seed(0)
    base = CLIPVisionModel(tiny_vision_config()).eval()
    experts = {f"t{i}": perturbed(base, seed=i, scale=0.05) for i in range(2)}
    with_copy = float_state(wudi_merging(base, {**experts, "same": copy.deepcopy(base)}, iter_num=3, lr=1e-4))
    without = float_state(wudi_merging(base, experts, iter_num=3, lr=1e-4))
    base_state = float_state(base)
    taus = task_vectors(base, experts)
    for key, value in with_copy.items():
        assert torch.isfinite(value).all(), key
        if value.dim() == 2:
            assert torch.equal(value, without[key]), key
        else:
            torch.testing.assert_close(value.double() - base_state[key].double(), sum(taus[key]) / 3, rtol=0,
                                       atol=1e-6, msg=key)


@pytest.mark.parametrize(("name", "value", "range_text"), [
    ("iter_num", 0, "[1, 100000]"), ("iter_num", -3, "[1, 100000]"), ("iter_num", 100_001, "[1, 100000]"),
    ("iter_num", 2.5, "integer"), ("iter_num", True, "integer"),
    ("lr", 0.0, "(0, 1]"), ("lr", -1e-5, "(0, 1]"), ("lr", 2.0, "(0, 1]"), ("lr", math.nan, "finite"),
    ("lr", "1e-5", "finite"),
])
def test_bad_parameters_are_refused_before_any_tensor_is_read(name, value, range_text):
    sources = {"base_model": "/nonexistent/base", "experts": {"a": "/nonexistent/a"}}  # never opened
    with pytest.raises(ValueError, match=f"`{name}`") as err:
        wudi_merging(**sources, **{name: value})
    assert range_text in str(err.value)
    with pytest.raises(ValueError, match=f"`{name}`"):
        merge_models(sources["base_model"], sources["experts"], "wudi", **{name: value})


def test_declared_with_the_fusionbench_defaults():
    method = get_method("wudi")
    assert method.paper_defaults == {"iter_num": 300, "lr": 1e-5}
    assert {p.name: p.default for p in method.parameters} == {"iter_num": 300, "lr": 1e-5}
    assert not method.needs_calibration_data


def test_progress_bar_counts_the_optimiser_steps(capsys):
    torch.manual_seed(0)
    base = CLIPVisionModel(tiny_vision_config()).eval()
    experts = {f"t{i}": perturbed(base, seed=i, scale=0.05) for i in range(2)}
    matrices = sum(1 for v in float_state(base).values() if v.dim() == 2)
    hf_logging.enable_progress_bar()
    wudi_merging(base, experts, iter_num=4, lr=1e-4)
    shown = capsys.readouterr().err
    assert f"WUDI: {matrices} matrices × 4 Adam steps" in shown and f"{4 * matrices}/{4 * matrices}" in shown
    hf_logging.disable_progress_bar()  # transformers' switch (``--quiet``) silences it
    wudi_merging(base, experts, iter_num=4, lr=1e-4)
    assert "WUDI" not in capsys.readouterr().err
