"""PEFT's post-hoc mitigation for LoRA, intruder-dimension reduction (no replay), as a peer curve from θ̂.

The arithmetic is :mod:`hf_janus.evaluation.intruder_reduction` (PEFT's, in float32, tested against PEFT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from torch import Tensor

from hf_janus.evaluation.candidates.base import Candidate, Curve, Option, PlotStyle, parse_float, require
from hf_janus.evaluation.candidates.registry import register

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

# mitigation_lambda of PEFT's intruder-dimension reduction (LoRA adapters only): PEFT's default 0.75 and the paper's
# range down to removing the intruders (0). 1 is θ̂ itself.
DEFAULT_INTRUDER_LAMBDAS = (0.75, 0.5, 0.25, 0.0)

INTRUDER_CURVE_SPEC = Curve("intruder", "intruder", PlotStyle("D", "C5", "intruder reduction (PEFT)", line="--"))


def check_lambda(kind: str, value: float) -> None:
    require(0.0 <= float(value) < 1.0, kind, "mitigation_lambda", value, "in [0, 1) (1 keeps θ̂)")


@register
@dataclass(frozen=True)
class Intruder(Candidate):
    """θ̂ with each adapted layer's intruder components scaled by ``mitigation_lambda`` (PEFT's ``top_k=10``,
    ``threshold_epsilon=0.5``); parameters outside the adapted linear layers keep θ̂, as in PEFT."""

    mitigation_lambda: float

    name: ClassVar[str] = "intruder"
    title: ClassVar[str] = "intruder reduction (PEFT)"
    options: ClassVar[tuple[Option, ...]] = (
        Option("mitigation_lambda", parse_float, DEFAULT_INTRUDER_LAMBDAS,
               "PEFT's mitigation_lambda in [0, 1): the scale left on the intruder dimensions"),)
    style: ClassVar[PlotStyle] = INTRUDER_CURVE_SPEC.style
    curve: ClassVar[Optional[Curve]] = INTRUDER_CURVE_SPEC
    lora_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_lambda(self.name, self.mitigation_lambda)

    @property
    def label(self) -> str:
        return f"intruder reduction λ={self.mitigation_lambda:g}"

    def describe(self) -> str:
        return (f"It is PEFT's intruder-dimension reduction of the adapter at mitigation_lambda="
                f"{self.mitigation_lambda:g} (no replay, no JANUS step).")

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        from hf_janus.errors import JanusError

        if builder.intruders is None:
            raise JanusError("intruder reduction needs a LoRA adapter as the fine-tuned model")
        return {**{k: v.float() for k, v in builder.finetuned.items()},
                **builder.intruders.weights(builder.theta0, self.mitigation_lambda)}
