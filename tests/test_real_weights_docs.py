"""README.md and docs/real-weights.md state the real-weights grid's standing as a stored run says it
(docs/real-weights-grid.json, comparison.json of `hf-featcal compare --demo --real-weights`): their generated
parts are benchmarks/real_weights_grid.py's rendering of that JSON, and its counts are the JSON's, counted
here by hand on a small grid."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "docs" / "real-weights-grid.json"
DOCS = ["README.md", "docs/real-weights.md"]


def _script():
    spec = importlib.util.spec_from_file_location("real_weights_grid", ROOT / "benchmarks" / "real_weights_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(mean: float, **tasks: float) -> dict:
    return {**tasks, "mean": mean}


#: Three merges; means chosen so that FeatCal raises two and lowers one, SVC beats FeatCal after one, ties
#: after one, trails after none; after FeatCal `a` falls on `wudi`, `b` on `ties` and `wudi`; `wudi+svc` failed.
GRID = {
    "tasks": ["a", "b"],
    "scores": {
        "experts": _row(90.0, a=90.0, b=90.0),
        "ta": _row(70.0, a=70.0, b=70.0),
        "ta+featcal": _row(72.04, a=73.0, b=71.08),
        "ta+featcal_module": _row(72.0, a=72.0, b=72.0),
        "ta+svc": _row(73.0, a=73.0, b=73.0),
        "ties": _row(60.0, a=60.0, b=60.0),
        "ties+featcal": _row(63.0, a=66.0, b=59.9),
        "ties+featcal_module": _row(61.0, a=61.0, b=61.0),
        "ties+svc": _row(62.96, a=62.96, b=62.96),
        "wudi": _row(80.0, a=80.0, b=80.0),
        "wudi+featcal": _row(79.0, a=79.0, b=79.0),
        "wudi+featcal_module": _row(79.5, a=79.5, b=79.5),
    },
    "drift": {},
    "errors": {"wudi+svc": "RuntimeError: out of memory"},
    "seconds": {},
}


def test_the_standing_counts_a_hand_made_grid():
    script = _script()
    text = " ".join(script.standing_sentences(GRID))
    # by hand: FeatCal 72.0 / 63.0 / 79.0 against 70.0 / 60.0 / 80.0
    assert "FeatCal raised the mean test accuracy after 2 of the 3 merges (+2.0 to +3.0 points)" in text
    assert "lowered it after 1 (wudi −1.0)" in text
    # SVC 73.0 vs 72.0 (above), 63.0 vs 63.0 (level at 0.1 point), wudi+svc failed (not counted)
    assert "SVC scored above FeatCal after 1 of the 3 merges (ta +1.0 points), below it after 0, level after 1 (ties)" \
        in text
    assert "`a` after 1 of the 3 merges; `b` after 2 of the 3 merges" in text
    table = script.standing_table(GRID)
    assert "| ta | 70.0 | 72.0 (+2.0) | 72.0 (+2.0) | 73.0 (+3.0) | svc |" in table
    assert "| ties | 60.0 | 63.0 (+3.0) | 61.0 (+1.0) | 63.0 (+3.0) | featcal = svc |" in table
    assert "| wudi | 80.0 | 79.0 (−1.0) | 79.5 (−0.5) | failed | none |" in table
    assert "| ties+featcal | 66.0 | 59.9 ↓ |" in script.per_task_table(GRID)
    assert "| ta+featcal | 73.0 | 71.1 |" in script.per_task_table(GRID)


@pytest.mark.parametrize("doc", DOCS)
def test_each_doc_has_one_generated_block_and_no_hand_count(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    _script().generated(text)  # exactly one begin/end pair
    assert "five of the six merges" not in text


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_generated_part_is_what_the_stored_run_gives(doc):
    if not STORED.is_file():
        pytest.skip("docs/real-weights-grid.json is not stored yet: the docs say so in the generated block")
    script = _script()
    grid = json.loads(STORED.read_text(encoding="utf-8"))
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert script.generated(text) == script.DOCS[ROOT / doc](grid).strip(), (
        f"{doc} is stale: python benchmarks/real_weights_grid.py --write")
    merges = script.merges_of(grid)
    svc_above = sum(round(grid["scores"][f"{m}+svc"]["mean"], 1) > round(grid["scores"][f"{m}+featcal"]["mean"], 1)
                    for m in merges if f"{m}+svc" in grid["scores"] and f"{m}+featcal" in grid["scores"])
    assert f"SVC scored above FeatCal after {svc_above} of the {len(merges)} merges" in text
