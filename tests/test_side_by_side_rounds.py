"""benchmarks/side_by_side_demo.py: its summary over several rounds and its check of --rounds (the timings
themselves, and the authors' demo, which CI does not have, are the benchmark's business, never a test's)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "side_by_side_demo.py")


def _load():
    spec = importlib.util.spec_from_file_location("side_by_side_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


side_by_side = _load()


def _round(demo_s: float, ours_s: float, demo_gib: float, ours_gib: float) -> dict:
    return {"demo": {"seconds": demo_s, "peak_rss_gib": demo_gib},
            "hf_featcal": {"seconds": ours_s, "peak_rss_gib": ours_gib}}


def test_the_summary_takes_medians_and_per_round_extremes():
    rounds = [_round(200.0, 130.0, 5.0, 2.0), _round(214.0, 128.0, 5.2, 2.5), _round(206.0, 125.0, 4.8, 2.1)]
    over = side_by_side.rounds_summary(rounds)
    assert over["demo_seconds_median"] == 206.0 and over["featcal_seconds_median"] == 128.0
    assert (over["demo_seconds_min"], over["demo_seconds_max"]) == (200.0, 214.0)
    assert (over["featcal_seconds_min"], over["featcal_seconds_max"]) == (125.0, 130.0)
    # the ratio of the medians, not the median of the ratios (206 / 128, while the middle ratio is 206 / 125)
    assert over["speed_up_of_medians"] == pytest.approx(206.0 / 128.0)
    assert over["speed_up_min"] == pytest.approx(200.0 / 130.0)
    assert over["speed_up_max"] == pytest.approx(214.0 / 128.0)
    assert over["memory_ratio_of_medians"] == pytest.approx(5.0 / 2.1)
    assert over["memory_ratio_min"] == pytest.approx(5.2 / 2.5)
    assert over["memory_ratio_max"] == pytest.approx(5.0 / 2.0)


def test_an_even_number_of_rounds_takes_the_middle_two():
    over = side_by_side.rounds_summary([_round(200.0, 120.0, 5.0, 2.0), _round(210.0, 130.0, 5.0, 2.0)])
    assert over["demo_seconds_median"] == 205.0 and over["featcal_seconds_median"] == 125.0
    assert over["speed_up_of_medians"] == pytest.approx(205.0 / 125.0)


def test_no_round_is_refused_by_name_before_any_work(tmp_path):
    workdir = tmp_path / "work"
    done = subprocess.run([sys.executable, SCRIPT, "--rounds", "0", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--rounds" in done.stderr and "got 0" in done.stderr
    assert not workdir.exists()  # no models written
