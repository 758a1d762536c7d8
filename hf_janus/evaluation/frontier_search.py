"""The stability-plasticity frontier: WiSE-FT, JANUS and their hybrids on the user's own data, and a choice.

Each candidate is a model between θ0 (before fine-tuning) and θ̂ (after):

* **WiSE-FT** ``θ0 + a(θ̂ − θ0)`` for a grid of ``a`` (free: no Jacobian);
* **JANUS** at each configured τ (one rectification each), and **damped JANUS** (``JanusConfig.damping``: the
  projection ``ΔW − Jᵀ(JJᵀ + λI)⁻¹JΔW`` keeps part of the update along weakly constrained directions) at each
  configured damping;
* **JANUS, then interpolation** toward θ0 (``θ0 + b(θ_J − θ0)``) or toward θ̂ (``θ_J + b(θ̂ − θ_J)``);
* **interpolation, then JANUS** on the interpolated update (a rectification of ``θ0 + a(θ̂ − θ0)``);
* for a **LoRA adapter**, PEFT's own post-hoc mitigation, **intruder-dimension reduction** at each
  ``mitigation_lambda`` (no replay; :mod:`hf_janus.evaluation.intruder_reduction`), and intruder reduction followed
  by JANUS;
* the **post-hoc peers**: replay fine-tuning at JANUS's budget, the input-covariance null space and one-sided
  RegMean, diagonal-Fisher interpolation, LiNeS and DG-Hard (by default those that beat JANUS on a benchmark run;
  any by a spec, ``candidates=``); given samples of the new task, also **JANUS with the repair after it**.

Each kind is one object (:mod:`hf_janus.evaluation.candidates`): it builds its own weights, reports its cost and
says which peer curve it belongs to; every point off a curve gets its AP1 margin over it.

A saved adapter is merged by PEFT in float32 (:func:`hf_janus.adapters.saved.effective.load_effective_model`), so on
a bf16 base every candidate is built from the adapter's exact update, not from its bf16 rounding.

Every candidate is scored (by lm-evaluation-harness unless a ``scorer`` is given) on past tasks (AP1, relative to
θ0) and new tasks (AP2, relative to θ̂). The result (:mod:`hf_janus.evaluation.frontier_result`) is a table, a PNG
of AP1 against AP2, and the point that meets a criterion (e.g. the largest AP1 with AP2 ≥ 95%), which can be saved or
pushed with its record like any rectification.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from hf_janus.engine.config import JanusConfig
from hf_janus.engine.layers import resolve_target_modules
from hf_janus.engine.rectifier import rectify
from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidate_weights import WeightBuilder, differing_parameters
from hf_janus.evaluation.candidates import (DEFAULT_GRID, FINETUNED, REFERENCE, BuildContext, Candidate,
                                            CandidateDiverged, SpecContext, default_peers, parse_candidates)
from hf_janus.evaluation.candidates.registry import SpecLike
from hf_janus.evaluation.intruder_reduction import IntruderReduction, plain_lora
from hf_janus.evaluation.harness import (ModelLike, Scorer, TaskLike, TaskResult, is_adapter, load_model,
                                         load_tokenizer, resolve_tasks)
from hf_janus.evaluation.samples import check_frontier_samples
from hf_janus.evaluation.scoring import ap_metrics
from hf_janus.replay.resolve import resolve_new_task, resolve_replay

from hf_janus.evaluation.frontier_result import (DIVERGED, SCORED, WISE_CURVE, FrontierPoint,
                                               FrontierResult, peer_curves, wise_margin)
logger = logging.getLogger(__name__)


def frontier(reference: ModelLike, finetuned: ModelLike, replay: Any, *,
             past_tasks: Union[TaskLike, Sequence[TaskLike]], new_tasks: Union[TaskLike, Sequence[TaskLike]],
             config: Optional[JanusConfig] = None, candidates: Optional[Union[SpecLike, Sequence[SpecLike]]] = None,
             new_task_samples: Any = None, tokenizer: Any = None, batch_size: Union[int, str] = 16,
             limit: Optional[Union[int, float]] = None, include_path: Optional[str] = None,
             replay_options: Any = None, device: Any = None, torch_dtype: Any = None, token: Any = None,
             progress: bool = True, allow_pickle: bool = False,
             rectify_fn: Callable[..., RectificationReport] = rectify,
             scorer: Optional[Callable[[nn.Module], Mapping[str, TaskResult]]] = None) -> FrontierResult:
    """Score WiSE-FT, JANUS, hybrids and the post-hoc peers on the user's tasks; the point with the largest AP is
    chosen (``result.select(min_ap2=95)`` chooses another way).

    Args:
        reference: θ0 (model object, directory or Hub repo id).
        finetuned: θ̂ (model object, directory or repo id of full weights or of a PEFT adapter, merged). A model
            object is used as the working model: it holds each candidate in turn and is θ̂ again on return.
        replay: past-task samples for JANUS, as :func:`hf_janus.rectify` takes them, or a dataset id or file as
            ``hf-janus merge --replay`` takes it (read with ``replay_options``, a :class:`~hf_janus.ReplayOptions`),
            or a :class:`~hf_janus.SelfReplay`, which ``reference`` (θ0, never θ̂) answers.
        past_tasks, new_tasks: lm-eval task names, local JSONL files or task configs (see
            :func:`hf_janus.evaluate`); AP1 is measured on the first, AP2 on the second.
        config: the :class:`JanusConfig` of every JANUS run (a candidate's own ``tau`` replaces its τ; the kinds
            that leave ``tau`` out take ``config.tau``).
        candidates: the candidates to score after θ0 and θ̂: spec strings such as ``"wise:0.25,0.5 janus:tau=0.95
            replay-sft:passes=4,8"`` and :class:`~hf_janus.evaluation.candidates.Candidate` objects, in the order
            given (see :mod:`hf_janus.evaluation.candidates.registry` for the syntax and the kinds). A kind that is
            not defined for this fine-tuning (intruder reduction on full weights, DG-Hard on an adapter) is refused.
            Default: :func:`~hf_janus.evaluation.candidates.default_candidates`, every kind's grid
            (:data:`~hf_janus.evaluation.candidates.DEFAULT_GRID`; intruder reduction where ``finetuned`` is a
            saved LoRA adapter) and the post-hoc peers that beat JANUS on a benchmark run, with ``new_task_samples``
            also JANUS with the repair after it; a default peer that is not defined here, or does not fit (replay
            training's optimizer state on the model's device), is left out with a logged warning.
        new_task_samples: samples of the new task (what fine-tuning trained on), in any form ``replay`` takes but a
            :class:`~hf_janus.SelfReplay` (a file or dataset id is read with ``replay_options`` too), for the
            candidates that fit them beside the replay to keep the gain (their ``labels``, -100 where no loss
            counts, as on a prompt; without labels every token counts).
        scorer: ``model -> {task name: TaskResult}`` on ``past_tasks`` and ``new_tasks`` (default: lm-evaluation-
            harness, :class:`~hf_janus.evaluation.harness.Scorer`, with ``batch_size``, ``limit``, ``include_path``).
        tokenizer, batch_size, limit, include_path: evaluation options (see :func:`hf_janus.evaluate`).
        progress: a progress bar over the candidates (its time estimate grows with each JANUS run).
        allow_pickle: accept ``reference``/``finetuned`` given by name whose weights are only a pickle, read with
            ``torch.load(weights_only=True)`` (see :func:`hf_janus.evaluate`); refused by default.

    Returns:
        A :class:`~hf_janus.evaluation.frontier_result.FrontierResult`; ``result.best`` is the chosen point.
    """
    config = config if config is not None else JanusConfig()
    cands, optional = _candidates(candidates, config, new_task_samples is not None)
    past, new = resolve_tasks(past_tasks), resolve_tasks(new_tasks)
    if not past or not new:
        raise JanusError("the frontier needs past_tasks (for AP1) and new_tasks (for AP2)")
    tok = load_tokenizer(tokenizer, [reference, finetuned], token=token)
    new_task = resolve_new_task(new_task_samples, tokenizer=tok, options=replay_options, token=token)
    builder = _working_model(reference, finetuned, replay, tok, replay_options, device=device,
                             torch_dtype=torch_dtype, token=token, allow_pickle=allow_pickle,
                             intruders=any(c.lora_only for c in cands))
    check_frontier_samples(builder.model, builder.replay, new_task)
    builder.new_task = new_task
    if candidates is None:  # the default grid offers intruder reduction where it is defined (LoRA adapters)
        cands = [c for c in cands if not c.lora_only or builder.intruders is not None]
    if any(c.uses_target_layers for c in cands):
        builder.target_layers = frozenset(resolve_target_modules(builder.model, config.target_modules,
                                                                 config.exclude_modules))
    cands = keep_defined(cands, builder, optional=optional)
    if scorer is None:
        scorer = Scorer(past + new, tok, batch_size=batch_size, limit=limit, include_path=include_path)
    past_names, new_names = [t.name for t in past], [t.name for t in new]

    start = time.perf_counter()
    context = BuildContext(config=config, rectify_fn=rectify_fn, progress=progress)
    points, metrics, higher = _score_candidates(cands, builder, scorer, context, past_names, new_names)
    _add_ap_figures(points, past_names, new_names, higher)
    result = FrontierResult(points=points, past_tasks=past_names, new_tasks=new_names, metrics=metrics,
                            higher_is_better=higher, reports={k: r.to_dict() for k, r in builder.reports.items()},
                            seconds=time.perf_counter() - start, _builder=builder,
                            intruder_layers=None if builder.intruders is None else {
                                "with_intruders": builder.intruders.layers_with_intruders,
                                "layers": len(builder.intruders.layers)})
    result.select()
    return result


def _candidates(candidates: Any, config: JanusConfig, new_task_samples: bool) -> tuple[list[Candidate],
                                                                                        set[Candidate]]:
    """The candidates in scoring order, θ0 and θ̂ first (AP needs them), and those that may be left out where they
    cannot run: the default peers. Checked before any model is loaded; the peers are parsed once, so that the ones
    :func:`keep_defined` leaves out are the very objects scored."""
    context = SpecContext(tau=config.tau)
    peers = [] if candidates is not None else parse_candidates(default_peers(new_task_samples), context)
    chosen = parse_candidates(DEFAULT_GRID if candidates is None else candidates, context)
    cands = [REFERENCE, FINETUNED]
    cands += [c for c in chosen + peers if not c.is_anchor and c not in cands]
    return cands, set(peers)


def keep_defined(cands: Sequence[Candidate], builder: WeightBuilder, optional: Collection[Candidate] = ()
                 ) -> list[Candidate]:
    """The candidates defined for this fine-tuning and this machine; one that is not raises its JanusError, unless it
    is ``optional`` (a default peer): that one is dropped with a warning, so that the default peers never stop a
    frontier they cannot run on (replay fine-tuning's optimizer state on a 7B model's GPU)."""
    kept = []
    for c in cands:
        try:
            c.check(builder)
        except JanusError as err:
            if c not in optional:
                raise
            logger.warning("frontier: %s is left out: %s", c.label, err)
            continue
        kept.append(c)
    return kept


def _working_model(reference: ModelLike, finetuned: ModelLike, replay: Any, tok: Any, replay_options: Any, *,
                   device: Any, torch_dtype: Any, token: Any, allow_pickle: bool,
                   intruders: bool = False) -> WeightBuilder:
    """θ̂ loaded as the working model, with θ0 and θ̂ of the parameters that differ and the replay samples.

    A saved adapter on a reference given by name is merged by PEFT in float32: θ0 and θ̂ of its layers are kept in
    float32 (the model holds them rounded to its dtype), and for a plain LoRA the intruder detection is done once
    (``intruders``)."""
    # θ0 is loaded once, on the host: first when a SelfReplay needs θ0's answers (never θ̂'s), then for the differences
    load_reference = functools.cache(functools.partial(load_model, reference, device="cpu", torch_dtype=torch_dtype,
                                                       token=token, allow_pickle=allow_pickle))
    replay = resolve_replay(replay, reference=load_reference, tokenizer=tok, options=replay_options,
                            token=token).samples
    base_name = os.fspath(reference) if isinstance(reference, (str, os.PathLike)) else None
    exact = None
    if base_name is not None and is_adapter(finetuned, token=token):
        exact = _exact_adapter(base_name, finetuned, device=device, torch_dtype=torch_dtype, token=token,
                               allow_pickle=allow_pickle)
        model = exact.model
    else:
        model = load_model(finetuned, device=device, torch_dtype=torch_dtype, token=token, allow_pickle=allow_pickle)
    differing = differing_parameters(model, dict(load_reference().named_parameters()),
                                     allow_identical=exact is not None)
    load_reference.cache_clear()  # θ0's whole model is not kept: only the parameters that differ
    theta0, tuned = {k: v[0] for k, v in differing.items()}, {k: v[1] for k, v in differing.items()}
    reduction, ranks = None, None
    if exact is not None:
        keys = [name + ".weight" for name in exact.linear_layers]
        ranks = {name + ".weight": exact.layers[name].rank for name in exact.linear_layers}
        theta0.update({k: exact.reference[k].float() for k in keys})
        tuned.update({name + ".weight": exact.finetuned_weight(name) for name in exact.linear_layers})
        if intruders and plain_lora(exact.adapter.config):
            base = {name + ".weight": exact.adapter_base(name) for name in exact.linear_layers}
            reduction = IntruderReduction({k: theta0[k] for k in keys}, {k: tuned[k] for k in keys}, ranks, base=base)
            logger.info("intruder reduction: %d of %d adapted layers have intruder dimensions",
                        reduction.layers_with_intruders, len(keys))
    if all(torch.equal(theta0[k].float(), tuned[k].float()) for k in theta0):
        raise JanusError("θ0 and θ̂ are identical: there is no fine-tuning to trade off")
    return WeightBuilder(model, theta0, tuned, tok, base_name, replay, intruders=reduction, adapter_ranks=ranks)


def _exact_adapter(base_name: str, adapter: ModelLike, **load: Any) -> Any:
    """The adapter merged on ``base_name`` by PEFT in float32 (:class:`~hf_janus.adapters.saved.effective.
    EffectiveModel`); the reference is θ0 by definition here, so a differently named copy of the base is fine."""
    from hf_janus.adapters.saved.effective import load_effective_model

    exact = load_effective_model(base_name, os.fspath(adapter), allow_base_mismatch=True, progress=False, **load)
    if exact.quantized:  # pragma: no cover - load_effective_model quantizes only when asked
        raise JanusError("the frontier scores unquantized models; load the base unquantized")
    return exact


def _score_candidates(cands: Sequence[Candidate], builder: WeightBuilder,
                      scorer: Callable[[nn.Module], Mapping[str, TaskResult]], context: BuildContext,
                      past_names: list[str], new_names: list[str]
                      ) -> tuple[list[FrontierPoint], dict[str, str], dict[str, bool]]:
    """Every candidate scored in turn, and each task's metric and direction; the model holds θ̂ again after."""
    from tqdm.auto import tqdm

    points: list[FrontierPoint] = []
    higher: dict[str, bool] = {}
    metrics: dict[str, str] = {}
    bar = tqdm(cands, desc="frontier", unit="point", disable=not context.progress)
    try:
        for c in bar:
            bar.set_postfix_str(c.label)
            point, results = _score_candidate(c, builder, scorer, context)
            points.append(point)
            if results is None:
                continue
            metrics = {n: r.metric for n, r in results.items()}
            higher = {n: r.higher_is_better for n, r in results.items()}
            logger.info("frontier: %s scored %s in %.1fs", c.label, point.scores, point.seconds)
            if len(points) == 2:  # θ0 and θ̂: fail now, not after every JANUS run, if AP is undefined
                ap_metrics(points[0].scores, points[0].scores, points[1].scores, past_names, new_names, higher)
    finally:
        bar.close()
        builder.write(builder.finetuned)
    return points, metrics, higher


def _score_candidate(c: Candidate, builder: WeightBuilder, scorer: Callable[[nn.Module], Mapping[str, TaskResult]],
                     context: BuildContext) -> tuple[FrontierPoint, Optional[Mapping[str, TaskResult]]]:
    """One candidate's point (what it builds first, unless an earlier candidate built it) and its task results,
    ``None`` for a build that diverged: its NaN weights would only score NaN."""
    t0 = time.perf_counter()
    try:
        cost = c.prepare(builder, context)
    except CandidateDiverged as err:
        logger.warning("frontier: %s diverged and is left out of the choice and the plot: %s", c.label, err)
        return FrontierPoint(c, {}, seconds=time.perf_counter() - t0, status=DIVERGED, reason=str(err)), None
    with builder.applied(c) as working, torch.no_grad():
        results = scorer(working)
    point = FrontierPoint(c, {n: r.score for n, r in results.items()}, cost=cost, seconds=time.perf_counter() - t0)
    return point, results


def _add_ap_figures(points: list[FrontierPoint], past_names: list[str], new_names: list[str],
                    higher: dict[str, bool]) -> None:
    """Fill in each point's AP1/AP2/AP (against the anchors, the first two points) and its margin over each peer
    curve it is not on (WiSE-FT points get none: they are the baseline every curve is compared with)."""
    for p in points:
        if p.status != SCORED:  # every task's score and figure is null, so that readers find the same keys
            p.scores = dict.fromkeys(past_names + new_names)
            continue
        ap = ap_metrics(p.scores, points[0].scores, points[1].scores, past_names, new_names, higher)
        p.ap1, p.ap2, p.ap = ap["ap1"], ap["ap2"], ap["ap"]
    curves = peer_curves(points)
    for p in points:
        if p.candidate.is_anchor or p.candidate.on_curve(WISE_CURVE) or p.status != SCORED:
            continue
        for curve in curves:
            if not p.candidate.on_curve(curve.name):
                p.above[curve.name] = wise_margin(points, p.ap1, p.ap2, curve.name)
