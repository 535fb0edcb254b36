"""The drift report on a bounded sample (`FeatCalConfig.drift_samples_per_task`): the calibrated weights
do not depend on it, the report's values are those of full-model forwards on the sampled examples, and
the merged-as-given stream runs on the sample alone."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_featcal import DriftReport, FeatCalCalibrator, FeatCalConfig
from testing_utils import build_clip_setting

BATCH_SIZES = (5, 5, 3)  # 13 examples per task


def _calibrated(setting, config: FeatCalConfig, **kwargs):
    base, experts, merged, data = setting
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, config, show_progress=False, **kwargs)
    calibrator.calibrate()
    return model, calibrator


def _documented_sample(sizes: tuple[int, ...], limit: int, seed: int) -> list[tuple[int, int]]:
    """The rule the config field states: whole batches in the order of `torch.randperm` seeded with
    `seed`, the last one cut to its first examples; (batch, examples) in batch order."""
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, used = [], 0
    for b in order:
        if used == limit:
            break
        take = min(sizes[b], limit - used)
        chosen.append((b, take))
        used += take
    return sorted(chosen)


def _independent_drift(merged, expert, pixels) -> list[float]:
    """Σ‖h_m − h_e‖ / N at every block output, from each full model's own forward on `pixels`."""
    with torch.no_grad():
        hm = merged(pixel_values=pixels, output_hidden_states=True).hidden_states
        he = expert(pixel_values=pixels, output_hidden_states=True).hidden_states
    tokens = hm[0].shape[0] * hm[0].shape[1]
    return [float((hm[i + 1].double() - he[i + 1].double()).norm(dim=-1).sum() / tokens)
            for i in range(merged.config.num_hidden_layers)]


@pytest.mark.parametrize("layers", [None, [0]], ids=["every block", "last block unchanged"])
def test_weights_bit_identical_with_report_off_on_and_any_sample(generator, layers):
    setting = build_clip_setting(generator, BATCH_SIZES)
    reference, _ = _calibrated(setting, FeatCalConfig(report_drift=False, layers_to_transform=layers))
    for limit in (None, 1, 7, 32):
        config = FeatCalConfig(drift_samples_per_task=limit, layers_to_transform=layers)
        model, calibrator = _calibrated(setting, config)
        assert calibrator.report is not None
        got, want = model.state_dict(), reference.state_dict()
        assert got.keys() == want.keys()
        different = [name for name in want if not torch.equal(got[name], want[name])]
        assert not different, (limit, different)


@pytest.mark.parametrize("layers", [None, [0]], ids=["every block", "last block unchanged"])
def test_sampled_report_is_full_model_drift_on_the_sampled_examples(generator, layers):
    setting = build_clip_setting(generator, BATCH_SIZES)
    base, experts, merged, data = setting
    config = FeatCalConfig(drift_samples_per_task=7, seed=3, layers_to_transform=layers)
    model, calibrator = _calibrated(setting, config)
    sample = _documented_sample(BATCH_SIZES, 7, 3)
    assert any(take < BATCH_SIZES[b] for b, take in sample)  # a cut batch is among them
    report = calibrator.report.to_dict()
    assert report["sample"] == {"examples_per_task": {"cars": 7, "dtd": 7},
                                "calibration_examples_per_task": {"cars": 13, "dtd": 13},
                                "drift_samples_per_task": 7, "seed": 3}
    for task, expert in experts.items():
        pixels = torch.cat([data[task][b]["pixel_values"][:take] for b, take in sample])
        stages = report["tasks"][task]
        assert stages["before"] == pytest.approx(_independent_drift(merged, expert, pixels), rel=1e-5)
        assert stages["after"] == pytest.approx(_independent_drift(model, expert, pixels), rel=1e-5)
    # the report says what it measured, and so does the model card that carries it
    assert "cars: 7 of 13" in calibrator.report.summary_markdown()
    assert "cars: 7 of 13" in str(calibrator.create_model_card())
    assert DriftReport.from_dict(report).sample == report["sample"]


def test_report_on_every_example_unchanged_by_a_large_bound(generator):
    setting = build_clip_setting(generator, BATCH_SIZES)
    _, everything = _calibrated(setting, FeatCalConfig(drift_samples_per_task=None))
    _, bounded = _calibrated(setting, FeatCalConfig(drift_samples_per_task=13))
    assert bounded.report.tasks == everything.report.tasks
    assert "Measured on every calibration example." in bounded.report.summary_markdown()


def _through_blocks(setting, config: FeatCalConfig, before_calibrating=lambda calibrator: None):
    """Per merged block: the rows of the forwards that ran to its end, and how many forwards began;
    then the calibrated model and its calibrator. `before_calibrating` gets the calibrator once built."""
    base, experts, merged, data = setting
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, config, show_progress=False)
    rows, begun = [0] * len(model.encoder.layers), [0] * len(model.encoder.layers)

    def ended(i, args):
        rows[i] += args[0].shape[0]

    def began(i):
        begun[i] += 1

    handles = [
        handle
        for i, layer in enumerate(model.encoder.layers)
        for handle in (
            layer.register_forward_hook(lambda _m, args, _out, i=i: ended(i, args)),
            layer.register_forward_pre_hook(lambda _m, _args, i=i: began(i)),
        )
    ]
    before_calibrating(calibrator)
    calibrator.calibrate()
    for handle in handles:
        handle.remove()
    return rows, begun, model, calibrator


def test_merged_as_given_stream_runs_on_the_sample_only(generator):
    """Rows through each merged block, forwards run to the block's end (the capture pass stops inside
    it): with the report on, the sample's examples run once more through every block as given, except
    in the first calibrated block, where the merged-as-given stream is still the student's: there the
    capture pass's student forwards of the sampled whole batches run to the block's end and give it,
    and only a cut batch's rows run again. The last block propagates the sampled batches only (with the
    report off, no student stream leaves it)."""
    setting = build_clip_setting(generator, BATCH_SIZES)
    base, experts, merged, data = setting

    def through_blocks(config: FeatCalConfig) -> tuple[list[int], list[int]]:
        return _through_blocks(setting, config)[:2]

    total = sum(BATCH_SIZES) * len(experts)
    off, off_begun = through_blocks(FeatCalConfig(report_drift=False))
    # the capture pass's first batch runs to the end (the last captured module is learnt from it); then
    # block 0: the propagation; the last block: nothing (its student stream would feed nothing)
    first = BATCH_SIZES[0]
    assert off == [first + total, first]
    sample = _documented_sample(BATCH_SIZES, 7, 42)
    sampled = 7 * len(experts)
    sampled_batches = sum(BATCH_SIZES[b] for b, _ in sample) * len(experts)
    cut = [(b, take) for b, take in sample if take < BATCH_SIZES[b]]
    assert cut and len(cut) < len(sample)  # the sample has a whole batch and a cut one
    first_is_sampled_whole = (0, first) in sample  # it runs to the end in the capture pass either way
    on, on_begun = through_blocks(FeatCalConfig(drift_samples_per_task=7))
    assert on == [off[0] + sampled - (first if first_is_sampled_whole else 0), off[1] + sampled + sampled_batches]
    # block 0 begins a forward of its own for the cut batches only; the last block two for every sampled
    # batch (the merged-as-given one and the propagation)
    assert on_begun == [off_begun[0] + len(cut) * len(experts), off_begun[1] + 2 * len(sample) * len(experts)]


def test_streams_entered_at_construction_are_moved_with_the_model(generator):
    """A model moved between construction and `calibrate()`: the streams that entered the first stack
    while the calibrator was built are moved where streams now wait, a merged-as-given batch that was
    the student's staying one object with it (the first block then takes it from the capture pass, as
    without the move), and the weights and the report are those of a run without the move. (On this
    CPU-only machine the move is simulated: the calibrator is told its streams entered on another
    device, so every stream batch is re-parked.)"""
    setting = build_clip_setting(generator, BATCH_SIZES)
    config = FeatCalConfig(drift_samples_per_task=7)
    rows, begun, model, calibrator = _through_blocks(setting, config)
    moved = []

    def entered_elsewhere(calibrator):
        calibrator._entered_device = torch.device("meta")
        take, context = calibrator._take_entered_streams, calibrator.context

        def taking():  # the stream batches parked while the entered streams are taken
            context.park = lambda state: moved.append(state) or type(context).park(context, state)
            try:
                return take()
            finally:
                del context.park

        calibrator._take_entered_streams = taking

    moved_rows, moved_begun, moved_model, moved_calibrator = _through_blocks(setting, config, entered_elsewhere)
    # every student and expert batch of both tasks once, and of the merged-as-given ones only the cut batch,
    # the only one that is not a student batch
    cut = [(b, take) for b, take in _documented_sample(BATCH_SIZES, 7, 42) if take < BATCH_SIZES[b]]
    tasks = len(setting[1])
    assert len(moved) == 2 * len(BATCH_SIZES) * tasks + len(cut) * tasks
    assert (moved_rows, moved_begun) == (rows, begun)  # no merged-as-given forward of block 0 for a whole batch
    got, want = moved_model.state_dict(), model.state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert moved_calibrator.report.tasks == calibrator.report.tasks


def test_bad_drift_samples_per_task_is_refused():
    for bad in (0, -3, 2.5, True, "32"):
        with pytest.raises(ValueError, match="drift_samples_per_task must be a positive integer or None"):
            FeatCalConfig(drift_samples_per_task=bad)
