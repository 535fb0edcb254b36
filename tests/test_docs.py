"""The docs' code blocks run, unchanged, against the offline stand-ins of `offline_hub.py`.

Every ```python block of README.md and docs/*.md is executed (the blocks of one file in order, in one
fresh interpreter, in a temporary working directory); a block that fails fails the test. Blocks that
are not meant to run (signatures, shell) use another fence language.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offline_hub import populate_offline_hub, write_open_clip_experts

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    env = dict(os.environ)
    env.update(populate_offline_hub(str(tmp_path_factory.mktemp("hf_home"))))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def test_the_docs_have_code_to_run():
    assert sum(len(python_blocks(p)) for p in DOC_FILES) >= 1


@pytest.mark.parametrize("path", [p for p in DOC_FILES if python_blocks(p)], ids=lambda p: p.name)
def test_doc_code_blocks_run(path, offline_env, tmp_path):
    if "import open_clip" in path.read_text(encoding="utf-8") and os.environ.get("HF_FEATCAL_REQUIRE_OPTIONAL") != "1":
        pytest.importorskip("open_clip")
    write_open_clip_experts(str(tmp_path))
    script = "import torch\ntorch.set_num_threads(1)\n" + "\n\n".join(python_blocks(path))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=offline_env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{path.name}:\n{result.stderr[-4000:]}"


def test_clip_example_runs_against_the_stand_ins(offline_env, tmp_path):
    """examples/clip_vit_b32_ta8.py — the paper's CLIP setting with real hub ids — unchanged, on two
    tasks and a few images."""
    script = ROOT / "examples" / "clip_vit_b32_ta8.py"
    result = subprocess.run(
        [sys.executable, str(script), "--tasks", "eurosat", "dtd", "--samples-per-task", "8",
         "--eval-max-samples", "8", "--output", str(tmp_path / "out")],
        cwd=tmp_path, env=offline_env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Task Arithmetic + FeatCal" in result.stdout
    assert (tmp_path / "out" / "featcal_drift_report.json").is_file()


def test_flan_t5_example_runs_against_the_stand_ins(offline_env, tmp_path):
    """examples/flan_t5_glue.py — the paper's FLAN-T5 GLUE setting with real hub ids — unchanged, on
    three tasks and a few examples."""
    script = ROOT / "examples" / "flan_t5_glue.py"
    result = subprocess.run(
        [sys.executable, str(script), "--tasks", "cola", "mnli", "stsb", "--samples-per-task", "8",
         "--eval-max-samples", "6", "--output", str(tmp_path / "out")],
        cwd=tmp_path, env=offline_env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Task Arithmetic + FeatCal" in result.stdout
    assert (tmp_path / "out" / "featcal_drift_report.json").is_file()
