"""Two CPU processes (gloo) give the single-process result; only the main process writes files.

Both sides run in float64, so the results must agree to 1e-9: the sharded sums, reduced across
processes, add the same terms in another order."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import as_float64, build_clip_setting, launch_two_processes

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


def _run_two_processes(out, family: str, *extra: str) -> None:
    result = launch_two_processes(WORKER, str(out), family, *extra)
    assert result.returncode == 0, result.stderr[-3000:]


def _rank_states(out) -> list[dict]:
    states = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    # each process really took a disjoint shard (5 batches: 3 + 2) and the sums were reduced
    assert [s.pop("num_processes") for s in states] == [2, 2]
    assert [s.pop("local_batches") for s in states] == [{"cars": 3, "dtd": 3}, {"cars": 2, "dtd": 2}]
    return states


def _assert_same_model(states: list[dict], ref: dict) -> None:
    for name, value in ref.items():
        for state in states:  # every process ends with the same calibrated model
            diff = float((state[name].double() - value.double()).norm())
            assert diff <= 1e-9 * max(float(value.double().norm()), 1e-12), name


def test_two_processes_match_one(tmp_path):
    """Also with task weights: they multiply each task's sums after the cross-process reduction, so
    two processes give the single-process weighted model (which is not the unweighted one)."""
    weights = {"cars": 3.0}
    out = tmp_path / "dist"
    _run_two_processes(out, "clip", json.dumps(weights))

    torch.manual_seed(0)
    base, experts, merged, data = as_float64(*build_clip_setting(torch.Generator().manual_seed(0), (4, 3, 5, 2, 4)))
    weighted = copy.deepcopy(merged)
    FeatCalCalibrator(weighted, base, experts, data, FeatCalConfig(compute_dtype="float64", task_weights=weights),
                      show_progress=False).calibrate()
    weighted_states = [torch.load(out / f"rank{r}.weighted.pt") for r in (0, 1)]
    _assert_same_model(weighted_states, weighted.state_dict())
    single = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(compute_dtype="float64"), show_progress=False)
    single.calibrate()
    ref = merged.state_dict()
    states = _rank_states(out)
    _assert_same_model(states, ref)
    assert any(not torch.equal(states[0][k], base.state_dict()[k]) for k in ref)
    assert any(not torch.equal(weighted_states[0][k], ref[k]) for k in ref)

    report = json.loads((out / "featcal_drift_report.json").read_text())
    for task, stages in single.report.to_dict()["tasks"].items():
        for stage, values in stages.items():
            assert torch.allclose(torch.tensor(report["tasks"][task][stage]), torch.tensor(values), rtol=1e-9)
    # one folder, written once: the model card counts every example, not one shard
    card = (out / "README.md").read_text()
    assert "cars: 18" in card


def test_two_processes_match_one_open_clip(tmp_path):
    """The same for an open_clip CLIP (packed projections, out_proj capture, saved the open_clip way)."""
    if os.environ.get("HF_FEATCAL_REQUIRE_OPTIONAL") != "1":
        pytest.importorskip("open_clip")
    from openclip_models import open_clip_setting

    out = tmp_path / "dist"
    _run_two_processes(out, "open_clip")
    torch.manual_seed(0)
    base, experts, merged, data = as_float64(*open_clip_setting(torch.Generator().manual_seed(0),
                                                                batch_sizes=(4, 3, 5, 2, 4)))
    FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(compute_dtype="float64"),
                      show_progress=False).calibrate()
    states = _rank_states(out)
    _assert_same_model(states, merged.state_dict())
    assert any(not torch.equal(states[0][k], base.state_dict()[k]) for k in base.state_dict())
    assert (out / "open_clip_model.safetensors").is_file()
