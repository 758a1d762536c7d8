"""WiSE-FT (Wortsman et al., 2022): ``θ0 + a(θ̂ − θ0)``, free (no replay, no Jacobian), the frontier's main peer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from torch import Tensor

from hf_janus.evaluation.candidates.base import (WISE_CURVE_SPEC, Candidate, Curve, Option, PlotStyle, in_open_unit,
                                                 interpolate, parse_float, require)
from hf_janus.evaluation.candidates.registry import register

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_WISE_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@register
@dataclass(frozen=True)
class Wise(Candidate):
    """Weight interpolation between θ0 and θ̂ at coefficient ``a`` in (0, 1) (the ends are the anchors)."""

    a: float

    name: ClassVar[str] = "wise"
    title: ClassVar[str] = "WiSE-FT"
    options: ClassVar[tuple[Option, ...]] = (
        Option("a", parse_float, DEFAULT_WISE_GRID, "interpolation coefficient in (0, 1): θ0 + a(θ̂ − θ0)"),)
    style: ClassVar[PlotStyle] = WISE_CURVE_SPEC.style
    curve: ClassVar[Optional[Curve]] = WISE_CURVE_SPEC

    def __post_init__(self) -> None:
        require(in_open_unit(self.a), self.name, "a", self.a,
                "strictly between 0 and 1 (the ends are θ0 and θ̂, scored anyway)")

    @property
    def label(self) -> str:
        return f"WiSE-FT a={self.a:g}"

    def describe(self) -> str:
        return (f"It is the WiSE-FT interpolation θ0 + {self.a:g}·(θ̂ − θ0) of the reference and fine-tuned weights "
                "(no replay, no JANUS step).")

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return interpolate(builder.theta0, builder.finetuned, self.a)
