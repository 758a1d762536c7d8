"""JANUS at a τ (one rectification from θ̂), and the base of every kind built from a JANUS run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from torch import Tensor

from hf_janus.evaluation.candidates.anchor import FINETUNED
from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, Cost, Option, PlotStyle, SpecContext,
                                                 measured, parse_float, require)
from hf_janus.evaluation.candidates.registry import register

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_TAUS = (0.9, 0.95, 0.98)


def tau_option(help_text: str = "JANUS τ in [0, 1) (default: the JanusConfig's τ)") -> Option:
    """The τ option of the JANUS kinds; a spec that leaves it out gets the run's ``JanusConfig.tau``."""
    return Option("tau", parse_float, lambda ctx: (ctx.tau,), help_text)


def check_tau(kind: str, tau: float) -> None:
    require(0.0 <= float(tau) < 1.0, kind, "tau", tau, "in [0, 1)")


class JanusBased(Candidate):
    """A candidate built from one JANUS run (shared with the other candidates of the same run key): the run
    starts at :meth:`start` (θ̂ unless said otherwise) with :meth:`changes` to the ``JanusConfig``."""

    tau: float

    def start(self) -> Candidate:
        """The point the rectification starts from (its weights are given to the rectifier exactly)."""
        return FINETUNED

    def changes(self) -> dict[str, Any]:
        """``JanusConfig`` fields this run replaces."""
        return {"tau": self.tau}

    def run_key(self) -> Optional[str]:
        return f"tau={self.tau:g}"

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        from hf_janus.evaluation.candidate_weights import run_janus  # the builder module imports the candidates

        key = self.run_key()
        if key in builder.janus:
            return Cost(reused=True)

        def work() -> Cost:
            report = run_janus(builder, key, self.start().weights(builder), self.changes(), context)
            return Cost(jacobian_evaluations=report.num_jacobian_evals)

        return measured(builder, work)

    def janus_weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        """θ_J: the JANUS result of the changed parameters (θ̂ where the rectifier left one alone), float32."""
        return {k: v.float() for k, v in {**builder.finetuned, **builder.janus[self.run_key()]}.items()}

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return self.janus_weights(builder)

    def janus_note(self) -> str:
        return " The JANUS run below is the rectification this point was built from."


@register
@dataclass(frozen=True)
class Janus(JanusBased):
    """JANUS at ``tau``: θ̂'s update projected onto the null space of the replay's per-sample Jacobians."""

    tau: float

    name: ClassVar[str] = "janus"
    title: ClassVar[str] = "JANUS"
    options: ClassVar[tuple[Option, ...]] = (tau_option(),)
    style: ClassVar[PlotStyle] = PlotStyle("s", "C0", "JANUS")

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)

    @property
    def label(self) -> str:
        return f"JANUS τ={self.tau:g}"

    def describe(self) -> str:
        return f"It is JANUS at τ={self.tau:g}: the rectification below."


__all__ = ["DEFAULT_TAUS", "Janus", "JanusBased", "SpecContext", "check_tau", "tau_option"]
