"""hf-janus: undo catastrophic forgetting after fine-tuning by JAcobian NUll Space projection."""

from .callback import JanusCallback
from .config import JanusConfig
from .errors import JanusError, RectificationError
from .hub import PublishedReport, load_report
from .layers import register_layer_rule, resolve_target_modules
from .merger import JanusMerger, MergeReport, RectifiedDelta
from .rectifier import Rectifier, rectify
from .report import LayerStats, RectificationReport, StepRecord, TrialRecord

__version__ = "0.1.0"

__all__ = [
    "JanusCallback",
    "JanusConfig",
    "JanusError",
    "JanusMerger",
    "LayerStats",
    "MergeReport",
    "PublishedReport",
    "RectificationError",
    "RectificationReport",
    "RectifiedDelta",
    "Rectifier",
    "StepRecord",
    "TrialRecord",
    "__version__",
    "load_report",
    "rectify",
    "register_layer_rule",
    "resolve_target_modules",
]
