"""DG-Hard ("Spectral Unforgetting", 2026): the Donoho-Gavish optimal hard threshold on each update's singular
values, for full fine-tuning.

Each changed linear layer's ``ΔW`` keeps its singular components above ``τ* = ω(β) · median(σ)``, with
``β = min(d_out, d_in) / max(d_out, d_in)`` and Gavish & Donoho's (2014) approximation
``ω(β) ≈ 0.56β³ − 0.95β² + 1.82β + 1.43`` for noise of unknown level (the median is numpy's: the mean of the two
middle values for an even count). Data-free. In the frontier it is applied to the layers JANUS rectifies
(``JanusConfig.target_modules``); other parameters keep θ̂.

A LoRA update is exactly of rank r: its median singular value is 0, so the threshold keeps everything and the
point would be θ̂ itself. It is refused for an adapter, and for any layer whose update is that degenerate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import Candidate, PlotStyle
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.replay_statistics import delta_matrix, linear_weights, with_deltas

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

#: a median singular value below this share of the largest means the update is (numerically) of low rank
DEGENERATE = 1e-6


def omega(beta: float) -> float:
    """Gavish & Donoho's approximation of the optimal hard-threshold coefficient at aspect ratio ``beta``."""
    return 0.56 * beta ** 3 - 0.95 * beta ** 2 + 1.82 * beta + 1.43


def hard_threshold(delta: Tensor, what: str = "ΔW") -> Tensor:
    """``delta`` (a matrix) with its singular values at or below ``ω(β)·median(σ)`` set to 0."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    if float(s[0]) == 0.0:
        return delta
    median = float(torch.quantile(s, 0.5))
    if median <= DEGENERATE * float(s[0]):
        raise JanusError(f"DG-Hard: the update of {what} has (numerically) low rank, so its median singular value "
                         "is 0 and the Donoho-Gavish threshold would remove nothing: DG-Hard is meant for full "
                         "fine-tuning, not for a merged low-rank (LoRA) update; drop dg-hard from the candidates")
    beta = min(delta.shape) / max(delta.shape)
    keep = s > omega(beta) * median
    return (u[:, keep] * s[keep]) @ vh[keep]


@register
@dataclass(frozen=True)
class DgHard(Candidate):
    """Each changed linear layer's ``ΔW`` hard-thresholded at the Donoho-Gavish ``τ*``."""

    name: ClassVar[str] = "dg-hard"
    title: ClassVar[str] = "DG-Hard"
    style: ClassVar[PlotStyle] = PlotStyle("*", "k", "DG-Hard")
    uses_target_layers: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return "DG-Hard"

    def describe(self) -> str:
        return ("It is DG-Hard: each linear layer's update keeps only its singular components above the "
                "Donoho-Gavish hard threshold ω(β)·median(σ) (no replay, no JANUS step).")

    def check(self, builder: "WeightBuilder") -> None:
        if builder.adapter_ranks is not None:
            raise JanusError("DG-Hard is for full fine-tuning: a LoRA update is exactly of rank r, so its median "
                             "singular value is 0 and the Donoho-Gavish threshold removes nothing; drop dg-hard "
                             "from the candidates of an adapter")

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return with_deltas(builder, {layer.key: hard_threshold(delta_matrix(builder, layer), layer.key)
                                     for layer in linear_weights(builder)})
