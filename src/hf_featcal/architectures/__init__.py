"""Per-architecture layer maps, found through a registry keyed by `config.model_type`.

Adding an architecture is one file here that defines a `LayerMap` subclass decorated with
`register_layer_map`, plus its name in `_LAYER_MAP_MODULES` below. The layer maps (and torch) load on
the first use of a name of this package, so that `model_type_of` (which `hf_featcal.families`, read by
the CLI's `--help`, uses) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LAYER_NORM",
    "LINEAR",
    "POSITIONS",
    "REPRESENTATION_FORWARDS",
    "RMS_NORM",
    "TOKEN",
    "VECTOR",
    "LayerMap",
    "LibraryCheckpoint",
    "ModuleSpec",
    "RepresentationPoint",
    "Stack",
    "find_library_checkpoint",
    "get_layer_map",
    "layer_map_or_none",
    "model_config",
    "model_type_of",
    "packed_attention_specs",
    "processing_recorded",
    "register_layer_map",
    "supported_model_types",
]

#: Modules that register a layer map when imported.
_LAYER_MAP_MODULES = ("bert", "clip", "llama", "openclip", "t5", "vit")


def model_type_of(model_or_config: Any) -> str | None:
    """The `model_type` of a model's config, or of a config itself; None when there is none (an
    open_clip model, a plain `nn.Module`). Defined here rather than in `base` so that it loads no torch."""
    return getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)


def __getattr__(name: str) -> Any:
    if name in (*_LAYER_MAP_MODULES, "auto", "base"):  # `architectures.openclip` without importing it
        return importlib.import_module(f".{name}", __name__)
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = importlib.import_module(".base", __name__)
    for module in _LAYER_MAP_MODULES:  # registers the layer maps
        importlib.import_module(f".{module}", __name__)
    value = getattr(base, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
