"""``hf-featcal run RECIPE.yaml``: a whole YAML recipe, merge → FeatCal → evaluate → save (→ push)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import (
    FORMATTER,
    ProgressBars,
    add_common,
    add_recipe_options,
    check_device,
    log,
    quiet_warnings,
)

_RUN_EPILOG = """\
examples:
  hf-featcal run examples/recipes/clip_vit_b32_ta8.yaml
  hf-featcal run examples/recipes/flan_t5_base_glue8.yaml --output-dir /data/t5-featcal --device cuda
  hf-featcal run my_recipe.yaml --no-eval --push-to-hub me/my-merged-featcal

Steps: validate the recipe, the output folder and the push (token; --private into an existing public
repo is refused) before anything is downloaded → load base, processor and calibration data → check
the FeatCal module selection and every calibration batch against the base, and the class names
against the evaluation data (the pre-flight; --check runs it too, loading local sources only, no
merge) → merge → evaluate the merged model → FeatCal → evaluate again →
save model, processor, model card (with the evaluation), drift report, drift plot (featcal_drift.png),
featcal_evaluation.json and the recipe → push to the hub if asked. With post_merging set to another
step (e.g. surgery, svc) that step runs in place of FeatCal, and its per-task modules, where it has
them, are saved beside the model.

recipe schema ("?": optional, [default]; generated from hf_featcal.schema, as in docs/recipes.md):
{schema}
"""


def _run_epilog() -> str:
    from ..schema import render_recipe_schema

    return _RUN_EPILOG.replace("{schema}", render_recipe_schema(indent=2))


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "run", help="run a YAML recipe: merge → FeatCal → evaluate before/after → save (→ push)",
        description="Run a YAML recipe end to end. The recipe is validated before anything is downloaded; "
        "errors name the offending key (e.g. merge.density).",
        epilog=_run_epilog(), formatter_class=FORMATTER,
    )
    p.add_argument("recipe", metavar="RECIPE", help="the recipe file (YAML)")
    add_recipe_options(p, "", ("output_dir", "push_to_hub", "private", "overwrite"), override=True)
    p.add_argument("--no-push", action="store_true", help="do not push even if the recipe says so")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation before and after calibration")
    p.add_argument("--check", action="store_true", help="only validate the recipe and print what would run")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..post_merging import get_step
    from ..recipes import load_recipe, run_recipe
    from ..recipes.preflight import check_recipe_targets

    overrides: dict[str, Any] = {}
    if args.output_dir is not None:
        overrides["output_dir"] = args.output_dir
    if args.push_to_hub is not None:
        overrides["push_to_hub"] = args.push_to_hub
    for switch in ("private", "overwrite"):
        if getattr(args, switch):
            overrides[switch] = True
    recipe = load_recipe(args.recipe, overrides)
    check_device(args.device)
    check_recipe_targets(recipe, push=not args.no_push)  # output folder and push, as the run checks them
    step = "" if recipe.post_merging == "featcal" else f", post-merging {recipe.post_merging}"
    print(f"Recipe {args.recipe}: {recipe.model_family}, base {recipe.base}, {len(recipe.experts)} experts "
          f"({', '.join(recipe.tasks)}), merge {recipe.merge.describe()}{step}, output {recipe.output_dir}")
    if args.check:
        return _check(args, recipe)
    finish = quiet_warnings()
    try:
        with ProgressBars(args.quiet):
            result = run_recipe(
                recipe, device=args.device, evaluate=not args.no_eval, push_to_hub=not args.no_push,
                show_progress=not args.quiet, log=log,
            )
    finally:
        ridge = finish()
    if result.table is not None:
        assert recipe.evaluation is not None
        splits = ", ".join(sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks}))
        heading = recipe.family.score_heading()
        limit = recipe.evaluation.max_samples
        subset = f", random subsets of at most {limit} examples per task" if limit else ""
        print(f"\n{heading}, split {splits}{subset}\n")
        print(result.table)
    if result.report is not None:
        print("\nFeature drift per task (before → after FeatCal)\n")
        print(result.report.summary_markdown())
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (set by the ridge).")
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    saved = ("model, processor, model card" + (", drift report" if result.report is not None else "")
             + (", drift plot" if result.plot_path else "")
             + (", per-task modules" if recipe.post_merging != "featcal"
                and get_step(recipe.post_merging).per_task_modules else ""))
    print(f"\nSaved to {result.output_dir} ({saved}). Timings: {timing}.")
    if result.pushed_to:
        print(f"Pushed to https://huggingface.co/{result.pushed_to}")
    return 0


def _check(args: argparse.Namespace, recipe: Any) -> int:
    """``--check``: the run's pre-flight without the merge (base and calibration data loaded when they
    are local; hub sources are not downloaded)."""
    from ..recipes.preflight import check_recipe_inputs, recipe_sources_are_local
    from ..recipes.run import prepare_recipe_inputs

    evaluation = "off" if recipe.evaluation is None else f"{len(recipe.evaluation.tasks)} tasks"
    featcal = recipe.post_merging == "featcal"  # FeatCal's pre-flight on the base (another step has none)
    if recipe_sources_are_local(recipe, evaluate=not args.no_eval):
        with ProgressBars(True):
            inputs = prepare_recipe_inputs(recipe, evaluate=not args.no_eval, log=log)
            check_recipe_inputs(recipe, inputs, featcal=featcal, evaluate=not args.no_eval, device=args.device)
        checked = ("the output folder, the push"
                   + (", the FeatCal module selection and every calibration batch against the base" if featcal else "")
                   + (", the class names against the evaluation data" if evaluation != "off" else ""))
    else:
        checked = ("the output folder and the push; some sources (base, datasets) are on the hub and are not "
                   "downloaded: the module selection, the batches and the class names are checked when the run "
                   "starts, before the merge")
    print(f"The recipe is valid. Checked {checked}. Calibration examples per task: "
          f"{ {t: s.num_examples for t, s in recipe.calibration.items()} }; evaluation: {evaluation}.")
    return 0
