"""Loading what a recipe names: its datasets (calibration rows sampled with the run's seed, evaluation
splits) and the scores of a model on its evaluation, through the recipe's model family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..architectures import model_type_of
from ..families import FamilyUsageError, detect_family, get_family, no_family_reason
from .spec import DatasetSpec, EvaluationSpec

__all__ = [
    "EVALUATION_SUBSET_SEED",
    "check_family",
    "evaluate_model",
    "load_dataset_spec",
    "model_family_of",
    "prepare_calibration",
]

#: Seed of the random subset evaluated when ``evaluation.max_samples`` cuts a split.
EVALUATION_SUBSET_SEED = 0


def load_dataset_spec(spec: DatasetSpec, *, what: str = "dataset") -> Any:
    """The ``datasets.Dataset`` a spec names: ``load_from_disk`` for a local folder (a
    ``DatasetDict`` gives its ``split``), else ``load_dataset(hub id, config, split=split)``."""
    import datasets as hf_datasets

    if spec.is_local:
        try:
            ds = hf_datasets.load_from_disk(spec.dataset)
        except Exception as err:  # noqa: BLE001 - datasets fails on an empty split with a bare IndexError
            raise ValueError(
                f"{what}: cannot load the local dataset {spec.dataset!r} (saved with Dataset.save_to_disk?; "
                f"an empty split cannot be loaded): {type(err).__name__}: {err}"
            ) from None
        if isinstance(ds, hf_datasets.DatasetDict):
            if spec.split not in ds:
                raise ValueError(f"{what}: the local DatasetDict {spec.dataset!r} has no split {spec.split!r} (it has "
                                 f"{list(ds)})")
            ds = ds[spec.split]
        if len(ds) == 0:
            raise ValueError(f"{what}: the local dataset {spec.dataset!r} (split {spec.split!r}) has 0 rows")
        return ds
    ds = hf_datasets.load_dataset(spec.dataset, spec.config, split=spec.split)
    if len(ds) == 0:
        raise ValueError(f"{what}: the dataset {spec.dataset!r} (split {spec.split!r}) has 0 rows")
    return ds


def prepare_calibration(family: str, task: str, spec: DatasetSpec, processing: Mapping[str, Any] | None,
                        seed: int) -> Any:
    """One task's calibration ``Dataset``: loaded, ``spec.num_examples`` drawn with `seed`
    (`data.sample_examples`, the one draw: the calibrator takes them all, in this order) and prepared
    the way the family's calibrator input needs (`ModelFamily.prepare_calibration`)."""
    from ..data import sample_examples  # torch: loaded when a run prepares data, not for --help

    ds = sample_examples(load_dataset_spec(spec, what=f"calibration.tasks.{task}"), spec.num_examples, seed)
    return get_family(family).prepare_calibration(task, ds, spec, processing)


def model_family_of(model_or_config: Any) -> str | None:
    """The name of the family (`hf_featcal.families`) of a model or config: ``"clip"`` /
    ``"flan_t5"`` from its ``model_type``, ``"open_clip"`` for an open_clip model; None if none."""
    family = detect_family(model_or_config)
    return None if family is None else family.name


def check_family(model: Any, family: str, argument: str) -> None:
    """Raise a `FamilyUsageError` (a ValueError; the CLI's usage error, exit status 2) when `model` is not
    of `family`: the recipe or option names a family its model is not of."""
    found = model_family_of(model)
    if found != family:
        model_type = model_type_of(model)
        why = f"it is a {found!r} model" if found is not None else no_family_reason(model)
        raise FamilyUsageError(f"{argument} has model_type {model_type!r}, which is not a {family!r} model: {why}")


def evaluate_model(
    family: str,
    model: Any,
    spec: EvaluationSpec,
    *,
    processing: Mapping[str, Any],
    clip_model: Any = None,
    device: Any = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Score `model` on every task of `spec`; returns (task → headline score, details). Scores the
    family has beyond the tasks' (lm-evaluation-harness tasks) are in the details under their name
    (``"lm_eval"``)."""
    model_family = get_family(family)
    scores: dict[str, float] = {}
    details: dict[str, Any] = {}
    for task in spec.tasks:
        data_spec = spec.datasets[task]
        ds = load_dataset_spec(data_spec, what=f"evaluation.datasets.{task}")
        if spec.max_samples is not None and len(ds) > spec.max_samples:
            # a seeded random subset: evaluation splits are often sorted by label
            ds = ds.shuffle(seed=EVALUATION_SUBSET_SEED).select(range(spec.max_samples))
        scores[task], details[task] = model_family.evaluate_task(
            model, task, ds, data_spec, spec, processing=processing, clip_model=clip_model, device=device
        )
    details.update(model_family.evaluate_whole_model(model, spec, processing=processing, device=device))
    return scores, details
