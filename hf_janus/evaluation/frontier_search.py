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
  RegMean, diagonal-Fisher interpolation, LiNeS and DG-Hard (by default those that beat JANUS on a benchmark run,
  ``peers=``; any by a spec, ``candidates=``); given samples of the new task, also **JANUS, then replay training**
  that fits them beside the replay, then back toward θ0 (the real-model study's recommended repair).

Each kind is one object (:mod:`hf_janus.evaluation.candidates`): it builds its own weights, reports its cost and
says which peer curve it belongs to; every point off a curve gets its AP1 margin over it.

A saved adapter is merged by PEFT in float32 (:func:`hf_janus.adapters.saved.effective.load_effective_model`), so on
a bf16 base every candidate is built from the adapter's exact update, not from its bf16 rounding.

Every candidate is scored (by lm-evaluation-harness unless a ``scorer`` is given) on past tasks (AP1, relative to
θ0) and new tasks (AP2, relative to θ̂). The result is a table, a PNG of AP1 against AP2, and the point that meets
a criterion (e.g. the largest AP1 with AP2 ≥ 95%), which can be saved or pushed with its record like any
rectification.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from hf_janus.engine.config import JanusConfig
from hf_janus.engine.layers import resolve_target_modules
from hf_janus.engine.public import GIB
from hf_janus.engine.rectifier import rectify
from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidate_weights import WeightBuilder, differing_parameters
from hf_janus.evaluation.candidates import (DEFAULT_DAMPINGS, DEFAULT_HYBRID_GRID, DEFAULT_INTRUDER_LAMBDAS,
                                            DEFAULT_PRE_JANUS_GRID, DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS, DEFAULT_TAUS,
                                            DEFAULT_WISE_GRID, FINETUNED, INTRUDER_CURVE_SPEC, REFERENCE,
                                            WISE_CURVE_SPEC, BuildContext, Candidate, CandidateDiverged, Cost, Curve,
                                            SpecContext, default_peers, kinds, parse_candidates)
from hf_janus.evaluation.candidates import candidates as keyword_candidates
from hf_janus.evaluation.candidates.registry import SpecLike
from hf_janus.evaluation.intruder_reduction import IntruderReduction, plain_lora
from hf_janus.evaluation.harness import (ModelLike, Scorer, TaskLike, TaskResult, is_adapter, load_model,
                                         load_tokenizer, resolve_tasks)
from hf_janus.evaluation.samples import check_frontier_samples
from hf_janus.evaluation.scoring import ap_metrics
from hf_janus.evaluation.strict_json import dumps, finite_or_none
from hf_janus.io_utils import atomic_replace, atomic_write_text
from hf_janus.replay.resolve import resolve_new_task, resolve_replay

logger = logging.getLogger(__name__)


#: a point's status: built and scored, or its build went non-finite (no scores, neither chosen nor plotted)
SCORED, DIVERGED = "scored", "diverged"


@dataclass
class FrontierPoint:
    """A scored candidate: the candidate itself (its options, label and kind), its scores, AP figures, margins
    over the peer curves and what building it cost."""

    candidate: Candidate
    scores: dict[str, Optional[float]]
    ap1: Optional[float] = None
    ap2: Optional[float] = None
    ap: Optional[float] = None
    #: AP1 above (+) or below (-) each peer curve at this point's AP2 (linear between its points), in points;
    #: ``"wise"`` (the WiSE-FT curve), ``"intruder"``, ``"replay-sft"``, ... for the curves scored
    above: dict[str, Optional[float]] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)
    seconds: float = 0.0  # building and scoring it
    status: str = SCORED
    reason: Optional[str] = None  # why it diverged

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def on_frontier(self) -> bool:
        """Whether it can be chosen and drawn: scored, with finite AP1 and AP2."""
        return (self.status == SCORED and self.ap1 is not None and self.ap2 is not None
                and math.isfinite(self.ap1) and math.isfinite(self.ap2))

    @property
    def kind(self) -> str:
        return self.candidate.kind

    @property
    def jacobian_evaluations(self) -> int:
        return self.cost.jacobian_evaluations

    @property
    def above_wise(self) -> Optional[float]:
        return self.above.get(WISE_CURVE)

    @property
    def above_intruder(self) -> Optional[float]:
        return self.above.get(INTRUDER_CURVE)

    def option(self, name: str) -> Any:
        """One of the candidate's options (``tau``, ``a``, ...), ``None`` when its kind has no such option."""
        return getattr(self.candidate, name, None)

    def to_dict(self) -> dict[str, Any]:
        """The point as JSON: label, kind, the candidate's own options, scores, AP figures, margins
        (``above_wise``, ``above_intruder`` and ``above``) and costs."""
        return {"label": self.label, "kind": self.kind, "options": self.candidate.record(), "scores": dict(self.scores),
                "ap1": self.ap1, "ap2": self.ap2, "ap": self.ap,
                "above_wise": self.above_wise, "above_intruder": self.above_intruder, "above": dict(self.above),
                "jacobian_evaluations": self.cost.jacobian_evaluations,
                "forward_passes": self.cost.forward_passes, "backward_passes": self.cost.backward_passes,
                "build_seconds": self.cost.seconds, "peak_memory_bytes": self.cost.peak_memory_bytes,
                "build_reused": self.cost.reused,
                "seconds": self.seconds, "status": self.status, "reason": self.reason,
                "description": self.candidate.describe()}


#: The curves every frontier can hold: WiSE-FT (from θ0 to θ̂) and PEFT's intruder reduction (from θ̂); the other
#: peers' curves are named by their kinds (Candidate.curve).
WISE_CURVE = WISE_CURVE_SPEC.name
INTRUDER_CURVE = INTRUDER_CURVE_SPEC.name


def _on_curve(p: FrontierPoint, curve: str) -> bool:
    return p.on_frontier and p.candidate.on_curve(curve)


def wise_margin(points: Sequence[FrontierPoint], ap1: Optional[float], ap2: Optional[float],
                curve: str = WISE_CURVE) -> Optional[float]:
    """``ap1`` minus a peer curve's AP1 at ``ap2`` (linear between its points sorted by AP2): the WiSE-FT curve,
    anchors included, or another peer's (``curve=INTRUDER_CURVE``, ``"replay-sft"``, ...: θ̂ and its points);
    ``None`` outside the curve's AP2 range (or when it has fewer than two points)."""
    if ap1 is None or ap2 is None:
        return None
    line = sorted((p.ap2, p.ap1) for p in points if _on_curve(p, curve))
    for (x0, y0), (x1, y1) in zip(line, line[1:]):
        if x0 <= ap2 <= x1:
            return ap1 - (y0 if x1 == x0 else y0 + (y1 - y0) * (ap2 - x0) / (x1 - x0))
    return None


def peer_curves(points: Sequence[FrontierPoint]) -> list[Curve]:
    """The curves of this frontier: WiSE-FT always (the anchors are on it), each other peer's when scored."""
    out = [WISE_CURVE_SPEC]
    for p in points:
        curve = p.candidate.curve
        if curve is not None and not p.candidate.is_anchor and p.on_frontier and curve not in out:
            out.append(curve)
    return out


@dataclass
class FrontierResult:
    """Every scored point, which one was chosen and why; ``save()``, ``to_markdown()``, ``plot()``,
    ``save_pretrained()``/``push_to_hub()`` of the chosen model."""

    points: list[FrontierPoint]
    past_tasks: list[str]
    new_tasks: list[str]
    metrics: dict[str, str]
    higher_is_better: dict[str, bool]
    criterion: str = "max AP"
    chosen: Optional[int] = None  # index into points
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # JANUS run key -> RectificationReport dict
    seconds: float = 0.0
    # LoRA adapters: how many adapted layers PEFT's detection found intruder dimensions in, of how many
    intruder_layers: Optional[dict[str, int]] = None
    # The weights of every point, rebuilt on demand (set by frontier(); not serialized).
    _builder: Optional[WeightBuilder] = field(default=None, repr=False, compare=False)

    @property
    def best(self) -> Optional[FrontierPoint]:
        return self.points[self.chosen] if self.chosen is not None else None

    def select(self, *, min_ap2: Optional[float] = None, min_ap1: Optional[float] = None) -> FrontierPoint:
        """Choose a point: the largest AP1 with AP2 ≥ ``min_ap2``, the largest AP2 with AP1 ≥ ``min_ap1``, or
        (neither given) the largest AP. Ties go to the cheaper point (fewer Jacobian evaluations)."""
        if min_ap2 is not None and min_ap1 is not None:
            raise JanusError("give min_ap2 or min_ap1, not both")
        scored = [(i, p) for i, p in enumerate(self.points) if p.on_frontier]
        if not scored:
            raise JanusError("no point has both AP1 and AP2: give past and new tasks, on which θ0 and θ̂ differ")
        if min_ap2 is not None:
            pool = [(i, p) for i, p in scored if p.ap2 >= min_ap2]
            key, criterion = (lambda p: (p.ap1, p.ap2, -p.jacobian_evaluations)), f"max AP1 with AP2 ≥ {min_ap2:g}"
            missing = f"no point keeps AP2 ≥ {min_ap2:g} (the largest is {max(p.ap2 for _, p in scored):.1f})"
        elif min_ap1 is not None:
            pool = [(i, p) for i, p in scored if p.ap1 >= min_ap1]
            key, criterion = (lambda p: (p.ap2, p.ap1, -p.jacobian_evaluations)), f"max AP2 with AP1 ≥ {min_ap1:g}"
            missing = f"no point keeps AP1 ≥ {min_ap1:g} (the largest is {max(p.ap1 for _, p in scored):.1f})"
        else:
            pool, criterion, missing = scored, "max AP", ""
            key = lambda p: (p.ap, -p.jacobian_evaluations)  # noqa: E731
        if not pool:
            raise JanusError(missing + "; relax the criterion")
        index, point = max(pool, key=lambda ip: key(ip[1]))
        self.chosen, self.criterion = index, criterion
        return point

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        data["points"] = [p.to_dict() for p in self.points]
        return data

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the result as JSON (atomically); non-finite numbers as null."""
        atomic_write_text(path, dumps(self.to_dict()) + "\n")

    def to_markdown(self) -> str:
        tasks = self.past_tasks + self.new_tasks

        def fmt(v: Optional[float], spec: str) -> str:
            return "" if v is None else format(v, spec)

        curves = peer_curves(self.points)
        head = ["", "candidate"] + tasks + ["AP1 (%)", "AP2 (%)", "AP (%)"]
        head += [f"AP1 vs {c.title}" for c in curves]
        head += ["Jacobian evals", "replay passes (fwd/bwd)", "s"]
        peaks = any(p.cost.peak_memory_bytes is not None for p in self.points)
        head += ["build peak GiB"] if peaks else []
        lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
        for i, p in enumerate(self.points):
            mark = "**→**" if i == self.chosen else ""
            label = p.label if p.status == SCORED else f"{p.label} ({p.status})"
            cells = [mark, label] + [fmt(p.scores.get(t), ".4f") for t in tasks]
            cells += [fmt(p.ap1, ".1f"), fmt(p.ap2, ".1f"), fmt(p.ap, ".1f")]
            cells += [fmt(p.above.get(c.name), "+.1f") for c in curves]
            passes = ("shared" if p.cost.reused else f"{p.cost.forward_passes:g}/{p.cost.backward_passes:g}"
                      if p.cost.forward_passes or p.cost.backward_passes else "")
            cells += [str(p.jacobian_evaluations or ""), passes, f"{p.seconds:.0f}"]
            if peaks:
                peak = p.cost.peak_memory_bytes
                cells.append("" if peak is None else f"{peak / GIB:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        if self.best is not None:
            lines.append(f"\nChosen ({self.criterion}): **{self.best.label}**.")
        return "\n".join(lines)

    def plot(self, path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
        """A PNG of AP1 against AP2: each peer curve (WiSE-FT, intruder reduction, the replay peers), the other
        points in their kinds' styles, and the chosen point."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise JanusError('the frontier plot needs matplotlib: pip install "hf-janus[eval]"') from err
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for curve in peer_curves(self.points):
            line = sorted((p.ap2, p.ap1) for p in self.points if _on_curve(p, curve.name))
            own = [p for p in self.points if not p.candidate.is_anchor and _on_curve(p, curve.name)]
            if line and (own or curve.name == WISE_CURVE):
                style = curve.style
                ax.plot([c[0] for c in line], [c[1] for c in line], style.line + style.marker, color=style.color,
                        ms=4, label=style.legend)
        for kind in kinds():
            if kind.curve is not None:
                continue
            pts = [p for p in self.points if type(p.candidate) is kind and p.on_frontier]
            if pts:
                ax.scatter([p.ap2 for p in pts], [p.ap1 for p in pts], marker=kind.style.marker,
                           color=kind.style.color, label=kind.style.legend, zorder=3)
        if self.best is not None and self.best.ap1 is not None:
            ax.scatter([self.best.ap2], [self.best.ap1], s=220, facecolors="none", edgecolors="k", linewidths=1.5,
                       zorder=4, label=f"chosen: {self.best.label}")
        ax.set_xlabel("AP2: new task kept (%)")
        ax.set_ylabel("AP1: past tasks kept (%)")
        ax.set_title(title or "Stability-plasticity frontier")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_replace(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
        plt.close(fig)

    # ---- the chosen model ------------------------------------------------------------------------------------
    def _require_builder(self) -> WeightBuilder:
        if self._builder is None:
            raise JanusError("this FrontierResult was loaded from JSON and holds no weights; run hf_janus.frontier "
                             "again to save a model")
        if self.best is None:
            raise JanusError("no point is chosen: call result.select(...) first")
        return self._builder

    def publication_record(self) -> dict[str, Any]:
        """The ``frontier`` field of the chosen model's ``janus_rectification.json``."""
        best = self.best
        points = [{k: v for k, v in p.to_dict().items() if k != "scores"} for p in self.points]
        return finite_or_none({"chosen": best.to_dict() if best else None, "criterion": self.criterion,
                               "past_tasks": self.past_tasks, "new_tasks": self.new_tasks, "metrics": self.metrics,
                               "points": points})

    def save_pretrained(self, save_directory: Union[str, os.PathLike], *, overwrite: bool = False,
                        tokenizer: Any = None) -> str:
        """Save the chosen model (full weights) with its record and model card; written atomically."""
        from hf_janus.io_utils import atomic_output_dir
        from hf_janus.publish.files import write_publication_files

        builder = self._require_builder()
        best = self.best
        with atomic_output_dir(save_directory, overwrite=overwrite) as tmp:
            with builder.applied(best):
                builder.model.save_pretrained(tmp)
            tok = tokenizer if tokenizer is not None else builder.tokenizer
            if tok is not None and hasattr(tok, "save_pretrained"):
                tok.save_pretrained(tmp)
            write_publication_files(tmp, builder.report_for(best), kind="full", base_model=builder.base_name,
                                    replay=builder.replay, frontier=self.publication_record(),
                                    repo_id=os.fspath(save_directory))
        return os.fspath(save_directory)

    def add_adapter(self, peft_model: nn.Module, new_adapter_name: str = "frontier", *, rank: Any = "same",
                    energy: float = 0.99) -> dict[str, Any]:
        """Add the chosen point to ``peft_model`` (the LoRA adapter the frontier scored, loaded with PEFT) as a new
        adapter beside the trained one, and activate it, as PEFT's ``reduce_intruder_dimension`` adds its result:
        compare the two with ``peft_model.set_adapter(name)`` without reloading; ``save_pretrained`` writes both.

        Each adapted layer gets the point's weight re-factorized at ``rank`` (``"same"``: the adapter's own, an int,
        ``"auto"`` with ``energy``, or a float energy): a point whose update is not of the adapter's rank (JANUS,
        Fisher interpolation, ...) is truncated, and the returned per-layer ``kept_energy`` says how much of its
        update the adapter holds. Returns what was written (as a :class:`RectificationReport`'s ``output``)."""
        from hf_janus.adapters.live.adapter_beside import add_adapter_beside, as_layer_matrices
        from hf_janus.adapters.peft_layers import adapted_linear_layers, effective_weights, is_peft_model

        builder = self._require_builder()
        if not is_peft_model(peft_model):
            raise JanusError(f"add_adapter adds an adapter to a PeftModel, got a {type(peft_model).__name__}; load "
                             "the scored adapter with PeftModel.from_pretrained(base, adapter)")
        weights = builder.weights(self.best)
        layers = adapted_linear_layers(peft_model)
        tuned, start = as_layer_matrices(layers, builder.finetuned), as_layer_matrices(layers, builder.theta0)
        outside = sorted(k for k in weights if k not in tuned and not torch.equal(weights[k], builder.finetuned[k]))
        if outside:
            raise JanusError(f"the chosen point ({self.best.label}) changes {outside[0]!r} (and {len(outside) - 1} "
                             "more), which no adapted linear layer holds: save it in full with save_pretrained()")
        for key, w in effective_weights(layers).items():
            # the scored θ̂ must be this adapter: another one would get the point's weights but not its scores
            if key not in tuned or (w - tuned[key]).norm() > 1e-3 * (tuned[key] - start[key]).norm() + 1e-6:
                raise JanusError(f"{key!r} of this PeftModel's active adapter is not the fine-tuned weight the "
                                 "frontier scored: activate that adapter (model.set_adapter(name)), loaded on the "
                                 "same base (unquantized) as the frontier's finetuned=")
        chosen = as_layer_matrices(layers, {k: weights[k] for k in tuned})
        return add_adapter_beside(peft_model, chosen, start, new_adapter_name, rank=rank, energy=energy)

    def push_to_hub(self, repo_id: str, *, private: Optional[bool] = None, token: Any = None,
                    commit_message: Optional[str] = None) -> str:
        """Upload the chosen model with its record in one commit; returns the commit URL."""
        import tempfile

        from hf_janus.publish.hub import push_folder

        with tempfile.TemporaryDirectory(prefix="janus-frontier-") as tmp:
            folder = self.save_pretrained(os.path.join(tmp, "model"))
            return push_folder(folder, repo_id, private=private, token=token,
                               commit_message=commit_message or f"hf-janus frontier: {self.best.label}")


def frontier(reference: ModelLike, finetuned: ModelLike, replay: Any, *,
             past_tasks: Union[TaskLike, Sequence[TaskLike]], new_tasks: Union[TaskLike, Sequence[TaskLike]],
             config: Optional[JanusConfig] = None, wise_grid: Sequence[float] = DEFAULT_WISE_GRID,
             taus: Sequence[float] = DEFAULT_TAUS, hybrids: bool = True,
             hybrid_grid: Sequence[float] = DEFAULT_HYBRID_GRID,
             pre_janus_grid: Sequence[float] = DEFAULT_PRE_JANUS_GRID,
             dampings: Sequence[float] = DEFAULT_DAMPINGS,
             intruder_lambdas: Sequence[float] = DEFAULT_INTRUDER_LAMBDAS,
             pre_janus_intruder_lambdas: Sequence[float] = DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS,
             min_ap2: Optional[float] = None,
             min_ap1: Optional[float] = None, tokenizer: Any = None, batch_size: Union[int, str] = 16,
             limit: Optional[Union[int, float]] = None, include_path: Optional[str] = None,
             replay_options: Any = None, device: Any = None, torch_dtype: Any = None, token: Any = None,
             progress: bool = True, allow_pickle: bool = False,
             rectify_fn: Callable[..., RectificationReport] = rectify,
             candidates: Optional[Union[SpecLike, Sequence[SpecLike]]] = None,
             peers: Optional[SpecLike] = None, new_task_samples: Any = None,
             scorer: Optional[Callable[[nn.Module], Mapping[str, TaskResult]]] = None) -> FrontierResult:
    """Score WiSE-FT, JANUS, hybrids and the post-hoc peers on the user's tasks and choose a point.

    Args:
        reference: θ0 (model object, directory or Hub repo id).
        finetuned: θ̂ (model object, directory or repo id of full weights or of a PEFT adapter, merged). A model
            object is used as the working model: it holds each candidate in turn and is θ̂ again on return.
        replay: past-task samples for JANUS, as :func:`hf_janus.rectify` takes them, or a dataset id or file as
            ``hf-janus merge --replay`` takes it (read with ``replay_options``, a :class:`~hf_janus.ReplayOptions`),
            or a :class:`~hf_janus.SelfReplay`, which ``reference`` (θ0, never θ̂) answers.
        past_tasks, new_tasks: lm-eval task names, local JSONL files or task configs (see
            :func:`hf_janus.evaluate`); AP1 is measured on the first, AP2 on the second.
        config: the :class:`JanusConfig` of every JANUS run (its ``tau`` is replaced by each of ``taus``; the
            hybrids use ``config.tau``).
        wise_grid: WiSE-FT coefficients a (θ0 + a(θ̂ − θ0)), strictly between 0 and 1.
        taus: the τ values of plain JANUS.
        dampings: the ``JanusConfig.damping`` values of the damped-JANUS runs (at ``config.tau``); ``()`` for none.
        hybrids: also score JANUS → θ0 and JANUS → θ̂ at ``hybrid_grid``, WiSE-FT → JANUS at ``pre_janus_grid``
            and (LoRA adapters) intruder reduction → JANUS at ``pre_janus_intruder_lambdas``.
        intruder_lambdas: when ``finetuned`` is a saved LoRA adapter given by path or repo id (and ``reference`` by
            path or repo id too), PEFT's intruder-dimension reduction at each of these ``mitigation_lambda`` values
            (PEFT's default top_k=10 and threshold_epsilon=0.5); ``()`` for none. Ignored for other models.
        candidates: the candidates to score, instead of the keyword grids above (which it replaces: they are then
            not used): spec strings such as ``"wise:0.25,0.5 janus:tau=0.95 replay-sft:passes=4,8"`` and
            :class:`~hf_janus.evaluation.candidates.Candidate` objects, in the order given, after θ0 and θ̂ (see
            :mod:`hf_janus.evaluation.candidates.registry` for the syntax and the kinds). JANUS kinds that leave
            ``tau`` out take ``config.tau``. A kind that is not defined for this fine-tuning (intruder reduction on
            full weights, DG-Hard on an adapter) is refused, where the keyword grids leave it out.
        peers: with the keyword grids, the post-hoc peers scored after them, as a spec (``""`` for none). The
            default, :data:`~hf_janus.evaluation.candidates.DEFAULT_PEERS`, names those that beat JANUS on a
            benchmark run (replay fine-tuning on the KL to θ0 at 4× JANUS's evaluations, Fisher interpolation, the
            input-covariance null space at energies 0.5 and 0.9), so that the frontier can choose them; with
            ``new_task_samples`` it adds :data:`~hf_janus.evaluation.candidates.NEW_TASK_PEERS` (JANUS with the
            repair after it, ``JanusConfig.distill_steps``, as ``rectify`` and the entry points run it). A peer that is
            not defined here, or does not fit (replay training's optimizer state on the model's device), is left out
            with a logged warning.
        scorer: scores a model on the tasks, ``model -> {task name: TaskResult}`` with the names of
            ``past_tasks`` and ``new_tasks`` (default: lm-evaluation-harness, :class:`~hf_janus.evaluation.
            harness.Scorer`, with ``batch_size``, ``limit`` and ``include_path``).
        new_task_samples: samples of the new task (what fine-tuning trained on), in any form ``replay`` takes but a
            :class:`~hf_janus.SelfReplay` (a file or dataset id is read with ``replay_options`` too), for the
            replay-training candidates' ``new_task_weight``, which fits them beside the replay to keep the gain
            (their ``labels``, -100 where no loss counts, as on a prompt; without labels every token counts).
        min_ap2 / min_ap1: the choice (see :meth:`FrontierResult.select`); default the largest AP.
        tokenizer, batch_size, limit, include_path: evaluation options (see :func:`hf_janus.evaluate`).
        progress: a progress bar over the candidates (its time estimate grows with each JANUS run).
        allow_pickle: accept ``reference``/``finetuned`` given by name whose weights are only a pickle, read with
            ``torch.load(weights_only=True)`` (see :func:`hf_janus.evaluate`); refused by default.

    Returns:
        A :class:`FrontierResult`; ``result.best`` is the chosen point.
    """
    config = config if config is not None else JanusConfig()
    if peers is None:
        peers = default_peers(new_task_samples is not None)
    # the candidates are checked before any model is loaded; the peers are parsed once, so that the optional ones
    # _checked may leave out are the very objects scored
    peer_cands = parse_candidates(peers, SpecContext(tau=config.tau)) if candidates is None and peers else []
    if candidates is None:
        cands = keyword_candidates(wise_grid, taus, hybrid_tau=config.tau if hybrids else None,
                                   hybrid_grid=hybrid_grid, pre_janus_grid=pre_janus_grid, dampings=dampings,
                                   damped_tau=config.tau, intruder_lambdas=intruder_lambdas,
                                   pre_janus_intruder_lambdas=pre_janus_intruder_lambdas, peers=peer_cands)
    else:
        chosen = parse_candidates(candidates, SpecContext(tau=config.tau))
        cands = [REFERENCE, FINETUNED] + [c for c in chosen if not c.is_anchor]
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
    if candidates is None:  # the keyword grids offer intruder reduction where it is defined (LoRA adapters)
        cands = [c for c in cands if not c.lora_only or builder.intruders is not None]
    if any(c.uses_target_layers for c in cands):
        builder.target_layers = frozenset(resolve_target_modules(builder.model, config.target_modules,
                                                                 config.exclude_modules))
    cands = _checked(cands, builder, optional=set(peer_cands))
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
    result.select(min_ap2=min_ap2, min_ap1=min_ap1)
    return result


def _checked(cands: list[Candidate], builder: WeightBuilder, optional: set[Candidate]) -> list[Candidate]:
    """The candidates defined for this fine-tuning and this machine; one that is not raises its JanusError, unless it
    is ``optional`` (a peer the keyword grids add): that one is dropped with a warning, so that the default peers
    never stop a frontier they cannot run on (replay fine-tuning's optimizer state on a 7B model's GPU)."""
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
    loaded: list[nn.Module] = []

    def theta0() -> nn.Module:  # for a SelfReplay: θ0 answers, loaded on its own (never θ̂)
        loaded.append(load_model(reference, device="cpu", torch_dtype=torch_dtype, token=token,
                                 allow_pickle=allow_pickle))
        return loaded[0]

    replay = resolve_replay(replay, reference=theta0, tokenizer=tok, options=replay_options, token=token).samples
    base_name = os.fspath(reference) if isinstance(reference, (str, os.PathLike)) else None
    exact = None
    if base_name is not None and is_adapter(finetuned, token=token):
        exact = _exact_adapter(base_name, finetuned, device=device, torch_dtype=torch_dtype, token=token,
                               allow_pickle=allow_pickle)
        model = exact.model
    else:
        model = load_model(finetuned, device=device, torch_dtype=torch_dtype, token=token, allow_pickle=allow_pickle)
    base = loaded.pop() if loaded else load_model(reference, device="cpu", torch_dtype=torch_dtype, token=token,
                                                  allow_pickle=allow_pickle)
    differing = differing_parameters(model, dict(base.named_parameters()), allow_identical=exact is not None)
    del base
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
