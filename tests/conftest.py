"""Shared fixtures and session settings. The builders the fixtures use live in testing_utils.py, which
test files import (never this module: pytest loads it on its own terms)."""

from __future__ import annotations

import os
import tempfile

# Tests never reach the hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from testing_utils import build_clip_setting

# Tiny models: one thread avoids oversubscription on small matmuls (and CI machines are 2-core).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """transformers initialises weights from the global RNG: make every test deterministic."""
    torch.manual_seed(0)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def clip_setting(generator):
    """A base CLIPVisionModel, two experts, their task-arithmetic merge and calibration batches."""
    return build_clip_setting(generator)


@pytest.fixture
def snapshot_tmpdir(tmp_path, monkeypatch):
    """TMPDIR (and tempfile's cached choice of it) set to an empty folder of the test's own."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return folder
