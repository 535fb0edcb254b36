"""Run by `torchrun --nproc_per_node 2` from test_granularity.py: a module-granular calibration of
the shared tiny CLIP setting (float64), each process saving the model it ends with."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_featcal import FeatCalCalibrator, FeatCalConfig
from testing_utils import as_float64, build_clip_setting


def main(output: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, experts, merged, data = as_float64(*build_clip_setting(torch.Generator().manual_seed(0), (4, 3, 5, 2, 4)))
    config = FeatCalConfig(compute_dtype="float64", granularity="module")
    calibrator = FeatCalCalibrator(merged, base, experts, data, config, show_progress=False)
    local_batches = {task: len(sizes) for task, sizes in calibrator.batch_sizes.items()}
    calibrator.calibrate()
    os.makedirs(output, exist_ok=True)
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    state["local_batches"] = local_batches
    torch.save(state, os.path.join(output, f"rank{calibrator.state.process_index}.pt"))
    calibrator.state.wait_for_everyone()
    calibrator.state.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
