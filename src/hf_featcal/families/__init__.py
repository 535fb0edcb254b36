"""Model families: what the CLI, recipes and evaluation know about a kind of model, one class each.

The families sit above `hf_featcal.architectures`, `hf_featcal.evaluation` and `hf_featcal.saving`:
they import those, never the other way round. `base` holds the `ModelFamily` interface and its
registry; `clip`, `open_clip`, `flan_t5`, `causal_lm` (Llama, Mistral, Qwen2/3), `bert` (BERT,
RoBERTa) and `vit` one family each (`image` what the image families share, `text` what the text ones share).
Adding a family is one module here with a `ModelFamily` subclass decorated with `register_family`, plus
its import below. Importing this package loads no heavy library (``hf-featcal --help`` reads it).
"""

from __future__ import annotations

from . import bert, causal_lm, clip, flan_t5, open_clip, vit  # noqa: F401 - each registers its family
from .base import (
    FamilyUsageError,
    ModelFamily,
    detect_family,
    family_names,
    get_family,
    image_family_names,
    iter_families,
    no_family_reason,
    register_family,
    source_schemes,
)

__all__ = [
    "FamilyUsageError",
    "ModelFamily",
    "detect_family",
    "family_names",
    "get_family",
    "image_family_names",
    "iter_families",
    "no_family_reason",
    "register_family",
    "source_schemes",
]
