"""Diagonal-Fisher-weighted interpolation from the replay: Fisher merging (Matena & Raffel, 2022) in its
single-model form, a per-parameter peer of JANUS at about one replay pass of cost.

Fisher merging averages models weighted by each one's diagonal Fisher. Of θ̂ only the update is known (no new-task
data here), so θ̂'s weight is a constant: ``θ = (s F̃ θ0 + θ̂) / (s F̃ + 1) = θ̂ − (s F̃ / (s F̃ + 1)) ΔW``, where
``F`` is the diagonal empirical Fisher at θ0 over the replay, ``F_j = Σ_i (∂ℓ_i/∂θ_j)²`` (``ℓ_i`` the i-th
sample's token-summed loss, one backward pass per sample), and ``F̃ = F / mean(F)`` per parameter tensor, so that
``strength`` ``s`` means the same in every layer. ``s = 0`` is θ̂; as ``s`` grows every parameter the replay's
loss depends on returns to θ0, the more so the more it matters to the past task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch
from torch import Tensor

from hf_janus.engine.public import model_device, token_summed_loss
from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, Cost, Curve, Option, PlotStyle,
                                                 finite_positive, measured, parse_float, require)
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.replay_statistics import holding, on_device, replay_batches
from hf_janus.model_modes import evaluation_mode

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_STRENGTHS = (0.1, 1.0, 10.0)
FISHER_KEY = "fisher_diagonal"

FISHER_CURVE = Curve("fisher", "Fisher", PlotStyle("h", "C9", "diagonal-Fisher interpolation", line="-."))


def fisher_diagonal(builder: "WeightBuilder", batch_size: int) -> dict[str, Tensor]:
    """``Σ_i (∂ℓ_i/∂θ)²`` at θ0 of every changed parameter (float32, on the host), ``ℓ_i`` each replay sample's
    token-summed next-token loss."""
    names = list(builder.theta0)
    params = [builder.params[k] for k in names]
    flags = [p.requires_grad for p in params]
    totals = {k: torch.zeros(builder.theta0[k].shape, dtype=torch.float32) for k in names}
    device = model_device(builder.model)
    try:
        for p in params:
            p.requires_grad_(True)
        with holding(builder, builder.theta0) as model, evaluation_mode(model):
            offset = 0
            for batch in replay_batches(builder, batch_size):
                for row in range(int(batch["input_ids"].shape[0])):
                    sample = on_device({k: v[row: row + 1] for k, v in batch.items()}, device)
                    loss = token_summed_loss(model, sample, offset)[0].sum()
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    for k, g in zip(names, grads):
                        if g is not None:
                            totals[k] += g.detach().float().cpu() ** 2
                    offset += 1
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return totals


@register
@dataclass(frozen=True)
class Fisher(Candidate):
    """``θ̂ − (s F̃ / (s F̃ + 1)) ΔW`` with the layer-normalized diagonal Fisher ``F̃`` of the replay at θ0."""

    strength: float

    name: ClassVar[str] = "fisher"
    title: ClassVar[str] = "diagonal-Fisher interpolation"
    options: ClassVar[tuple[Option, ...]] = (
        Option("strength", parse_float, DEFAULT_STRENGTHS,
               "s > 0 in θ̂ − (sF̃/(sF̃ + 1))ΔW, F̃ the replay Fisher at θ0 over its mean per tensor"),)
    style: ClassVar[PlotStyle] = FISHER_CURVE.style
    curve: ClassVar[Optional[Curve]] = FISHER_CURVE

    def __post_init__(self) -> None:
        require(finite_positive(self.strength), self.name, "strength", self.strength, "finite and > 0")

    @property
    def label(self) -> str:
        return f"Fisher interpolation s={self.strength:g}"

    def describe(self) -> str:
        return ("It is diagonal-Fisher-weighted interpolation (Fisher merging in single-model form): each parameter "
                f"moved back toward θ0 by sF̃/(sF̃ + 1), s = {self.strength:g}, F̃ the replay's diagonal Fisher at θ0 "
                "over its mean per tensor (no JANUS step).")

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        if FISHER_KEY in builder.artifacts:
            return Cost(reused=True)

        def work() -> Cost:
            builder.artifacts[FISHER_KEY] = fisher_diagonal(builder, context.config.replay_batch_size)
            return Cost(forward_passes=1.0, backward_passes=1.0)

        return measured(builder, work)

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        fisher = builder.artifacts[FISHER_KEY]
        out = {}
        for k, f in fisher.items():
            mean = float(f.double().mean())
            normalized = f.double() / mean if mean > 0 else torch.zeros_like(f, dtype=torch.float64)
            back = self.strength * normalized / (self.strength * normalized + 1.0)
            t1 = builder.finetuned[k].double()
            out[k] = (t1 - back * (t1 - builder.theta0[k].double())).float()
        return out
