"""What a run holds at once: a stream is held twice for one task at a time while a block's outputs
replace its inputs, and the calibration batches are let go once the streams have entered the last stack."""

from __future__ import annotations

import copy
import weakref

import pytest

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.pipeline.context import RunContext
from testing_utils import build_clip_setting

BATCH_SIZES = (5, 5, 3)


def test_a_block_replaces_its_streams_one_task_at_a_time(generator, monkeypatch):
    """The most stream batches alive at once (counted at every `park`, where each new one is made):
    the student and expert streams of every task, plus one task's new batches of one of them."""
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    alive: list[weakref.ref] = []
    most = [0]
    park = RunContext.park

    def counting_park(self, state):
        parked = park(self, state)
        alive.append(weakref.ref(parked.hidden))
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        return parked

    monkeypatch.setattr(RunContext, "park", counting_park)
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(report_drift=False), show_progress=False)
    calibrator.calibrate()
    per_task = len(BATCH_SIZES)
    # two streams of every task, and one task's batches made while that task's entering ones are alive
    # (the whole stream twice, as before, would be 2 · 2 · 2 · 3 = 24)
    assert most[0] == 2 * len(experts) * per_task + per_task


def test_calibration_batches_let_go_and_a_stopped_run_refuses_a_second_try(generator, monkeypatch):
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    given = {task: list(batches) for task, batches in data.items()}
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, show_progress=False)
    assert [len(b) for b in calibrator.batches.values()] == [3, 3]

    def fail(*args, **kwargs):
        raise RuntimeError("fault injected")

    monkeypatch.setattr(calibrator, "_solve_and_write", fail)
    with pytest.raises(RuntimeError, match="fault injected"):
        calibrator.calibrate()
    assert calibrator.batches == {"cars": [], "dtd": []}  # released by the streams' entry into the stack
    assert all(data[task] == given[task] for task in data)  # the caller's own lists are untouched
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="build a new FeatCalCalibrator"):
        calibrator.calibrate()
    FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, show_progress=False).calibrate()
