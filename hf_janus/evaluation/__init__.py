"""Evaluation with lm-evaluation-harness (the ``[eval]`` extra): the paper's AP1/AP2/AP for θ0, θ̂ and
rectified models, lm-eval tasks that read local files, and the stability-plasticity frontier."""

import sys

from hf_janus.evaluation import frontier_search
from hf_janus.evaluation.frontier_search import FrontierPoint, FrontierResult, frontier
from hf_janus.evaluation.harness import EvaluationResult, Scorer, evaluate, resolve_tasks
from hf_janus.evaluation.local_tasks import completion_task, qa_task, task_dir, task_from_file
from hf_janus.evaluation.scoring import ap_metrics, exact_match, normalize_answer

# The implementation's module was ``frontier``, the same name as the function it defines, so that
# ``hf_janus.evaluation.frontier`` was the function or the module depending on what had been imported; it is now
# ``frontier_search``. The old module path stays importable for code written against it (``from
# hf_janus.evaluation.frontier import wise_margin``), as an alias registered here, without a module of that name being
# loaded later and rebinding the package's ``frontier`` from the function to a module.
sys.modules[__name__ + ".frontier"] = frontier_search

__all__ = [
    "EvaluationResult",
    "FrontierPoint",
    "FrontierResult",
    "Scorer",
    "ap_metrics",
    "completion_task",
    "evaluate",
    "exact_match",
    "frontier",
    "normalize_answer",
    "qa_task",
    "resolve_tasks",
    "task_dir",
    "task_from_file",
]
