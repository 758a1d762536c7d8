"""The two ends every frontier scores first, because AP1 and AP2 are relative to them: θ0 and θ̂."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import WISE_CURVE_SPEC, Candidate, PlotStyle

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder


@dataclass(frozen=True)
class Anchor(Candidate):
    """θ0 (``a=0``) or θ̂ (``a=1``): exactly the kept weights, no interpolation."""

    a: float

    name: ClassVar[str] = "anchor"
    title: ClassVar[str] = "anchor"
    style: ClassVar[PlotStyle] = WISE_CURVE_SPEC.style

    def __post_init__(self) -> None:
        if self.a not in (0.0, 1.0):
            raise JanusError(f"an anchor is θ0 (a=0) or θ̂ (a=1), got a={self.a!r}")

    @property
    def label(self) -> str:
        return "θ0 (reference)" if self.a == 0 else "θ̂ (fine-tuned)"

    def describe(self) -> str:
        return ("This is the reference model θ0 itself (no fine-tuning kept)." if self.a == 0 else
                "This is the fine-tuned model θ̂ itself: no repair scored higher on the criterion.")

    @property
    def is_anchor(self) -> bool:
        return True

    def on_curve(self, curve: str) -> bool:
        # every peer curve starts at θ̂; only WiSE-FT's also ends at θ0
        return self.a == 1.0 or curve == WISE_CURVE_SPEC.name

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return {k: v.float() for k, v in (builder.theta0 if self.a == 0 else builder.finetuned).items()}


REFERENCE, FINETUNED = Anchor(0.0), Anchor(1.0)
