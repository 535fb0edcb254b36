"""hf_featcal: FeatCal feature calibration for merged models, as a one-call Hugging Face step.

The public names load on first use (PEP 562 module `__getattr__`): `import hf_featcal` stays fast, and
torch, transformers and datasets are imported only when a name that needs them is first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the eager imports, for type checkers and IDEs
    from .architectures import LayerMap, get_layer_map, register_layer_map, supported_model_types
    from .calibrator import FeatCalCalibrator, FeatCalError, FeatCalWarning
    from .config import FeatCalConfig
    from .report import DriftReport

# public name -> the submodule that defines it
_LAZY_NAMES: dict[str, str] = {
    "DriftReport": ".report",
    "FeatCalCalibrator": ".calibrator",
    "FeatCalConfig": ".config",
    "FeatCalError": ".calibrator",
    "FeatCalWarning": ".calibrator",
    "LayerMap": ".architectures",
    "get_layer_map": ".architectures",
    "register_layer_map": ".architectures",
    "supported_model_types": ".architectures",
}

__all__ = [
    "DriftReport",
    "FeatCalCalibrator",
    "FeatCalConfig",
    "FeatCalError",
    "FeatCalWarning",
    "LayerMap",
    "get_layer_map",
    "register_layer_map",
    "supported_model_types",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # resolved once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
