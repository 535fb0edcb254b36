"""Count the package's import structure: every import of one hf_featcal module by another — at the top
level, inside functions and under ``TYPE_CHECKING`` alike, since a lazy import is still a dependency —
and the import circles (strongly connected groups of modules) they form.

    python scripts/import_graph.py                 # edges, circles, largest files; exit 1 on a circle
    python scripts/import_graph.py --baseline F    # exit 1 only on a circle edge not listed in F
    python scripts/import_graph.py --write-baseline F

CI runs it with the baseline of the circles known on 2026-12-03 (issue "One house without circles"
removes them and then the baseline): a change that adds an edge to a circle fails.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "hf_featcal"

#: The package's floors, bottom first: a module may import modules of its own floor or below, never above.
#: Patterns match the dotted name without ``hf_featcal.``; the first floor with a matching pattern wins.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations: numerics, CPU kernels, settings, stream records, torch-free declarations", (
        "_kernels", "_kernels.*", "solver", "statistics", "config", "parameters", "devices", "interrupts", "data",
        "hub", "checkpointing", "restore", "hooks", "progress", "pipeline", "pipeline.streams", "merging.params",
        "merging.registry", "post_merging.registry", "cost", "evaluation._datasets", "evaluation.clip_templates",
        "evaluation.glue_metric*", "evaluation.results",
    )),
    ("architectures: the layer maps", ("architectures", "architectures.*")),
    ("checkpoints and model sources", ("model_io", "saving", "experts", "processing")),
    ("calibration stages, drift report, evaluation",
     ("pipeline.*", "report", "plotting", "evaluation", "evaluation.*", "post_merging.corrections",
      "post_merging.representation", "post_merging.task_modules", "post_merging.surgery")),
    ("the library: calibrator, merging, search", (
        "", "calibrator", "merging", "merging.*", "post_merging", "post_merging.*", "regmean", "hparam_search",
        "tuning",
    )),
    ("recipe declarations and scenarios", ("schema", "recipes.spec", "scenarios", "scenarios.*")),
    ("model families (recipe keys, processing, evaluation, saving per family)", ("families", "families.*")),
    ("the runners: recipes, compare, CLI", ("recipes", "recipes.*", "compare", "cli", "cli.*", "__main__")),
]


def floor_of(name: str) -> int | None:
    """The index in `FLOORS` of module `name` (dotted, with the package prefix); None if no floor names it."""
    short = name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + ".") else ("" if name == PACKAGE else name)
    for index, (_, patterns) in enumerate(FLOORS):
        if any(fnmatch.fnmatchcase(short, pattern) for pattern in patterns):
            return index
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges from a module to one on a higher floor."""
    return sorted(
        (a, b) for a, targets in graph.items() for b in targets
        if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a)  # type: ignore[operator]
    )


def module_names(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    names = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute dotted name of a (possibly relative) `from ... import` base."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports_submodule_by_name(node: ast.AST) -> bool:
    """A call `importlib.import_module(<relative name>, __name__)`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Name)
        and node.args[1].id == "__name__"
    )


def _lazy_module_strings(tree: ast.Module, call: ast.Call) -> list[str]:
    """String constants that can name a module for a package's lazy loader: those of module-level
    assignments (tuples, lists, dict values) and a constant first argument of the call."""
    texts = []
    for statement in tree.body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
            value = statement.value
            items = value.values if isinstance(value, ast.Dict) else getattr(value, "elts", [])
            texts += [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        texts.append(first.value)
    return [text for text in texts if text.replace(".", "").isidentifier()]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif is_package and _imports_submodule_by_name(node):
            # `importlib.import_module(name, __name__)` in a package's lazy loader: it depends on the
            # modules it names in module-level string constants (`_LAYER_MAP_MODULES`, a name -> module
            # table) and in the call itself; a submodule reached only as an attribute (`pkg.families`) is
            # a dependency of whoever names it, not of the package
            candidates = [_resolve(name, True, 1, text.lstrip(".")) for text in _lazy_module_strings(tree, node)]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:  # `import a.b.c` of a name inside a module
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith(PACKAGE) and candidate != name:
                targets.add(candidate)
    return targets


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; groups of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def circle_edges(graph: dict[str, set[str]], groups: Iterable[list[str]]) -> set[tuple[str, str]]:
    """The edges that lie inside a circle (both ends in one strongly connected group)."""
    edges = set()
    for group in groups:
        members = set(group)
        edges |= {(a, b) for a in group for b in graph[a] if b in members}
    return edges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--largest", type=int, default=8, help="how many of the largest files to list")
    args = parser.parse_args(argv)

    names = module_names(Path(args.src))
    known = set(names)
    graph = {name: imports_of(name, path, known) for name, path in names.items()}
    groups = strongly_connected(graph)
    edges = circle_edges(graph, groups)
    upward = upward_imports(graph)
    unplaced = sorted(name for name in names if floor_of(name) is None)

    print(f"{len(names)} modules, {sum(map(len, graph.values()))} import edges, {len(groups)} circle(s), "
          f"{len(upward)} upward import(s)")
    for group in groups:
        print(f"  circle of {len(group)}: {', '.join(group)}")
    for a, b in sorted(edges):
        print(f"  in a circle: {a} -> {b}")
    for a, b in upward:
        print(f"  upward: {a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})")
    for name in unplaced:
        print(f"  on no floor: {name} (add it to FLOORS in {Path(__file__).name})")
    sizes = sorted(((len(path.read_text().splitlines()), name) for name, path in names.items()), reverse=True)
    print("largest files: " + ", ".join(f"{name} {lines}" for lines, name in sizes[: args.largest]))
    return 1 if groups or upward or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
