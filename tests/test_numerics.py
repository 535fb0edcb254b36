"""Robust numerics: low-precision models, dead inputs, rank-deficient Grams, extreme scales."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalWarning
from hf_featcal.solver import solve_linear_weight
from hf_featcal.statistics import LinearGroupStatistics, LinearTargets
from reference_featcal import reference_featcal


def _all_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# half a unit in the last place of bfloat16's 8-bit significand: the relative error of storing a value in bf16
BF16_ROUNDING = 2.0**-9


def test_bfloat16_model_end_to_end(clip_setting):
    """A bf16 model, bf16 experts and bf16 data: the calibrated bf16 weights are the float64 reference's
    (computed from the same values upcast to float64) up to bf16 precision.

    Tolerance: storing the float64 solution in bf16 alone costs up to 2^-9 relative per element (RMS
    1.8e-3 over the block weights here); the bf16 forwards that produce the features add errors of the
    same order (measured 1.5-2.2e-3 per kind of parameter over three seeds). 3·2^-9 = 5.9e-3 leaves room
    for other CPUs' bf16 kernels, and stays far below a wrong implementation: ignoring α (x_t = x_e) is
    ~0.15 away, uniform last-block token weights ~0.04, even α = 0.3 instead of 0.25 ~0.010, a bias
    anchored at the merged bias ~0.13 (on the biases).
    """
    base, experts, merged, data = clip_setting
    bf = lambda m: copy.deepcopy(m).to(torch.bfloat16)  # noqa: E731
    merged16, base16, experts16 = bf(merged), bf(base), {t: bf(e) for t, e in experts.items()}
    data16 = {t: [{"pixel_values": b["pixel_values"].to(torch.bfloat16)} for b in bs] for t, bs in data.items()}
    given = {k: v.clone() for k, v in merged16.state_dict().items()}
    pixels = {t: [b["pixel_values"] for b in bs] for t, bs in data16.items()}
    expected = reference_featcal(merged16, base16, experts16, pixels)[0].state_dict()  # float64 of the bf16 values
    calibrator = FeatCalCalibrator(merged16, base16, experts16, data16, show_progress=False)
    calibrator.calibrate()
    assert all(p.dtype == torch.bfloat16 for p in merged16.parameters())
    got = merged16.state_dict()
    blocks = [k for k in given if k.startswith("encoder.layers.")]
    assert all(torch.equal(got[k], given[k]) for k in given if k not in blocks)
    # per kind of parameter, so that a wrong bias (small next to the weights) cannot hide in a total
    groups = {
        kind: [
            k for k in blocks if isinstance(merged16.get_submodule(k.rsplit(".", 1)[0]), module) and k.endswith(attr)
        ]
        for kind, module, attr in [
            ("Linear weights", torch.nn.Linear, "weight"),
            ("Linear biases", torch.nn.Linear, "bias"),
            ("LayerNorm affines", torch.nn.LayerNorm, ""),
        ]
    }
    assert sum(map(len, groups.values())) == len(blocks)

    def relative_errors(weights: dict) -> dict:
        return {
            kind: (sum(float((weights[k].double() - expected[k]).square().sum()) for k in keys)
                   / sum(float(expected[k].square().sum()) for k in keys)) ** 0.5
            for kind, keys in groups.items()
        }

    tolerance = 3 * BF16_ROUNDING
    errors = relative_errors(got)
    assert all(e <= tolerance for e in errors.values()), errors
    # the tolerance separates right from wrong: the reference itself with α ignored lies far outside it
    alpha_ignored = relative_errors(reference_featcal(merged16, base16, experts16, pixels, alpha=1.0)[0].state_dict())
    assert alpha_ignored["Linear weights"] > 10 * tolerance, alpha_ignored
    for stages in calibrator.report.tasks.values():
        assert stages["after"][-1] < stages["before"][-1]


def _kill_fc1_unit(models, unit: int = 3) -> None:
    """fc1 unit `unit` outputs 0 everywhere (QuickGELU(0) = 0): fc2's input dimension `unit` is dead."""
    for model in models:
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.mlp.fc1.weight[unit].zero_()
                layer.mlp.fc1.bias[unit] = 0.0


def test_dead_input_dimension(clip_setting):
    base, experts, merged, data = clip_setting
    _kill_fc1_unit([base, merged, *experts.values()])
    anchor_col = [
        (
            base.encoder.layers[i].mlp.fc2.weight[:, 3]
            + 2.2 * (merged.encoder.layers[i].mlp.fc2.weight[:, 3] - base.encoder.layers[i].mlp.fc2.weight[:, 3])
        ).clone()
        for i in range(2)
    ]
    with pytest.warns(FeatCalWarning, match=r"mlp\.fc2.*(numerically singular|weighted tokens)"):
        FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    assert _all_finite(merged)
    for i, layer in enumerate(merged.encoder.layers):
        # no data on that input: the ridge sets the column, (λ+ε)·w = λ·A
        torch.testing.assert_close(layer.mlp.fc2.weight[:, 3], anchor_col[i] * 0.05 / (0.05 + 1e-8), rtol=1e-5,
                                   atol=1e-6)


def test_dead_input_without_ridge_stays_finite(clip_setting):
    """λ = 0 and a dead input: only ε holds that direction, and the data say nothing there, so fc2's
    column is exactly 0 ((0 + ε)·w = 0); everything else is the float64 reference's ridge-free solution."""
    base, experts, merged, data = clip_setting
    _kill_fc1_unit([base, merged, *experts.values()])
    expected = reference_featcal(merged, base, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()},
                                 lam=0.0)[0]
    with pytest.warns(FeatCalWarning):
        FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(lambda_ratio=0.0), show_progress=False).calibrate()
    assert _all_finite(merged)
    for layer in merged.encoder.layers:  # the anchor's column reaches 0.14-0.28: a ridge term left in shows at once
        torch.testing.assert_close(layer.mlp.fc2.weight[:, 3], torch.zeros(layer.mlp.fc2.weight.shape[0]), rtol=0,
                                   atol=1e-6)
    ref = dict(expected.named_parameters())
    num = sum(float((p.detach().double() - ref[n].detach()).square().sum()) for n, p in merged.named_parameters())
    den = sum(float(v.detach().square().sum()) for v in ref.values())
    # float32 against float64 without a ridge: measured 6e-5 to 8e-4 over three seeds
    assert (num / den) ** 0.5 < 1e-2, (num / den) ** 0.5


def test_duplicated_inputs_rank_deficient_gram(clip_setting, generator):
    """8 copies of one image and λ = 0: each Gram has rank ≤ 5 per task, so only W·x on the data's span is
    determined. There the first block's Linears give the float64 reference's outputs (the later blocks
    read features that depend on the undetermined directions, and are not compared)."""
    base, experts, merged, _ = clip_setting
    one = torch.randn(1, 3, 8, 8, generator=generator)
    data = {t: [{"pixel_values": one.repeat(8, 1, 1, 1)}] for t in experts}  # 8 copies: Gram rank ≤ 5
    given = copy.deepcopy(merged)
    expected = reference_featcal(merged, base, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()},
                                 lam=0.0)[0]
    with pytest.warns(FeatCalWarning, match="numerically singular"):
        calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(lambda_ratio=0.0),
                                       show_progress=False)
        calibrator.calibrate()
    assert _all_finite(merged)
    inputs = {}  # every Linear's input in the first block (the same for library and reference: the given block's)
    block = given.encoder.layers[0]
    handles = [
        m.register_forward_pre_hook(
            lambda mod, args, _n=n: inputs.__setitem__(_n, args[0].reshape(-1, args[0].shape[-1]).double())
        )
        for n, m in block.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        given(pixel_values=one)
    for handle in handles:
        handle.remove()
    assert len(inputs) == 6
    for name, x in inputs.items():
        weight = lambda model, name=name: model.encoder.layers[0].get_submodule(name).weight.detach().double()  # noqa: E731
        step = float(((weight(expected) - weight(given)) @ x.T).norm())
        # measured ≤ 1e-4 of the step over three seeds; α ignored gives ~2
        assert float(((weight(merged) - weight(expected)) @ x.T).norm()) <= 1e-3 * step, name


def test_extreme_feature_scales_are_equalised(generator):
    """Two tasks whose features differ by 1e9 in scale: s_i puts them on an equal footing, and the
    float32 solve stays finite and close to float64."""
    d, out = 8, 5
    results = {}
    for dtype in (torch.float32, torch.float64):
        stats = LinearGroupStatistics(("m",), d, dtype=dtype, device=torch.device("cpu"), epsilon=1e-8)
        gen = torch.Generator().manual_seed(1)
        for scale in (1e-4, 1e5):
            x = scale * torch.randn(200, d, generator=gen, dtype=torch.float64)
            w_i = torch.randn(out, d, generator=gen, dtype=torch.float64)
            stats.accumulate(x.to(dtype), x.to(dtype), torch.ones(200, dtype=dtype))
            stats.finish_task({"m": LinearTargets(w_i.to(dtype), None)})
        weight, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], torch.zeros(out, d, dtype=dtype), 0.05,
                                        1e-8)
        results[dtype] = weight.double()
        assert bool(torch.isfinite(weight).all())
        assert stats.task_scales[0] / stats.task_scales[1] == pytest.approx(1e18, rel=0.5)
    rel = float((results[torch.float32] - results[torch.float64]).norm() / results[torch.float64].norm())
    assert rel < 1e-5


# fc1 scaled 50× moves what one head reads: the warning is expected here
@pytest.mark.filterwarnings("ignore:what the head reads moved away:hf_featcal.pipeline.context.FeatCalWarning")
def test_large_activations_match_the_reference(clip_setting):
    base, experts, merged, data = clip_setting
    for model in [base, merged, *experts.values()]:
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.mlp.fc1.weight.mul_(50.0)  # fc2 inputs ~50× larger than the rest
    expected, _ = reference_featcal(merged, base, experts,
                                    {t: [b["pixel_values"] for b in bs] for t, bs in data.items()})
    FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    ref = dict(expected.named_parameters())
    num = sum(float((p.detach().double() - ref[n].detach()).square().sum()) for n, p in merged.named_parameters())
    den = sum(float(v.detach().square().sum()) for v in ref.values())
    assert (num / den) ** 0.5 < 1e-5


@pytest.mark.parametrize("placement", ["accelerator", "cpu", "pinned_cpu"])
def test_stream_placement_decides_where_streams_wait(clip_setting, placement):
    """Parked streams wait on the compute device ('accelerator') or on the CPU ('cpu', 'pinned_cpu'),
    and are fetched back onto the compute device. The meta device stands in for an accelerator as the
    compute device, so this can fail on a CPU-only machine (the calibrator is only built, never run)."""
    from hf_featcal.pipeline.streams import StreamBatch

    base, experts, merged, data = clip_setting
    config = FeatCalConfig(stream_placement=placement)
    calibrator = FeatCalCalibrator(merged, base, experts, data, config, device="cpu", show_progress=False)
    calibrator.device = torch.device(
        "meta"
    )  # the library refuses 'meta' as an argument; here it only moves stream batches
    state = StreamBatch(torch.randn(2, 5, 16), (torch.ones(2, 1, 5, 5),), {"mask": torch.ones(2, 5)},
                        torch.ones(2, 5), {"encoder_weights": torch.ones(2, 3)})

    def devices(batch):
        return {batch.hidden.device.type, batch.args[0].device.type, batch.kwargs["mask"].device.type,
                batch.weights.device.type, batch.extras["encoder_weights"].device.type}

    parked = calibrator.context.park(state)
    assert devices(parked) == ({"meta"} if placement == "accelerator" else {"cpu"})
    if placement != "accelerator":
        # page-locked only where there is a GPU to copy to; the values are the stream's own
        assert parked.hidden.is_pinned() == (placement == "pinned_cpu" and torch.cuda.is_available())
        assert torch.equal(parked.hidden, state.hidden) and torch.equal(parked.weights, state.weights)
    assert devices(calibrator.context.fetch(parked)) == {"meta"}


def test_stream_batches_move_every_tensor():
    from hf_featcal.pipeline.streams import StreamBatch

    state = StreamBatch(torch.ones(2, 3, 4), (torch.ones(2), None, [torch.ones(1)]), {"mask": torch.ones(2)},
                        torch.ones(2, 3), {"encoder_weights": torch.ones(2, 5)})
    moved = state.to("meta")
    assert moved.hidden.is_meta and moved.args[0].is_meta and moved.args[1] is None and moved.args[2][0].is_meta
    assert moved.kwargs["mask"].is_meta and moved.weights.is_meta and moved.extras["encoder_weights"].is_meta
