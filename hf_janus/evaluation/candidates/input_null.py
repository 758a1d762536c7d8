"""The input-covariance null space, post hoc: per linear layer ``ΔW ← ΔW(I − U_k U_kᵀ)``, ``U_k`` the top
eigenvectors of the layer's replay input Gram ``G = Σ x xᵀ`` at θ0.

This is the subspace orthogonality of CorDA's knowledge-preserved mode, MiLoRA, LoRA-Null, GPM, InfLoRA,
AlphaEdit and Adam-NSCL, applied to a finished update: PyTorch's ``Linear`` computes ``y = x Wᵀ`` (``W`` is
``(d_out, d_in)``), so an update that leaves the replay's inputs' outputs unchanged satisfies ``ΔW x = 0`` for
those inputs, i.e. ``ΔW U_k = 0``. ``k`` is the smallest number of eigenvectors that hold the fraction
``energy`` of ``trace(G)``. It needs one forward pass over the replay (no Jacobian), and it isolates the paper's
claim that parameter-space orthogonality (JANUS) beats subspace orthogonality.

The inputs are captured with forward hooks on θ0 at every non-padding replay token (``tokens="all"``: each
position's activations feed the later positions through attention), or only at the positions whose next token
carries loss (``tokens="loss"``). In the frontier the projection is applied to the layers JANUS rectifies
(``JanusConfig.target_modules``: every linear layer but the output head by default), so that the two compare layer
for layer; other parameters keep θ̂.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Optional

import torch
from torch import Tensor

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, Cost, Curve, Option, PlotStyle, in_open_unit,
                                                 measured, parse_float, parse_str, require)
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.replay_statistics import (TOKEN_CHOICES, delta_matrix, input_spectra,
                                                              linear_weights, spectra_key, with_deltas)

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_ENERGIES = (0.9, 0.99, 0.999)

INPUT_NULL_CURVE = Curve("input-null", "input null space",
                         PlotStyle("<", "C7", "input-covariance null space", line="--"))


def tokens_option() -> Option:
    return Option("tokens", parse_str, ("all",),
                  "which replay tokens' inputs make the Gram: 'all' (non-padding) or 'loss' (next token counted)")


def check_tokens(kind: str, tokens: str) -> None:
    require(tokens in TOKEN_CHOICES, kind, "tokens", tokens, f"one of {TOKEN_CHOICES}")


def spectra_cost(builder: "WeightBuilder", context: BuildContext, tokens: str) -> Cost:
    """Capture the Grams if no candidate did yet: one forward pass over the replay, or nothing (reused)."""
    if spectra_key(tokens) in builder.artifacts:
        return Cost(reused=True)

    def work() -> Cost:
        input_spectra(builder, tokens, context.config.replay_batch_size)
        return Cost(forward_passes=1.0)

    return measured(builder, work)


def energy_rank(values: Tensor, energy: float) -> int:
    """The smallest ``k`` whose top-``k`` eigenvalues hold ``energy`` of their sum (0 for a zero Gram)."""
    total = float(values.sum())
    if total <= 0.0:
        return 0
    kept = torch.cumsum(values, 0) / total
    return int(torch.searchsorted(kept, torch.tensor(energy, dtype=kept.dtype)).item()) + 1


@register
@dataclass(frozen=True)
class InputNull(Candidate):
    """``ΔW(I − U_k U_kᵀ)`` per changed linear layer, ``k`` holding ``energy`` of the replay input energy."""

    energy: float
    tokens: str = "all"

    name: ClassVar[str] = "input-null"
    title: ClassVar[str] = "input-covariance null space"
    options: ClassVar[tuple[Option, ...]] = (
        Option("energy", parse_float, DEFAULT_ENERGIES,
               "fraction in (0, 1) of the replay input Gram's trace that the removed eigenvectors hold"),
        tokens_option())
    style: ClassVar[PlotStyle] = INPUT_NULL_CURVE.style
    uses_target_layers: ClassVar[bool] = True
    curve: ClassVar[Optional[Curve]] = INPUT_NULL_CURVE

    def __post_init__(self) -> None:
        require(in_open_unit(self.energy), self.name, "energy", self.energy, "strictly between 0 and 1")
        check_tokens(self.name, self.tokens)

    @property
    def label(self) -> str:
        return f"input null space energy={self.energy:g}" + ("" if self.tokens == "all" else " (loss tokens)")

    def describe(self) -> str:
        return ("It is θ̂ with each linear layer's update projected off the top eigenvectors of the layer's input "
                f"covariance on the replay at θ0 (ΔW(I − U_kU_kᵀ), k holding {self.energy:g} of its trace; no "
                "JANUS step).")

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        return spectra_cost(builder, context, self.tokens)

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        def kept(values: Tensor) -> Tensor:
            removed = energy_rank(values, self.energy)
            return (torch.arange(len(values), device=values.device) >= removed).to(values.dtype)

        return filtered_by_spectra(builder, self.tokens, kept)


def filtered_by_spectra(builder: "WeightBuilder", tokens: str,
                        kept: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """θ̂ with each changed linear layer's update filtered along its input Gram's eigenvectors,
    ``ΔW U diag(kept(s)) Uᵀ`` (``G = U diag(s) Uᵀ``, ``s`` descending, as ``prepare`` captured them for
    ``tokens``): the null-space projection keeps 0 or 1 of each direction, RegMean a share."""
    spectra = builder.artifacts.get(spectra_key(tokens))
    if spectra is None:
        raise JanusError("the input Grams were not captured: call prepare() before weights()")
    deltas = {}
    for layer in linear_weights(builder):
        values, vectors = spectra[layer.key]
        deltas[layer.key] = ((delta_matrix(builder, layer) @ vectors) * kept(values)) @ vectors.T
    return with_deltas(builder, deltas)
