"""``acceptance="loss"``: the whole-replay loss, which each trial's capture measures anyway, may rise from the
current point by at most ``tolerance · α`` times the fine-tune's rise."""

from __future__ import annotations

from hf_janus.engine.acceptance.base import (SCORE_THRESHOLD, AcceptanceRule, TrialMeasurement, loss_ratio,
                                             loss_score, ratio_of)
from hf_janus.engine.acceptance.registry import register
from hf_janus.kinds import KindOption, is_real

#: the option of every loss-based rule: the share of the fine-tune's replay-loss rise the rule allows
TOLERANCE = KindOption("tolerance", 0.05, "the share of the fine-tune's replay-loss rise the rule allows",
                       lambda v: is_real(v) and v > 0, "a number > 0")


@register
class LossAcceptance(AcceptanceRule):
    """A trial passes when its replay loss rose from the current point θ_t by at most ``tolerance · α ·
    rise`` (``rise``: the fine-tune's replay-loss rise; α: the share of the remaining update the step moves).

    The allowance is per step: over a run it adds up to ``tolerance · rise · Σα``, and Σα is not bounded by 1
    (α is a share of what remains, and a run may take many steps), so the whole run may add more than
    ``tolerance · rise`` to the replay loss. ``loss-absolute`` bounds the total instead. The score maps the
    ratio of the rise to its allowance to ``1 − ratio · (1 − 0.5)``, at or above 0.5 exactly when it passes.
    """

    name = "loss"
    summary = ("the whole-replay loss, which each trial's capture measures anyway, rose from the current point by "
               "at most tolerance · α times the fine-tune's rise, an allowance per step, so that over a run "
               "they add up to tolerance · rise · Σα, and Σα may exceed 1")
    options = (TOLERANCE,)
    needs_rise = True
    bar_key = "rise"

    def __init__(self, tolerance: float = TOLERANCE.default):
        self.tolerance = float(tolerance)

    @property
    def threshold(self) -> float:
        return SCORE_THRESHOLD

    def score(self, trial: TrialMeasurement) -> float:
        return loss_score(loss_ratio(trial, self.tolerance))

    def describe(self) -> str:
        return f"replay-loss rise from the current point ≤ {self.tolerance:g}·α·(the fine-tune's rise)"

    def verdict(self, trial: TrialMeasurement, score: float) -> str:
        # the share of the step's allowance the trial used
        return f"{ratio_of(score):.2f}{'≤' if self.passes(score) else '>'}1×allowance"
