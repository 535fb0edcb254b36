"""`hf_featcal._kernels.memory`: glibc keeps freed memory for reuse during a CPU run (resident memory
measured in a fresh process), hands it back afterwards, and results do not change. What it saves in
page faults and time is measured by `benchmarks/bench_clip.py` (minor page faults per run)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal._kernels import memory

needs_glibc = pytest.mark.skipif(not memory.available(), reason="not glibc")

# In a fresh process (glibc's adaptive thresholds untouched): the resident memory a 40 MB tensor
# leaves behind once touched and freed — outside, inside and after the context — and what the
# context's exit hands back. 40 MB is above glibc's adaptive ceiling of 32 MB, so by default such a
# block is mapped and unmapped (and faulted in again by the next one).
_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from hf_featcal._kernels.memory import reuse_freed_memory

    def resident_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    def kept_mb():
        before = resident_mb()
        x = torch.empty(10 * 2**20)
        x.fill_(1.0)
        del x
        return resident_mb() - before

    kept_mb()  # warm-up: torch's first operations load and allocate what they keep for the process
    result = {"default": kept_mb()}
    with reuse_freed_memory(sys.argv[1] == "on") as active:
        result["active"] = active
        result["inside"] = kept_mb()
        inside = resident_mb()
    result["handed_back"] = inside - resident_mb()
    result["after"] = kept_mb()
    with reuse_freed_memory(sys.argv[1] == "on"):
        with reuse_freed_memory(sys.argv[1] == "on"):
            pass
        result["after_inner_exit"] = kept_mb()  # the outer context's settings still hold
    print(json.dumps(result))
    """
)


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_freed_memory_is_kept_inside_and_handed_back_after():
    result = _probe("on")
    assert result["active"] is True
    assert result["default"] < 10  # handed back at once (and faulted in again by the next block)
    assert result["inside"] > 35  # kept in the heap for the next block
    assert result["handed_back"] > 35  # the exit hands what the run kept back
    assert result["after"] < 10  # blocks above 32 MB are handed back at once again
    assert result["after_inner_exit"] > 35


@needs_glibc
def test_disabled_changes_nothing():
    result = _probe("off")
    assert result["active"] is False
    assert result["inside"] < 10 and result["handed_back"] < 10


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="reuse_freed_cpu_memory must be a bool"):
        FeatCalConfig(reuse_freed_cpu_memory="yes")


@needs_glibc
@pytest.mark.parametrize("reuse", [True, False])
def test_calibrate_tunes_the_allocator_while_it_runs(clip_setting, reuse):
    """Every block forward of `calibrate()` runs inside the context with the option, none without;
    afterwards it is closed. (What the context does is measured in a fresh process above: in this
    one earlier tests have left the heap with holes that any block may reuse.)"""
    base, experts, merged, data = clip_setting
    seen = []
    model = copy.deepcopy(merged)
    model.encoder.layers[0].register_forward_pre_hook(lambda module, args: seen.append(memory.active()))
    calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(reuse_freed_cpu_memory=reuse),
                                   device="cpu")
    seen.clear()  # (the constructor's input checks forward a batch before the run)
    calibrator.calibrate()
    assert seen and set(seen) == {reuse}
    assert not memory.active()


@needs_glibc
def test_nested_contexts_reset_once():
    with memory.reuse_freed_memory() as outer:
        with memory.reuse_freed_memory() as inner:
            assert outer and inner and memory.active()
        assert memory.active()  # the inner exit left the outer's settings alone
        with memory.reuse_freed_memory(False) as disabled:
            assert disabled  # (still inside the outer one)
    assert not memory.active()


def test_results_are_the_same_bit_for_bit(clip_setting):
    base, experts, merged, data = clip_setting
    weights = []
    for reuse in (True, False):
        model = copy.deepcopy(merged)
        calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(reuse_freed_cpu_memory=reuse),
                                       device="cpu")
        weights.append({k: v.clone() for k, v in calibrator.calibrate().state_dict().items()})
    assert not torch.equal(weights[0]["encoder.layers.0.mlp.fc1.weight"],
                           merged.state_dict()["encoder.layers.0.mlp.fc1.weight"])
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


# In a fresh process: a 10 MB tensor taken from the heap (glibc's adaptive threshold raised above its
# size by an earlier, larger block) and freed below a small tensor that stays alive is a free hole
# under the heap's top, which glibc keeps resident; `release_freed_memory` hands it back.
_HOLE_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from hf_featcal._kernels.memory import release_freed_memory, reuse_freed_memory

    def resident_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    big = torch.empty(5 * 2**20); big.fill_(1.0); del big  # 20 MB, mapped: the threshold rises to it
    result = {}
    for mode in ("plain", "reusing"):
        hole = torch.empty(10 * 2**18); hole.fill_(1.0)  # 10 MB, now from the heap
        kept = torch.empty(2**18); kept.fill_(1.0)  # 1 MB above it, kept alive
        del hole
        before = resident_mb()
        if mode == "plain":
            result["released"] = release_freed_memory()
        else:
            with reuse_freed_memory():
                result["released_while_reusing"] = release_freed_memory()
        result[mode] = before - resident_mb()
        del kept
    print(json.dumps(result))
    """
)


@needs_glibc
def test_free_holes_in_the_heap_are_handed_back():
    out = subprocess.run([sys.executable, "-c", _HOLE_PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["released"] is True and result["plain"] > 8  # the hole's 10 MB left the resident set
    # while freed memory is kept for reuse on purpose, nothing is handed back
    assert result["released_while_reusing"] is False


def test_calibrate_hands_freed_memory_back_after_every_tasks_pass(clip_setting, monkeypatch):
    """After each task's pass over a block (capture, then propagation) the freed memory is handed
    back: twice per task and calibrated block."""
    from hf_featcal.pipeline import context

    base, experts, merged, data = clip_setting
    calls = []
    monkeypatch.setattr(context, "release_freed_memory", lambda: calls.append(1) or True)
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(), device="cpu")
    calibrator.calibrate()
    blocks = len(model.encoder.layers)
    assert len(calls) == 2 * blocks * len(experts)
