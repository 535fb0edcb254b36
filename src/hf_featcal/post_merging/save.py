"""Saving a post-merging step's result (`PostMergingResult`) as one save (`hf_featcal.saving.atomic_folder`):
the model's files as its library loads them back, and for a result with per-task modules their files
(`TaskModules.save_pretrained`: ``post_merging_modules.safetensors`` and ``post_merging_config.json``)
beside them, with a model card (``README.md``) that says the task is needed at inference and how many
parameters the modules add. The save's manifest (``featcal_manifest.json``) lists every file, so a push
(`hf_featcal.saving.push_folder`) uploads them all."""

from __future__ import annotations

import os
from typing import Any

from .registry import PostMergingResult

__all__ = ["save_post_merged", "write_post_merged"]


def save_post_merged(result: PostMergingResult, output_dir: str | os.PathLike, *, step: str,
                     processing_class: Any = None, overwrite: bool = False) -> list[str]:
    """Save `result` of post-merging step `step` into `output_dir` (checked as every save is: an empty or
    new folder, or an earlier hf_featcal save; `overwrite` as in `check_output_dir`); returns the entries
    the save wrote (its manifest's)."""
    from ..saving import atomic_folder, read_manifest
    from .registry import get_step

    get_step(step)  # KeyError naming the known steps for an unknown one, before writing
    if not isinstance(result, PostMergingResult):
        raise TypeError(f"`result` must be a PostMergingResult, got {type(result).__name__}")
    with atomic_folder(output_dir, overwrite=overwrite) as folder:
        write_post_merged(result, folder, step=step, processing_class=processing_class)
    return read_manifest(output_dir) or []


def write_post_merged(result: PostMergingResult, folder: str, *, step: str, processing_class: Any = None) -> None:
    """Write `result` of step `step` into `folder`, a save being made (`hf_featcal.saving.atomic_folder`):
    the model's files, and for a result with per-task modules their files and the model card."""
    from ..saving import save_model_files
    from .registry import get_step

    save_model_files(result.model, folder, processing_class=processing_class)
    if result.task_modules is not None:
        result.task_modules.save_pretrained(folder)
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(_card(result, get_step(step)))


def _card(result: PostMergingResult, step: Any) -> str:
    modules = result.task_modules
    use = ("pass the task at inference: `with modules.for_task(model, task): ...`" if result.needs_task
           else "one module serves every task: `with modules.for_task(model): ...`")
    return f"""# Merged model with {step.name} modules

A merged `{type(result.model).__name__}` (unchanged) with the per-task representation modules of
`{step.name}` ({step.reference}), saved by `hf_featcal`.

- **Task needed at inference:** {"yes" if result.needs_task else "no"}
- **Parameters added to the merged model:** {result.added_parameters:,} (tasks: {", ".join(modules.tasks)})
- **Files:** the model's, `post_merging_modules.safetensors`, `post_merging_config.json`

Load and use:

```python
from hf_featcal.post_merging.task_modules import TaskModules

modules = TaskModules.from_pretrained("<this folder>")
# model = <the model class>.from_pretrained("<this folder>")
# {use}
```
"""
