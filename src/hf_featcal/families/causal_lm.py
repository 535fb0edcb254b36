"""Decoder-only LLMs (Llama, Mistral, Qwen2, Qwen3): the ``causal_lm`` family, calibrated on text or chat
messages and scored by held-out perplexity (and lm-evaluation-harness tasks when asked)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..architectures import model_type_of
from .base import FamilyUsageError, register_family
from .text import TextFamily, tokenize_texts

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import EvaluationSpec

__all__ = ["CausalLMFamily"]


@register_family
class CausalLMFamily(TextFamily):
    """Llama-architecture decoders (``*ForCausalLM``; the layer map's model types)."""

    name = "causal_lm"
    article_name = "a decoder LLM (Llama, Mistral, Qwen2/3)"
    score_label = "held-out perplexity"
    score_in_percent = False
    lower_is_better = True
    evaluation_data_keys = ("dataset", "config", "split", "text_column", "messages_column")
    evaluation_keys = ("lm_eval_tasks", "lm_eval_include_path")
    default_evaluation_batch_size = 8

    def matches(self, model_or_config: Any) -> bool:
        from ..architectures.llama import LlamaFamilyLayerMap  # the model types FeatCal calibrates

        return model_type_of(model_or_config) in LlamaFamilyLayerMap.model_types

    def default_evaluation_split(self, task: str) -> str:
        return "test"

    def evaluation_to_dict(self, evaluation: EvaluationSpec) -> dict[str, Any]:
        if not evaluation.lm_eval_tasks:
            return {}
        return {"lm_eval_tasks": list(evaluation.lm_eval_tasks),
                "lm_eval_include_path": evaluation.lm_eval_include_path}

    def check_evaluate_options(self, *, class_names, templates, clip_model) -> None:
        if class_names or templates or clip_model:
            raise FamilyUsageError("--class-names, --template and --clip-model are only for CLIP models")

    def evaluation_source(self, task, data, configs, class_names):
        if task not in data:
            raise FamilyUsageError(f"--task {task}: a decoder LLM is scored by perplexity on text: give --data "
                                   f"{task}=DATASET (a hub id or a save_to_disk folder with a held-out split)")
        return data[task], configs.get(task), None

    def evaluate_task(self, model, task, ds, data_spec, spec, *, processing, clip_model=None, device=None):
        """Perplexity of `model` on the task's held-out texts (tokenised as for calibration)."""
        from ..evaluation.perplexity import perplexity

        if getattr(model, "get_output_embeddings", lambda: None)() is None:
            raise ValueError(f"perplexity needs a language-model head: the model is a {type(model).__name__}; "
                             "use the *ForCausalLM checkpoint (or evaluation: false)")
        tokenizer = processing["tokenizer"]
        rows = tokenize_texts(ds, data_spec, tokenizer, f"evaluation.datasets.{task}")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        result = perplexity(model, rows["input_ids"], pad_token_id=pad or 0, batch_size=spec.batch_size,
                            device=device)
        return result["perplexity"], {**result, "split": data_spec.split}

    def evaluate_whole_model(self, model: Any, spec: EvaluationSpec, *, processing: Mapping[str, Any],
                             device: Any = None) -> dict[str, Any]:
        """The lm-evaluation-harness tasks of ``evaluation.lm_eval_tasks`` (none: {})."""
        if not spec.lm_eval_tasks:
            return {}
        from ..evaluation.lm_harness import lm_eval_scores

        return {"lm_eval": lm_eval_scores(model, processing["tokenizer"], spec.lm_eval_tasks,
                                          include_path=spec.lm_eval_include_path, batch_size=spec.batch_size,
                                          limit=spec.max_samples)}
