"""The paper's constraint: each sample's summed next-token loss, optionally at a softmax temperature."""

from __future__ import annotations

from torch import Tensor

from hf_janus.engine.constraints.base import Constraint, ReplayLogits
from hf_janus.engine.constraints.registry import register


@register
class LossConstraint(Constraint):
    """The summed next-token loss at softmax temperature T (1 = the paper's); T > 1 softens confident predictions
    so that they keep a gradient where the past task is well fit."""

    name = "loss"
    summary = "the paper's summed next-token loss, at constraint_temperature"
    options = ("constraint_temperature",)

    def __init__(self, constraint_temperature: float = 1.0):
        self.temperature = float(constraint_temperature)

    def functions(self, batch: ReplayLogits) -> Tensor:
        # the cross-entropy is already 0 where a position does not count: at T = 1 this is the sample loss itself
        return batch.loss_at(self.temperature).sum(dim=1)
