"""hf-janus: undo catastrophic forgetting after fine-tuning by JAcobian NUll Space projection."""

from hf_janus.integrations.trainer import JanusCallback
from hf_janus.config import JanusConfig
from hf_janus.errors import JanusError, RectificationError
from hf_janus.publish.hub import PublishedReport, load_report
from hf_janus.engine.layers import register_layer_rule, resolve_target_modules
from hf_janus.adapters.merger import JanusMerger, MergeReport, RectifiedDelta
from hf_janus.engine.rectifier import Rectifier, rectify
from hf_janus.engine.report import LayerStats, RectificationReport, StepRecord, TrialRecord

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
