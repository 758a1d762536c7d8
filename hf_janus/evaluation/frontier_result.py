"""The frontier's result: every scored point (:class:`FrontierPoint`), its AP margins over the peer curves, the choice
of a point (:meth:`FrontierResult.select`), the table and the plot, and the chosen model saved, pushed or added to
an adapter (the weights rebuilt by the search's :class:`~hf_janus.evaluation.candidate_weights.WeightBuilder`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from hf_janus.engine.public import GIB
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidate_weights import WeightBuilder
from hf_janus.evaluation.candidates import (INTRUDER_CURVE_SPEC, WISE_CURVE_SPEC, Candidate, Cost, Curve,
                                            kinds)
from hf_janus.evaluation.strict_json import dumps, finite_or_none
from hf_janus.io_utils import atomic_replace, atomic_write_text

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
        return self.candidate.name

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
        """The point as JSON: label, kind and its title, the candidate's own options, scores, AP figures, margins
        (``above_wise``, ``above_intruder`` and ``above``) and costs."""
        return {"label": self.label, "kind": self.kind, "title": self.candidate.title,
                "options": self.candidate.record(), "scores": dict(self.scores),
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

    def add_adapter(self, peft_model: nn.Module, new_adapter_name: str = "frontier", *,
                    adapter_rank: Any = "same", adapter_energy: float = 0.99) -> dict[str, Any]:
        """Add the chosen point to ``peft_model`` (the LoRA adapter the frontier scored, loaded with PEFT) as a new
        adapter beside the trained one, and activate it, as PEFT's ``reduce_intruder_dimension`` adds its result:
        compare the two with ``peft_model.set_adapter(name)`` without reloading; ``save_pretrained`` writes both.

        Each adapted layer gets the point's weight re-factorized at ``adapter_rank`` (``"same"``: the adapter's own,
        an int, ``"auto"`` with ``adapter_energy``, or a float energy): a point whose update is not of the adapter's
        rank (JANUS, Fisher interpolation, ...) is truncated, and the returned per-layer ``kept_energy`` says how much
        of its update the adapter holds. Returns what was written (as a :class:`RectificationReport`'s ``output``)."""
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
        return add_adapter_beside(peft_model, chosen, start, new_adapter_name, rank=adapter_rank,
                                  energy=adapter_energy)

    def push_to_hub(self, repo_id: str, *, private: Optional[bool] = None, token: Any = None,
                    commit_message: Optional[str] = None) -> str:
        """Upload the chosen model with its record in one commit; returns the commit URL."""
        import tempfile

        from hf_janus.publish.hub import push_folder

        with tempfile.TemporaryDirectory(prefix="janus-frontier-") as tmp:
            folder = self.save_pretrained(os.path.join(tmp, "model"))
            return push_folder(folder, repo_id, private=private, token=token,
                               commit_message=commit_message or f"hf-janus frontier: {self.best.label}")
