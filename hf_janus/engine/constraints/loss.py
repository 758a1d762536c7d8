"""The paper's constraint: each sample's summed next-token loss, optionally at a softmax temperature."""

from __future__ import annotations

from torch import Tensor

from hf_janus.engine.constraints.base import Constraint, ReplayLogits
from hf_janus.engine.constraints.registry import register
from hf_janus.kinds import KindOption, is_real


@register
class LossConstraint(Constraint):
    """The summed next-token loss at softmax temperature T (1 = the paper's); T > 1 softens confident predictions
    so that they keep a gradient where the past task is well fit."""

    name = "loss"
    summary = "the paper's summed next-token loss, at a softmax temperature (option temperature)"
    options = (KindOption("temperature", 1.0, "the softmax temperature T of the per-sample replay loss whose Jacobian "
                          "is kept (1 = the paper's; T > 1 softens confident predictions so that they keep a gradient "
                          "where the past task is well fit; the replay loss reported and compared stays at T = 1)",
                          lambda t: is_real(t) and t > 0, "a number > 0"),)

    def __init__(self, temperature: float = 1.0):
        self.temperature = float(temperature)

    @property
    def logits_copies(self) -> int:
        return 0 if self.temperature == 1.0 else 1  # the scaled logits

    def functions(self, batch: ReplayLogits) -> Tensor:
        # the cross-entropy is already 0 where a position does not count: at T = 1 this is the sample loss itself
        return batch.loss_at(self.temperature).sum(dim=1)
