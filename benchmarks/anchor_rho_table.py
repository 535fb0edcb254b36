"""The ρ × merge table of docs/merge-methods.md ("FeatCal's anchor after each merge") from the JSON rows
`benchmarks/no_harm.py --output` writes, one file or several (e.g. one per merge):

    python benchmarks/anchor_rho_table.py benchmarks/results/rho_digits.json
    python benchmarks/anchor_rho_table.py benchmarks/results/rho_minilm_*.json

Per merge and variant: the mean test accuracy over tasks, averaged over the seeds that have every variant
of that merge (in brackets its change from the merge alone), and how many (seed, task) pairs fell below the
merge alone, out of how many. The best mean of each row is in bold.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            rows.extend(json.load(handle))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    by_merge: dict[str, dict[tuple[int, str], dict[str, float]]] = defaultdict(dict)
    for row in rows:
        by_merge[row["merge"]][(row["seed"], row["variant"])] = row["scores"]
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "merge"))
    lines = ["| merge | seeds | merge alone | " + " | ".join(variants) + " |",
             "|---|---|---:|" + "---:|" * len(variants)]
    for merge, cells in by_merge.items():
        seeds = sorted(s for s in {s for s, _ in cells} if all((s, v) in cells for v in ["merge", *variants]))
        if not seeds:
            continue
        tasks = [t for t in cells[(seeds[0], "merge")] if t != "mean"]

        def mean(variant: str, cells: dict = cells, seeds: list = seeds) -> float:
            return sum(cells[(s, variant)]["mean"] for s in seeds) / len(seeds)

        def below(variant: str, cells: dict = cells, seeds: list = seeds, tasks: list = tasks) -> int:
            return sum(cells[(s, variant)][t] < cells[(s, "merge")][t] for s in seeds for t in tasks)

        best = max(variants, key=mean)
        shown, pairs = [], len(seeds) * len(tasks)
        for variant in variants:
            text = f"{mean(variant):.1f} ({mean(variant) - mean('merge'):+.1f}); {below(variant)}/{pairs} ↓"
            shown.append(f"**{text}**" if variant == best else text)
        lines.append(f"| `{merge}` | {', '.join(map(str, seeds))} | {mean('merge'):.1f} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="JSON files of benchmarks/no_harm.py --output")
    print(table(load(parser.parse_args().paths)))


if __name__ == "__main__":
    main()
