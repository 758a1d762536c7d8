"""JANUS with the repair after it (``JanusConfig.distill_steps``): the engine's own stage, as ``rectify``,
``JanusCallback`` and ``JanusMerger`` run it, so that the frontier scores the point a user gets. One rectification
with the repair's settings: JANUS, the distillation toward θ0 that fits the new task's samples, and the point the
repair chooses itself on its held-out slices."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from hf_janus.evaluation.candidates.base import (BuildContext, Cost, Option, PlotStyle, finite_positive,
                                                 parse_float, parse_int, parse_str, require)
from hf_janus.evaluation.candidates.registry import register
from hf_janus.engine.config import DEFAULT_DISTILL_LR, DISTILL_SCHEDULES, JanusConfig
from hf_janus.engine.repair import check_samples
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option
from hf_janus.evaluation.candidates.replay_statistics import new_task_batches, replay_batches
from hf_janus.errors import JanusError

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

_DEFAULTS = JanusConfig()
#: the study's training length (32 passes over 64 answers in batches of 8): the frontier's default grid
DEFAULT_REPAIR_STEPS = 256


@register
@dataclass(frozen=True)
class JanusRepair(JanusBased):
    """JANUS at ``tau``, then ``steps`` distillation steps and the repair's own choice of point (``keep_gain``)."""

    tau: float
    steps: int = DEFAULT_REPAIR_STEPS
    keep_gain: float = _DEFAULTS.keep_gain
    lr: float = DEFAULT_DISTILL_LR
    schedule: str = _DEFAULTS.distill_schedule
    new_task_weight: float = _DEFAULTS.new_task_weight
    new_task_batch_size: int = _DEFAULTS.new_task_batch_size

    name: ClassVar[str] = "janus-repair"
    title: ClassVar[str] = "JANUS → repair"
    options: ClassVar[tuple[Option, ...]] = (
        tau_option(),
        Option("steps", parse_int, (DEFAULT_REPAIR_STEPS,), "distillation steps after JANUS (JanusConfig."
                                                            "distill_steps, ≥ 1)"),
        Option("keep_gain", parse_float, (_DEFAULTS.keep_gain,), "the share of the new task's held-out gain the "
                                                                 "chosen point keeps, in (0, 1]"),
        Option("lr", parse_float, (DEFAULT_DISTILL_LR,), "the distillation's Adam learning rate (> 0)"),
        Option("schedule", parse_str, (_DEFAULTS.distill_schedule,),
               "the learning rate over the steps: " + ", ".join(DISTILL_SCHEDULES) + " (JanusConfig.distill_schedule)"),
        Option("new_task_weight", parse_float, (_DEFAULTS.new_task_weight,),
               "the weight of the new task's cross-entropy in each step (> 0)"),
        Option("new_task_batch_size", parse_int, (_DEFAULTS.new_task_batch_size,),
               "new-task samples fitted per step (≥ 1)"))
    style: ClassVar[PlotStyle] = PlotStyle("P", "C2", "JANUS → repair")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        require(int(self.steps) == self.steps and self.steps >= 1, self.name, "steps", self.steps,
                "a whole number ≥ 1")
        require(math.isfinite(self.keep_gain) and 0.0 < self.keep_gain <= 1.0, self.name, "keep_gain",
                self.keep_gain, "in (0, 1]")
        require(finite_positive(self.lr), self.name, "lr", self.lr, "finite and > 0")
        require(self.schedule in DISTILL_SCHEDULES, self.name, "schedule", self.schedule,
                " or ".join(DISTILL_SCHEDULES))
        require(finite_positive(self.new_task_weight), self.name, "new_task_weight", self.new_task_weight,
                "finite and > 0")
        require(int(self.new_task_batch_size) == self.new_task_batch_size and self.new_task_batch_size >= 1,
                self.name, "new_task_batch_size", self.new_task_batch_size, "a whole number ≥ 1")

    def changes(self) -> dict[str, Any]:
        return {"tau": self.tau, "distill_steps": int(self.steps), "keep_gain": self.keep_gain,
                "distill_lr": self.lr, "distill_schedule": self.schedule, "new_task_weight": self.new_task_weight,
                "new_task_batch_size": int(self.new_task_batch_size)}

    def run_key(self) -> Optional[str]:
        return (f"tau={self.tau:g} repair steps={self.steps} keep_gain={self.keep_gain:g} lr={self.lr:g} "
                f"schedule={self.schedule} "
                f"new_task_weight={self.new_task_weight:g} new_task_batch_size={self.new_task_batch_size}")

    def check(self, builder: "WeightBuilder") -> None:
        super().check(builder)
        if builder.new_task is None:
            raise JanusError(f"{self.name} fits the new task's samples and keeps keep_gain of their gain, but none "
                             "were given; pass new_task_samples= to frontier (hf-janus frontier --new-task-samples "
                             "FILE), or drop it from the candidates")
        # made now, so that unlabelled samples and a replay or new task too small to hold a slice out are refused
        # before any work
        check_samples(replay_batches(builder, 1), new_task_batches(builder, int(self.new_task_batch_size)))

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        cost = super().prepare(builder, context)
        if cost.reused:
            return cost
        # the distillation's replay passes beside JANUS's evaluations: θ0's forward and the trained point's
        # forward/backward over one replay batch a step
        samples = len(builder.replay)
        passes = self.steps * min(context.config.distill_replay_batch_size, samples) / max(samples, 1)
        return dataclasses.replace(cost, forward_passes=2 * passes, backward_passes=passes)

    @property
    def label(self) -> str:
        return (f"JANUS τ={self.tau:g} → repair {self.steps} steps (keep {self.keep_gain:.0%} of the gain, "
                f"lr={self.lr:g} {self.schedule}, new task ×{self.new_task_weight:g})")

    def describe(self) -> str:
        return (f"It is JANUS at τ={self.tau:g} with the repair after it (JanusConfig.distill_steps={self.steps}): "
                f"{self.steps} Adam steps (lr {self.lr:g}, {self.schedule}) on the replay's KL divergence to θ0, "
                f"each also fitting {self.new_task_batch_size} of the new task's samples (weight "
                f"{self.new_task_weight:g}), then the farthest point on the line back toward θ0 that keeps "
                f"{self.keep_gain:.0%} of the new task's gain on a held-out slice." + self.janus_note())


__all__ = ["DEFAULT_REPAIR_STEPS", "JanusRepair"]
