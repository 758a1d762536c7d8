"""What a rectification did: the step/trial trajectory, per-layer statistics, replay losses and timings."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from hf_janus.io_utils import atomic_write_text
from hf_janus.serialization import known_fields

SCHEMA_VERSION = 1

#: ``RectificationReport.residual_jacobian`` of this version: whatever ``factor_dtype`` the run stored its factors
#: in, the residuals are measured against θ0's capture kept in float32 (at the run's compression rank), except where
#: pinned host memory cannot be given back (:func:`rounded_reference`).
REFERENCE_JACOBIAN = "J0 captured in float32 at θ0"


def rounded_reference(dtype: Any) -> str:
    """``RectificationReport.residual_jacobian`` where θ0 could not be captured again in float32: J0 as stored."""
    return f"J0 captured in {str(dtype).replace('torch.', '')} at θ0 (rounded as the factors were stored)"


@dataclass
class TrialRecord:
    """One trial point ``θ_t + α Δθ_proj``: its JANUS orientation comparison, its replay loss, its score under the
    run's acceptance rule, whether it passed, and whether the step moved there.

    ``taken`` and ``passed`` differ: a step may take a failing trial (``StepRecord.forced``: the step floor or the
    last step), and a passing trial may be left for a larger one that passes too.
    """

    step: int
    alpha: float
    mean_cosine: float
    layer_cosines: dict[str, Optional[float]]
    taken: bool
    replay_loss: float
    score: Optional[float] = None  # compared with the rule's threshold (c̄ itself for the paper's rule)
    passed: Optional[bool] = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialRecord":
        return cls(**known_fields(cls, data))


@dataclass
class StepRecord:
    """One rectification step: the trials tried and the step size finally taken."""

    step: int
    alpha: float
    trials: list[TrialRecord] = field(default_factory=list)
    forced: bool = False  # taken although it failed the acceptance test (min_alpha or max_steps reached)

    @property
    def taken(self) -> Optional[TrialRecord]:
        """The trial the step moved to: not always the last one, since the adaptive controller may try a larger α
        after a passing trial and then take the passing one."""
        return next((t for t in self.trials if t.taken), self.trials[-1] if self.trials else None)


@dataclass
class LayerStats:
    name: str
    shape: list[int]  # [d_out, d_in]
    path: str  # "ghost" or "materialized"
    delta_norm: float  # ||ΔW|| = ||W_ft - W_0||
    rect_delta_norm: float  # ||ΔW_rect|| = ||W_rect - W_0||
    residual: Optional[float]  # ||J_0 ΔW_rect|| / ||J_0 ΔW||, None when J_0 ΔW = 0
    gram_rank: int  # numerical rank of J_0 J_0ᵀ


@dataclass
class PointFigures:
    """One point's figures on the held-out slices: the new task's loss, the replay's NLL and token agreement."""

    new_task_loss: Optional[float] = None
    replay_nll: Optional[float] = None
    replay_agreement: Optional[float] = None


@dataclass
class RepairReport:
    """What the repair after JANUS did: the training, the point chosen and why, the validation figures."""

    steps: int = 0
    lr: float = 0.0
    #: how the learning rate ran over the steps (``JanusConfig.distill_schedule``)
    schedule: str = "constant"
    new_task_weight: float = 0.0
    #: replay samples a step (``JanusConfig.distill_replay_batch_size``)
    replay_batch_size: int = 0
    new_task_batch_size: int = 0
    keep_gain: float = 0.0
    #: ``"b=<move>"`` (``θ0 + b(θ_T − θ0)``), ``"janus"`` (the JANUS point kept), or None when nothing was trained
    chosen: Optional[str] = None
    b: Optional[float] = None
    reason: str = ""
    #: figures per point: ``reference`` (θ0), ``finetuned`` (θ̂), ``janus``, ``trained`` (θ_T), ``chosen``
    validation: dict[str, PointFigures] = field(default_factory=dict)
    validation_samples: dict[str, int] = field(default_factory=dict)
    #: which new-task samples the gain was measured on (held out of those fitted, or given for it)
    gain_measured_on: str = ""
    #: what was trained: the target layers' weights, or an adapter's own factors
    trained: str = ""
    #: the parameters outside the target layers fine-tuning changed that were distilled and moved with them
    outside_parameters: list[str] = field(default_factory=list)
    #: the training passes' autocast dtype (a Trainer's mixed precision), None at the weights' own precision
    autocast_dtype: Optional[str] = None
    #: the layers whose training passes ran under gradient checkpointing, as they did in fine-tuning
    checkpointed_layers: int = 0
    seconds: float = 0.0

    def gain_kept(self, point: str = "chosen") -> Optional[float]:
        """The share of the fine-tune's new-task gain (on the held-out slice) that ``point`` keeps."""
        figures = {k: v.new_task_loss for k, v in self.validation.items()}
        ref, ft, at = figures.get("reference"), figures.get("finetuned"), figures.get(point)
        if None in (ref, ft, at) or ref == ft:
            return None
        return (ref - at) / (ref - ft)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["validation"] = {k: asdict(v) for k, v in self.validation.items()}
        return out

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> Optional["RepairReport"]:
        if data is None:
            return None
        report = cls(**known_fields(cls, data))
        report.validation = {k: PointFigures(**known_fields(PointFigures, v))
                             for k, v in (data.get("validation") or {}).items()}
        return report

    def summary(self) -> str:
        if self.chosen is None:
            return f"repair after JANUS: none ({self.reason})"
        kept = self.gain_kept()
        outside = f", and {len(self.outside_parameters)} other changed parameters" if self.outside_parameters else ""
        engine = "".join([f", {self.autocast_dtype} autocast" if self.autocast_dtype else "",
                          f", {self.checkpointed_layers} layers checkpointed" if self.checkpointed_layers else ""])
        lines = [f"repair after JANUS: {self.steps} distillation steps (lr {self.lr:g} {self.schedule}, "
                 f"{self.replay_batch_size} replay and {self.new_task_batch_size} new-task samples a step, new task ×"
                 f"{self.new_task_weight:g}{engine}; {self.trained or 'the target layers'}{outside}), chosen "
                 f"{self.chosen}: {self.reason}"
                 + (f"; gain kept {kept:.0%}" if kept is not None else "") + f" ({self.seconds:.1f} s)",
                 f"  validation (new-task loss / replay NLL / replay agreement; the gain measured on "
                 f"{self.gain_measured_on or 'held-out new-task samples'}):"]
        for name, figures in self.validation.items():
            lines.append(f"    {name:<10} {_fmt(figures.new_task_loss)} / {_fmt(figures.replay_nll)} / "
                         f"{_fmt(figures.replay_agreement)}")
        return "\n".join(lines)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


@dataclass
class RectificationReport:
    """The record of one :func:`hf_janus.rectify` run; ``to_dict()``/``save()`` give JSON."""

    config: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    num_jacobian_evals: int = 0
    # captures taken again because captures="two" dropped them (θ0's for the statistics, a kept trial's), or θ0's
    # taken again in float32 for the statistics when the factors are stored in bf16: passes that cost as much as an
    # evaluation but decide nothing
    recaptures: int = 0
    replay_loss: dict[str, float] = field(default_factory=dict)  # reference / finetuned / rectified
    layers: list[LayerStats] = field(default_factory=list)
    # the Jacobian the per-layer residuals (and the adapter write-back's) are measured against; "" in reports of
    # versions that did not say (theirs used the factors as stored: bf16 factors gave residuals near zero)
    residual_jacobian: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0
    num_tokens: int = 0
    converged: bool = False
    stop_reason: str = ""
    # True when a budget (max_evaluations / max_seconds) ended the loop: the weights are the last accepted point.
    stopped_early: bool = False
    # Set when the unchecked final step at max_steps was left out (final_step="guarded") because it raised the
    # replay loss above the last accepted point's, which was returned: its alpha, mean_cosine, replay_loss and
    # the returned point's replay loss (kept_replay_loss).
    discarded_final_step: Optional[dict[str, float]] = None
    # What callers did with the rectified weights afterwards (e.g. the callback's PEFT write-back:
    # format, per-layer rank, kept energy and residual after re-factorization); empty for plain rectify().
    output: dict[str, Any] = field(default_factory=dict)
    # The memory plan made before the run (hf_janus.engine.memory_plan.MemoryPlan.to_dict()): where θ0, θ_t, the
    # projection and the factors lived, and the predicted peak device and host bytes.
    memory_plan: dict[str, Any] = field(default_factory=dict)
    # the repair after JANUS (JanusConfig.distill_steps): the training, the point chosen and why; None without one
    repair: Optional[RepairReport] = None
    schema_version: int = SCHEMA_VERSION

    @property
    def alphas(self) -> list[float]:
        return [s.alpha for s in self.steps]

    @property
    def num_trials(self) -> int:
        return sum(len(s.trials) for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["repair"] = self.repair.to_dict() if self.repair is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RectificationReport":
        """Rebuild a report; keys it does not know (e.g. the publication record that
        :func:`hf_janus.publish.record_file.build_report` puts around it) are ignored."""
        data = known_fields(cls, data)
        steps = []
        for s in data.pop("steps", []):
            s = dict(s)
            trials = [TrialRecord.from_dict(t) for t in s.pop("trials", [])]
            steps.append(StepRecord(trials=trials, **s))
        layers = [LayerStats(**layer) for layer in data.pop("layers", [])]
        repair = RepairReport.from_dict(data.pop("repair", None))
        return cls(steps=steps, layers=layers, repair=repair, **data)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the report as JSON (atomically)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "RectificationReport":
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def summary(self) -> str:
        """A few human-readable lines for logs and the terminal."""
        loss = self.replay_loss
        traj = ", ".join(f"{s.alpha:.3g}" for s in self.steps)
        lines = [
            f"JANUS rectification: {len(self.steps)} step(s), {self.num_trials} trial(s), "
            f"{self.num_jacobian_evals} Jacobian evaluation(s); {'converged' if self.converged else self.stop_reason}",
            f"  step sizes α: [{traj}]",
        ]
        if loss:
            lines.append(
                ("  replay loss: reference {reference:.4f} | fine-tuned {finetuned:.4f} | "
                 "rectified {rectified:.4f}").format(
                    **{k: loss.get(k, float("nan")) for k in ("reference", "finetuned", "rectified")}
                )
            )
        residuals = [layer.residual for layer in self.layers if layer.residual is not None]
        if residuals:
            against = f" (against {self.residual_jacobian})" if self.residual_jacobian else ""
            lines.append(f"  first-order residual ||J0 ΔW_rect||/||J0 ΔW||: max {max(residuals):.3g}{against}")
        if self.repair is not None:
            lines += ["  " + line for line in self.repair.summary().splitlines()]
        if self.timings:
            lines.append("  time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        return "\n".join(lines)
