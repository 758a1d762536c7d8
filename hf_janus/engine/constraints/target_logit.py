"""The summed logit of each target token: Orthogonal Gradient Descent's ground-truth logit."""

from __future__ import annotations

from torch import Tensor

from hf_janus.engine.constraints.base import Constraint, ReplayLogits
from hf_janus.engine.constraints.registry import register


@register
class TargetLogitConstraint(Constraint):
    """Unlike the loss, its gradient does not vanish where the target is already predicted with confidence."""

    name = "target_logit"
    summary = "the summed logit of each target token (OGD's ground-truth logit)"

    def functions(self, batch: ReplayLogits) -> Tensor:
        picked = batch.scores.gather(-1, batch.targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return batch.masked_sum(picked)
