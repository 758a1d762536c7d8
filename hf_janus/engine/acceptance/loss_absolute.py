"""``acceptance="loss-absolute"``: the whole run may add at most ``tolerance`` times the fine-tune's rise to
θ0's replay loss (a bound on the total, where ``"loss"`` bounds each step)."""

from __future__ import annotations

from hf_janus.engine.acceptance.base import TrialMeasurement, loss_ratio, loss_score
from hf_janus.engine.acceptance.registry import register
from hf_janus.engine.acceptance.loss import LossAcceptance


@register
class LossAbsoluteAcceptance(LossAcceptance):
    """A trial passes when its replay loss is at most θ0's plus ``tolerance · rise`` (``rise``: the
    fine-tune's replay-loss rise): the rectified model forgets at most that share of what the fine-tune made it
    forget, whatever the number of steps. Once a run has used that allowance, larger steps fail, the loop shrinks
    to ``min_alpha`` (forced steps), and the guarded final step keeps the last point below the bound. The
    tolerance, threshold and progress-bar verdict are the ``loss`` rule's; only the bound differs."""

    name = "loss-absolute"
    summary = ("the whole-replay loss stays at most tolerance times the fine-tune's rise above θ0's, over the "
               "whole run")
    bar_key = "above θ0"

    def score(self, trial: TrialMeasurement) -> float:
        return loss_score(loss_ratio(trial, self.tolerance, per_step=False))

    def describe(self) -> str:
        return f"replay loss ≤ θ0's + {self.tolerance:g}·(the fine-tune's rise)"
