"""Two CPU processes (gloo) give the single-process result; only the main process writes files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

from conftest import build_clip_setting
from hf_featcal import FeatCalCalibrator, FeatCalConfig

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    out = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), WORKER, str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    torch.manual_seed(0)
    base, experts, merged, data = build_clip_setting(torch.Generator().manual_seed(0), (4, 3, 5, 2, 4))
    single = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(), show_progress=False)
    single.calibrate()
    ref = merged.state_dict()
    states = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    # each process really took a disjoint shard (5 batches: 3 + 2) and the sums were reduced
    assert [s.pop("num_processes") for s in states] == [2, 2]
    assert [s.pop("local_batches") for s in states] == [{"cars": 3, "dtd": 3}, {"cars": 2, "dtd": 2}]
    for name, value in ref.items():
        for state in states:  # every process ends with the same calibrated model
            diff = float((state[name].double() - value.double()).norm())
            assert diff <= 1e-5 * max(float(value.double().norm()), 1e-12), name
    assert any(not torch.equal(states[0][k], base.state_dict()[k]) for k in ref)

    report = json.loads((out / "featcal_drift_report.json").read_text())
    for task, stages in single.report.to_dict()["tasks"].items():
        for stage, values in stages.items():
            assert torch.allclose(torch.tensor(report["tasks"][task][stage]), torch.tensor(values), rtol=1e-5)
    # one folder, written once: the model card counts every example, not one shard
    card = (out / "README.md").read_text()
    assert "cars: 18" in card
