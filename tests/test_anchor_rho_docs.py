"""docs/merge-methods.md's ρ × merge tables ("FeatCal's anchor ρ after each merge") are what
benchmarks/anchor_rho_table.py renders from the stored rows of benchmarks/no_harm.py
(benchmarks/results/rho_*.json), and that rendering counts as a hand count of a small set of rows says."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "merge-methods.md"
RESULTS = ROOT / "benchmarks" / "results"


def _script():
    spec = importlib.util.spec_from_file_location("anchor_rho_table", ROOT / "benchmarks" / "anchor_rho_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(seed: int, merge: str, variant: str, a: float, b: float) -> dict:
    return {"seed": seed, "merge": merge, "variant": variant, "scores": {"a": a, "b": b, "mean": (a + b) / 2}}


def test_the_table_averages_over_seeds_and_counts_the_tasks_below_the_merge():
    rows = [
        _row(0, "ta", "merge", 80.0, 60.0), _row(0, "ta", "rho1", 79.0, 65.0), _row(0, "ta", "default", 82.0, 62.0),
        _row(1, "ta", "merge", 70.0, 50.0), _row(1, "ta", "rho1", 70.0, 49.0), _row(1, "ta", "default", 75.0, 51.0),
        # seed 2 lacks a variant: left out of the averages
        _row(2, "ta", "merge", 0.0, 0.0), _row(2, "ta", "rho1", 100.0, 100.0),
    ]
    lines = _script().table(rows).splitlines()
    assert lines[0] == "| merge | seeds | merge alone | rho1 | default |"
    # by hand: merge means 70, 60 → 65; rho1 72, 59.5 → 65.75 (+0.75); default 72, 63 → 67.5 (+2.5)
    # below the merge: rho1 seed 0 a (79 < 80), seed 1 b (49 < 50); default none; equal is not below
    assert lines[2] == "| `ta` | 0, 1 | 65.0 | 65.8 (+0.8); 2/4 ↓ | **67.5 (+2.5); 0/4 ↓** |"


def _generated(name: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name}: begin -->\n(.*?)\n<!-- {name}: end -->", text, flags=re.DOTALL)
    assert match, f"docs/merge-methods.md has no generated block {name}"
    return match.group(1)


def _files(scenario: str) -> list[str]:
    """The stored rows in the documented order (merges as the docs' command lists them)."""
    command = next(line for line in DOC.read_text(encoding="utf-8").splitlines()
                   if line.startswith("python benchmarks/anchor_rho_table.py") and f"rho_{scenario}" in line)
    return [str(ROOT / path) for path in command.split()[2:]]


def test_the_docs_tables_are_the_stored_rows():
    script = _script()
    for scenario in ("digits", "minilm"):
        files = _files(scenario)
        assert files and all(Path(f).is_file() for f in files), files
        assert _generated(f"anchor-rho-{scenario}") == script.table(script.load(files)), scenario
