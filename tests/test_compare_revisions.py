"""benchmarks/compare_revisions.py: the library source it exports per revision and its round summary
(timings themselves are the benchmark's business, never a test's)."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("compare_revisions",
                                                  os.path.join(ROOT, "benchmarks", "compare_revisions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_revisions = _load()
needs_git = pytest.mark.skipif(
    subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="not a git checkout",
)


def _run(seconds: float, rss: float) -> dict:
    return {"seconds_total": seconds, "peak_rss_gib": rss, "seconds_per_stage": {"statistics": seconds / 2}}


def test_summary_ratios_are_before_over_after():
    result = compare_revisions.summary([(_run(60.0, 2.3), _run(48.0, 2.2)), (_run(70.0, 2.4), _run(50.0, 2.2))])
    assert [r["ratio"] for r in result["rounds"]] == pytest.approx([1.25, 1.4])
    assert result["ratio_mean"] == pytest.approx(1.325)
    assert result["ratio_min"] == pytest.approx(1.25)
    assert result["ratio_max"] == pytest.approx(1.4)
    assert result["rounds"][0]["before_rss_gib"] == 2.3 and result["rounds"][0]["after_rss_gib"] == 2.2


def test_working_tree_is_this_checkouts_src(tmp_path):
    assert compare_revisions.library_source(".", str(tmp_path)) == os.path.join(ROOT, "src")
    assert os.listdir(tmp_path) == []  # nothing exported for the working tree


@needs_git
def test_a_revision_is_exported_with_its_own_library(tmp_path):
    source = compare_revisions.library_source("HEAD", str(tmp_path))
    assert source.startswith(str(tmp_path))
    committed = subprocess.run(["git", "-C", ROOT, "show", "HEAD:src/hf_featcal/solver.py"], capture_output=True,
                               text=True, check=True)
    with open(os.path.join(source, "hf_featcal", "solver.py"), encoding="utf-8") as handle:
        assert handle.read() == committed.stdout


@needs_git
def test_an_unknown_revision_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no-such-revision"):
        compare_revisions.library_source("no-such-revision", str(tmp_path))


def test_cpu_halves_split_this_process_cpus_evenly():
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        with pytest.raises(SystemExit, match="at least 2 CPUs"):
            compare_revisions.cpu_halves()
        return
    first, second = compare_revisions.cpu_halves()
    assert first and len(first) == len(second) == len(cpus) // 2
    assert not first & second and first | second <= cpus


# a stand-in for bench_clip.py: its arguments name the environment variables it reports
_REPORTER = """
import json, os, sys, time
time.sleep(1.0)  # run one after the other, the three would start at least a second apart
end = sys.argv.index("--output")
with open(sys.argv[end + 1], "w") as handle:
    json.dump([{"cpus": sorted(os.sched_getaffinity(0)), "threads": [os.environ.get(v) for v in sys.argv[1:end]],
                "path": os.environ["PYTHONPATH"], "start": time.time()}], handle)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_paired_runs_are_pinned_to_their_halves_with_matching_threads(tmp_path):
    script = tmp_path / "reporter.py"
    script.write_text(_REPORTER)
    first, second = compare_revisions.cpu_halves()
    names = list(compare_revisions.THREAD_VARIABLES)
    a, b, free = compare_revisions.measure_together(
        [("source-a", first), ("source-b", second), ("source-c", None)], names, script=str(script)
    )
    assert a["cpus"] == sorted(first) and b["cpus"] == sorted(second)
    assert a["threads"] == b["threads"] == [str(len(first))] * len(names)
    assert free["cpus"] == sorted(os.sched_getaffinity(0))  # not pinned: this process's CPUs
    assert (a["path"], b["path"], free["path"]) == ("source-a", "source-b", "source-c")
    assert max(r["start"] for r in (a, b, free)) - min(r["start"] for r in (a, b, free)) < 1.0  # started together


def test_a_failed_run_is_reported_with_its_script(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(SystemExit, match=r"fails\.py with the library from src-x failed \(exit status 3\)"):
        compare_revisions.measure_together([("src-x", None)], [], script=str(script))
