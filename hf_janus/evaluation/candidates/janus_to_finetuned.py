"""JANUS, then interpolation toward θ̂: ``θ_J + b(θ̂ − θ_J)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from hf_janus.evaluation.candidates.base import Option, PlotStyle, in_open_unit, interpolate, require
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option
from hf_janus.evaluation.candidates.janus_to_reference import b_option

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder


@register
@dataclass(frozen=True)
class JanusToFinetuned(JanusBased):
    """The JANUS result at ``tau`` moved toward θ̂ by ``b``."""

    b: float
    tau: float

    name: ClassVar[str] = "janus-to-finetuned"
    title: ClassVar[str] = "JANUS → θ̂"
    options: ClassVar[tuple[Option, ...]] = (b_option(), tau_option())
    style: ClassVar[PlotStyle] = PlotStyle("^", "C2", "JANUS → θ̂")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        require(in_open_unit(self.b), self.name, "b", self.b, "strictly between 0 and 1 (the ends are JANUS and θ̂)")

    @property
    def label(self) -> str:
        return f"JANUS τ={self.tau:g} → θ̂ b={self.b:g}"

    def describe(self) -> str:
        return (f"It is θ_J + {self.b:g}·(θ̂ − θ_J), θ_J the JANUS result at τ={self.tau:g}." + self.janus_note())

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        janus = self.janus_weights(builder)
        return interpolate(janus, {k: builder.finetuned[k] for k in janus}, self.b)
