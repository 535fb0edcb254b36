"""``hf-featcal merge``: merge experts into their base by a registered method (then SVC with ``--svc``)
and save the merged model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..families import detect_family
from ._common import (
    DEVICE_HELP,
    FORMATTER,
    CLIError,
    ProgressBars,
    add_common,
    add_recipe_options,
    check_device,
    check_not_adapter_base,
    check_output_dir,
    check_source,
    help_text,
    log,
    maybe_processing,
    task_pairs,
    task_value,
)

_MERGE_EPILOG = """\
{methods}

examples:
  hf-featcal merge --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert dtd=tanganke/clip-vit-base-patch32_dtd \\
      --method task_arithmetic --scaling-factor 0.3 --output-dir clip-ta
  hf-featcal merge --base ./base --expert a=./expert_a --expert b=./expert_b --method dare \\
      --drop-rate 0.5 --seed 1 --output-dir merged-dare
  hf-featcal merge --base ./base --expert a=./expert_a --expert b=./expert_b --method ties --svc \\
      --output-dir merged-ties-svc

--svc calibrates the merged matrices' singular values afterwards (SVC, data-free; config.json's
hf_featcal_merge record gets a "post_merging" entry). A CLIPModel base with CLIPVisionModel experts
merges the vision tower. The output folder holds the merged model (save_pretrained; the merge is
recorded in config.json as hf_featcal_merge) and the base's processor / tokenizer when it has one.
open_clip bases and experts (hf-hub:/local-dir: references) give an open_clip folder
(open_clip_model.safetensors + open_clip_config.json).
"""


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "merge", help="merge expert models into their base (Task Arithmetic, TIES, DARE, averaging)",
        description="Merge fine-tuned experts into a copy of their base model and save the result.",
        epilog=_MERGE_EPILOG.format(methods=_merge_methods_table()), formatter_class=FORMATTER,
    )
    p.add_argument("--base", required=True, help="base model: hub id or local folder")
    p.add_argument("--expert", dest="experts", type=task_value, action="append", required=True, metavar="TASK=SOURCE",
                   help="an expert (hub id or local folder) for TASK; repeat for every expert")
    _add_merge_options(p)
    _add_svc_options(p)
    p.add_argument("--output-dir", required=True, help="folder the merged model is saved to")
    add_recipe_options(p, "", ("overwrite",))
    add_common(p, DEVICE_HELP + "; merge: where --svc computes (the merge itself streams tensors on the CPU)")
    p.set_defaults(func=run)


def _merge_options() -> dict[str, list[tuple[str, Any]]]:
    """Parameter name -> [(method, its declaration)], over every method ``merge`` offers (those that need
    no calibration data), in registration and declaration order."""
    from ..merging import merge_methods

    options: dict[str, list[tuple[str, Any]]] = {}
    for method, declared in merge_methods(calibration_data=False).items():
        for parameter in declared.parameters:
            options.setdefault(parameter.name, []).append((method, parameter))
    return options


def _add_merge_options(parser: argparse.ArgumentParser) -> None:
    """``--method`` and one flag per declared merge parameter (`hf_featcal.merging.registry`)."""
    from ..merging import merge_methods

    offered = list(merge_methods(calibration_data=False))

    def method(text: str) -> str:
        if text in merge_methods(calibration_data=True):
            from ..recipes.parse import needs_data_reason

            raise argparse.ArgumentTypeError(needs_data_reason(text))
        return text

    parser.add_argument("--method", default="task_arithmetic", type=method, choices=offered,
                        help="merge method (default: task_arithmetic)")
    for name, users in _merge_options().items():
        parameter = users[0][1]
        defaults = {repr(p.default) for _, p in users}
        if len(defaults) == 1:
            default = f"default {parameter.default!r}"
        else:
            default = "default " + ", ".join(f"{m}: {p.default!r}" for m, p in users)
        where = ", ".join(m for m, _ in users)
        if parameter.kind is bool:  # a switch away from the default
            action = "store_false" if parameter.default is True else "store_true"
            state = "on" if parameter.default else "off"
            turn = "off" if parameter.default else "on"
            text = help_text(f"{where}: turn {turn}: {parameter.help} (default {state})")
            parser.add_argument(parameter.flag, dest=name, action=action, default=None, help=text)
            continue
        text = help_text(f"{where}: {parameter.help}, {parameter.describe_range()} ({default})")
        if parameter.choices:
            parser.add_argument(parameter.flag, dest=name, choices=list(parameter.choices), help=text)
        else:
            parser.add_argument(parameter.flag, dest=name, type=parameter.kind, metavar=parameter.metavar, help=text)


def _add_svc_options(parser: argparse.ArgumentParser) -> None:
    """``--svc`` and ``--svc-alpha``: Singular Value Calibration after the merge (`hf_featcal.merging.svc`)."""
    from ..merging import merge_methods
    from ..merging.svc import SVC_ALPHA, svc_alpha_for

    group = parser.add_argument_group("post-merging")
    group.add_argument("--svc", action="store_true",
                       help="then Singular Value Calibration (SVC, data-free): rescale the merged matrices' singular "
                            "values by how much of each task they hold")
    by_merge = ", ".join(f"{m}: {svc_alpha_for(m):g}" for m in merge_methods(calibration_data=False))
    group.add_argument("--svc-alpha", type=float, metavar=SVC_ALPHA.metavar,
                       help=help_text(f"with --svc: {SVC_ALPHA.help}, {SVC_ALPHA.describe_range()} (default: "
                                  f"FusionBench's for the merge method: {by_merge})"))


def _merge_methods_table() -> str:
    from ..merging import merge_methods

    lines = ["methods and their parameters (default):"]
    for method, declared in merge_methods(calibration_data=False).items():
        flags = ", ".join(f"{p.flag} ({p.default!r})" for p in declared.parameters)
        described = flags or f"no parameters ({declared.summary})"
        lines.append(f"  {method:<17} {described}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..recipes import RecipeError, merge_experts, validate_merge_spec

    base = check_source(args.base, "--base")
    check_not_adapter_base(base)
    experts = {t: check_source(s, f"--expert {t}") for t, s in task_pairs(args.experts, "--expert").items()}
    options = _merge_options()
    params = {name: getattr(args, name) for name in options if getattr(args, name) is not None}
    try:
        spec = validate_merge_spec(args.method, params)
    except RecipeError as err:
        name = err.key.split(".", 1)[-1]
        option = options[name][0][1].flag if err.key.startswith("merge.") and name in options else err.key
        raise CLIError(f"{option}: {err.reason}") from None
    alpha = _svc_alpha(args)
    inputs = {"--base": base, **{f"--expert {task}": source for task, source in experts.items()}}
    writer = {"command": "hf-featcal merge", "base": base}  # recorded in the manifest
    check_output_dir(args.output_dir, inputs=inputs, overwrite=bool(args.overwrite), written_by=writer)
    check_device(args.device)
    start = time.perf_counter()
    with ProgressBars(args.quiet):
        merged = merge_experts(base, experts, spec, log=log)  # the recipe run's merge stage
        described = spec.describe()
        if alpha is not None:
            from ..merging import singular_value_calibration

            log(f"Singular Value Calibration (alpha={alpha:g}) ...")
            merged = singular_value_calibration(merged, base, experts, alpha=alpha, device=args.device)
            described += f" + SVC (alpha={alpha:g})"
    from ..processing import describe_processing, processing_classes_of
    from ..saving import atomic_folder, save_model_files

    # the base's tokenizer and processor go beside the merge, as mergekit copies them
    family = detect_family(merged)
    if family is not None:
        to_save = family.processing_to_save(maybe_processing(family, [base]))
    else:  # a model no family takes (merge_models merges any transformers model): what the base was saved with
        to_save = processing_classes_of(base)
    with atomic_folder(args.output_dir, "--output-dir", inputs=inputs, overwrite=bool(args.overwrite),
                       written_by=writer) as folder:  # as FeatCalCalibrator.save_model saves
        save_model_files(merged, folder, processing_class=to_save)
    print(f"Merged {type(merged).__name__} ({described}; tasks: {', '.join(experts)}) "
          f"in {time.perf_counter() - start:.1f} s → {args.output_dir}"
          + (f" (with the base's {describe_processing(to_save)})" if to_save
             else " (no processor/tokenizer found with the base)"))
    return 0


def _svc_alpha(args: argparse.Namespace) -> float | None:
    """SVC's α when ``--svc`` is given (checked before any work), else None."""
    from ..merging.svc import SVC_ALPHA, svc_alpha_for

    if not args.svc:
        if args.svc_alpha is not None:
            raise CLIError("--svc-alpha: needs --svc")
        return None
    if args.svc_alpha is None:
        return svc_alpha_for(args.method)
    try:
        return SVC_ALPHA.check(args.svc_alpha)
    except ValueError as err:
        raise CLIError(f"--svc-alpha: {err}") from None
