"""lm-evaluation-harness tasks on an in-memory causal language model (``lm_eval.simple_evaluate`` with
its ``hf`` backend wrapped around the model and tokenizer, so nothing is saved or reloaded)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

__all__ = ["LM_EVAL_INSTALL", "lm_eval_installed", "lm_eval_scores"]

#: How to install the harness with its transformers backend.
LM_EVAL_INSTALL = "pip install 'hf_featcal[lm_eval]' (lm-eval[hf])"


def lm_eval_installed() -> bool:
    """Whether lm-evaluation-harness can be imported (checked without importing it)."""
    return importlib.util.find_spec("lm_eval") is not None


def lm_eval_scores(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, dict[str, float]]:
    """Task → metric → value (e.g. ``{"my_mc": {"acc": 0.6, "acc_norm": 0.4}}``; standard errors left
    out) of `model` on lm-evaluation-harness `tasks` (zero-shot; `include_path`: a folder of task YAMLs;
    `limit`: at most this many documents per task)."""
    if not lm_eval_installed():
        raise ImportError(f"lm-evaluation-harness tasks need lm-eval: {LM_EVAL_INSTALL}")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    task_manager = None
    if include_path is not None:  # indexing the harness's own ~15k task files takes seconds: only when needed
        task_manager = TaskManager(include_path=include_path, include_defaults=False)
        if not set(tasks) <= set(task_manager.all_tasks):
            task_manager = None
    if task_manager is None:
        task_manager = TaskManager(include_path=include_path)
    was_training = model.training
    model.eval()
    try:
        harness_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        results = simple_evaluate(model=harness_model, tasks=list(tasks), num_fewshot=0, limit=limit,
                                  task_manager=task_manager, log_samples=False)
    finally:
        model.train(was_training)
    if results is None:  # pragma: no cover - non-zero ranks of a distributed run
        return {}
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        scores[task] = {name.split(",")[0]: float(value) for name, value in metrics.items()
                        if isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in name}
    return scores
