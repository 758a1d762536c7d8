"""JANUS, then replay fine-tuning from its result: the projection keeps the replay's losses to first order along
its steps, and a few passes on the replay's KL to θ0 then restore what the first order misses (θ0's answers are
near-ties that a small move flips), in the directions the projection left free. With ``b``, the trained point is
moved toward θ0 (``θ0 + b(θ_T − θ0)``), or with ``b_hat`` toward θ̂ (``θ_T + b_hat(θ̂ − θ_T)``, which gives back
some of the gain the passes cost); both share the training with the candidates of the same settings. With
``new_task_weight`` the passes also fit the new task's samples and keep the gain, which ``b`` can then spend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

from torch import Tensor

from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, Cost, Option, PlotStyle, SpecContext,
                                                 in_open_unit, interpolate, parse_float, parse_int, parse_str, require)
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option
from hf_janus.evaluation.candidates.replay_sft import (DEFAULT_LR, DEFAULT_NEW_TASK_BATCH, NEW_TASK_OPTIONS,
                                                       STEPS_OPTION, ReplayTraining)
from hf_janus.errors import JanusError

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_POLISH_PASSES = (16,)


@dataclass(frozen=True)
class JanusThenReplaySft(ReplayTraining, JanusBased):
    """The JANUS result at ``tau`` trained ``passes`` passes (or about ``steps`` optimizer steps) on the replay (by
    default on its KL to θ0)."""

    tau: float
    passes: Optional[int] = None
    steps: Optional[int] = None
    loss: str = "kl"
    optimizer: str = "adam"
    lr: float = DEFAULT_LR
    batch_size: Optional[int] = None  # None: the JanusConfig's replay_batch_size
    new_task_weight: Optional[float] = None  # None: the replay alone
    new_task_batch_size: int = DEFAULT_NEW_TASK_BATCH
    b: Optional[float] = None  # None: the trained point itself
    b_hat: Optional[float] = None  # None: the trained point itself

    name: ClassVar[str] = "janus-then-replay-sft"
    kind: ClassVar[str] = "janus_then_replay_sft"
    title: ClassVar[str] = "JANUS → replay SFT"
    options: ClassVar[tuple[Option, ...]] = (
        Option("passes", parse_int, DEFAULT_POLISH_PASSES, "passes over the replay after JANUS (≥ 1)"),
        STEPS_OPTION,
        tau_option(),
        Option("loss", parse_str, ("kl",), "'kl' (KL to θ0's next-token distributions) or 'ce'"),
        Option("optimizer", parse_str, ("adam",), "'adam' or 'sgd'"),
        Option("lr", parse_float, (DEFAULT_LR,), "learning rate (> 0)"),
        Option("batch_size", parse_int, None, "replay samples per step (default: the JanusConfig's "
                                              "replay_batch_size)"),
        Option("b", parse_float, None, "move the trained point toward θ0: θ0 + b(θ_T − θ0), b in (0, 1) (default: "
                                       "the trained point)"),
        Option("b_hat", parse_float, None, "move the trained point toward θ̂ instead: θ_T + b_hat(θ̂ − θ_T), b_hat "
                                           "in (0, 1) (default: the trained point)"),
        *NEW_TASK_OPTIONS)
    style: ClassVar[PlotStyle] = PlotStyle("P", "C2", "JANUS → replay SFT")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        if (self.passes is None) == (self.steps is None):
            raise JanusError(f"{self.name} takes passes= or steps=, exactly one, got passes={self.passes!r}, "
                             f"steps={self.steps!r}")
        self.check_training()
        if self.b is not None:
            require(in_open_unit(self.b), self.name, "b", self.b, "strictly between 0 and 1 (1 is the trained point)")
        if self.b_hat is not None:
            require(in_open_unit(self.b_hat), self.name, "b_hat", self.b_hat,
                    "strictly between 0 and 1 (0 is the trained point)")
            if self.b is not None:
                raise JanusError(f"{self.name} takes b= or b_hat=, not both: b moves the trained point toward θ0, "
                                 "b_hat toward θ̂")

    @classmethod
    def expand(cls, values: Mapping[str, Sequence[Any]], context: SpecContext) -> list[Candidate]:
        """The spec's grid; ``passes``'s default grid only when ``steps`` is not given."""
        if "steps" in values:
            if "passes" in values:
                raise JanusError(f"{cls.name} takes passes= or steps=, not both: passes counts replay passes, "
                                 "steps optimizer steps")
            values = {**values, "passes": (None,)}
        return super().expand(values, context)

    @property
    def label(self) -> str:
        return (f"JANUS τ={self.tau:g} → replay SFT {self.training_length()} ({self.loss.upper()}, {self.optimizer} "
                f"lr={self.lr:g}{self.new_task_label()}){self._toward()}")

    def _toward(self) -> str:
        if self.b is not None:
            return f" → θ0 b={self.b:g}"
        return "" if self.b_hat is None else f" → θ̂ b={self.b_hat:g}"

    def describe(self) -> str:
        target = ("the KL divergence to θ0's next-token distributions on the replay" if self.loss == "kl"
                  else "the replay's next-token cross-entropy")
        toward = ("" if self.b is None else f" It is then moved toward θ0: θ0 + {self.b:g}·(θ_T − θ0).") + (
            "" if self.b_hat is None else f" It is then moved toward θ̂: θ_T + {self.b_hat:g}·(θ̂ − θ_T).")
        return (f"It is the JANUS result at τ={self.tau:g} trained further for {self.training_length(card=True)} "
                f"on {target} ({self.optimizer}, lr {self.lr:g}), θ_T."
                + self.new_task_note() + toward + self.janus_note())

    def artifact_key(self) -> str:
        # b and b_hat only move the trained point: the points of every b share one training
        if self.b is None and self.b_hat is None:
            return super().artifact_key()
        return dataclasses.replace(self, b=None, b_hat=None).artifact_key()

    def train(self, builder: "WeightBuilder", context: BuildContext) -> tuple[dict[str, Tensor], Cost]:
        janus = JanusBased.prepare(self, builder, context)  # the run of this τ, or the one another kind made
        batch_size = self.batch_size or context.config.replay_batch_size
        passes = self.passes_for(builder, batch_size)
        trained = self.trained(builder, passes, batch_size, start=self.janus_weights(builder))
        return trained, self.passes_cost(passes, janus.jacobian_evaluations)

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        trained = super().weights(builder)
        if self.b is not None:
            return interpolate(builder.theta0, trained, self.b)
        return trained if self.b_hat is None else interpolate(trained, builder.finetuned, self.b_hat)
