"""Weight-space merging of task experts, in mergekit's shape: every method of `merge_methods()` (the
table in docs/merge-methods.md lists them with the data each needs, what it holds in memory and its
reference).

* `hf_featcal.merging.methods`: one file per method, each with its function and the `MergeMethod` it
  registers (the file names are the method names).
* `hf_featcal.merging.params` (no torch): `MergeParameter` and `MergeMethod`, what a method declares.
* `hf_featcal.merging.registry` (no torch): `register`, `get_method`, `merge_methods`; the schema, the
  CLI, recipes and `hf_featcal.compare` read the methods there.
* `hf_featcal.merging.engine`: what the task-vector methods share (opening the base and the experts,
  lining their keys up, the per-tensor loop, sign election, radix select).
* `hf_featcal.merging.svc`: `singular_value_calibration`, a data-free post-merging step (after any merge).

Every merge function returns a *new* model (the base model and the experts are never modified) and
records the merge as ``merged.config.hf_featcal_merge``; `merge_models` names the method by string.
Importing this package loads no torch: the method files import it inside their functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .methods.average import simple_average
from .methods.dare import dare_merging
from .methods.dare_ties import dare_ties_merging
from .methods.iso_c import iso_c_merging
from .methods.iso_cts import iso_cts_merging
from .methods.regmean import regmean_merging
from .methods.regmean_plusplus import regmean_plusplus_merging
from .methods.task_arithmetic import task_arithmetic
from .methods.ties import ties_merging
from .methods.tsv_m import tsv_merging
from .methods.wudi import wudi_merging
from .params import CALIBRATION_ARGUMENTS, MERGE_CONFIG_ATTRIBUTE, MergeMethod, MergeParameter
from .registry import get_method, merge_methods, paper_defaults, register
from .svc import singular_value_calibration

if TYPE_CHECKING:
    from torch import nn

    from ..model_io import ModelLike, find_key_prefix

__all__ = [
    "paper_defaults",
    "task_arithmetic",
    "simple_average",
    "ties_merging",
    "dare_merging",
    "dare_ties_merging",
    "regmean_merging",
    "regmean_plusplus_merging",
    "tsv_merging",
    "iso_c_merging",
    "iso_cts_merging",
    "wudi_merging",
    "singular_value_calibration",
    "merge_models",
    "find_key_prefix",
    "get_method",
    "merge_methods",
    "register",
    "MergeMethod",
    "MergeParameter",
    "MERGE_CONFIG_ATTRIBUTE",
    "MERGE_METHODS",
]


def merge_models(base_model: ModelLike, experts: Mapping[str, ModelLike], method: str, **params: object) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with the registered method named ``method``.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id.
        method: a name of `merge_methods()` or an alias (e.g. ``"simple_average"`` for ``"average"``);
            each method's parameters are its function's (``get_method(name).parameters``).
        **params: The method's parameters (defaults as in its function); a method that needs
            calibration data also takes ``calibration_data`` (required) and its batching
            (``num_samples_per_task``, ``batch_size``, ``processing_class``, ``seed``).

    Returns:
        The merged model (``config.hf_featcal_merge`` records method and parameters).

    Raises:
        ValueError: for an unknown ``method``, a parameter the method does not take, missing calibration
            data, or an invalid value (the message names the argument).
    """
    known = [name for m in merge_methods().values() for name in (m.name, *m.aliases)]
    if not isinstance(method, str) or method not in known:
        raise ValueError(f"`method` must be one of {sorted(known)}, got {method!r}")
    declared = get_method(method)
    accepted = [p.name for p in declared.parameters]
    if declared.needs_calibration_data:
        accepted += CALIBRATION_ARGUMENTS
        if "calibration_data" not in params:
            raise ValueError(f"merge method {method!r} needs `calibration_data` (task -> its calibration data)")
    for name in params:
        if name not in accepted:
            raise ValueError(
                f"`{name}` is not a parameter of merge method {method!r} (accepted: {accepted or 'none'})"
            )
    return declared.function(base_model, experts, **params)


def __getattr__(name: str) -> Any:
    if name == "MERGE_METHODS":  # read from the registry: a method registered later is in it
        methods: dict[str, Callable[..., Any]] = {}
        for method in merge_methods().values():
            methods.update(dict.fromkeys((method.name, *method.aliases), method.function))
        return methods
    if name == "find_key_prefix":  # a torch module: loaded on first use
        from ..model_io import find_key_prefix

        return find_key_prefix
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
