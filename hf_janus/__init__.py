"""hf-janus: undo catastrophic forgetting after fine-tuning by JAcobian NUll Space projection."""

from .callback import JanusCallback
from .config import JanusConfig
from .errors import JanusError, RectificationError
from .layers import register_layer_rule, resolve_target_modules
from .rectifier import Rectifier, rectify
from .report import LayerStats, RectificationReport, StepRecord, TrialRecord

__version__ = "0.1.0"

__all__ = [
    "JanusCallback",
    "JanusConfig",
    "JanusError",
    "LayerStats",
    "RectificationError",
    "RectificationReport",
    "Rectifier",
    "StepRecord",
    "TrialRecord",
    "__version__",
    "rectify",
    "register_layer_rule",
    "resolve_target_modules",
]
