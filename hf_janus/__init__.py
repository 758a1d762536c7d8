"""hf-janus: undo catastrophic forgetting after fine-tuning by JAcobian NUll Space projection."""

from hf_janus.adapters.saved.delta import RectifiedDelta
from hf_janus.adapters.saved.merge_report import MergeReport
from hf_janus.adapters.saved.merger import JanusMerger
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.layers import register_layer_rule, resolve_target_modules
from hf_janus.engine.rectifier import Rectifier, rectify
from hf_janus.engine.report import LayerStats, RectificationReport, StepRecord, TrialRecord
from hf_janus.engine.result import LayerResult, RectificationResult
from hf_janus.errors import JanusError, RectificationError
from hf_janus.evaluation.frontier_search import FrontierResult, frontier
from hf_janus.evaluation.harness import EvaluationResult, evaluate
from hf_janus.integrations.trainer import JanusCallback
from hf_janus.publish.hub import load_report
from hf_janus.publish.record_file import PublishedReport
from hf_janus.replay.self_replay import SelfReplay, self_replay
from hf_janus.replay.sources import ReplayOptions
from hf_janus.version import __version__


__all__ = [
    "JanusCallback",
    "JanusConfig",
    "EvaluationResult",
    "FrontierResult",
    "JanusError",
    "JanusMerger",
    "LayerResult",
    "LayerStats",
    "MergeReport",
    "PublishedReport",
    "RectificationError",
    "RectificationReport",
    "RectificationResult",
    "RectifiedDelta",
    "ReplayOptions",
    "Rectifier",
    "SelfReplay",
    "StepRecord",
    "TrialRecord",
    "__version__",
    "evaluate",
    "frontier",
    "load_report",
    "rectify",
    "register_layer_rule",
    "resolve_target_modules",
    "self_replay",
]
