"""``acceptance="cosine"``: the paper's test, the mean principal-angle cosine c̄ against τ."""

from __future__ import annotations

from hf_janus.engine.acceptance.base import AcceptanceRule, TrialMeasurement
from hf_janus.engine.acceptance.registry import register


@register
class CosineAcceptance(AcceptanceRule):
    """A trial passes when c̄ ≥ τ: the Jacobian row space barely turned, so the first-order constraint of the next
    step still describes the loss contour (Algorithm 1). The score is c̄ itself."""

    name = "cosine"
    summary = "the paper's, c̄ ≥ τ"
    uses_tau = True
    bar_key = "cos"

    def __init__(self, tau: float):
        self.tau = float(tau)

    @property
    def threshold(self) -> float:
        return self.tau

    def score(self, trial: TrialMeasurement) -> float:
        return trial.mean_cosine

    def describe(self) -> str:
        return f"mean cosine c̄ ≥ τ={self.tau:g}"

    def verdict(self, trial: TrialMeasurement, score: float) -> str:
        return f"{score:.4f}{'≥' if self.passes(score) else '<'}τ={self.tau:g}"

    def card_sentence(self) -> str:
        return ("Each step tries the step size α = 1, shrinks it by β while the mean cosine c̄ of the principal "
                "angles between the Jacobian row spaces before and after the trial stays below τ, and takes the "
                "first accepted α.")
