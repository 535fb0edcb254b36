"""`import hf_featcal` is cheap: the public names resolve on first use, heavy libraries load only then."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hf_featcal

HEAVY = ("torch", "transformers", "datasets", "torchvision", "scipy", "pandas", "accelerate", "safetensors")


def _fresh(code: str) -> dict:
    """Run `code` (which prints one JSON line) in a fresh interpreter and return what it printed."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_loads_no_heavy_library():
    loaded = _fresh(f"import json, sys, hf_featcal; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    assert loaded == []


def test_a_public_name_loads_what_it_needs_on_first_use():
    code = (
        "import json, sys, hf_featcal\n"
        "before = 'hf_featcal.config' in sys.modules\n"
        "config = hf_featcal.FeatCalConfig\n"
        "print(json.dumps([before, 'hf_featcal.config' in sys.modules, config.__module__]))"
    )
    assert _fresh(code) == [False, True, "hf_featcal.config"]


def test_public_names_are_the_submodules_objects():
    from hf_featcal.architectures import get_layer_map, supported_model_types
    from hf_featcal.calibrator import FeatCalCalibrator, FeatCalError
    from hf_featcal.config import FeatCalConfig
    from hf_featcal.report import DriftReport

    assert hf_featcal.FeatCalCalibrator is FeatCalCalibrator and hf_featcal.FeatCalError is FeatCalError
    assert hf_featcal.FeatCalConfig is FeatCalConfig and hf_featcal.DriftReport is DriftReport
    assert hf_featcal.get_layer_map is get_layer_map and hf_featcal.supported_model_types is supported_model_types
    namespace: dict = {}
    exec("from hf_featcal import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(hf_featcal.__all__)
    assert set(hf_featcal.__all__) <= set(dir(hf_featcal))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'FeatCalibrator'"):
        hf_featcal.FeatCalibrator  # noqa: B018
    with pytest.raises(ImportError):
        exec("from hf_featcal import FeatCalibrator", {})
