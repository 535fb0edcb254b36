"""hf_featcal: FeatCal feature calibration for merged models, as a one-call Hugging Face step."""

from .architectures import LayerMap, get_layer_map, register_layer_map, supported_model_types
from .calibrator import FeatCalCalibrator, FeatCalError, FeatCalWarning
from .config import FeatCalConfig
from .report import DriftReport

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
