"""A layer map inferred for an architecture without one, used only when the caller opts in
(`FeatCalCalibrator(..., allow_inferred_layer_map=True)`).

Blocks are the repeated modules that `model._no_split_modules` names (that list also holds embedding
classes: only classes that appear as the items of a `ModuleList` of two or more count), in forward
order; every `nn.Linear` and `nn.LayerNorm` / `*RMSNorm` inside them is calibrated; each stream
enters the first block through the model's own forward. No pooled-token weighting, no shared-input
groups (statistics are computed per module), and only plain-scale RMS norms: a norm class whose
forward adds an offset to its weight (Gemma's `1 + w`) would be solved wrongly, so check the list of
what was found that the calibrator prints.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from . import model_type_of
from .base import LayerMap, Stack

#: Batch keys that are targets or masks for a loss rather than model inputs.
_NOT_INPUTS = ("labels", "loss_mask")


class InferredLayerMap(LayerMap):
    """The inferred map of one model (built by `infer_layer_map`)."""

    def __init__(self, model: nn.Module, block_lists: list[str]) -> None:
        self.block_lists = block_lists
        self.main_input_name = getattr(model, "main_input_name", "input_ids")
        config: Any = model.config
        self.model_types = (config.model_type,)
        # a key/value cache would be shared by the replays of a block: never build one
        self._no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def stacks(self, tower: nn.Module) -> list[Stack]:
        # `infer_layer_map` chose these names among the model's ModuleLists
        return [Stack(name, cast(nn.ModuleList, tower.get_submodule(name))) for name in self.block_lists]

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k not in _NOT_INPUTS}
        return {**inputs, "use_cache": False} if self._no_cache else inputs

    def compatibility(self, config: Any) -> dict[str, Any]:
        # no known geometry fields: the parameter-shape check does the work
        return {}


#: Architectures whose blocks apply one Linear to two different inputs per forward, which FeatCal's
#: per-module objective cannot express (DeBERTa: `query_proj`/`key_proj` also project the shared
#: relative-position embeddings).
_REFUSED = {
    "deberta": "its disentangled attention applies query_proj/key_proj to the hidden states and to the "
    "relative-position embeddings alike",
    "deberta-v2": "its disentangled attention applies query_proj/key_proj to the hidden states and to the "
    "relative-position embeddings alike",
}


def infer_layer_map(model: nn.Module) -> InferredLayerMap:
    """Infer the blocks of an unregistered architecture; warns with what was found."""
    model_type = model_type_of(model)
    if model_type in _REFUSED:
        raise ValueError(f"`model`: {type(model).__name__} cannot be calibrated with FeatCal: {_REFUSED[model_type]}.")
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    lists = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(item).__name__ for item in module}
            if len(classes) == 1 and classes <= block_classes:
                lists.append(name)
    if not lists:
        raise ValueError(
            f"`model`: cannot infer the blocks of {type(model).__name__}: no ModuleList of the classes in its "
            f"_no_split_modules ({sorted(block_classes)})."
        )
    layer_map = InferredLayerMap(model, lists)
    layer_map.rms_norm_classes = tuple(
        {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    )
    first = cast(nn.ModuleList, model.get_submodule(lists[0]))[0]
    found = [f"{spec.name} ({spec.kind})" for spec in layer_map.block_modules(first)]
    sizes = ", ".join(str(len(cast(nn.ModuleList, model.get_submodule(n)))) for n in lists)
    warnings.warn(
        f"{type(model).__name__} has no registered layer map; inferred blocks {lists} "
        f"({sizes} blocks) with modules {found}. "
        "Check that these are the blocks and norms to calibrate.",
        UserWarning,
        stacklevel=3,
    )
    return layer_map
