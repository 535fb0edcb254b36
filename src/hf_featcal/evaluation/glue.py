"""GLUE text-to-text evaluation for FLAN-T5 models (8 GLUE tasks, as in the FeatCal paper).

Prompt templates and label words are those of the public FLAN-T5 GLUE experts
``tanganke/flan-t5-base_glue-<task>``, taken verbatim (typos such as "Answere" included,
since the experts were fine-tuned on these exact strings) from FusionBench:
repository ``tanganke/fusion_bench``, file
``fusion_bench/tasks/flan_t5_text_generation/glue_prompt_templates.py``
(with the label handling of ``glue_preprocessors.py`` and the scoring of
``glue_evaluation.py`` in the same folder). Only the data are taken from there; the code
here is independent.

Conventions, following FusionBench:

- classification targets are the label words below; an example whose label is not a
  valid class (e.g. -1 in the unlabelled test splits) gets an empty target;
- the STS-B target is the similarity score formatted with ``"{:.1f}"`` (e.g. ``"3.2"``),
  and STS-B references are those rounded scores;
- generation is greedy; FusionBench compares the decoded answer with the decoded target
  by exact string equality, here answers are compared after stripping surrounding
  whitespace and lower-casing (:func:`parse_answer`);
- an STS-B answer that does not parse as a float is scored as 0.0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ._datasets import local_split
from .results import EvaluationResults

if TYPE_CHECKING:  # pragma: no cover
    import evaluate
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "GLUE_TASKS",
    "GLUE_INPUT_COLUMNS",
    "GLUE_PROMPT_TEMPLATES",
    "GLUE_LABEL_WORDS",
    "GLUE_HEADLINE_METRICS",
    "GLUE_DEFAULT_SPLITS",
    "STSB_TARGET_FORMAT",
    "GlueResults",
    "validate_glue_task",
    "glue_target_text",
    "glue_reference",
    "format_glue_example",
    "preprocess_glue_dataset",
    "parse_answer",
    "load_glue_split",
    "glue_metric_path",
    "load_glue_metric",
    "compute_glue_scores",
    "evaluate_glue",
]

GLUE_TASKS: tuple[str, ...] = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")

# Text columns of each task in ``nyu-mll/glue`` (besides "label" and "idx").
GLUE_INPUT_COLUMNS: dict[str, tuple[str, ...]] = {
    "cola": ("sentence",),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence",),
    "stsb": ("sentence1", "sentence2"),
}

# Verbatim from tanganke/fusion_bench glue_prompt_templates.py (see module docstring).
GLUE_PROMPT_TEMPLATES: dict[str, str] = {
    "cola": (
        "Indicate if the following sentence is grammatically correct or not: "
        "\"{sentence}\". Answere 'acceptable' or 'unacceptable'."
    ),
    "mnli": (
        "Does the premise: '{premise}' logically imply, contradict, or is neutral to the "
        "hypothesis: '{hypothesis}'? Answere with 'entailment', 'contradiction', or 'neutral'."
    ),
    "mrpc": (
        "Are the following sentences '{sentence1}' and '{sentence2}' conveying the same "
        "meaning? Answere with 'yes' or 'no'."
    ),
    "qnli": (
        "Given the context: '{sentence}', does the question '{question}' have an answer "
        "based on the information provided? Answer with 'yes' or 'no'."
    ),
    "qqp": (
        "Do the questions '{question1}' and '{question2}' have the same intent? "
        "Answere with 'yes' or 'no'."
    ),
    "rte": "Does the text: '{sentence1}' entail that '{sentence2}' is true? Provide 'yes' or 'no'.",
    "sst2": "Given the sentence '{sentence}', determine the sentiment. Is it positive or negative?",
    "stsb": (
        "Consider the sentences '{sentence1}' and '{sentence2}'. On a scale from 1 "
        "(completely different) to 5 (completely similar), rate the similarity."
    ),
}

# Label words indexed by the GLUE label id (verbatim from the same file).
GLUE_LABEL_WORDS: dict[str, tuple[str, ...]] = {
    "cola": ("unacceptable", "acceptable"),
    "mnli": ("entailment", "neutral", "contradiction"),
    "mrpc": ("no", "yes"),
    "qnli": ("yes", "no"),
    "qqp": ("no", "yes"),
    "rte": ("yes", "no"),
    "sst2": ("negative", "positive"),
}

# STS-B target text format (FusionBench: one decimal).
STSB_TARGET_FORMAT = "{:.1f}"

# Headline metric of each task: the score averaged over tasks.
GLUE_HEADLINE_METRICS: dict[str, str] = {
    task: ("spearman" if task == "stsb" else "accuracy") for task in GLUE_TASKS
}

# Default evaluation split of ``nyu-mll/glue`` per task.
GLUE_DEFAULT_SPLITS: dict[str, str] = {
    task: ("validation_matched" if task == "mnli" else "validation") for task in GLUE_TASKS
}

_GLUE_HUB_ID = "nyu-mll/glue"

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- tasks


def validate_glue_task(task: str, argument: str = "task") -> str:
    """Return the canonical (lower-case) GLUE task name, or raise ``ValueError``.

    Args:
        task: a task name such as ``"cola"`` (case-insensitive).
        argument: the argument name to mention in the error message.
    """
    if isinstance(task, str):
        name = task.strip().lower()
        if name in GLUE_TASKS:
            return name
    raise ValueError(
        f"{argument}={task!r} is not a supported GLUE task; valid tasks are: {', '.join(GLUE_TASKS)}"
    )


def _validate_tasks(tasks: str | Iterable[str], argument: str = "tasks") -> list[str]:
    if isinstance(tasks, str):
        tasks = [tasks]
    out: list[str] = []
    for t in tasks:
        name = validate_glue_task(t, argument)
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"{argument} must name at least one GLUE task; valid tasks are: {', '.join(GLUE_TASKS)}")
    return out


# ------------------------------------------------------------------- formatting


def _as_int_label(label: Any) -> int | None:
    if label is None or isinstance(label, bool):
        return None
    try:
        value = float(label)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value) or value != int(value):
        return None
    return int(value)


def glue_target_text(task: str, label: Any) -> str:
    """Target text for a GLUE label: the label word, or the STS-B score as ``"{:.1f}"``.

    Classification labels outside the task's classes (e.g. -1 in test splits) give ``""``.
    """
    task = validate_glue_task(task)
    if task == "stsb":
        if label is None or not math.isfinite(float(label)):
            return ""
        return STSB_TARGET_FORMAT.format(float(label))
    words = GLUE_LABEL_WORDS[task]
    idx = _as_int_label(label)
    return words[idx] if idx is not None and 0 <= idx < len(words) else ""


def glue_reference(task: str, label: Any) -> int | float | None:
    """Reference value used for scoring: the class id, or the rounded STS-B score.

    STS-B references are ``float("{:.1f}".format(label))``, i.e. the value of the target
    text, as in FusionBench. Returns None for a missing/invalid label (including the
    negative placeholder labels of the unlabelled test splits).
    """
    task = validate_glue_task(task)
    if task == "stsb":
        text = glue_target_text(task, label)
        return float(text) if text and float(label) >= 0 else None
    idx = _as_int_label(label)
    return idx if idx is not None and 0 <= idx < len(GLUE_LABEL_WORDS[task]) else None


def format_glue_example(task: str, example: Mapping[str, Any]) -> tuple[str, str]:
    """Format one GLUE example (a row of ``nyu-mll/glue``) as ``(input_text, target_text)``.

    Args:
        task: GLUE task name.
        example: mapping with the task's text columns (see :data:`GLUE_INPUT_COLUMNS`)
            and ``"label"`` (optional; a missing label gives an empty target).
    """
    task = validate_glue_task(task)
    columns = GLUE_INPUT_COLUMNS[task]
    missing = [c for c in columns if c not in example]
    if missing:
        raise KeyError(f"GLUE {task} example is missing column(s) {missing}; expected {list(columns)}")
    values = {c: example[c] for c in columns}
    for c, v in values.items():
        if not isinstance(v, str):
            raise TypeError(f"GLUE {task} column {c!r} must be a string, got {type(v).__name__}")
    return GLUE_PROMPT_TEMPLATES[task].format(**values), glue_target_text(task, example.get("label"))


def preprocess_glue_dataset(
    task: str,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    max_input_length: int | None = 512,
    max_target_length: int | None = 32,
    padding: bool | str = False,
    remove_columns: bool = True,
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> Dataset:
    """Map a GLUE ``Dataset`` to text-to-text form, optionally tokenised.

    Adds ``input_text`` and ``target_text``; with a tokenizer also ``input_ids``,
    ``attention_mask`` and ``labels`` (target ids with padding replaced by -100), ready
    for seq2seq training or calibration.

    Args:
        task: GLUE task name.
        dataset: a ``datasets.Dataset`` with the ``nyu-mll/glue`` columns of ``task``.
        tokenizer: optional tokenizer; without it only the text columns are added.
        max_input_length: truncation length of inputs (None: no truncation).
        max_target_length: truncation length of targets (None: no truncation).
        padding: passed to the tokenizer (``False``, ``"longest"``, ``"max_length"``).
        remove_columns: drop the original GLUE columns.
        batch_size: ``Dataset.map`` batch size.
        num_proc: ``Dataset.map`` processes.
    """
    task = validate_glue_task(task)
    columns = GLUE_INPUT_COLUMNS[task]
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"dataset lacks the GLUE {task} column(s) {missing}; it has {dataset.column_names}"
        )
    has_label = "label" in dataset.column_names

    def _map(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        n = len(batch[columns[0]])
        inputs, targets = [], []
        for i in range(n):
            example = {c: batch[c][i] for c in columns}
            if has_label:
                example["label"] = batch["label"][i]
            x, y = format_glue_example(task, example)
            inputs.append(x)
            targets.append(y)
        out: dict[str, list[Any]] = {"input_text": inputs, "target_text": targets}
        if tokenizer is not None:
            enc = tokenizer(
                inputs,
                max_length=max_input_length,
                truncation=max_input_length is not None,
                padding=padding,
            )
            lab = tokenizer(
                text_target=targets,
                max_length=max_target_length,
                truncation=max_target_length is not None,
                padding=padding,
            )
            pad_id = tokenizer.pad_token_id
            out["input_ids"] = enc["input_ids"]
            out["attention_mask"] = enc["attention_mask"]
            out["labels"] = [
                [(-100 if pad_id is not None and t == pad_id else t) for t in ids] for ids in lab["input_ids"]
            ]
        return out

    drop = list(dataset.column_names) if remove_columns else [
        c for c in ("input_text", "target_text", "input_ids", "attention_mask", "labels") if c in dataset.column_names
    ]
    return dataset.map(_map, batched=True, batch_size=batch_size, remove_columns=drop, num_proc=num_proc)


# ---------------------------------------------------------------------- parsing


def parse_answer(task: str, generated_text: str | None) -> int | float | None:
    """Parse a generated answer into a GLUE label.

    Classification tasks: the text, stripped of surrounding whitespace and lower-cased,
    must equal one of the task's label words exactly; returns its label id. STS-B:
    returns ``float(text)`` if it is a finite number. Returns None when unparsable.
    """
    task = validate_glue_task(task)
    if generated_text is None:
        return None
    text = str(generated_text).strip()
    if task == "stsb":
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) else None
    text = text.lower()
    words = GLUE_LABEL_WORDS[task]
    return words.index(text) if text in words else None


# ------------------------------------------------------------------------- data


def load_glue_split(
    task: str,
    split: str | None = None,
    dataset: Dataset | Any | PathLike | None = None,
) -> Dataset:
    """Load one GLUE split.

    Args:
        task: GLUE task name.
        split: split name; default ``"validation"`` (``"validation_matched"`` for mnli).
        dataset: optional local data instead of the Hub: a ``datasets.Dataset`` (returned
            as is), a ``DatasetDict`` (``split`` is taken from it), or a path written by
            ``save_to_disk`` (loaded with ``datasets.load_from_disk``). Without it,
            ``datasets.load_dataset("nyu-mll/glue", task, split=split)`` is used.
    """
    import datasets as hf_datasets

    task = validate_glue_task(task)
    split = split or GLUE_DEFAULT_SPLITS[task]
    if dataset is None:
        ds = hf_datasets.load_dataset(_GLUE_HUB_ID, task, split=split)
    else:
        ds = dataset
    ds = local_split(ds, split, f"dataset for GLUE {task}")
    missing = [c for c in (*GLUE_INPUT_COLUMNS[task], "label") if c not in ds.column_names]
    if missing:
        raise ValueError(f"dataset for GLUE {task} lacks column(s) {missing}; it has {ds.column_names}")
    return ds


# ----------------------------------------------------------------------- metric


def glue_metric_path() -> str:
    """Path of the bundled ``evaluate`` metric module (the ``glue_metric`` folder)."""
    return str(Path(__file__).resolve().parent / "glue_metric")


def load_glue_metric(task: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """Load the bundled GLUE metric offline with ``evaluate.load(path, task)``.

    Keyword arguments go to ``evaluate.load`` (e.g. ``keep_in_memory=True``).
    """
    import evaluate

    task = validate_glue_task(task)
    return evaluate.load(glue_metric_path(), task, **kwargs)


def _metric_inputs(task: str, parsed: Sequence[int | float | None]) -> list[Any]:
    if task == "stsb":
        return [float("nan") if p is None else float(p) for p in parsed]
    return [None if p is None else int(p) for p in parsed]


def compute_glue_scores(
    task: str,
    generated_texts: Sequence[str],
    references: Sequence[int | float],
    metric: evaluate.EvaluationModule | None = None,
) -> dict[str, float]:
    """Parse generated answers and score them with the bundled metric.

    Args:
        task: GLUE task name.
        generated_texts: decoded model outputs.
        references: gold labels (class ids; floats for stsb).
        metric: an already loaded metric for ``task`` (else it is loaded).
    """
    task = validate_glue_task(task)
    if len(generated_texts) != len(references):
        raise ValueError(
            f"generated_texts ({len(generated_texts)}) and references ({len(references)}) differ in length"
        )
    parsed = [parse_answer(task, t) for t in generated_texts]
    metric = metric if metric is not None else load_glue_metric(task, keep_in_memory=True)
    result = metric.compute(predictions=_metric_inputs(task, parsed), references=list(references))
    return {k: float(v) for k, v in result.items()}


# ---------------------------------------------------------------------- results


@dataclass
class GlueResults(EvaluationResults):
    """Scores of one GLUE evaluation.

    Attributes:
        metrics: per task, all metrics (headline first), e.g.
            ``{"cola": {"accuracy": .8, "matthews_correlation": .5}}``.
        num_examples: evaluated examples per task.
        num_unparsable: unparsable answers per task.
        generations: per task, the decoded answers (not part of :meth:`to_dict`).
    """

    metrics: dict[str, dict[str, float]]
    num_examples: dict[str, int] = field(default_factory=dict)
    num_unparsable: dict[str, int] = field(default_factory=dict)
    generations: dict[str, list[str]] = field(default_factory=dict, repr=False)

    _columns = (("Metric", "---"), ("Score", "---:"), ("Other metrics", "---"), ("N", "---:"), ("Unparsable", "---:"))
    _average_column = 1

    @property
    def scores(self) -> dict[str, float]:
        """Headline score per task (accuracy; Spearman for stsb)."""
        return {t: m[GLUE_HEADLINE_METRICS[t]] for t, m in self.metrics.items()}

    def _task_name(self, task: str) -> str:
        return validate_glue_task(task)

    def to_dict(self, include_generations: bool = False) -> dict[str, Any]:
        """Plain-Python (JSON-serialisable) form."""
        out: dict[str, Any] = {
            "scores": dict(self.scores),
            "average": self.average,
            "metrics": {t: dict(m) for t, m in self.metrics.items()},
            "headline_metrics": {t: GLUE_HEADLINE_METRICS[t] for t in self.metrics},
            "num_examples": dict(self.num_examples),
            "num_unparsable": dict(self.num_unparsable),
        }
        if include_generations:
            out["generations"] = {t: list(g) for t, g in self.generations.items()}
        return out

    def _cells(self, task: str, fmt: Callable[[float], str]) -> list[str]:
        metrics = self.metrics[task]
        head = GLUE_HEADLINE_METRICS[task]
        extra = ", ".join(f"{k}: {fmt(v)}" for k, v in metrics.items() if k != head)
        return [head, fmt(metrics[head]), extra, str(self.num_examples.get(task, "")),
                str(self.num_unparsable.get(task, ""))]


# ------------------------------------------------------------------- evaluation


def _resolve_model_and_tokenizer(
    model: PreTrainedModel | PathLike, tokenizer: PreTrainedTokenizerBase | PathLike | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    loaded = False
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        from ..model_io import load_model  # the library's one checkpoint reader (LoRA adapters too)

        model = load_model(path, "model", auto_class=AutoModelForSeq2SeqLM)
        loaded = True
        if tokenizer is None:
            tokenizer = path
    if tokenizer is None:
        raise ValueError("tokenizer is required when model is a model object (not a path)")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
    if not getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"model must be a seq2seq (encoder-decoder) model such as FLAN-T5, got {type(model).__name__}"
        )
    return model, tokenizer, loaded


def evaluate_glue(
    model: PreTrainedModel | PathLike,
    tokenizer: PreTrainedTokenizerBase | PathLike | None,
    tasks: str | Iterable[str] = GLUE_TASKS,
    datasets: Mapping[str, Dataset | PathLike] | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 10,
    device: str | Any | None = None,
    max_samples: int | None = None,
    *,
    split: str | None = None,
    max_input_length: int | None = 512,
    progress: bool = False,
) -> GlueResults:
    """Evaluate a seq2seq model (FLAN-T5) on GLUE tasks by greedy generation.

    Each example is formatted with the FusionBench FLAN-T5 prompt, answered with greedy
    decoding (``do_sample=False, num_beams=1``), parsed with :func:`parse_answer` and
    scored with the bundled ``evaluate`` metric.

    Args:
        model: a seq2seq ``PreTrainedModel``, or a local path/Hub id loaded with
            ``AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=False)`` (a LoRA
            adapter folder: merged into its recorded base model).
        tokenizer: the tokenizer (or its path); None to load it from ``model``'s path.
        tasks: one task name or several (see :data:`GLUE_TASKS`).
        datasets: optional mapping task -> local ``Dataset`` / ``DatasetDict`` /
            ``save_to_disk`` path; tasks missing from it are loaded from the Hub.
        batch_size: generation batch size.
        max_new_tokens: maximum generated tokens per answer.
        device: device to run on; None keeps a given model where it is (a model loaded
            from a path goes to CUDA when available).
        max_samples: evaluate only the first ``max_samples`` examples of each task.
        split: split to evaluate (default: validation / validation_matched).
        max_input_length: truncation length of prompts (None: no truncation).
        progress: show a progress bar.

    Returns:
        :class:`GlueResults` with per-task metrics and the mean headline score.
    """
    import torch
    from tqdm.auto import tqdm

    task_list = _validate_tasks(tasks)
    if datasets is not None:
        for key in datasets:
            validate_glue_task(key, "datasets key")
        datasets = {validate_glue_task(k): v for k, v in datasets.items()}
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")

    model, tokenizer, loaded = _resolve_model_and_tokenizer(model, tokenizer)
    if device is None and loaded:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device is not None:
        model.to(device)
    run_device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    results = GlueResults(metrics={})
    try:
        for task in task_list:
            local = None if datasets is None else datasets.get(task)
            ds = load_glue_split(task, split=split, dataset=local)
            if max_samples is not None and len(ds) > max_samples:
                ds = ds.select(range(max_samples))
            if len(ds) == 0:
                raise ValueError(f"the GLUE {task} dataset is empty")
            columns = GLUE_INPUT_COLUMNS[task]
            prompts: list[str] = []
            references: list[int | float] = []
            for row in ds.select_columns([*columns, "label"]):
                ref = glue_reference(task, row["label"])
                if ref is None:
                    raise ValueError(
                        f"GLUE {task} example has label {row['label']!r}, which cannot be scored "
                        "(test splits are unlabelled; evaluate a validation split)"
                    )
                prompts.append(format_glue_example(task, row)[0])
                references.append(ref)

            generations: list[str] = []
            batches = range(0, len(prompts), batch_size)
            for start in tqdm(batches, desc=f"GLUE {task}", disable=not progress):
                enc = tokenizer(
                    prompts[start : start + batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=max_input_length is not None,
                    max_length=max_input_length,
                )
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=enc["input_ids"].to(run_device),
                        attention_mask=enc["attention_mask"].to(run_device),
                        do_sample=False,
                        num_beams=1,
                        max_new_tokens=max_new_tokens,
                    )
                generations.extend(tokenizer.batch_decode(out, skip_special_tokens=True))

            metric = load_glue_metric(task, keep_in_memory=True)
            results.metrics[task] = compute_glue_scores(task, generations, references, metric=metric)
            results.num_examples[task] = len(generations)
            results.num_unparsable[task] = sum(parse_answer(task, g) is None for g in generations)
            results.generations[task] = generations
    finally:
        if was_training:
            model.train()
    return results
