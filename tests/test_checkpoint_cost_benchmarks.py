"""benchmarks/fingerprint_cost.py and benchmarks/checkpoint_digest_cost.py run against today's library (they
time library functions by name, so a renamed one breaks them) and put those functions back afterwards. At
their smallest size; the timings themselves are the benchmarks' business, never a test's."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import hf_featcal.calibrator as calibrator_module
import hf_featcal.checkpointing as checkpointing
from hf_featcal.pipeline.checkpoint import open_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALLEST = ["--layers", "1", "--hidden", "64", "--samples", "2", "--threads", "1"]


def _run_benchmark(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *SMALLEST])
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:  # the benchmark sets the process's thread count and seed
        module.main()
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fingerprint_cost_runs_and_restores_the_timed_functions(monkeypatch, capsys):
    digest, folder = checkpointing.DigestBuilder.add_all, open_checkpoint
    out = _run_benchmark("fingerprint_cost", monkeypatch, capsys)
    for label in ("in-memory experts", "experts as folders"):
        assert f"{label}: fingerprint " in out and "run digest" in out
    assert checkpointing.DigestBuilder.add_all is digest and calibrator_module.open_checkpoint is folder


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_digest_cost_runs_and_restores_the_timed_functions(monkeypatch, capsys):
    block_digest, streams_digest = checkpointing.file_digest, checkpointing._streams_digest
    out = _run_benchmark("checkpoint_digest_cost", monkeypatch, capsys)
    assert "run: " in out and "resume of the finished checkpoint: " in out and "block-00001.safetensors" in out
    assert checkpointing.file_digest is block_digest and checkpointing._streams_digest is streams_digest
