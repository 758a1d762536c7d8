"""LiNeS (Wang et al., ICLR 2025, "Post-training Layer Scaling Prevents Forgetting and Enhances Model Merging"):
each layer's update scaled by ``λ(ℓ) = α + β ℓ / (L − 1)``, rising with the block's depth ``ℓ = 0 … L − 1``.

Data-free (no replay). The paper's single-task setting is ``α = 0, β = 1``: the first block returns to θ0 and the
last keeps its whole update. Parameters before the first block (embeddings) get the first block's scale ``α``,
parameters after the last (final norm, output head) the last block's ``α + β``. The block index is the first
number in a parameter's name (``model.layers.3.…``, ``transformer.h.3.…``); ``L`` is the number of blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from torch import Tensor

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import Candidate, Curve, Option, PlotStyle, parse_float, require
from hf_janus.evaluation.candidates.registry import register

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

LINES_CURVE = Curve("lines", "LiNeS", PlotStyle("p", "olive", "LiNeS", line="--"))
_BLOCK = re.compile(r"\.(\d+)\.")


def block_depths(names: list[str]) -> tuple[dict[str, float], int]:
    """Each parameter's depth ``ℓ / (L − 1)`` in [0, 1] (in model order: parameters before the first block 0,
    after the last 1) and the number of blocks ``L``."""
    index = {n: int(m.group(1)) for n in names if (m := _BLOCK.search(n))}
    if not index:
        raise JanusError("LiNeS scales updates by block depth, but no parameter name holds a block number "
                         "(model.layers.N. …): the model has no stack of blocks to scale")
    blocks = max(index.values()) + 1
    if blocks < 2:
        raise JanusError("LiNeS needs at least two blocks (its scale rises from the first to the last); this model "
                         "has one")
    first = names.index(next(n for n in names if n in index))
    depths = {}
    for position, name in enumerate(names):
        if name in index:
            depths[name] = index[name] / (blocks - 1)
        else:
            depths[name] = 0.0 if position < first else 1.0
    return depths, blocks


@register
@dataclass(frozen=True)
class Lines(Candidate):
    """``θ0 + (α + β ℓ/(L − 1)) ΔW`` per parameter."""

    alpha: float = 0.0
    beta: float = 1.0

    name: ClassVar[str] = "lines"
    title: ClassVar[str] = "LiNeS"
    options: ClassVar[tuple[Option, ...]] = (
        Option("alpha", parse_float, (0.0,), "scale of the first block's update (the paper's single-task α = 0)"),
        Option("beta", parse_float, (1.0,), "rise of the scale to the last block (the paper's β = 1)"))
    style: ClassVar[PlotStyle] = LINES_CURVE.style
    curve: ClassVar[Optional[Curve]] = LINES_CURVE

    def __post_init__(self) -> None:
        require(0.0 <= self.alpha <= 1.0, self.name, "alpha", self.alpha, "in [0, 1]")
        require(0.0 <= self.alpha + self.beta <= 1.0 and self.beta >= 0.0, self.name, "beta", self.beta,
                f"≥ 0 with alpha + beta in [0, 1] (alpha is {self.alpha:g})")
        require(not (self.alpha == 1.0 or (self.alpha == 0.0 and self.beta == 0.0)), self.name, "alpha/beta",
                (self.alpha, self.beta), "other than a constant 0 or 1 scale (θ0 and θ̂, scored anyway)")

    @property
    def label(self) -> str:
        return f"LiNeS α={self.alpha:g} β={self.beta:g}"

    def describe(self) -> str:
        return (f"It is LiNeS: each block's update scaled by {self.alpha:g} + {self.beta:g}·ℓ/(L − 1), rising with "
                "depth (no replay, no JANUS step).")

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        depths, _ = block_depths(list(builder.params))
        return {k: (t0.double() + (self.alpha + self.beta * depths[k])
                    * (builder.finetuned[k].double() - t0.double())).float()
                for k, t0 in builder.theta0.items()}
