"""One constraint row per early answer token: the loss of each of a sample's first k counted tokens alone, and the
rest of its loss as one more row.

Why: a replayed answer's summed loss is one direction per sample, which keeps the likelihood of the whole answer
to first order but not which token is the argmax at each position; answers θ0 gives with thin margins flip at their
first tokens. The rows sum to the sample's loss, so the paper's constraint stays in their span.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hf_janus.engine.constraints.base import Constraint, ReplayLogits
from hf_janus.engine.constraints.registry import register
from hf_janus.kinds import KindOption, is_int


@register
class TokenLossConstraint(Constraint):
    """k + 1 functions per sample: the losses of its first k counted tokens, each alone, and the sum of the rest
    (a sample with fewer tokens gives zero rows, which the projection ignores)."""

    name = "token_loss"
    summary = "the loss of each of the first k answer tokens alone (option tokens), and the rest of the loss"
    options = (KindOption("tokens", 3, "the number k of a replayed answer's first tokens that are each their own "
                          "Jacobian row (k + 1 rows per sample, k + 1 backward passes per replay batch)",
                          lambda k: is_int(k) and k >= 1, "an int >= 1"),)

    def __init__(self, tokens: int = 3):
        self.tokens = int(tokens)

    @property
    def rows_per_sample(self) -> int:
        return self.tokens + 1

    def functions(self, batch: ReplayLogits) -> Tensor:
        counted = batch.counted
        order = counted.long().cumsum(dim=1) - 1  # 0 at a sample's first counted position, 1 at its second, ...
        zero = torch.zeros((), dtype=batch.per_token.dtype, device=batch.per_token.device)
        rows = [torch.where(counted & (order == j), batch.per_token, zero).sum(dim=1) for j in range(self.tokens)]
        rows.append(torch.where(counted & (order >= self.tokens), batch.per_token, zero).sum(dim=1))
        return torch.stack(rows, dim=1)
