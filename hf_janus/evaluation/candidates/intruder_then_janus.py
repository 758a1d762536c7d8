"""PEFT's intruder reduction, then JANUS on the reduced adapter (LoRA adapters only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from hf_janus.evaluation.candidates.base import Candidate, Option, PlotStyle, parse_float
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.intruder import Intruder, check_lambda
from hf_janus.evaluation.candidates.janus import JanusBased, check_tau, tau_option

# the λ of "intruder reduction, then JANUS" (one more JANUS run, LoRA adapters only, with the hybrids)
DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS = (0.5,)


@register
@dataclass(frozen=True)
class IntruderThenJanus(JanusBased):
    """JANUS at ``tau`` applied to the intruder-reduced point ``mitigation_lambda`` (its own JANUS run)."""

    mitigation_lambda: float
    tau: float

    name: ClassVar[str] = "intruder-then-janus"
    title: ClassVar[str] = "intruder reduction → JANUS"
    options: ClassVar[tuple[Option, ...]] = (
        Option("mitigation_lambda", parse_float, DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS,
               "PEFT's mitigation_lambda in [0, 1) before JANUS"),
        tau_option())
    style: ClassVar[PlotStyle] = PlotStyle("X", "C6", "intruder reduction → JANUS")
    lora_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        check_lambda(self.name, self.mitigation_lambda)

    @property
    def label(self) -> str:
        return f"intruder reduction λ={self.mitigation_lambda:g} → JANUS τ={self.tau:g}"

    def describe(self) -> str:
        return (f"It is JANUS at τ={self.tau:g} applied to PEFT's intruder-dimension reduction of the adapter at "
                f"mitigation_lambda={self.mitigation_lambda:g}." + self.janus_note())

    def start(self) -> Candidate:
        return Intruder(self.mitigation_lambda)

    def run_key(self) -> Optional[str]:
        return f"tau={self.tau:g},intruder={self.mitigation_lambda:g}"
