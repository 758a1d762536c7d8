"""Interpolation, then JANUS: a rectification of ``θ0 + a(θ̂ − θ0)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from hf_janus.evaluation.candidates.base import Candidate, Option, PlotStyle, in_open_unit, parse_float, require
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option
from hf_janus.evaluation.candidates.wise import Wise

DEFAULT_PRE_JANUS_GRID = (0.5, 0.75)


@register
@dataclass(frozen=True)
class WiseThenJanus(JanusBased):
    """JANUS at ``tau`` applied to the WiSE-FT point ``a`` (its own JANUS run)."""

    a: float
    tau: float

    name: ClassVar[str] = "wise-then-janus"
    title: ClassVar[str] = "WiSE-FT → JANUS"
    options: ClassVar[tuple[Option, ...]] = (
        Option("a", parse_float, DEFAULT_PRE_JANUS_GRID, "WiSE-FT coefficient before JANUS, in (0, 1)"),
        tau_option())
    style: ClassVar[PlotStyle] = PlotStyle("D", "C3", "WiSE-FT → JANUS")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        require(in_open_unit(self.a), self.name, "a", self.a, "strictly between 0 and 1")

    @property
    def label(self) -> str:
        return f"WiSE-FT a={self.a:g} → JANUS τ={self.tau:g}"

    def describe(self) -> str:
        return (f"It is JANUS at τ={self.tau:g} applied to the WiSE-FT point θ0 + {self.a:g}·(θ̂ − θ0)."
                + self.janus_note())

    def start(self) -> Candidate:
        return Wise(self.a)

    def run_key(self) -> Optional[str]:
        return f"tau={self.tau:g},a={self.a:g}"
