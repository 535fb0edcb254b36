"""A checkpoint's fingerprint ignores the config fields that only say where things are kept
(`restore_snapshot`, `stream_placement`): a resume with other values of them continues the run and
gives the uninterrupted result; a resume with another value of a field that changes results is refused."""

from __future__ import annotations

import pytest
import torch

from hf_featcal import FeatCalConfig
from test_resume import _run


def test_resume_accepts_other_placements_and_refuses_another_lambda(clip_setting, tmp_path, monkeypatch):
    base, experts, merged, data = clip_setting
    expected, reference, _ = _run(merged, base, experts, data, monkeypatch=monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # block 1 of 2 finished, with the default placements
        _run(merged, base, experts, data, tmp_path, config=FeatCalConfig(), interrupt_at=2, monkeypatch=monkeypatch)

    with pytest.raises(ValueError, match=r"`checkpoint_dir` .* holds a checkpoint of a different run"):
        _run(merged, base, experts, data, tmp_path, config=FeatCalConfig(lambda_ratio=0.1), monkeypatch=monkeypatch)

    moved = FeatCalConfig(restore_snapshot="disk", stream_placement="cpu")
    resumed, calibrator, calls = _run(merged, base, experts, data, tmp_path, config=moved, monkeypatch=monkeypatch)
    assert calls == [(0, 1)]  # only the second block was calibrated: the checkpoint was accepted
    for (name, p), q in zip(resumed.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert calibrator.report.to_dict() == reference.report.to_dict()
