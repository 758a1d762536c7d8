"""hf-janus: undo catastrophic forgetting after fine-tuning by JAcobian NUll Space projection.

The public names are imported when first used (PEP 562), so that ``import hf_janus`` and ``hf-janus --help`` do not
load torch, transformers, PEFT and bitsandbytes before anything needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_janus.version import __version__

#: each public name and the module that defines it
_PUBLIC = {
    "RectifiedDelta": "hf_janus.adapters.saved.delta",
    "MergeReport": "hf_janus.adapters.saved.merge_report",
    "JanusMerger": "hf_janus.adapters.saved.merger",
    "JanusConfig": "hf_janus.engine.config",
    "register_layer_rule": "hf_janus.engine.layers",
    "resolve_target_modules": "hf_janus.engine.layers",
    "Rectifier": "hf_janus.engine.rectifier",
    "rectify": "hf_janus.engine.rectifier",
    "LayerStats": "hf_janus.engine.report",
    "RectificationReport": "hf_janus.engine.report",
    "StepRecord": "hf_janus.engine.report",
    "TrialRecord": "hf_janus.engine.report",
    "LayerResult": "hf_janus.engine.result",
    "RectificationResult": "hf_janus.engine.result",
    "JanusError": "hf_janus.errors",
    "RectificationError": "hf_janus.errors",
    "FrontierResult": "hf_janus.evaluation.frontier_result",
    "frontier": "hf_janus.evaluation.frontier_search",
    "EvaluationResult": "hf_janus.evaluation.harness",
    "evaluate": "hf_janus.evaluation.harness",
    "JanusCallback": "hf_janus.integrations.trainer",
    "load_report": "hf_janus.publish.hub",
    "PublishedReport": "hf_janus.publish.record_file",
    "SelfReplay": "hf_janus.replay.self_replay",
    "self_replay": "hf_janus.replay.self_replay",
    "ReplayOptions": "hf_janus.replay.sources",
}

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time each name is imported on first use
    from hf_janus.adapters.saved.delta import RectifiedDelta
    from hf_janus.adapters.saved.merge_report import MergeReport
    from hf_janus.adapters.saved.merger import JanusMerger
    from hf_janus.engine.config import JanusConfig
    from hf_janus.engine.layers import register_layer_rule, resolve_target_modules
    from hf_janus.engine.rectifier import Rectifier, rectify
    from hf_janus.engine.report import LayerStats, RectificationReport, StepRecord, TrialRecord
    from hf_janus.engine.result import LayerResult, RectificationResult
    from hf_janus.errors import JanusError, RectificationError
    from hf_janus.evaluation.frontier_result import FrontierResult
    from hf_janus.evaluation.frontier_search import frontier
    from hf_janus.evaluation.harness import EvaluationResult, evaluate
    from hf_janus.integrations.trainer import JanusCallback
    from hf_janus.publish.hub import load_report
    from hf_janus.publish.record_file import PublishedReport
    from hf_janus.replay.self_replay import SelfReplay, self_replay
    from hf_janus.replay.sources import ReplayOptions


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_janus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


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
