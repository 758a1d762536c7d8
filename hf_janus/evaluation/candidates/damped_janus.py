"""Damped JANUS: the projection ``ΔW − Jᵀ(JJᵀ + λI)⁻¹JΔW`` (``JanusConfig.damping``), which keeps part of the
update along the directions the replay constrains weakly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from hf_janus.evaluation.candidates.base import Option, PlotStyle, finite_positive, parse_float, require
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option

# Dampings relative to each layer's largest Gram eigenvalue, chosen to span the range where damping changes the
# result: much less is plain JANUS, much more is θ̂ (the measurement: docs/guides/evaluate-and-frontier.md).
DEFAULT_DAMPINGS = (0.01, 0.1)


@register
@dataclass(frozen=True)
class DampedJanus(JanusBased):
    """JANUS at ``tau`` with ``JanusConfig.damping = damping`` (> 0; 0 is plain JANUS)."""

    tau: float
    damping: float

    name: ClassVar[str] = "damped-janus"
    title: ClassVar[str] = "damped JANUS"
    options: ClassVar[tuple[Option, ...]] = (
        Option("damping", parse_float, DEFAULT_DAMPINGS,
               "JanusConfig.damping, relative to each layer's largest Gram eigenvalue (> 0)"),
        tau_option())
    style: ClassVar[PlotStyle] = PlotStyle("P", "C4", "damped JANUS")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        require(finite_positive(self.damping), self.name, "damping", self.damping,
                "finite and > 0 (0 is plain JANUS: use the janus kind)")

    @property
    def label(self) -> str:
        return f"JANUS τ={self.tau:g}, damping {self.damping:g}"

    def describe(self) -> str:
        return f"It is damped JANUS at τ={self.tau:g}, damping {self.damping:g}: the rectification below."

    def changes(self) -> dict[str, Any]:
        return {"tau": self.tau, "damping": self.damping}

    def run_key(self) -> Optional[str]:
        return f"tau={self.tau:g},damping={self.damping:g}"
