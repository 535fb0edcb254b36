"""The drift report (how far the merged model's features are from each expert's, per block) and the
model card that carries it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

REPORT_NAME = "featcal_drift_report.json"


@dataclass
class DriftReport:
    """Per task and block: Σ‖h_merged − h_expert‖₂ / N over the N non-padding token positions of the
    task's calibration examples, at each block's raw output. `before` is the merged model as given,
    `after` the calibrated one."""

    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """`{"tasks": {task: {"before": [...], "after": [...]}}}` with plain Python floats."""
        return {
            "tasks": {
                task: {stage: [float(v) for v in values] for stage, values in stages.items()}
                for task, stages in self.tasks.items()
            }
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DriftReport":
        return cls({task: {k: list(v) for k, v in stages.items()} for task, stages in data["tasks"].items()})

    def save(self, save_directory: str | os.PathLike) -> str:
        """Write the report as JSON into `save_directory`; returns the file path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, REPORT_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DriftReport":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, REPORT_NAME)
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    def summary_markdown(self) -> str:
        """A table of last-block drift and the mean over blocks, before and after, per task."""
        if not self.tasks:
            return "No drift was measured."
        lines = [
            "| task | last block before | last block after | mean over blocks before | mean over blocks after |",
            "|---|---:|---:|---:|---:|",
        ]
        for task, stages in self.tasks.items():
            before, after = stages.get("before", []), stages.get("after", [])
            if not before or not after:
                continue
            lines.append(
                f"| {task} | {before[-1]:.4g} | {after[-1]:.4g} | "
                f"{sum(before) / len(before):.4g} | {sum(after) / len(after):.4g} |"
            )
        return "\n".join(lines)


def build_model_card(
    *,
    model_class: str,
    base_model: str | None,
    library_name: str = "transformers",
    experts: dict[str, str],
    samples_per_task: dict[str, int],
    featcal_config: dict[str, Any],
    report: DriftReport | None,
    merge_info: dict[str, Any] | None,
) -> ModelCard:
    """A model card (README.md with hub metadata) for a FeatCal-calibrated merged model."""
    if base_model is not None and base_model.startswith("hf-hub:"):  # open_clip's reference → the repo id
        base_model = base_model[len("hf-hub:"):]
    data = ModelCardData(
        library_name=library_name,
        base_model=base_model,
        tags=["hf_featcal", "featcal", "model-merging", "merge"],
    )
    data.featcal = {
        "experts": experts,
        "tasks": list(experts),
        "samples_per_task": samples_per_task,
        "merge": merge_info,
        "config": featcal_config,
    }
    merge_text = (
        ", ".join(f"{k}={v}" for k, v in merge_info.items()) if merge_info else "not recorded"
    )
    expert_lines = "\n".join(f"- `{task}`: {source}" for task, source in experts.items())
    sample_lines = ", ".join(f"{task}: {n}" for task, n in samples_per_task.items())
    config_lines = "\n".join(f"| {k} | {v} |" for k, v in featcal_config.items())
    drift = report.summary_markdown() if report is not None else "Not measured."
    content = f"""---
{data.to_yaml()}
---

# FeatCal-calibrated merged model

A merged `{model_class}` whose block weights were recalibrated with FeatCal (feature calibration for
post-merging models, arXiv 2605.13030) using `hf_featcal`. Same architecture and size as the merged model: no extra modules, no task routing.

- **Base model:** {base_model or "none (anchor = merged weights)"}
- **Merge:** {merge_text}
- **Calibration examples per task:** {sample_lines}

## Experts

{expert_lines}

## FeatCal settings

| setting | value |
|---|---|
{config_lines}

## Feature drift (mean ‖h_merged − h_expert‖ per token, per block)

{drift}
"""
    return ModelCard(content)
