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


def test_bfloat16_model_end_to_end(clip_setting):
    base, experts, merged, data = clip_setting
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    bf = lambda m: copy.deepcopy(m).to(torch.bfloat16)  # noqa: E731
    merged16 = bf(merged)
    data16 = {t: [{"pixel_values": b["pixel_values"].to(torch.bfloat16)} for b in bs] for t, bs in data.items()}
    calibrator = FeatCalCalibrator(merged16, bf(base), {t: bf(e) for t, e in experts.items()}, data16, show_progress=False)
    calibrator.calibrate()
    assert all(p.dtype == torch.bfloat16 for p in merged16.parameters())
    assert _all_finite(merged16)
    for task, stages in calibrator.report.tasks.items():
        assert stages["after"][-1] < stages["before"][-1]
    # statistics accumulate in float32: the bf16 result is the float32 one up to bf16 resolution
    ref = dict(reference.named_parameters())
    num = sum(float((p.double() - ref[n].double()).square().sum()) for n, p in merged16.named_parameters())
    den = sum(float(p.double().square().sum()) for p in ref.values())
    assert (num / den) ** 0.5 < 3e-2


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
        (base.encoder.layers[i].mlp.fc2.weight[:, 3] + 2.2 * (merged.encoder.layers[i].mlp.fc2.weight[:, 3] - base.encoder.layers[i].mlp.fc2.weight[:, 3])).clone()
        for i in range(2)
    ]
    with pytest.warns(FeatCalWarning, match=r"mlp\.fc2.*(numerically singular|weighted tokens)"):
        FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    assert _all_finite(merged)
    for i, layer in enumerate(merged.encoder.layers):
        # no data on that input: the ridge sets the column, (λ+ε)·w = λ·A
        torch.testing.assert_close(layer.mlp.fc2.weight[:, 3], anchor_col[i] * 0.05 / (0.05 + 1e-8), rtol=1e-5, atol=1e-6)


def test_dead_input_without_ridge_stays_finite(clip_setting):
    base, experts, merged, data = clip_setting
    _kill_fc1_unit([base, merged, *experts.values()])
    with pytest.warns(FeatCalWarning):
        FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(lambda_ratio=0.0), show_progress=False).calibrate()
    assert _all_finite(merged)


def test_duplicated_inputs_rank_deficient_gram(clip_setting, generator):
    base, experts, merged, _ = clip_setting
    one = torch.randn(1, 3, 8, 8, generator=generator)
    data = {t: [{"pixel_values": one.repeat(8, 1, 1, 1)}] for t in experts}  # 8 copies: Gram rank ≤ 5
    with pytest.warns(FeatCalWarning, match="numerically singular"):
        calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(lambda_ratio=0.0), show_progress=False)
        calibrator.calibrate()
    assert _all_finite(merged)


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
        weight, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], torch.zeros(out, d, dtype=dtype), 0.05, 1e-8)
        results[dtype] = weight.double()
        assert bool(torch.isfinite(weight).all())
        assert stats.task_scales[0] / stats.task_scales[1] == pytest.approx(1e18, rel=0.5)
    rel = float((results[torch.float32] - results[torch.float64]).norm() / results[torch.float64].norm())
    assert rel < 1e-5


def test_large_activations_match_the_reference(clip_setting):
    base, experts, merged, data = clip_setting
    for model in [base, merged, *experts.values()]:
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.mlp.fc1.weight.mul_(50.0)  # fc2 inputs ~50× larger than the rest
    expected, _ = reference_featcal(merged, base, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()})
    FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    ref = dict(expected.named_parameters())
    num = sum(float((p.double() - ref[n]).square().sum()) for n, p in merged.named_parameters())
    den = sum(float(v.square().sum()) for v in ref.values())
    assert (num / den) ** 0.5 < 1e-5


def test_stream_placement_does_not_change_results(clip_setting):
    base, experts, merged, data = clip_setting
    results = []
    for placement in ("accelerator", "cpu", "pinned_cpu"):
        model = copy.deepcopy(merged)
        calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(stream_placement=placement), show_progress=False)
        calibrator.calibrate()
        results.append((model, calibrator.report.to_dict()))
    for model, report in results[1:]:
        assert report == results[0][1]
        for p, q in zip(model.parameters(), results[0][0].parameters()):
            assert torch.equal(p, q)


def test_stream_batches_move_every_tensor():
    from hf_featcal.streams import StreamBatch

    state = StreamBatch(torch.ones(2, 3, 4), (torch.ones(2), None, [torch.ones(1)]), {"mask": torch.ones(2)},
                        torch.ones(2, 3), {"encoder_weights": torch.ones(2, 5)})
    moved = state.to("meta")
    assert moved.hidden.is_meta and moved.args[0].is_meta and moved.args[1] is None and moved.args[2][0].is_meta
    assert moved.kwargs["mask"].is_meta and moved.weights.is_meta and moved.extras["encoder_weights"].is_meta
