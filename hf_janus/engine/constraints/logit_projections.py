"""Per sample, k sums of the logits projected on fixed random directions."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hf_janus.engine.constraints.base import Constraint, ReplayLogits
from hf_janus.engine.constraints.registry import register
from hf_janus.kinds import KindOption, is_int, setting


def logit_projections(vocab: int, count: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The fixed random directions ``(vocab, count)``: Gaussian, scaled by ``1/sqrt(vocab)``, drawn from ``seed`` on
    the CPU so that every capture (and every rank) uses the same ones."""
    gen = torch.Generator().manual_seed(0x4C4F4749 + seed)
    return (torch.randn(vocab, count, generator=gen, dtype=torch.float64) / vocab ** 0.5).to(device, dtype)


@register
class LogitProjectionsConstraint(Constraint):
    """k functions per sample: more of the output distribution than the loss's one direction keeps."""

    name = "logit_projections"
    summary = "per sample, k sums of the logits projected on fixed random directions (option projections)"
    options = (KindOption("projections", 4, "the number k of random logit directions per replay sample (k Jacobian "
                          "rows per sample, k backward passes per replay batch; drawn from JanusConfig.seed)",
                          lambda k: is_int(k) and k >= 1, "an int >= 1"),)

    def __init__(self, projections: int = 4, seed: int = 0):
        self.projections, self.seed = int(projections), int(seed)

    @classmethod
    def from_config(cls, config: Any) -> "LogitProjectionsConstraint":
        return cls(**cls.options_from(config), seed=setting(config, "seed") or 0)

    @property
    def rows_per_sample(self) -> int:
        return self.projections

    def functions(self, batch: ReplayLogits) -> Tensor:
        scores = batch.scores
        directions = logit_projections(scores.shape[-1], self.projections, self.seed, scores.device, scores.dtype)
        return batch.masked_sum(scores @ directions)
