"""The drift report (how far the merged model's features are from each expert's, per block) and the
model card that carries it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .model_io import config_field

REPORT_NAME = "featcal_drift_report.json"


@dataclass
class DriftReport:
    """Per task and block, at each block's raw output on the task's calibration examples:

    - `before` / `after`: Σ‖h_merged − h_expert‖₂ / N over the N non-padding token positions, for the
      merged model as given and the calibrated one;
    - `head_before` / `head_after`: what the task's head reads, relative to the expert's features:
      Σ w‖h_merged − h_expert‖₂ / Σ w‖h_expert‖₂ with the token weights w the calibration uses there
      (padding 0; in the last block of a pooled-head model, the pooled token 1 and every other token
      `final_block_token_weight`). Its last value is what the head sees move.

    The mean drift can fall while one task's head reads a worse feature (the calibration is a joint
    compromise of all tasks): `rising_tasks()` names the tasks whose last `head_after` is above their
    `head_before`; `calibrate()` warns about them and the summary marks them.

    `sample` says which examples were measured (None where not recorded): `examples_per_task` (task →
    how many), `calibration_examples_per_task` (task → how many it was calibrated on),
    `drift_samples_per_task` (the bound asked for; None: all) and `seed` (how they were chosen:
    `FeatCalConfig.drift_samples_per_task`); with held-out examples also `heldout_examples_per_task`
    and `heldout_fraction`.

    With held-out examples (`FeatCalConfig.heldout_fraction`) each task also has `heldout_before`,
    `heldout_after`, `heldout_head_before` and `heldout_head_after`: the same measures on the examples
    the calibration did not see, so in-sample gains that do not carry over (over-fitting) show;
    `heldout_rising_tasks()` names the tasks whose last held-out head measure rose, and `calibrate()`
    warns about them too.
    `guard` (None without a guard): `{"mode": ..., "blocks": [{"block", "gamma", "gammas",
    "heldout_head_drift"}, ...]}`, the γ each calibrated block was given and why."""

    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    sample: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None

    def rising_tasks(self) -> list[str]:
        """Tasks whose head measure at the last block rose with calibration (`head_after[-1] >
        head_before[-1]`): calibration moved what their heads read away from their experts."""
        return self._rising("head")

    def heldout_rising_tasks(self) -> list[str]:
        """Tasks whose held-out head measure at the last block rose with calibration (empty without
        held-out examples)."""
        return self._rising("heldout_head")

    def _rising(self, measure: str) -> list[str]:
        before, after = f"{measure}_before", f"{measure}_after"
        return [task for task, stages in self.tasks.items()
                if stages.get(before) and stages.get(after) and stages[after][-1] > stages[before][-1]]

    def guard_gammas(self) -> dict[str, float]:
        """Block → the γ the held-out guard gave it (empty without a guard)."""
        return {} if self.guard is None else {entry["block"]: entry["gamma"] for entry in self.guard["blocks"]}

    def to_dict(self) -> dict[str, Any]:
        """`{"tasks": {task: {"before": [...], "after": [...]}}, "sample": {...}, "guard": {...}}` with plain
        Python floats (no "sample" / "guard" where none is recorded)."""
        out: dict[str, Any] = {
            "tasks": {
                task: {stage: [float(v) for v in values] for stage, values in stages.items()}
                for task, stages in self.tasks.items()
            }
        }
        if self.sample is not None:
            out["sample"] = self.sample
        if self.guard is not None:
            out["guard"] = self.guard
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriftReport:
        return cls({task: {k: list(v) for k, v in stages.items()} for task, stages in data["tasks"].items()},
                   data.get("sample"), data.get("guard"))

    def sample_sentence(self) -> str | None:
        """Which examples were measured, in words (None where not recorded)."""
        if self.sample is None:
            return None
        counts = self.sample["examples_per_task"]
        given = self.sample.get("calibration_examples_per_task", counts)
        if all(counts[task] >= given.get(task, 0) for task in counts):
            return "Measured on every calibration example."
        measured = ", ".join(f"{task}: {counts[task]} of {given[task]}" for task in counts)
        return (f"Measured on a sample of the calibration examples ({measured}; `drift_samples_per_task="
                f"{self.sample.get('drift_samples_per_task')}`: whole batches in an order drawn with seed "
                f"{self.sample.get('seed')}, the last one cut to fit).")

    def save(self, save_directory: str | os.PathLike) -> str:
        """Write the report as JSON into `save_directory`; returns the file path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, REPORT_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DriftReport:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, REPORT_NAME)
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    def summary_markdown(self) -> str:
        """A table per task: last-block drift and the mean over blocks, before and after; what the
        head reads (relative drift at the last block, before → after; lower is better, as for every drift),
        marked "rises" where it rose."""
        if not self.tasks:
            return "No drift was measured."
        lines = [
            "| task | last block before | last block after | mean over blocks before | mean over blocks after "
            "| head reads: relative distance to the expert (lower is better), before → after |",
            "|---|---:|---:|---:|---:|---|",
        ]
        rising = set(self.rising_tasks())
        for task, stages in self.tasks.items():
            before, after = stages.get("before", []), stages.get("after", [])
            if not before or not after:
                continue
            head_before, head_after = stages.get("head_before"), stages.get("head_after")
            head = "not measured"
            if head_before and head_after:
                head = f"{head_before[-1]:.2%} → {head_after[-1]:.2%}" + (" **rises**" if task in rising else "")
            lines.append(
                f"| {markdown_cell(task)} | {before[-1]:.4g} | {after[-1]:.4g} | "
                f"{sum(before) / len(before):.4g} | {sum(after) / len(after):.4g} | {head} |"
            )
        sentence = self.sample_sentence()
        if sentence is not None:
            lines.append(f"\n{sentence}")
        lines.extend(self._heldout_markdown())
        if rising:
            lines.append(
                f"\nWhat the head reads moved away from the expert for {sorted(rising)}: check these tasks' "
                "accuracy; a larger lambda_ratio or tuning on held-out data (docs/tuning.md) softens the compromise."
            )
        return "\n".join(lines)

    def _heldout_markdown(self) -> list[str]:
        """The held-out table (in-sample beside held-out, what the head reads at the last block) and the
        guard's γ per block; nothing without held-out examples."""
        lines: list[str] = []
        measured = {task: stages for task, stages in self.tasks.items()
                    if stages.get("heldout_head_before") and stages.get("heldout_head_after")
                    and stages.get("head_before") and stages.get("head_after")}
        if measured:
            counts = (self.sample or {}).get("heldout_examples_per_task", {})
            lines += [
                "\nIn-sample and held-out: what the head reads at the last block (relative distance to the expert, "
                "lower is better), before → after calibration, on the calibration examples and on examples held "
                "out of it" + (f" ({', '.join(f'{t}: {n}' for t, n in counts.items())})" if counts else "") + ". "
                "A gain in-sample that is smaller held-out is over-fitting.\n",
                "| task | in-sample before → after | held-out before → after | held-out last block drift before → "
                "after |",
                "|---|---|---|---|",
            ]
            rising = set(self.heldout_rising_tasks())
            for task, st in measured.items():
                lines.append(
                    f"| {markdown_cell(task)} | {st['head_before'][-1]:.2%} → {st['head_after'][-1]:.2%} | "
                    f"{st['heldout_head_before'][-1]:.2%} → {st['heldout_head_after'][-1]:.2%}"
                    + (" **rises**" if task in rising else "")
                    + f" | {st['heldout_before'][-1]:.4g} → {st['heldout_after'][-1]:.4g} |"
                )
        if self.guard is not None:
            gammas = ", ".join(f"{block}: {gamma:g}" for block, gamma in self.guard_gammas().items())
            lines.append(
                f"\nHeld-out guard `{self.guard.get('mode')}`: each calibrated block blended as W_merged + "
                f"γ·(W_calibrated − W_merged), γ chosen on the held-out drift (γ = 1: unguarded). γ per block: "
                f"{gammas or 'no block calibrated'}."
            )
        return lines


def markdown_cell(text: str) -> str:
    """`text` as one Markdown table cell: on one line, its `|` escaped (a task name with either would
    end its row early or split it into more cells)."""
    return " ".join(str(text).split()).replace("|", "\\|")


@dataclass(frozen=True)
class CardModel:
    """A model named on the card: its hub id (None when none is known) and how the card's text names it."""

    hub_id: str | None
    label: str


def describe_model(name: str | None, model: Any = None) -> CardModel:
    """What the card says about a base / expert given as `name` (hub id, open_clip ``hf-hub:`` /
    ``local-dir:`` reference, local folder; None for an in-memory model, whose ``_name_or_path`` is
    used). A local folder resolves to the hub id it came from when that is recorded: a snapshot in the
    hub cache (``models--org--name/snapshots/...``) or a config whose ``_name_or_path`` is a hub id."""
    if name is None and model is not None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if not name:
        return CardModel(None, "an in-memory model (no hub id recorded)")
    name = os.fspath(name)
    if name.startswith("hf-hub:"):
        return CardModel(name[len("hf-hub:"):], name[len("hf-hub:"):])
    path = name[len("local-dir:"):] if name.startswith("local-dir:") else name
    if os.path.isdir(path):
        hub_id = _hub_id_of_folder(path)
        folder = os.path.basename(os.path.normpath(path))
        if hub_id is not None and _hub_cache_id(path) == hub_id:  # a snapshot of the repository itself
            return CardModel(hub_id, hub_id)
        if hub_id is not None:
            return CardModel(hub_id, f"{hub_id} (local folder `{folder}`)")
        return CardModel(None, f"local folder `{folder}` (no hub id recorded)")
    if _is_hub_id(name):
        return CardModel(name, name)
    return CardModel(None, f"`{os.path.basename(os.path.normpath(path))}` (no hub id recorded)")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_cache_id(folder: str) -> str | None:
    """The repository of a snapshot folder in the hub cache (``models--{org}--{name}/snapshots/{revision}``)."""
    parts = os.path.realpath(folder).split(os.sep)
    for index, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[index + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/")
    return None


def _hub_id_of_folder(folder: str) -> str | None:
    cached = _hub_cache_id(folder)
    if cached is not None:
        return cached
    recorded = config_field(folder, "_name_or_path")
    return recorded if isinstance(recorded, str) and _is_hub_id(recorded) else None


def license_of(name: str | None, model: Any = None) -> dict[str, str]:
    """`license` (and `license_name` / `license_link` for ``other``) from the card of the model `name`
    refers to: a local folder's README.md, or a hub repository's card when it is in the local hub cache
    (nothing is downloaded). Empty when there is no such card or it names no license."""
    if name is None and model is not None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if not name:
        return {}
    name = os.fspath(name)
    path = name[len("local-dir:"):] if name.startswith("local-dir:") else name
    card_path = None
    if os.path.isfile(os.path.join(path, "README.md")):
        card_path = os.path.join(path, "README.md")
    else:
        hub_id = describe_model(name).hub_id
        if hub_id is not None:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(hub_id, "README.md")
            card_path = cached if isinstance(cached, str) else None
    if card_path is None:
        return {}
    try:
        data = ModelCard.load(card_path, ignore_metadata_errors=True).data
    except Exception:  # noqa: BLE001 - an unreadable card carries no license
        return {}
    return {
        key: str(getattr(data, key)) for key in ("license", "license_name", "license_link") if getattr(data, key, None)
    }


def pipeline_tag_of(model: Any) -> str | None:
    """The hub's pipeline tag for `model`'s class, from transformers' own task mapping (the one
    `Trainer` uses for its cards); a bare backbone is a feature extractor. open_clip: zero-shot image
    classification with a text tower, image feature extraction without."""
    from .architectures import layer_map_or_none

    layer_map = layer_map_or_none(model)
    tag = layer_map.pipeline_tag(model) if layer_map is not None else None
    if tag is not None:
        return tag
    from transformers.modelcard import TASK_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = type(model).__name__
    for task, mapping in TASK_MAPPING.items():
        if name in _class_names(mapping):
            return task
    if name in _class_names(MODEL_MAPPING_NAMES):
        return (
            "image-feature-extraction"
            if getattr(model, "main_input_name", None) == "pixel_values"
            else "feature-extraction"
        )
    return None


def _class_names(mapping: Any) -> set[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update(value if isinstance(value, (list, tuple)) else [value])
    return names


def _without_inherited_ids(base: CardModel | None, experts: dict[str, CardModel]) -> dict[str, CardModel]:
    """An expert whose hub id is the base's or another expert's is a copy changed in memory (its
    ``_name_or_path`` says where it was loaded from, not what it is now): it has no hub id of its own."""
    ids = [m.hub_id for m in experts.values()]
    taken = {base.hub_id} if base is not None else set()
    out = {}
    for task, model in experts.items():
        if model.hub_id is not None and (model.hub_id in taken or ids.count(model.hub_id) > 1):
            model = CardModel(None, f"a model derived from {model.hub_id} in memory (no hub id of its own)")
        out[task] = model
    return out


def build_model_card(
    *,
    model_class: str,
    base: CardModel | None,
    experts: dict[str, CardModel],
    library_name: str = "transformers",
    pipeline_tag: str | None = None,
    license: dict[str, Any] | None = None,
    samples_per_task: dict[str, int],
    featcal_config: dict[str, Any],
    report: DriftReport | None,
    merge_info: dict[str, Any] | None,
) -> ModelCard:
    """A model card (README.md with hub metadata) for a FeatCal-calibrated merged model.

    Metadata as the hub expects for merges: `base_model` lists the hub ids of the merged models (the
    base, then the experts; models without a hub id are named in the text only) with
    `base_model_relation: merge`; `pipeline_tag`, `library_name`, the base's license, and the run under
    `featcal`."""
    experts = _without_inherited_ids(base, experts)
    parents = list(dict.fromkeys(m.hub_id for m in [*([base] if base else []), *experts.values()] if m.hub_id))
    data = ModelCardData(
        base_model=parents or None,
        library_name=library_name,
        pipeline_tag=pipeline_tag,
        tags=["merge", "hf_featcal", "featcal", "model-merging"],
        **(license or {}),
    )
    if parents:
        data.base_model_relation = "merge"  # type: ignore[attr-defined]  # kept as extra card metadata
    data.featcal = {  # type: ignore[attr-defined]
        "base_model": None if base is None else base.hub_id,
        "experts": {task: model.hub_id for task, model in experts.items()},
        "tasks": list(experts),
        "samples_per_task": samples_per_task,
        "merge": merge_info,
        "config": featcal_config,
    }
    if report is not None and report.guard is not None:
        data.featcal["guard_gammas"] = report.guard_gammas()  # type: ignore[attr-defined]
    merge_text = (
        ", ".join(f"{k}={v}" for k, v in merge_info.items()) if merge_info else "not recorded"
    )
    expert_lines = "\n".join(f"- `{task}`: {model.label}" for task, model in experts.items())
    sample_lines = ", ".join(f"{task}: {n}" for task, n in samples_per_task.items())
    config_lines = "\n".join(f"| {k} | {v} |" for k, v in featcal_config.items())
    drift = report.summary_markdown() if report is not None else "Not measured."
    content = f"""---
{data.to_yaml()}
---

# FeatCal-calibrated merged model

A merged `{model_class}` whose block weights were recalibrated with FeatCal (feature calibration for
post-merging models, arXiv 2605.13030) using `hf_featcal`. Same architecture and size as the merged model: no extra modules, no task routing.

- **Base model:** {base.label if base is not None else "none (anchor = merged weights)"}
- **Merge:** {merge_text}
- **Calibration examples per task:** {sample_lines}

## Experts

{expert_lines}

## FeatCal settings

| setting | value |
|---|---|
{config_lines}

## Feature drift (mean ‖h_merged − h_expert‖ per token; what the head reads, relative to the expert)

{drift}
"""  # noqa: E501 - the card's paragraph as it is written
    return ModelCard(content)
