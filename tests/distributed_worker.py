"""Run by `torchrun --nproc_per_node N` from test_distributed.py: calibrate the shared tiny CLIP (or
open_clip) setting with the same user code as on one process; the main process saves the result. Given
task weights (JSON, a third argument), each process then calibrates another copy of the merge with them
and keeps its result in `rank<r>.weighted.pt` (one launch for both runs)."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import as_float64, build_clip_setting


def main(output: str, family: str = "clip", task_weights: str | None = None) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if family == "open_clip":
        from openclip_models import open_clip_setting

        base, experts, merged, data = open_clip_setting(torch.Generator().manual_seed(0), batch_sizes=(4, 3, 5, 2, 4))
    else:
        base, experts, merged, data = build_clip_setting(torch.Generator().manual_seed(0), (4, 3, 5, 2, 4))
    base, experts, merged, data = as_float64(base, experts, merged, data)
    given = copy.deepcopy(merged)
    # "clip_guard": the held-out guard (test_heldout_guard.py), every process must pick the same γs
    config = (FeatCalConfig(compute_dtype="float64", heldout_fraction=0.4, guard="minimax") if family == "clip_guard"
              else FeatCalConfig(compute_dtype="float64"))
    calibrator = FeatCalCalibrator(merged, base, experts, data, config, show_progress=False)
    local_batches = {task: len(sizes) for task, sizes in calibrator.batch_sizes.items()}
    calibrator.calibrate()
    calibrator.save_model(output)  # writes on the main process only
    # the rank files go beside the finished save (into a folder holding anything but an earlier save, a
    # save is refused)
    calibrator.state.wait_for_everyone()
    rank = calibrator.state.process_index
    os.makedirs(output, exist_ok=True)  # save_model creates it on the main process only
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    state["local_batches"] = local_batches
    state["num_processes"] = calibrator.state.num_processes
    state["guard_log"] = calibrator.guard_log
    torch.save(state, os.path.join(output, f"rank{rank}.pt"))
    if task_weights is not None:
        config = FeatCalConfig(compute_dtype="float64", task_weights=json.loads(task_weights))
        FeatCalCalibrator(given, base, experts, data, config, show_progress=False).calibrate()
        torch.save(given.state_dict(), os.path.join(output, f"rank{rank}.weighted.pt"))
    # a clean end of a multi-process script: no rank exits while gloo's threads still serve the others
    calibrator.state.wait_for_everyone()
    calibrator.state.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
