"""``hf-featcal evaluate``: score a model on its family's tasks (CLIP zero-shot top-1, FLAN-T5 GLUE)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ..families import ModelFamily, family_names, get_family
from ..schema import TASK
from ._common import (
    FORMATTER,
    CLIError,
    ProgressBars,
    add_common,
    add_recipe_options,
    check_device,
    check_output_file,
    check_source,
    family_of,
    first_processing,
    key_checker,
    log,
    task_pairs,
    task_value,
)

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
  # a decoder LLM (Llama, Mistral, Qwen2/3): held-out perplexity (lower is better) of each --data's test split
  hf-featcal evaluate --model llama-featcal --task chat --data chat=./chat_data --messages-column messages

BERT / RoBERTa and ViT have no built-in evaluation (their heads are task-specific).

Built-in CLIP tasks: sun397, stanford-cars, resisc45, eurosat, svhn, gtsrb, mnist, dtd.
GLUE tasks: cola, mnli, mrpc, qnli, qqp, rte, sst2, stsb.
"""  # noqa: E501 - a whole example command, as a user copies it


_EVALUATION_DEST = "evaluation_"


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "evaluate", help="score a model: CLIP / open_clip zero-shot top-1, FLAN-T5 GLUE or LLM perplexity",
        description="Evaluate a CLIP model (zero-shot classification with the text tower of a CLIPModel; an "
        "open_clip CLIP uses its own), a "
        "FLAN-T5 model (GLUE by greedy generation) or a decoder LLM (held-out perplexity) and print a table of "
        "per-task scores.",
        epilog=_EVALUATE_EPILOG, formatter_class=FORMATTER,
    )
    p.add_argument("--model", required=True, help="model to evaluate: local folder or hub id")
    p.add_argument("--task", dest="tasks", action="append", required=True, metavar="TASK",
                   help="a task; repeat for several")
    p.add_argument("--family", choices=family_names(), help="model family (default: from the model)")
    p.add_argument("--data", type=task_value, action="append", default=[], metavar="TASK=DATASET",
                   help="evaluation dataset of TASK: hub id or save_to_disk folder (default: the task's built-in "
                        "dataset)")
    p.add_argument("--data-config", type=task_value, action="append", default=[], metavar="TASK=NAME",
                   help="dataset config name of TASK (hub datasets)")
    add_recipe_options(p, "evaluation", ("split", "max_samples", "batch_size"), dest_prefix=_EVALUATION_DEST)
    add_recipe_options(p, f"evaluation.datasets.{TASK}", ("text_column", "messages_column"),
                       dest_prefix=_EVALUATION_DEST)
    add_recipe_options(p, "calibration.default", ("max_length",), dest_prefix=_EVALUATION_DEST)
    p.add_argument("--clip-model",
                   help="CLIP: the CLIPModel whose text tower builds the zero-shot heads (default: the model)")
    p.add_argument("--class-names", type=task_value, action="append", default=[], metavar="TASK=A,B,...",
                   help="CLIP: class names of TASK in label order, comma-separated (default for a custom task: "
                        "the names of its dataset's ClassLabel column 'label')")
    p.add_argument("--template", type=task_value, action="append", default=[], metavar="TASK=TEMPLATE",
                   help="CLIP: a prompt template with '{c}' for TASK; repeat for several")
    p.add_argument("--processor", help="processor / tokenizer folder or hub id (default: the model, else --clip-model)")
    p.add_argument("--output-json", metavar="FILE", help="also write the scores as JSON (missing folders are created)")
    add_common(p)
    p.set_defaults(func=run)


def _built_in_clip_task(task: str) -> bool:
    from ..evaluation.clip_templates import CLIP_CLASS_NAMES, CLIP_TASK_ALIASES

    return task in CLIP_CLASS_NAMES or task in CLIP_TASK_ALIASES


def _class_label_names(v: Any, source: str, config: str | None, split: str | None, task: str) -> list[str] | None:
    """The class names of the dataset's ``label`` column when it is a ``ClassLabel`` (in label order), read
    from the dataset's features (a local folder's metadata, a hub dataset's card); None when it has none."""
    import datasets

    from ..recipes import RecipeError

    try:
        local = v.local_path(source, f"--data {task}", "dataset")
    except RecipeError as err:
        raise CLIError(str(err)) from None
    try:
        if local is not None:
            loaded = datasets.load_from_disk(local)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[split] if split in loaded else next(iter(loaded.values()))
            features = loaded.features
        else:
            features = datasets.load_dataset_builder(source, config).info.features
    except (OSError, ValueError, ConnectionError) as err:  # the evaluation itself reports it, naming --data
        log(f"--data {task}: could not read its label names ({type(err).__name__}); give --class-names {task}=...")
        return None
    label = (features or {}).get("label")
    names = getattr(label, "names", None)
    return list(names) if isinstance(label, datasets.ClassLabel) and names else None


def _text_fields(args: argparse.Namespace, family: ModelFamily) -> dict[str, Any]:
    """The text keys given (--text-column, --messages-column, --max-length), refused for a family without them."""
    given = {name: getattr(args, _EVALUATION_DEST + name) for name in ("text_column", "messages_column", "max_length")
             if getattr(args, _EVALUATION_DEST + name) is not None}
    for name in given:
        if name not in (*family.evaluation_data_keys, *family.calibration_data_keys):
            raise CLIError(f"--{name.replace('_', '-')} is not for {family.article_name} model ({family.name})")
    if "text_column" in given and "messages_column" in given:
        raise CLIError("give either --text-column or --messages-column, not both")
    return given


def _evaluation_spec(args: argparse.Namespace, family: ModelFamily) -> Any:
    from ..recipes import DatasetSpec, EvaluationSpec, RecipeError

    v = key_checker()
    data = task_pairs(args.data, "--data")
    configs = task_pairs(args.data_config, "--data-config")
    class_names = {t: [n.strip() for n in names.split(",") if n.strip()]
                   for t, names in task_pairs(args.class_names, "--class-names").items()}
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
    if "class_names" in family.evaluation_keys:
        for task in tasks:
            if task in data and task not in class_names and not _built_in_clip_task(task):
                split = args.evaluation_split or family.default_evaluation_split(task)
                names = _class_label_names(v, data[task], configs.get(task), split, task)
                if names is not None:
                    class_names[task] = names
    text_fields = _text_fields(args, family)
    specs: dict[str, DatasetSpec] = {}
    for task in tasks:
        dataset, config, glue_task = family.evaluation_source(task, data, configs, class_names)
        split = args.evaluation_split or family.default_evaluation_split(task)
        try:
            local = v.local_path(dataset, f"--data {task}", "dataset")
        except RecipeError as err:
            raise CLIError(str(err)) from None
        specs[task] = DatasetSpec(dataset=local or dataset, config=config, split=split, num_examples=None,
                                  is_local=local is not None, glue_task=glue_task, **text_fields)
    return EvaluationSpec(
        tasks=tasks, datasets=specs, max_samples=args.evaluation_max_samples,
        batch_size=args.evaluation_batch_size or family.default_evaluation_batch_size,
        class_names=class_names, templates=templates, clip_model=args.clip_model,
    )


def run(args: argparse.Namespace) -> int:
    from ..evaluation.results import scores_table
    from ..model_io import load_model
    from ..recipes import evaluate_model

    model_source = check_source(args.model, "--model")
    clip_source = check_source(args.clip_model, "--clip-model") if args.clip_model else None
    for task, dataset in task_pairs(args.data, "--data").items():  # every path, before any model loads
        check_source(dataset, f"--data {task}", kind="dataset")
    check_device(args.device)
    if args.output_json:
        check_output_file(args.output_json, "--output-json",
                          inputs={"--model": model_source, "--clip-model": clip_source, "--processor": args.processor})
    if args.family is not None:
        _evaluation_spec(args, get_family(args.family))  # check the arguments before loading anything
    log(f"Loading {args.model} ...")
    with ProgressBars(args.quiet):
        model = load_model(model_source, "--model")
        family = family_of(model, args.family)
        spec = _evaluation_spec(args, family)
        clip_model = family.command_text_model(model, clip_source, load_model)
        processing = first_processing(family, [args.processor, model_source, clip_source])
        family.check_evaluation_processing(processing)
        device = args.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        scores, details = evaluate_model(family.name, model, spec, processing=processing, clip_model=clip_model,
                                         device=device)
    heading = family.score_heading(family.evaluation_label)
    splits = ", ".join(sorted({spec.datasets[t].split or "" for t in spec.tasks}))
    print(f"{heading}, split {splits}"
          + (f", random subsets of at most {spec.max_samples} examples per task" if spec.max_samples else "") + "\n")
    print(scores_table({os.path.basename(os.path.normpath(args.model)) or args.model: scores}, spec.tasks,
                       percent=family.score_in_percent))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "scores": scores, "details": details}, handle, indent=2, default=str)
            handle.write("\n")
    return 0
