"""Evaluation with lm-evaluation-harness (the ``[eval]`` extra): the paper's AP1/AP2/AP for θ0, θ̂ and
rectified models, lm-eval tasks that read local files, and the stability-plasticity frontier."""

from hf_janus.evaluation.frontier_result import FrontierPoint, FrontierResult
from hf_janus.evaluation.frontier_search import frontier
from hf_janus.evaluation.harness import EvaluationResult, Scorer, evaluate, resolve_tasks
from hf_janus.evaluation.local_tasks import completion_task, qa_task, task_dir, task_from_file
from hf_janus.evaluation.scoring import ap_metrics, exact_match, normalize_answer

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
