"""One-sided RegMean (Jin et al., 2023), the soft form of the input-covariance null space.

RegMean merges linear layers by minimizing ``Σ‖W x − W_i x‖²`` over each model's inputs; with θ0's replay inputs
(Gram ``G``) on one side and θ̂'s update kept where the replay does not pin it, the merged weight is
``W = W0 + ΔW · λ(G + λI)⁻¹``, i.e. ``ΔW ← ΔW (I − G(G + λI)⁻¹)``. PyTorch's ``Linear`` computes ``y = x Wᵀ`` with
``W`` of shape ``(d_out, d_in)``, so ``G`` (``d_in × d_in``) multiplies ``ΔW`` from the right, as it does in
:mod:`.input_null`, whose hard projection this becomes as ``λ → 0`` (and θ̂ as ``λ → ∞``). ``λ`` is ``lam`` times
the layer's largest Gram eigenvalue, so that one grid serves layers of any input scale. Computed from the Gram's
eigendecomposition ``G = U S Uᵀ``: ``ΔW U diag(λ / (s + λ)) Uᵀ``. Applied to the same layers as
:mod:`.input_null` (JANUS's), the inputs taken the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from torch import Tensor

from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, Cost, Curve, Option, PlotStyle,
                                                 finite_positive, parse_float, require)
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.input_null import check_tokens, filtered_by_spectra, spectra_cost, tokens_option

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_REGMEAN_LAMS = (0.1, 0.01, 0.001)

REGMEAN_CURVE = Curve("regmean", "RegMean", PlotStyle(">", "C8", "one-sided RegMean", line=":"))


@register
@dataclass(frozen=True)
class RegMean(Candidate):
    """``ΔW · λ(G + λI)⁻¹`` per changed linear layer, ``λ = lam · λ_max(G)``."""

    lam: float
    tokens: str = "all"

    name: ClassVar[str] = "regmean"
    title: ClassVar[str] = "one-sided RegMean"
    options: ClassVar[tuple[Option, ...]] = (
        Option("lam", parse_float, DEFAULT_REGMEAN_LAMS,
               "regularization λ relative to each layer's largest input-Gram eigenvalue (> 0)"),
        tokens_option())
    style: ClassVar[PlotStyle] = REGMEAN_CURVE.style
    uses_target_layers: ClassVar[bool] = True
    curve: ClassVar[Optional[Curve]] = REGMEAN_CURVE

    def __post_init__(self) -> None:
        require(finite_positive(self.lam), self.name, "lam", self.lam, "finite and > 0")
        check_tokens(self.name, self.tokens)

    @property
    def label(self) -> str:
        return f"RegMean λ={self.lam:g}" + ("" if self.tokens == "all" else " (loss tokens)")

    def describe(self) -> str:
        return ("It is one-sided RegMean: each linear layer's update times λ(G + λI)⁻¹, G the layer's input "
                f"covariance on the replay at θ0 and λ = {self.lam:g} × its largest eigenvalue (no JANUS step).")

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        return spectra_cost(builder, context, self.tokens)

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        def kept(values: Tensor) -> Tensor:
            lam = self.lam * float(values[0]) if float(values[0]) > 0 else 1.0
            return lam / (values + lam)

        return filtered_by_spectra(builder, self.tokens, kept)
