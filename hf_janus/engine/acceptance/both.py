"""``acceptance="both"``: the loss test and the paper's cosine test together."""

from __future__ import annotations

import math

from hf_janus.engine.acceptance.base import (SCORE_THRESHOLD, AcceptanceRule, TrialMeasurement, loss_ratio,
                                             loss_score, ratio_of)
from hf_janus.engine.acceptance.loss import TOLERANCE
from hf_janus.engine.acceptance.registry import register


@register
class BothAcceptance(AcceptanceRule):
    """A trial passes when it passes :class:`~hf_janus.engine.acceptance.loss.LossAcceptance` and c̄ ≥ τ. The
    score is that of the larger of the loss ratio and the cosine's ``(1 − c̄)/(1 − τ)``; an undefined loss or c̄
    fails the whole test."""

    name = "both"
    summary = ("loss and cosine together, an experiment of the well-fit-past-task study (see the forgetting "
               "benchmark's README)")
    options = (TOLERANCE,)
    uses_tau = True
    needs_rise = True

    def __init__(self, tau: float, tolerance: float = TOLERANCE.default):
        self.tau, self.tolerance = float(tau), float(tolerance)

    @property
    def threshold(self) -> float:
        return SCORE_THRESHOLD

    def score(self, trial: TrialMeasurement) -> float:
        ratio = loss_ratio(trial, self.tolerance)
        cbar, tau = trial.mean_cosine, self.tau
        cosine = (1.0 - cbar) / (1.0 - tau) if tau < 1.0 else (0.0 if cbar >= 1.0 else math.inf)
        # not max(): max(ratio, nan) is ratio and max(nan, ratio) is nan, so either order would let one undefined
        # half pass; an undefined loss or c̄ fails the whole test
        worse = math.nan if math.isnan(ratio) or math.isnan(cosine) else max(ratio, cosine)
        return loss_score(worse)

    def describe(self) -> str:
        return (f"replay-loss rise from the current point ≤ {self.tolerance:g}·α·(the fine-tune's rise) and "
                f"mean cosine c̄ ≥ τ={self.tau:g}")

    def verdict(self, trial: TrialMeasurement, score: float) -> str:
        return f"{ratio_of(score):.2f}{'≤' if self.passes(score) else '>'}1 (loss and cos)"
