"""JANUS, then interpolation toward θ0: ``θ0 + b(θ_J − θ0)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from hf_janus.evaluation.candidates.base import Option, PlotStyle, in_open_unit, interpolate, parse_float, require
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_HYBRID_GRID = (0.25, 0.5, 0.75)


def b_option() -> Option:
    return Option("b", parse_float, DEFAULT_HYBRID_GRID, "interpolation after JANUS, strictly between 0 and 1")


@register
@dataclass(frozen=True)
class JanusToReference(JanusBased):
    """The JANUS result at ``tau`` moved toward θ0 by ``1 − b``."""

    b: float
    tau: float

    name: ClassVar[str] = "janus-to-reference"
    title: ClassVar[str] = "JANUS → θ0"
    options: ClassVar[tuple[Option, ...]] = (b_option(), tau_option())
    style: ClassVar[PlotStyle] = PlotStyle("v", "C1", "JANUS → θ0")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        require(in_open_unit(self.b), self.name, "b", self.b, "strictly between 0 and 1 (the ends are θ0 and JANUS)")

    @property
    def label(self) -> str:
        return f"JANUS τ={self.tau:g} → θ0 b={self.b:g}"

    def describe(self) -> str:
        return (f"It is θ0 + {self.b:g}·(θ_J − θ0), θ_J the JANUS result at τ={self.tau:g}." + self.janus_note())

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return interpolate(builder.theta0, self.janus_weights(builder), self.b)
