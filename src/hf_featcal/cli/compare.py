"""``hf-featcal compare``: merge methods × post-merging steps in one table (``--demo`` or a recipe)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ._common import (
    DEFAULT_CACHE_DIR,
    DEVICE_HELP,
    FORMATTER,
    PROG,
    CLIError,
    ProgressBars,
    add_common,
    check_device,
    check_output_dir,
    default_output_dir,
    log,
    positive_int,
    quiet_warnings,
)
from .demo import REAL_WEIGHTS_HELP, demo_scenario

_COMPARE_EPILOG = """\
examples:
  hf-featcal compare --demo
  hf-featcal compare --demo --merges task_arithmetic ties regmean --post-merging none featcal
  hf-featcal compare --demo --real-weights            # the grid on the real MiniLM (see hf-featcal demo --help)
  hf-featcal compare examples/recipes/clip_vit_b32_ta8.yaml --output-dir clip-compare --device cuda
  hf-featcal compare --demo --merges task_arithmetic --samples 8,32,128   # + sample_efficiency.png
  hf-featcal compare --demo --post-merging none featcal surgery --step-parameter surgery.steps=200

Runs every merge method ({methods}; each computed once)
and then every post-merging step on it:
{steps}
scores each result per task (the demo: test accuracy; a recipe: its family's evaluation, e.g. CLIP
zero-shot top-1 or GLUE; a result with per-task modules is scored task by task with that task's
module), and prints one table with the experts' own scores as the ceiling, the last-block drift, each
row's seconds and peak memory (peak RSS increase during the row), whether the row needs the task at
inference and the parameters it adds. A combination that fails is a "failed: ..." row; the grid goes
on (exit status 1 when every requested row failed). Writes comparison.md, comparison.json and the bar
chart comparison.png into the output folder.

Every step that needs data uses the same calibration examples (the demo: the first --samples-per-task
train images per task; a recipe: its calibration data, drawn with featcal.seed), never the test split.
--samples 8,32,128 runs those steps at each number of examples per task (the merges and the data-free
steps once) and draws sample_efficiency.png: accuracy against examples per task, one line per step, the
merge as a flat line, the experts as the ceiling.

With a RECIPE, its base, experts, calibration, featcal and evaluation sections are used; the grid is
the recipe's own merge × every post-merging step, or every merge with --all-merges; an optional
compare: section (merges: method -> parameters, or null for every merge; post_merging: [...] or
step -> parameters; samples: [...]) sets the grid instead, and --merges / --post-merging / --samples
restrict or replace it. The grid's size is printed before it starts.
"""


def samples_list(text: str) -> list[int]:
    """``8,32,128`` → [8, 32, 128]: positive integers, none twice."""
    values = [positive_int(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a number is given twice in {text!r}")
    return values


def step_parameter(text: str) -> tuple[str, str, Any]:
    """``STEP.NAME=VALUE`` → (step, name, value as YAML reads it), checked against the step's declaration."""
    import yaml

    from ..post_merging import get_step

    where, equals, raw = text.partition("=")
    step, dot, name = where.partition(".")
    if not equals or not dot or not step or not name:
        raise argparse.ArgumentTypeError(f"expected STEP.NAME=VALUE, got {text!r}")
    try:
        declaration = get_step(step)
    except KeyError as err:
        raise argparse.ArgumentTypeError(str(err.args[0])) from None
    try:
        value = yaml.safe_load(raw)
        return step, name, declaration.checked_parameters({name: value})[name]
    except (ValueError, yaml.YAMLError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _steps_text() -> str:
    """One line per registered post-merging step: its name, summary, result and parameters' defaults."""
    from ..post_merging import post_merging_steps

    lines = []
    for step in post_merging_steps().values():
        defaults = {**{p.name: p.default for p in step.parameters}, **step.paper_defaults}
        parameters = ", ".join(f"{k}={'per merge' if v is None else v}" for k, v in defaults.items())
        data = "calibration data" if step.needs_calibration_data else "no data"
        lines.append(f"  {step.name}: {step.summary} [{data}; {step.result_text}"
                     + (f"; {parameters}" if parameters else "") + "]")
    return "\n".join(lines)


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    from ..merging import merge_methods
    from ..post_merging import step_names

    p = commands.add_parser(
        "compare", help="compare merge methods × post-merging steps in one table (--demo, or a RECIPE)",
        description="Run a grid of merge methods × post-merging steps (none, FeatCal, ...) on the offline demo "
        "scenario or on a recipe's base, experts, calibration and evaluation data, and write one table "
        "(per task and mean, the experts as the ceiling), the drift per run, a bar chart and a JSON file.",
        epilog=_COMPARE_EPILOG.format(methods=", ".join(merge_methods()), steps=_steps_text()),
        formatter_class=FORMATTER,
    )
    p.add_argument("recipe", metavar="RECIPE", nargs="?", help="a recipe file (YAML); or give --demo")
    p.add_argument("--demo", action="store_true", help="the offline digits demo scenario (as hf-featcal demo)")
    p.add_argument("--output-dir", help="where comparison.md/.json/.png go (default: a new folder "
                   "./outputs/compare-<date>-<time> for --demo, the recipe's output_dir for a recipe)")
    p.add_argument("--merges", nargs="+", metavar="METHOD",
                   help="only these merge methods (default: all; a recipe's compare.merges)")
    p.add_argument("--post-merging", nargs="+", metavar="STEP",
                   help=f"only these post-merging steps, of: {', '.join(step_names())} (default: all; a recipe's "
                        "compare.post_merging)")
    p.add_argument("--step-parameter", action="append", type=step_parameter, default=[], metavar="STEP.NAME=VALUE",
                   help="a post-merging step's parameter, e.g. surgery.steps=200 (repeatable; default: the paper's, "
                        "listed below)")
    p.add_argument("--samples", type=samples_list, metavar="N,N,...",
                   help="calibration examples per task to run the steps that need data at, e.g. 8,32,128: writes "
                        "sample_efficiency.png (default: once; a recipe's compare.samples)")
    demo = p.add_argument_group("--demo options")
    demo.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                      help=f"where the built scenario is cached (default {DEFAULT_CACHE_DIR})")
    demo.add_argument("--samples-per-task", type=positive_int, default=64,
                      help="calibration images per task (default 64)")
    demo.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    demo.add_argument("--fast", action="store_true",
                      help="a smaller, quickly trained scenario (a smoke test; accuracies are lower)")
    demo.add_argument("--real-weights", action="store_true", help=REAL_WEIGHTS_HELP)
    recipe = p.add_argument_group("RECIPE options")
    recipe.add_argument("--all-merges", action="store_true",
                        help="every merge method in the grid (default without a compare: section: the recipe's "
                             "own merge)")
    add_common(p, DEVICE_HELP + "; --demo runs on the CPU")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..compare import DEFAULT_MERGES, post_merging_steps

    if args.demo == (args.recipe is not None):
        raise CLIError("give either --demo or a RECIPE file (not both)" if args.demo
                       else "give --demo or a RECIPE file")
    if args.merges:
        unknown = [m for m in args.merges if m not in DEFAULT_MERGES]
        if unknown:
            raise CLIError(f"--merges: unknown methods {unknown}; known: {list(DEFAULT_MERGES)}")
    if args.post_merging:
        offered = post_merging_steps()
        unknown = [s for s in args.post_merging if s not in offered]
        if unknown:
            raise CLIError(f"--post-merging: unknown steps {unknown}; this build offers {list(offered)}")
    merges = list(dict.fromkeys(args.merges)) if args.merges else None
    steps = list(dict.fromkeys(args.post_merging)) if args.post_merging else None
    for step, name, _ in args.step_parameter:
        if steps is not None and step not in steps:
            raise CLIError(f"--step-parameter: {step}.{name} is for a step not in --post-merging {steps}")
    if args.demo:
        if args.device not in (None, "cpu"):
            raise CLIError(f"--device {args.device}: compare --demo runs on the CPU (a RECIPE's grid takes a device)")
        if args.all_merges:
            raise CLIError("--all-merges is for a RECIPE, not --demo")
        return _compare_demo(args, merges, steps)
    return _compare_recipe(args, merges, steps)


def _compare_demo(args: argparse.Namespace, merges: list[str] | None, steps: list[str] | None) -> int:
    import torch

    from ..compare import DEFAULT_MERGES, compare_demo, post_merging_steps

    name, words, overrides = demo_scenario(args)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    output_dir = args.output_dir or default_output_dir("compare")
    check_output_dir(output_dir, model_folder=False)  # tables and plots, not a model save
    cache_dir = os.path.expanduser(args.cache_dir)
    say_grid(len(merges or DEFAULT_MERGES), len(steps or post_merging_steps()))
    log(f"Building the scenario of {words} (cache: {cache_dir}); the grid goes to {output_dir}/ ...")
    start = time.perf_counter()
    with ProgressBars(args.quiet):
        result = compare_demo(output_dir, seed=args.seed, cache_dir=cache_dir, samples_per_task=args.samples_per_task,
                              merges=merges, post_merging=_with_parameters(args, steps, {}),
                              scenario_overrides=overrides, scenario=name, log=log, samples=args.samples)
    print(f"Test accuracy (%) on {words}; last-block drift ‖h_merged − h_expert‖ per token\n")
    print(result.to_markdown())
    print(f"({time.perf_counter() - start:.1f} s) Saved {_saved(result)} to {output_dir}/")
    return _compare_status(result)


def _saved(result: Any) -> str:
    return ("comparison.md, comparison.json, comparison.png and sample_efficiency.png" if result.samples
            else "comparison.md, comparison.json and comparison.png")


def _with_parameters(args: argparse.Namespace, steps: list[str] | None,
                     given: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | None] | list[str] | None:
    """The grid's steps with their parameters: `given` (a recipe's) and --step-parameter's laid over."""
    from ..compare import post_merging_steps

    parameters = {step: dict(values) for step, values in given.items()}
    for step, name, value in args.step_parameter:
        parameters.setdefault(step, {})[name] = value
    if not parameters:
        return steps
    return {step: parameters.get(step) for step in (steps if steps is not None else post_merging_steps())}


def say_grid(merges: int, steps: int, note: str = "") -> None:
    """One line before the grid starts: its size (rows computed, besides the experts' own row)."""
    log(f"Grid: {merges} merge{'s' if merges != 1 else ''} × {steps} post-merging step{'s' if steps != 1 else ''} "
        f"= {merges * steps} rows, plus the experts' row{note}")


def _compare_status(result: Any) -> int:
    """1 (with one line on stderr) when no requested row of the grid succeeded, else 0."""
    if result.succeeded():
        return 0
    print(f"{PROG} compare: error: none of the {len(result.errors)} requested rows succeeded; the table says why",
          file=sys.stderr)
    return 1


def _compare_recipe(args: argparse.Namespace, merges: list[str] | None, steps: list[str] | None) -> int:
    from ..compare import DEFAULT_MERGES, compare_recipe, post_merging_steps, recipe_grid
    from ..recipes import load_recipe

    overrides = {"output_dir": args.output_dir} if args.output_dir is not None else {}
    recipe = load_recipe(args.recipe, overrides)
    if recipe.evaluation is None:
        raise CLIError(f"{args.recipe}: evaluation: false; compare scores every row, so it needs the evaluation")
    check_device(args.device)
    check_output_dir(recipe.output_dir, "output_dir", model_folder=False)  # tables and plots, not a model save
    # --merges picks from the compare section's merges, else (no section) from every merge
    grid = recipe_grid(recipe, all_merges=args.all_merges or (merges is not None and recipe.compare is None))
    if merges is not None:
        missing = [m for m in merges if m not in grid]
        if missing:
            raise CLIError(f"--merges: {missing} are not in the recipe's compare.merges {list(grid)}")
        grid = {m: grid[m] for m in merges}
    own = recipe.compare is None and not args.all_merges and merges is None
    section = recipe.compare
    if steps is None and section is not None and section.post_merging is not None:
        steps = list(section.post_merging)
    grid_steps = _with_parameters(args, steps, section.step_parameters if section is not None else {})
    print(f"Recipe {args.recipe}: {recipe.model_family}, base {recipe.base}, {len(recipe.experts)} experts "
          f"({', '.join(recipe.tasks)}); merges: "
          + (f"the recipe's own ({recipe.merge.describe()})" if own else ", ".join(grid)))
    steps_of = steps or (recipe.compare.post_merging if recipe.compare is not None else None) or post_merging_steps()
    say_grid(len(grid), len(steps_of), f" (--all-merges: {len(DEFAULT_MERGES)} merges)" if own else "")
    start = time.perf_counter()
    finish = quiet_warnings()
    try:
        with ProgressBars(args.quiet):
            result = compare_recipe(recipe, merges=grid, post_merging=grid_steps, device=args.device, log=log,
                                    samples=args.samples)
    finally:
        ridge = finish()
    splits = ", ".join(sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks}))
    limit = recipe.evaluation.max_samples
    subset = f", random subsets of at most {limit} examples per task" if limit else ""
    print(f"\n{recipe.family.score_heading()}, split {splits}{subset}; last-block drift ‖h_merged − h_expert‖ per "
          "token\n")
    print(result.to_markdown())
    if ridge:
        print(f"{ridge} module groups had input directions without data (set by the ridge).")
    print(f"({time.perf_counter() - start:.1f} s) Saved {_saved(result)} to {recipe.output_dir}/")
    return _compare_status(result)
