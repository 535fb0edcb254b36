"""Per-architecture layer maps, found through a registry keyed by `config.model_type`.

Adding an architecture is one file here that defines a `LayerMap` subclass decorated with
`register_layer_map`, plus its import below.
"""

from .base import (
    LAYER_NORM,
    LINEAR,
    RMS_NORM,
    LayerMap,
    LibraryCheckpoint,
    ModuleSpec,
    Stack,
    find_library_checkpoint,
    get_layer_map,
    model_config,
    packed_attention_specs,
    register_layer_map,
    supported_model_types,
)
from . import bert, clip, llama, openclip, t5, vit  # noqa: F401  (registers the layer maps)

__all__ = [
    "LAYER_NORM",
    "LINEAR",
    "RMS_NORM",
    "LayerMap",
    "LibraryCheckpoint",
    "ModuleSpec",
    "Stack",
    "find_library_checkpoint",
    "get_layer_map",
    "model_config",
    "packed_attention_specs",
    "register_layer_map",
    "supported_model_types",
]
