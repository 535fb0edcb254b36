"""The real-weights grid's standing, written from the run's own JSON into README.md and docs/real-weights.md.

`hf-featcal compare --demo --real-weights` writes comparison.json (every merge × none / FeatCal / FeatCal
module-granular / SVC, test accuracy in %). Its copy lives in docs/real-weights-grid.json; this script
renders from it the paragraph of README.md and the section of docs/real-weights.md between the markers
``<!-- real-weights-grid: begin -->`` and ``<!-- real-weights-grid: end -->``, so no count in them is
written by hand. tests/test_real_weights_docs.py fails when the docs differ from what the JSON gives.

    hf-featcal compare --demo --real-weights --cache-dir /tmp/rwgrid/cache --output-dir /tmp/rwgrid/grid
    cp /tmp/rwgrid/grid/comparison.json docs/real-weights-grid.json
    python benchmarks/real_weights_grid.py --write        # rewrite both docs' generated parts

Means and per-task scores are compared as the tables show them, to 0.1 point: two steps that show the
same mean are a tie.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GRID_JSON = ROOT / "docs" / "real-weights-grid.json"
BEGIN, END = "<!-- real-weights-grid: begin -->", "<!-- real-weights-grid: end -->"
#: The post-merging steps, in the table's order, and how the text names them.
STEPS = {"featcal": "FeatCal", "featcal_module": "FeatCal module-granular", "svc": "SVC"}


def shown(value: float) -> float:
    """A score as the tables show it (0.1 point)."""
    return round(value, 1)


def merges_of(grid: dict[str, Any]) -> list[str]:
    """The merges of the grid, in its order: rows without a "+" (the experts' row aside)."""
    rows = [*grid["scores"], *grid["errors"]]
    return [row for row in dict.fromkeys(rows) if "+" not in row and row != "experts"]


def mean(grid: dict[str, Any], row: str) -> float | None:
    """The row's mean as shown, None for a row that failed or was not run."""
    scores = grid["scores"].get(row)
    return None if scores is None else shown(scores["mean"])


def signed(value: float) -> str:
    return f"{value:+.1f}".replace("-", "−")


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return signed(low) if low == high else f"{signed(low)} to {signed(high)}"


def _names(rows: list[tuple[str, float]]) -> str:
    return ", ".join(f"{merge} {signed(delta)}" for merge, delta in rows)


def step_effects(grid: dict[str, Any], step: str) -> tuple[list[tuple[str, float]], list[tuple[str, float]], list[str]]:
    """(merges the step raised, merges it lowered, merges where it left the mean as shown), with the change."""
    raised, lowered, level = [], [], []
    for merge in merges_of(grid):
        before, after = mean(grid, merge), mean(grid, f"{merge}+{step}")
        if before is None or after is None:
            continue
        delta = shown(after - before)
        (raised if delta > 0 else lowered if delta < 0 else level).append((merge, delta))
    return raised, lowered, [merge for merge, _ in level]


def svc_against_featcal(grid: dict[str, Any]) -> tuple[list[tuple[str, float]], list[tuple[str, float]], list[str]]:
    """(merges after which SVC's mean is above FeatCal's, those where it is below, ties), with SVC − FeatCal."""
    above, below, ties = [], [], []
    for merge in merges_of(grid):
        svc, featcal = mean(grid, f"{merge}+svc"), mean(grid, f"{merge}+featcal")
        if svc is None or featcal is None:
            continue
        delta = shown(svc - featcal)
        if delta > 0:
            above.append((merge, delta))
        elif delta < 0:
            below.append((merge, delta))
        else:
            ties.append(merge)
    return above, below, ties


def best_step(grid: dict[str, Any], merge: str) -> str:
    """The name(s) of the highest mean after `merge`: "none" (the merge alone) or a step."""
    candidates = {"none": mean(grid, merge), **{step: mean(grid, f"{merge}+{step}") for step in STEPS}}
    ran = {name: value for name, value in candidates.items() if value is not None}
    top = max(ran.values())
    return " = ".join(name for name, value in ran.items() if value == top)


def fallen_tasks(grid: dict[str, Any], step: str) -> dict[str, list[str]]:
    """Task → the merges after which `step` lowered that task's score (as shown)."""
    fallen: dict[str, list[str]] = {task: [] for task in grid["tasks"]}
    for merge in merges_of(grid):
        before, after = grid["scores"].get(merge), grid["scores"].get(f"{merge}+{step}")
        if before is None or after is None:
            continue
        for task in grid["tasks"]:
            if shown(after[task]) < shown(before[task]):
                fallen[task].append(merge)
    return fallen


def standing_sentences(grid: dict[str, Any]) -> list[str]:
    """The standing, one sentence per claim, every count taken from `grid`."""
    total = len(merges_of(grid))
    raised, lowered, level = step_effects(grid, "featcal")
    text = [f"FeatCal raised the mean test accuracy after {len(raised)} of the {total} merges "
            f"({_span([d for _, d in raised])} points)" if raised else
            f"FeatCal raised the mean test accuracy after none of the {total} merges"]
    if lowered:
        text[-1] += f" and lowered it after {len(lowered)} ({_names(lowered)})"
    if level:
        text[-1] += f"; it left it level after {', '.join(level)}"
    text[-1] += "."
    module_raised, _, _ = step_effects(grid, "featcal_module")
    svc_raised, svc_lowered, _ = step_effects(grid, "svc")
    text.append(f"FeatCal module-granular raised it after {len(module_raised)} of the {total}; the data-free SVC "
                f"after {len(svc_raised)} of the {total}" + (f" (lowered after {len(svc_lowered)})." if svc_lowered
                                                              else "."))
    above, below, ties = svc_against_featcal(grid)
    sentence = f"SVC scored above FeatCal after {len(above)} of the {total} merges"
    if above:
        sentence += f" ({_names(above)} points)"
    sentence += f", below it after {len(below)}"
    if below:
        sentence += f" ({_names(below)})"
    if ties:
        sentence += f", level after {len(ties)} ({', '.join(ties)})"
    text.append(sentence + ".")
    fallen = {task: merges for task, merges in fallen_tasks(grid, "featcal").items() if merges}
    if fallen:
        text.append("After FeatCal a task fell while the mean moved: " + "; ".join(
            f"`{task}` after {len(merges)} of the {total} merges" for task, merges in fallen.items()) + ".")
    return text


def standing_table(grid: dict[str, Any]) -> str:
    """One row per merge: its mean, then each step's mean and change, and the best row."""
    header = ["merge", "merge alone", *STEPS.values(), "best"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
    for merge in merges_of(grid):
        before = mean(grid, merge)
        cells = [merge, "failed" if before is None else f"{before:.1f}"]
        for step in STEPS:
            after = mean(grid, f"{merge}+{step}")
            if after is None:
                cells.append("failed" if f"{merge}+{step}" in grid["errors"] else "–")
            else:
                cells.append(f"{after:.1f}" + ("" if before is None else f" ({signed(shown(after - before))})"))
        cells.append("–" if before is None else best_step(grid, merge))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_task_table(grid: dict[str, Any]) -> str:
    """Every row of the grid, per task (as comparison.md, without the seconds); a task score below the
    merge's own after a step is marked ↓."""
    tasks = grid["tasks"]
    lines = ["|  | " + " | ".join(tasks) + " | mean | last-block drift |", "|---|" + "---:|" * (len(tasks) + 2)]
    for row in [*grid["scores"], *(r for r in grid["errors"] if r not in grid["scores"])]:
        if row in grid["errors"]:
            lines.append(f"| {row} | failed |" + " |" * (len(tasks) + 1))
            continue
        scores, merge = grid["scores"][row], grid["scores"].get(row.split("+")[0])
        cells = []
        for task in tasks:
            fell = "+" in row and merge is not None and shown(scores[task]) < shown(merge[task])
            cells.append(f"{scores[task]:.1f}" + (" ↓" if fell else ""))
        drift = grid["drift"].get(row)
        cells += [f"{scores['mean']:.1f}", f"{sum(drift.values()) / len(drift):.3g}" if drift else ""]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_block(grid: dict[str, Any]) -> str:
    experts = grid["scores"]["experts"]["mean"]
    return (f"On the default scenario (four tasks, experts fine-tuned for 100 steps: mean {experts:.1f}; seed 0; "
            f"{len(merges_of(grid))} merges × none / FeatCal / FeatCal module-granular / SVC): "
            + " ".join(standing_sentences(grid)))


def docs_block(grid: dict[str, Any]) -> str:
    return "\n\n".join([
        "Mean test accuracy in % after each merge and each post-merging step (in brackets: the change from the "
        "merge alone; best: the highest mean of the row):",
        standing_table(grid),
        "\n".join(f"- {sentence}" for sentence in standing_sentences(grid)),
        "Every row, per task (↓: below the merge alone on that task):",
        per_task_table(grid),
    ])


def generated(text: str) -> str:
    """The part of `text` between the markers (stripped); ValueError without exactly one pair."""
    found = re.findall(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if len(found) != 1:
        raise ValueError(f"expected one {BEGIN} … {END} block, found {len(found)}")
    return found[0].strip()


def replace_generated(text: str, block: str) -> str:
    generated(text)  # exactly one block
    return re.sub(re.escape(BEGIN) + r"\n.*?\n" + re.escape(END), lambda _: f"{BEGIN}\n{block}\n{END}", text,
                  flags=re.S)


DOCS = {ROOT / "README.md": readme_block, ROOT / "docs" / "real-weights.md": docs_block}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(GRID_JSON), help="the grid's comparison.json")
    parser.add_argument("--write", action="store_true", help="rewrite the generated parts of the docs")
    args = parser.parse_args()
    grid = json.loads(Path(args.json).read_text(encoding="utf-8"))
    for path, render in DOCS.items():
        block = render(grid)
        if args.write:
            path.write_text(replace_generated(path.read_text(encoding="utf-8"), block), encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            print(f"--- {path.relative_to(ROOT)}\n{block}\n")


if __name__ == "__main__":
    main()
