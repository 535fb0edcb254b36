"""End-to-end checks on tiny CLIP vision models against independent computations."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import CLIPModel, CLIPVisionModel, CLIPVisionModelWithProjection

from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalWarning
from testing_utils import (
    assert_same_up_to_rounding,
    perturbed,
    pixel_batches,
    randomise_norms,
    tiny_clip_config,
    tiny_vision_config,
)


def _hidden_states(model, pixels):
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states


def _independent_drift(merged, expert, batches):
    """Σ‖h_m − h_e‖ / N at every block output, from each full model's own forward."""
    num_blocks = merged.config.num_hidden_layers
    sums, count = torch.zeros(num_blocks, dtype=torch.float64), 0
    for batch in batches:
        hm = _hidden_states(merged, batch["pixel_values"])
        he = _hidden_states(expert, batch["pixel_values"])
        for layer in range(num_blocks):
            sums[layer] += (hm[layer + 1].double() - he[layer + 1].double()).norm(dim=-1).sum()
        count += hm[0].shape[0] * hm[0].shape[1]
    return (sums / count).tolist()


def _relative_error(got, want) -> float:
    return float((got.detach() - want.detach()).norm() / want.detach().norm())


@pytest.mark.parametrize(
    "dtype,compute_dtype,epsilon,weight_tol,output_tol",
    [
        # the library defaults on a float32 model: the outputs come back to 1e-4; the weights up to
        # float32 round-off times the condition number of fc2's Gram (~1e3 here)
        (torch.float32, "float32", 1e-8, 1e-3, 1e-4),
        # in float64, and with ε (added to the scale-normalised Gram's diagonal) far below its smallest
        # eigenvalue, the recovery is exact to round-off
        (torch.float64, "float64", 1e-15, 1e-9, 1e-9),
    ],
)
def test_exact_recovery_when_only_fc2_differs(generator, dtype, compute_dtype, epsilon, weight_tol, output_tol):
    expert = CLIPVisionModel(tiny_vision_config()).eval()
    randomise_norms(expert, generator)
    with torch.no_grad():  # random init leaves Linear biases at zero
        for module in expert.modules():
            if isinstance(module, torch.nn.Linear):
                module.bias.normal_(0.0, 0.1, generator=generator)
    expert = expert.to(dtype)
    merged = copy.deepcopy(expert)
    with torch.no_grad():
        for layer in merged.encoder.layers:
            layer.mlp.fc2.weight.add_(0.3 * torch.randn(layer.mlp.fc2.weight.shape, generator=generator, dtype=dtype))
            layer.mlp.fc2.bias.add_(0.3 * torch.randn(layer.mlp.fc2.bias.shape, generator=generator, dtype=dtype))
    # 64 examples × 5 tokens = 320 tokens per module ≥ the largest input dimension (32)
    data = {"task": [{"pixel_values": b["pixel_values"].to(dtype)} for b in pixel_batches(generator, [16, 16, 16, 16])]}
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype=compute_dtype, epsilon=epsilon)
    probe = torch.randn(6, 3, 8, 8, generator=generator).to(dtype)
    with torch.no_grad():
        assert _relative_error(merged(pixel_values=probe).last_hidden_state,
                               expert(pixel_values=probe).last_hidden_state) > 0.05
    FeatCalCalibrator(merged, None, {"task": expert}, data, config, show_progress=False).calibrate()
    with torch.no_grad():
        got, want = merged(pixel_values=probe).last_hidden_state, expert(pixel_values=probe).last_hidden_state
    assert _relative_error(got, want) <= output_tol
    for ml, el in zip(merged.encoder.layers, expert.encoder.layers, strict=True):
        assert _relative_error(ml.mlp.fc2.weight, el.mlp.fc2.weight) <= weight_tol
        assert _relative_error(ml.mlp.fc2.bias, el.mlp.fc2.bias) <= weight_tol
        # every other module sees the expert's inputs too, so keeps the expert's values
        assert _relative_error(ml.layer_norm1.weight, el.layer_norm1.weight) <= weight_tol
        assert _relative_error(ml.layer_norm2.bias, el.layer_norm2.bias) <= weight_tol
    with torch.no_grad():
        states = expert(pixel_values=probe, output_hidden_states=True).hidden_states
        for i, (ml, el) in enumerate(zip(merged.encoder.layers, expert.encoder.layers, strict=True)):
            x = el.layer_norm1(states[i])
            for name in ("q_proj", "k_proj", "v_proj"):
                assert _relative_error(getattr(ml.self_attn, name)(x), getattr(el.self_attn, name)(x)) <= output_tol


def test_drift_report_matches_full_model_forwards(clip_setting):
    base, experts, merged, data = clip_setting
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    report = calibrator.report.to_dict()
    assert set(report["tasks"]) == set(experts)
    for task, expert in experts.items():
        stages = report["tasks"][task]
        assert all(isinstance(v, float) for v in stages["before"] + stages["after"])
        assert stages["before"] == pytest.approx(_independent_drift(given, expert, data[task]), rel=1e-5)
        assert stages["after"] == pytest.approx(_independent_drift(merged, expert, data[task]), rel=1e-5)
        assert stages["after"][-1] < stages["before"][-1]
    # every Linear of both blocks was solved; the logged J(merged) − J(calibrated) is the objective of
    # the method evaluated directly on the module inputs of full-model forwards, at the given and the new weights
    assert len(calibrator.solve_log) == 2 * 6
    logged = {(int(e["block"].split()[1]), e["module"]): e["objective_decrease"] for e in calibrator.solve_log}
    assert len(logged) == 2 * 6
    for (layer, module), decrease in logged.items():
        objective = _weight_objective(given, merged, base, experts, data, layer, module)
        old = given.encoder.layers[layer].get_submodule(module).weight
        new = merged.encoder.layers[layer].get_submodule(module).weight
        want = objective(old) - objective(new)
        # measured agreement ≤ 6e-7 (float32 statistics); a wrong term moves it by far more
        assert decrease == pytest.approx(want, rel=2e-5), (layer, module, decrease, want)


# the method's default hyperparameters, written out here (not read from the library's config)
LAMBDA, RHO, ALPHA, LAST_BLOCK_TOKEN_WEIGHT, EPSILON = 0.05, 2.2, 0.25, 0.01, 1e-8


def _linear_inputs(model, layer, module, batches):
    """Input of `module` in block `layer`, from the model's own full forward, every token: (tokens, d) float64."""
    store = []
    handle = model.encoder.layers[layer].get_submodule(module).register_forward_pre_hook(
        lambda m, args: store.append(args[0].detach().double())
    )
    with torch.no_grad():
        for batch in batches:
            model(pixel_values=batch["pixel_values"])
    handle.remove()
    shapes = [x.shape[:2] for x in store]
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in store]), shapes


def _weight_objective(given, calibrated, base, experts, data, layer, module):
    """J(W) = Σ_i s_i E_w‖W x_s − W_i x_t‖² + λ‖W − A‖² + ε‖W‖² of one Linear, in float64 from raw tensors.

    The student input x_s is that of the merged model whose blocks before `layer` are calibrated and
    block `layer` is as given; x_e that of expert i's own forward; x_t = α x_e + (1 − α) x_s; w is 1 per
    token, except in the last block where non-class tokens get 0.01 (not for the key/value projections).
    """
    student = copy.deepcopy(given)
    for earlier in range(layer):
        student.encoder.layers[earlier].load_state_dict(calibrated.encoder.layers[earlier].state_dict())
    last = layer == given.config.num_hidden_layers - 1
    terms = []
    for task, expert in experts.items():
        x_s, shapes = _linear_inputs(student, layer, module, data[task])
        x_e, _ = _linear_inputs(expert, layer, module, data[task])
        weights = []
        for batch_size, tokens in shapes:
            w = torch.ones(batch_size, tokens, dtype=torch.float64)
            if last and module not in ("self_attn.k_proj", "self_attn.v_proj"):
                w[:, 1:] = LAST_BLOCK_TOKEN_WEIGHT
            weights.append(w.reshape(-1))
        w = torch.cat(weights)
        w = w / w.sum()
        scale = 1.0 / max(float(torch.linalg.norm((x_s * w[:, None]).T @ x_s)), EPSILON)
        target = (ALPHA * x_e + (1 - ALPHA) * x_s) @ expert.encoder.layers[layer].get_submodule(
            module
        ).weight.detach().double().T
        terms.append((scale, w, x_s, target))
    base_w = base.encoder.layers[layer].get_submodule(module).weight.detach().double()
    anchor = base_w + RHO * (given.encoder.layers[layer].get_submodule(module).weight.detach().double() - base_w)

    def objective(weight):
        weight = weight.detach().double()
        value = LAMBDA * float((weight - anchor).square().sum()) + EPSILON * float(weight.square().sum())
        for scale, w, x_s, target in terms:
            value += scale * float((w * (x_s @ weight.T - target).square().sum(1)).sum())
        return value

    return objective


def test_mixed_wrapper_classes_give_the_same_tower(generator, tmp_path):
    """Base saved as a full CLIPModel, experts as CLIPVisionModel folders, merged as any wrapper."""
    clip = CLIPModel(tiny_clip_config()).eval()
    randomise_norms(clip, generator)
    base_vision = CLIPVisionModel(clip.config.vision_config).eval()
    base_vision.load_state_dict(clip.vision_model.state_dict())
    experts = {t: perturbed(base_vision, generator, 0.05).eval() for t in ("a", "b")}
    clip.save_pretrained(tmp_path / "base")
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
    data = {t: pixel_batches(generator, [6, 6]) for t in experts}

    def merged_tower_state():
        sd = {}
        for k, v in base_vision.state_dict().items():
            sd[k] = v + 0.3 * sum(e.state_dict()[k] - v for e in experts.values())
        return sd

    reference = CLIPVisionModel(clip.config.vision_config).eval()
    reference.load_state_dict(merged_tower_state())
    FeatCalCalibrator(reference, base_vision, experts, data, show_progress=False).calibrate()

    from_paths = CLIPVisionModel(clip.config.vision_config).eval()
    from_paths.load_state_dict(merged_tower_state())
    FeatCalCalibrator(
        from_paths, str(tmp_path / "base"), {t: str(tmp_path / t) for t in experts}, data, show_progress=False
    ).calibrate()
    assert_same_up_to_rounding(from_paths.state_dict(), reference.state_dict())

    full = copy.deepcopy(clip)
    full.vision_model.load_state_dict(merged_tower_state())
    text_before = copy.deepcopy(full.text_model.state_dict())
    projection_before = full.visual_projection.weight.clone()
    out = FeatCalCalibrator(full, str(tmp_path / "base"), experts, data, show_progress=False).calibrate()
    assert type(out) is CLIPModel
    assert_same_up_to_rounding(full.vision_model.state_dict(), reference.state_dict())
    for k, v in text_before.items():
        assert torch.equal(full.text_model.state_dict()[k], v)
    assert torch.equal(full.visual_projection.weight, projection_before)

    projected = CLIPVisionModelWithProjection(clip.config.vision_config).eval()
    projected.vision_model.load_state_dict(merged_tower_state())
    FeatCalCalibrator(projected, clip, experts, data, show_progress=False).calibrate()
    assert_same_up_to_rounding(projected.vision_model.state_dict(), reference.state_dict())


def test_selection_leaves_unselected_modules_untouched(clip_setting):
    base, experts, merged, data = clip_setting
    before = copy.deepcopy(merged.state_dict())
    config = FeatCalConfig(target_modules=["fc2", "layer_norm1"], layers_to_transform=[-1], calibrate_bias=False)
    FeatCalCalibrator(merged, base, experts, data, config, show_progress=False).calibrate()
    after = merged.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {
        "encoder.layers.1.mlp.fc2.weight",
        "encoder.layers.1.layer_norm1.weight",
        "encoder.layers.1.layer_norm1.bias",
    }


def test_regex_exclusion_and_no_norms(clip_setting):
    base, experts, merged, data = clip_setting
    before = copy.deepcopy(merged.state_dict())
    config = FeatCalConfig(exclude_modules=r"self_attn\..*", calibrate_norms=False)
    FeatCalCalibrator(merged, base, experts, data, config, show_progress=False).calibrate()
    after = merged.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".mlp.fc" in k for k in changed)
    assert len(changed) == 8  # fc1/fc2 weight and bias in both blocks


def test_warns_when_tokens_are_fewer_than_the_input_dimension(clip_setting):
    base, experts, merged, data = clip_setting
    few = {t: [{"pixel_values": bs[0]["pixel_values"][:1]}] for t, bs in data.items()}  # 5 tokens per task
    with pytest.warns(FeatCalWarning, match=r"mlp\.fc2.*weighted tokens for input dimension 32"):
        FeatCalCalibrator(merged, base, experts, few, show_progress=False).calibrate()


def test_warns_on_singular_gram_after_zero_bias_layer_norm(generator):
    base = CLIPVisionModel(tiny_vision_config()).eval()  # random init: LayerNorm γ=1, β=0
    experts = {"a": perturbed(base, generator, 0.02)}
    with torch.no_grad():
        for m in experts["a"].modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()
    data = {"a": pixel_batches(generator, [16, 16])}
    # the default ridge (λ = 0.05 against a Gram of norm ≤ 1) sets the null direction: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FeatCalCalibrator(copy.deepcopy(base), None, experts, data, show_progress=False).calibrate()
    assert not [w for w in caught if "numerically singular" in str(w.message)]
    # without a ridge only ε and round-off set it
    with pytest.warns(FeatCalWarning, match=r"self_attn\.q_proj.*numerically singular.*raise lambda_ratio"):
        FeatCalCalibrator(copy.deepcopy(base), None, experts, data, FeatCalConfig(lambda_ratio=0.0),
                          show_progress=False).calibrate()


def test_training_flag_and_device_are_restored(clip_setting):
    base, experts, merged, data = clip_setting
    merged.train()
    out = FeatCalCalibrator(merged, base, experts, data, show_progress=False, device="cpu").calibrate()
    assert out.training
    assert all(e.training is False for e in experts.values())


def test_expert_checkpoint_with_transformers4_key_prefix(clip_setting, tmp_path):
    """The public CLIP experts were saved by transformers 4.x with `vision_model.`-prefixed keys."""
    from safetensors.torch import save_file

    base, experts, merged, data = clip_setting
    folder = tmp_path / "old-expert"
    experts["dtd"].config.save_pretrained(folder)
    save_file(
        {f"vision_model.{k}": v.contiguous() for k, v in experts["dtd"].state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    FeatCalCalibrator(merged, base, {**experts, "dtd": str(folder)}, data, show_progress=False).calibrate()
    for (name, p), q in zip(merged.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_merged_calibrating_pass_stops_after_the_last_captured_input(clip_setting):
    """The student's forward through the uncalibrated block is cut after fc2's input is captured (its
    output would be recomputed by the propagation anyway): fc2 runs once per batch, not twice."""
    base, experts, merged, data = clip_setting
    calls = []
    handles = [layer.mlp.fc2.register_forward_hook(lambda m, a, o: calls.append(1)) for layer in merged.encoder.layers]
    FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(report_drift=False), show_progress=False).calibrate()
    for h in handles:
        h.remove()
    batches = sum(len(bs) for bs in data.values())
    # per block: the first batch runs whole (to learn the call order), then only the propagation; the
    # last block propagates nothing without the drift report (its student stream would feed nothing)
    assert len(calls) == (1 + batches) + 1
