"""Evaluate θ0, θ̂ and rectified models with lm-evaluation-harness (the paper's harness), and compute AP1/AP2/AP.

Needs the ``[eval]`` extra (``pip install "hf-janus[eval]"``). Tasks are lm-eval task names, lm-eval task config
dicts, or local JSONL files (:mod:`hf_janus.evaluation.local_tasks`: QA exact match or completion likelihood), so
evaluation can run offline.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from hf_janus.errors import JanusError
from hf_janus.evaluation.local_tasks import task_from_file
from hf_janus.evaluation.scoring import ap_metrics
from hf_janus.evaluation.strict_json import dumps
from hf_janus.io_utils import atomic_write_text
from hf_janus.model_modes import evaluation_mode

logger = logging.getLogger(__name__)

ModelLike = Union[nn.Module, str, os.PathLike]
TaskLike = Union[str, os.PathLike, Mapping[str, Any]]

#: The names of the three models of a rectification, as rows of an :class:`EvaluationResult`.
REFERENCE, FINETUNED, RECTIFIED = "reference", "finetuned", "rectified"


def require_lm_eval() -> Any:
    """The ``lm_eval`` module, or an error that says how to install it."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401 - the backend every evaluation here uses
    except ImportError as err:
        raise JanusError('evaluation needs lm-evaluation-harness: pip install "hf-janus[eval]" '
                         f"(or pip install lm-eval) ({err})") from err
    return lm_eval


# ---- tasks -------------------------------------------------------------------------------------------------
@dataclass
class TaskSpec:
    """One task as lm-eval takes it, and the name its results are filed under."""

    name: str
    spec: Any  # an lm-eval task name or task config dict

    @property
    def description(self) -> str:
        if isinstance(self.spec, str):
            return self.spec
        kwargs = self.spec.get("dataset_kwargs") or {}
        return f"{self.name} ({kwargs.get('data_files', 'inline config')})"


def resolve_task(task: TaskLike) -> TaskSpec:
    """A task name, a local JSONL path (QA or completion rows, see :func:`task_from_file`) or a config dict."""
    if isinstance(task, Mapping):
        if "task" not in task:
            raise JanusError(f"a task config dict needs a 'task' key (its name); got keys {sorted(task)}")
        return TaskSpec(str(task["task"]), dict(task))
    text = os.fspath(task)
    if text.endswith((".jsonl", ".json")) or os.path.isfile(text):
        config = task_from_file(text)
        return TaskSpec(config["task"], config)
    return TaskSpec(text, text)


def resolve_tasks(tasks: Union[TaskLike, Sequence[TaskLike], None]) -> list[TaskSpec]:
    if tasks is None:
        return []
    if isinstance(tasks, (str, os.PathLike, Mapping)):
        tasks = [tasks]
    specs = [resolve_task(t) for t in tasks]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise JanusError(f"task names must be unique, got {names}; name the tasks of same-named files")
    return specs


# ---- models --------------------------------------------------------------------------------------------------
def load_model(model: ModelLike, *, revision: Optional[str] = None, torch_dtype: Any = None,
               device: Any = None, token: Any = None, allow_pickle: bool = False) -> nn.Module:
    """A model object as is; a local directory or Hub repo id of full weights or of a PEFT adapter (merged on the
    base its ``adapter_config.json`` names).

    Weights are read from safetensors files; weights stored only as a pickle (``pytorch_model.bin``,
    ``adapter_model.bin``) are refused unless ``allow_pickle``, and then read with ``torch.load(weights_only=True)``.
    """
    if isinstance(model, nn.Module):
        return model
    from hf_janus.adapters.saved.loading import load_base_model

    name = os.path.expanduser(os.fspath(model))
    # a Hub repo: transformers would load an adapter repo itself, pickles included, so it is routed here
    if is_adapter(name, revision=revision, token=token):
        return _load_merged_adapter(name, revision=revision, torch_dtype=torch_dtype, device=device, token=token,
                                    allow_pickle=allow_pickle)
    return load_base_model(name, revision=revision, torch_dtype=torch_dtype, device=device, token=token,
                           allow_pickle=allow_pickle)


def is_adapter(model: ModelLike, *, revision: Optional[str] = None, token: Any = None) -> bool:
    """Whether ``model`` names a saved PEFT adapter (a directory or Hub repo with ``adapter_config.json``)."""
    if isinstance(model, nn.Module):
        return False
    from hf_janus.adapters.saved.loading import ADAPTER_CONFIG_NAME, hub_has_file

    name = os.path.expanduser(os.fspath(model))
    if os.path.isdir(name):
        return os.path.isfile(os.path.join(name, ADAPTER_CONFIG_NAME))
    return bool(hub_has_file(name, ADAPTER_CONFIG_NAME, revision, token))


def _load_merged_adapter(name: str, *, revision: Optional[str], torch_dtype: Any, device: Any, token: Any,
                         allow_pickle: bool) -> nn.Module:
    """A PEFT adapter merged on its base, both read under the same pickle policy as :func:`load_model`. As PEFT's
    ``AutoPeftModelForCausalLM``, the base's embeddings grow to a larger tokenizer saved with the adapter."""
    from peft import PeftModel

    from hf_janus.adapters.saved.loading import load_base_model, resolve_adapter

    src = resolve_adapter(name, revision, token, allow_pickle=allow_pickle)
    base_name = getattr(src.config, "base_model_name_or_path", None)
    if not base_name:
        raise JanusError(f"adapter {name!r} does not name its base model (base_model_name_or_path in "
                         "adapter_config.json): load the adapter on its base yourself and pass the model object")
    base = load_base_model(base_name, revision=getattr(src.config, "revision", None), torch_dtype=torch_dtype,
                           token=token, allow_pickle=allow_pickle)
    if os.path.isfile(os.path.join(src.path, "tokenizer_config.json")) and hasattr(base, "get_input_embeddings"):
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(src.path))
        if size > base.get_input_embeddings().weight.shape[0]:
            base.resize_token_embeddings(size)
    try:
        peft_model = PeftModel.from_pretrained(base, src.path)
    except Exception as err:
        raise JanusError(f"could not load the adapter in {name!r} on its base model {base_name!r}: "
                         f"{type(err).__name__}: {err}") from err
    merged = peft_model.merge_and_unload()
    return (merged.to(device) if device is not None else merged).eval()


def load_tokenizer(tokenizer: Any, models: Sequence[ModelLike], token: Any = None) -> Any:
    """The tokenizer given, else the first one found beside a model given by name (or its ``name_or_path``)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    candidates = [os.fspath(tokenizer)] if tokenizer is not None else []
    for model in models:
        if isinstance(model, (str, os.PathLike)):
            candidates.append(os.path.expanduser(os.fspath(model)))
        elif getattr(getattr(model, "config", None), "name_or_path", None):
            candidates.append(model.config.name_or_path)
    errors = []
    for name in candidates:
        try:
            return AutoTokenizer.from_pretrained(name, token=token)
        except Exception as err:  # try the next candidate; all failures are reported together
            errors.append(f"{name}: {type(err).__name__}: {err}")
    raise JanusError("no tokenizer found: pass tokenizer= (an object, directory or repo id)"
                     + (f"; tried {'; '.join(errors)}" if errors else ""))


@functools.lru_cache(maxsize=4)
def _task_manager(include_paths: tuple[str, ...]) -> Any:
    """lm-eval's task index over its own tasks and ``include_paths``: building it reads every task YAML (~5 s),
    so the Scorers of a process share one per set of paths (a Scorer's task configs are not registered in it)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths))


# ---- scoring one model --------------------------------------------------------------------------------------
@dataclass
class TaskResult:
    """One task's score on one model, with the metric it came from."""

    score: float
    metric: str
    higher_is_better: bool


def _primary_metric(task_results: Mapping[str, Any], higher: Mapping[str, Any], task: str) -> tuple[str, float, bool]:
    """The task's first scored metric (lm-eval files them as ``"<metric>,<filter>"`` beside stderrs and counts)."""
    for key, value in task_results.items():
        metric = key.split(",")[0]
        if metric in higher and isinstance(value, (int, float)):
            return key, float(value), bool(higher[metric])
    raise JanusError(f"lm-eval returned no score for task {task!r} (got {sorted(task_results)})")


class Scorer:
    """Scores models on a fixed list of tasks with lm-eval; the task objects are built once and reused."""

    def __init__(self, tasks: Sequence[TaskSpec], tokenizer: Any, *, batch_size: Union[int, str] = 16,
                 limit: Optional[Union[int, float]] = None, max_length: Optional[int] = None,
                 include_path: Optional[str] = None, add_bos_token: Optional[bool] = None):
        require_lm_eval()
        if not tasks:
            raise JanusError("no tasks to evaluate: pass past_tasks and/or new_tasks")
        self.tasks = list(tasks)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.limit = limit
        self.max_length = max_length
        self.include_path = include_path
        self.add_bos_token = add_bos_token

    @property
    def task_manager(self) -> Any:
        from hf_janus.evaluation.local_tasks import task_dir

        return _task_manager((task_dir(),) + ((self.include_path,) if self.include_path else ()))

    def __call__(self, model: nn.Module) -> dict[str, TaskResult]:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        kwargs: dict[str, Any] = {"pretrained": model, "tokenizer": self.tokenizer, "batch_size": self.batch_size}
        if self.max_length is not None:
            kwargs["max_length"] = self.max_length
        if self.add_bos_token is not None:
            kwargs["add_bos_token"] = self.add_bos_token
        try:
            with evaluation_mode(model):
                lm = HFLM(**kwargs)
                out = simple_evaluate(model=lm, tasks=[t.spec for t in self.tasks], limit=self.limit,
                                      task_manager=self.task_manager, bootstrap_iters=0, log_samples=False)
        except JanusError:
            raise
        except KeyError as err:
            if "registered" not in str(err):  # lm-eval's "... is not a registered task/group/tag name"
                raise
            raise JanusError(f"lm-eval does not know a task: {err}; pass a task name from `lm_eval --tasks list`, "
                             "a local JSONL file or a task config dict") from err
        if out is None:  # a non-zero rank of a distributed lm-eval run
            return {}
        results = {**out.get("groups", {}), **out["results"]}
        higher = out.get("higher_is_better", {})
        scores = {}
        for task in self.tasks:
            if task.name not in results:
                raise JanusError(f"lm-eval returned no results for task {task.name!r} (got {sorted(results)})")
            metric, value, better = _primary_metric(results[task.name], higher.get(task.name, {}), task.name)
            scores[task.name] = TaskResult(value, metric, better)
        return scores


# ---- the result of evaluate() -----------------------------------------------------------------------------
@dataclass
class EvaluationResult:
    """Scores per model and task, and AP1/AP2/AP of every model against ``reference`` (θ0) and ``finetuned`` (θ̂)."""

    scores: dict[str, dict[str, float]]  # model label -> task -> score
    metrics: dict[str, str]  # task -> lm-eval metric key the score is
    higher_is_better: dict[str, bool]
    past_tasks: list[str]
    new_tasks: list[str]
    ap: dict[str, dict[str, Optional[float]]] = field(default_factory=dict)  # model label -> ap1/ap2/ap
    seconds: dict[str, float] = field(default_factory=dict)  # model label -> evaluation time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the result as JSON (atomically); non-finite numbers as null."""
        atomic_write_text(path, dumps(self.to_dict()) + "\n")

    def to_markdown(self) -> str:
        tasks = self.past_tasks + self.new_tasks
        head = ["model"] + [f"{t} ({self.metrics[t].split(',')[0]})" for t in tasks] + ["AP1 (%)", "AP2 (%)", "AP (%)"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]

        def fmt(v: Optional[float], spec: str = ".2f") -> str:
            return "" if v is None else format(v, spec)

        for label, row in self.scores.items():
            ap = self.ap.get(label, {})
            cells = [label] + [fmt(row.get(t), ".4f") for t in tasks]
            cells += [fmt(ap.get("ap1"), ".1f"), fmt(ap.get("ap2"), ".1f"), fmt(ap.get("ap"), ".1f")]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def compute_ap(scores: Mapping[str, Mapping[str, float]], higher_is_better: Mapping[str, bool],
               past_tasks: Sequence[str], new_tasks: Sequence[str], reference: str = REFERENCE,
               finetuned: str = FINETUNED) -> dict[str, dict[str, Optional[float]]]:
    """AP1/AP2/AP of every row of ``scores`` against its ``reference`` and ``finetuned`` rows."""
    if reference not in scores or finetuned not in scores:
        return {}
    try:
        return {label: ap_metrics(row, scores[reference], scores[finetuned], past_tasks, new_tasks, higher_is_better)
                for label, row in scores.items()}
    except JanusError as err:  # the scores are still worth having
        logger.warning("AP1/AP2/AP left out: %s", err)
        return {}


def evaluate(reference: ModelLike, finetuned: ModelLike, rectified: Optional[ModelLike] = None, *,
             past_tasks: Union[TaskLike, Sequence[TaskLike], None] = None,
             new_tasks: Union[TaskLike, Sequence[TaskLike], None] = None,
             others: Optional[Mapping[str, ModelLike]] = None, tokenizer: Any = None,
             batch_size: Union[int, str] = 16, limit: Optional[Union[int, float]] = None,
             max_length: Optional[int] = None, add_bos_token: Optional[bool] = None,
             include_path: Optional[str] = None, device: Any = None, torch_dtype: Any = None,
             token: Any = None, allow_pickle: bool = False) -> EvaluationResult:
    """Run lm-eval tasks on θ0, θ̂ and the rectified model and compute the paper's AP1/AP2/AP.

    Args:
        reference: θ0, the model before fine-tuning: a model object, a local directory or a Hub repo id.
        finetuned: θ̂, the fine-tuned model (full weights, or a PEFT adapter directory, merged on its base).
        rectified: the rectified model, if any.
        past_tasks: what the model should keep (AP1, relative to θ0): lm-eval task names (``"nq_open"``), local
            JSONL files (QA rows → exact match; prompt/completion rows → NLL per byte) or task config dicts
            (:func:`~hf_janus.evaluation.qa_task`, :func:`~hf_janus.evaluation.completion_task`).
        new_tasks: what fine-tuning taught (AP2, relative to θ̂).
        others: more models to score, by label (e.g. WiSE-FT interpolations).
        tokenizer: a tokenizer (object, directory or repo id); default: the first found beside a model given by
            name.
        batch_size: lm-eval's batch size (``"auto"`` works on GPUs).
        limit: at most this many documents per task (a fraction when < 1), for quick looks.
        max_length: the context length lm-eval may use (default: the model's).
        add_bos_token: prepend BOS to every input (lm-eval's ``add_bos_token``; default: the tokenizer's habit).
        include_path: a directory of more lm-eval task YAMLs.
        device, torch_dtype, token: used to load models given by name.
        allow_pickle: accept models and adapters given by name whose weights are only a pickle
            (``pytorch_model.bin``, ``adapter_model.bin``), read with ``torch.load(weights_only=True)``; refused
            by default, because unpickling can run code.

    Returns:
        An :class:`EvaluationResult` (``to_markdown()``, ``save()``); rows ``reference``, ``finetuned``,
        ``rectified`` and the ``others``.
    """
    past = resolve_tasks(past_tasks)
    new = resolve_tasks(new_tasks)
    overlap = {t.name for t in past} & {t.name for t in new}
    if overlap:
        raise JanusError(f"task(s) {sorted(overlap)} are both past and new tasks; a task measures one side")
    models = _labelled_models(reference, finetuned, rectified, others)
    tok = load_tokenizer(tokenizer, list(models.values()), token=token)
    scorer = Scorer(past + new, tok, batch_size=batch_size, limit=limit, max_length=max_length,
                    include_path=include_path, add_bos_token=add_bos_token)
    past_names, new_names = [t.name for t in past], [t.name for t in new]
    result = EvaluationResult(scores={}, metrics={}, higher_is_better={}, past_tasks=past_names, new_tasks=new_names)
    for label, given in models.items():
        start = time.perf_counter()
        model = load_model(given, device=device, torch_dtype=torch_dtype, token=token, allow_pickle=allow_pickle)
        with torch.no_grad():
            results = scorer(model)
        if model is not given:
            del model  # a model loaded here is not kept beyond its evaluation
        _add_row(result, label, results, time.perf_counter() - start)
    result.ap = compute_ap(result.scores, result.higher_is_better, past_names, new_names)
    return result


def _labelled_models(reference: ModelLike, finetuned: ModelLike, rectified: Optional[ModelLike],
                     others: Optional[Mapping[str, ModelLike]]) -> dict[str, ModelLike]:
    """The models of :func:`evaluate` by row label, in scoring order."""
    models: dict[str, ModelLike] = {REFERENCE: reference, FINETUNED: finetuned}
    if rectified is not None:
        models[RECTIFIED] = rectified
    for label, model in (others or {}).items():
        if label in models:
            raise JanusError(f"model label {label!r} is taken by one of reference/finetuned/rectified; rename it")
        models[label] = model
    return models


def _add_row(result: EvaluationResult, label: str, results: Mapping[str, TaskResult], seconds: float) -> None:
    """Record one model's task results (and how long they took) as row ``label`` of ``result``."""
    result.scores[label] = {name: r.score for name, r in results.items()}
    for name, r in results.items():
        result.metrics[name], result.higher_is_better[name] = r.metric, r.higher_is_better
    result.seconds[label] = seconds
    logger.info("evaluated %s in %.1fs: %s", label, seconds, result.scores[label])
